"""anyio_comm.rpc application errors, from the RPC guide ("Application errors")
and the docstring of ``ApplicationError``: a handler (or an interceptor) raises
one with a status and details, and the caller gets them typed, without pickle,
from calls, streams, uploads and channels; a client announces that it
understands them (``rpc.hello``), and a client that did not gets a plain error.
Every backend; TCP, TLS and the other address transports."""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Any

import anyio
import msgpack
import pytest

import anyio_comm
from anyio_comm import rpc
from anyio_comm.rpc._protocol import (
    Call,
    ErrorCode,
    ErrorReply,
    Notify,
    ProtocolViolation,
    decode,
)

from .helpers import ADDRESS_TRANSPORTS, rpc_server_and_client

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]
DETAILS = {"key": "k", "tries": [1, 2], "raw": b"\x00\x01", "ratio": 0.5, "none": None}


class NotFound(rpc.ApplicationError):
    """An application's own subclass."""


class Methods:
    async def lookup(self, key: str) -> str:
        raise rpc.ApplicationError("not-found", f"no key {key}", DETAILS)

    async def numbered(self) -> None:
        raise rpc.ApplicationError(404, "gone")

    async def subclassed(self) -> None:
        raise NotFound("not-found", "from a subclass", {"why": "test"})

    async def items(self) -> AsyncIterator[int]:
        yield 1
        raise rpc.ApplicationError("exhausted", "no more", [1])

    async def upload(self, items: rpc.InputStream) -> None:
        async for item in items:
            raise rpc.ApplicationError("rejected", f"bad item {item}", {"item": item})

    async def fine(self) -> str:
        return "ok"


@pytest.mark.parametrize("kind", KINDS)
async def test_an_application_error_reaches_the_caller_typed(kind: str) -> None:
    with anyio.fail_after(20):
        async with rpc_server_and_client(kind, Methods()) as (_, client):
            with pytest.raises(rpc.ApplicationError) as caught:
                await client.call("lookup", "k")
            error = caught.value
            assert (error.status, error.details) == ("not-found", DETAILS)
            assert (error.method, error.remote_message) == ("lookup", "no key k")
            assert error.remote_type == "anyio_comm.rpc.ApplicationError"
            assert isinstance(error, rpc.RemoteError)
            assert "lookup()" in str(error) and "'not-found'" in str(error)

            with pytest.raises(rpc.ApplicationError) as caught:
                await client.call("numbered")
            assert (caught.value.status, caught.value.details) == (404, None)

            with pytest.raises(rpc.ApplicationError) as caught:
                await client.call("subclassed")
            assert caught.value.remote_type.endswith("NotFound")
            assert caught.value.details == {"why": "test"}

            with pytest.raises(rpc.ApplicationError) as caught:
                async with client.stream("items") as items:
                    assert [item async for item in items] == [1]
            assert (caught.value.status, caught.value.details) == ("exhausted", [1])

            with pytest.raises(rpc.ApplicationError) as caught:
                async with client.upload("upload") as upload:
                    await upload.send(7)
                    await upload.finish()
            assert (caught.value.status, caught.value.details) == ("rejected", {"item": 7})
            assert await client.call("fine") == "ok"


async def test_an_interceptor_refuses_with_an_application_error() -> None:
    async def authenticate(call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        if "token" not in call.metadata:
            raise rpc.ApplicationError("unauthenticated", "a token is needed", {"realm": "x"})
        return await proceed()

    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", Methods(), interceptors=[authenticate]) as (
            _,
            client,
        ):
            with pytest.raises(rpc.ApplicationError) as caught:
                await client.call("fine")
            assert (caught.value.status, caught.value.details) == (
                "unauthenticated",
                {"realm": "x"},
            )
            assert await client.with_metadata({"token": "t"}).call("fine") == "ok"


async def test_a_client_that_did_not_announce_it_gets_a_plain_error() -> None:
    """A client that sent no ``rpc.hello`` (one from before application errors)
    gets an ERROR of the items it knows; one that announced ``status`` gets the
    status item."""
    with anyio.fail_after(20):
        async with rpc.serve("tcp://127.0.0.1:0", Methods()) as server:
            async with await anyio_comm.connect(server.address) as comm:
                await comm.send(Call(1, "lookup", ["k"], {}, None).encode())
                raw = await comm.receive()
                assert raw == [2, 1, "error", "anyio_comm.rpc.ApplicationError", "no key k"]
            async with await anyio_comm.connect(server.address) as comm:
                await comm.send(Notify("rpc.hello", [["status", "later"]], {}).encode())
                await comm.send(Call(1, "lookup", ["k"], {}, None).encode())
                raw = await comm.receive()
                assert raw[5:] == [{}, ["not-found", DETAILS]]
                reply = decode(raw)
                assert isinstance(reply, ErrorReply) and reply.status == ("not-found", DETAILS)


def test_an_application_error_survives_pickling() -> None:
    error = rpc.ApplicationError.received("m", "T", "text", "code", {"d": [1]})
    error.trailers = {"t": "v"}
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is rpc.ApplicationError
    assert (again.method, again.remote_type, again.remote_message) == ("m", "T", "text")
    assert (again.status, again.details, again.trailers) == ("code", {"d": [1]}, {"t": "v"})
    assert str(again) == str(error)


@pytest.mark.parametrize("status", [True, 1.5, None, b"x", ["a"]])
def test_a_status_is_an_int_or_a_str(status: Any) -> None:
    with pytest.raises(TypeError, match="status"):
        rpc.ApplicationError(status, "m")


@pytest.mark.parametrize(
    "bad",
    [
        [2, 1, "error", "T", "m", {}, [1]],
        [2, 1, "error", "T", "m", {}, [True, None]],
        [2, 1, "error", "T", "m", {}, [1.5, None]],
        [2, 1, "error", "T", "m", {}, "status"],
    ],
)
def test_a_malformed_status_is_a_protocol_violation(bad: list[Any]) -> None:
    with pytest.raises(ProtocolViolation):
        decode(bad)


async def test_the_hello_method_is_reserved() -> None:
    with pytest.raises(ValueError, match="reserves"):
        async with rpc.serve("tcp://127.0.0.1:0", {"rpc.hello": lambda: None}):
            pass


def test_an_error_reply_with_a_status_encodes_empty_trailers_before_it() -> None:
    reply = ErrorReply(3, ErrorCode.ERROR, "T", "m", None, ("s", {"k": b"v"}))
    assert reply.encode() == [2, 3, "error", "T", "m", {}, ["s", {"k": b"v"}]]
    body = msgpack.packb(reply.encode(), use_bin_type=True)
    assert decode(msgpack.unpackb(body, raw=False)) == ErrorReply(
        3, ErrorCode.ERROR, "T", "m", {}, ("s", {"k": b"v"})
    )
