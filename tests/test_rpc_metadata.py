"""anyio_comm.rpc call metadata and trailers: what a caller sends beside the
arguments reaches the handler (calls, streams, notifications), what the
handler sets comes back with the result or the error, within the limits; the
wire items are optional, and receivers ignore items they do not know. Every
backend; TCP, TLS and the other address transports."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import msgpack
import pytest

import anyio_comm
from anyio_comm import rpc
from anyio_comm.rpc._protocol import (
    MAX_METADATA_BYTES,
    MAX_METADATA_ENTRIES,
    MAX_METADATA_KEY,
    Call,
    Credit,
    End,
    ErrorCode,
    ErrorReply,
    Item,
    Notify,
    Ping,
    Pong,
    ProtocolViolation,
    Result,
    decode,
)

from .helpers import ADDRESS_TRANSPORTS, rpc_server_and_client

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]
GUIDE = Path(__file__).parents[1] / "docs" / "guides" / "rpc.md"


class Methods:
    def __init__(self) -> None:
        self.notified: list[dict[str, str | bytes]] = []
        self.noticed = anyio.Event()

    def echo(self) -> dict[str, str | bytes]:
        call = rpc.current_call()
        call.set_trailer("served-by", "here")
        call.set_trailer("count", str(len(call.metadata)))
        return dict(call.metadata)

    def refuse(self) -> None:
        rpc.current_call().set_trailer("reason", b"\x00binary")
        raise PermissionError("not authorized")

    async def items(self, n: int) -> Any:
        call = rpc.current_call()
        for _ in range(n):
            yield call.metadata.get("tag")
            await anyio.lowlevel.checkpoint()
        call.set_trailer("items", str(n))

    def notice(self) -> None:
        self.notified.append(dict(rpc.current_call().metadata))
        self.noticed.set()

    def overfull(self) -> str:
        call = rpc.current_call()
        for i in range(MAX_METADATA_ENTRIES):
            call.set_trailer(f"k{i}", "v")
        try:
            call.set_trailer("one-more", "v")
        except ValueError as exc:
            return str(exc)
        return "accepted"


@pytest.mark.parametrize("kind", KINDS)
async def test_metadata_goes_and_trailers_come_back(kind: str) -> None:
    methods = Methods()
    sent = {"authorization": "Bearer x", "trace": b"\x01\x02", "tag": "t"}
    with anyio.fail_after(20):
        async with rpc_server_and_client(kind, methods) as (_server, client):
            trailers: dict[str, str | bytes] = {}
            tagged = client.with_metadata(sent, trailers=trailers)
            assert await tagged.call("echo") == sent
            assert trailers == {"served-by": "here", "count": "3"}

            trailers.clear()
            with pytest.raises(rpc.RemoteError) as info:
                await tagged.call("refuse")
            assert info.value.remote_type == "PermissionError"
            assert info.value.trailers == {"reason": b"\x00binary"}
            assert trailers == {"reason": b"\x00binary"}

            trailers.clear()
            async with tagged.stream("items", 3) as items:
                assert [item async for item in items] == ["t", "t", "t"]
            assert trailers == {"items": "3"}

            await tagged.notify("notice")
            await methods.noticed.wait()
            assert methods.notified == [sent]

            # without metadata: none seen, no trailers sent back
            assert await client.call("echo") == {}
            with pytest.raises(rpc.RemoteError) as info:
                await client.call("refuse")
            assert info.value.trailers == {}
            # with an empty map: trailers come back
            trailers.clear()
            assert await client.with_metadata(trailers=trailers).call("echo") == {}
            assert trailers == {"served-by": "here", "count": "0"}


async def test_a_call_without_metadata_gets_a_reply_without_trailers() -> None:
    """On the wire: a CALL of seven items (as clients from before metadata send)
    gets a RESULT of three, though its handler set trailers; a CALL with a
    metadata item gets them as a fourth."""
    with anyio.fail_after(20):
        async with (
            rpc.serve("tcp://127.0.0.1:0", Methods()) as server,
            await anyio_comm.connect(server.address) as comm,
        ):
            await comm.send(Call(1, "echo", [], {}, None).encode())
            raw = await comm.receive()
            assert raw == [1, 1, {}]
            await comm.send(Call(2, "echo", [], {}, None, False, {"a": "b"}).encode())
            raw = await comm.receive()
            assert raw == [1, 2, {"a": "b"}, {"served-by": "here", "count": "1"}]


async def test_items_a_receiver_does_not_know_are_ignored() -> None:
    """A CALL with an item after its last known one is served; the decoder takes
    replies with items after their trailers."""
    with anyio.fail_after(20):
        async with (
            rpc.serve("tcp://127.0.0.1:0", Methods()) as server,
            await anyio_comm.connect(server.address) as comm,
        ):
            # (after the metadata, CALL's next item is input: the unknown one follows it)
            await comm.send([*Call(1, "echo", [], {}, None, False, {}).encode(), False, "later"])
            assert decode(await comm.receive()) == Result(
                1, {}, {"served-by": "here", "count": "0"}
            )
            await comm.send([*Notify("notice", [], {}).encode(), {"x": "y"}, 7])
            await comm.send(Call(2, "echo", [], {}, None).encode())
            assert decode(await comm.receive()) == Result(2, {})
    assert decode([1, 5, "v", {"t": "u"}, "later"]) == Result(5, "v", {"t": "u"})
    assert decode([2, 5, "error", "T", "m", {}, None, "later"]) == ErrorReply(
        5, ErrorCode.ERROR, "T", "m", {}
    )
    assert decode([3, 9, "later"]).id == 9  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "bad",
    [
        [0, 1, "m", [], {}, None, False, []],
        [0, 1, "m", [], {}, None, False, {1: "v"}],
        [0, 1, "m", [], {}, None, False, {"k": 1}],
        [0, 1, "m", [], {}, None, False, {"": "v"}],
        [0, 1, "m", [], {}, None, False, {f"k{i}": "" for i in range(MAX_METADATA_ENTRIES + 1)}],
        [0, 1, "m", [], {}, None, False, {"k": "v" * MAX_METADATA_BYTES}],
        [4, "m", [], {}, "not a map"],
        [1, 1, "v", {"k": None}],
        [2, 1, "error", "T", "m", ["no"]],
    ],
)
def test_malformed_metadata_is_a_protocol_violation(bad: list[Any]) -> None:
    with pytest.raises(ProtocolViolation):
        decode(bad)


async def test_a_server_closes_a_connection_that_sends_malformed_metadata() -> None:
    with anyio.fail_after(20):
        async with (
            rpc.serve("tcp://127.0.0.1:0", Methods()) as server,
            await anyio_comm.connect(server.address) as comm,
        ):
            await comm.send([0, 1, "echo", [], {}, None, False, {"k": 1}])
            with pytest.raises(anyio_comm.PeerClosedError) as info:
                await comm.receive()
            assert info.value.reason.code is anyio_comm.CloseCode.PROTOCOL_ERROR


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({f"k{i}": "" for i in range(MAX_METADATA_ENTRIES + 1)}, "entries"),
        ({"": "v"}, "keys"),
        ({"k" * (MAX_METADATA_KEY + 1): "v"}, "keys"),
        ({1: "v"}, "keys"),
        ({"k": 1}, "values"),
        ({"k": bytearray(b"v")}, "values"),
        ({"k": "v" * MAX_METADATA_BYTES}, "bytes"),
        ("not a map", "map"),
    ],
)
async def test_metadata_over_the_limits_is_refused_before_sending(
    metadata: Any, match: str
) -> None:
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", Methods()) as (_server, client):
            with pytest.raises(ValueError, match=match):
                client.with_metadata(metadata)
            assert await client.call("echo") == {}  # the connection goes on


async def test_trailers_over_the_limits_are_refused_in_the_handler() -> None:
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", Methods()) as (_server, client):
            trailers: dict[str, str | bytes] = {}
            message = await client.with_metadata(trailers=trailers).call("overfull")
            assert "more than 64" in message
            assert len(trailers) == MAX_METADATA_ENTRIES


def test_an_error_keeps_its_trailers_when_pickled() -> None:
    error = rpc.RemoteError("m", "ValueError", "bad")
    error.trailers = {"k": b"v"}
    again = pickle.loads(pickle.dumps(error))
    assert (again.method, again.remote_type, again.trailers) == ("m", "ValueError", {"k": b"v"})


def test_the_guides_golden_bodies() -> None:
    """The RPC guide's examples are the bytes the encoders make, and decode back."""
    page = GUIDE.read_text()
    blocks = dict(re.findall(r"^```hex golden:(\S+)\n(.*?)^```$", page, re.M | re.S))
    expected = {
        "rpc-call-metadata": Call(
            1, "whoami", [], {}, None, False, {"trace-id": "abc", "token": b"\x01\x02"}
        ),
        "rpc-result-trailers": Result(1, "ok", {"served-by": "a"}),
        "rpc-call-input": Call(2, "store", ["a.txt"], {}, 5, False, None, True),
        "rpc-credit-input": Credit(2, 16),
        "rpc-item-input": Item(2, b"\x00\x01"),
        "rpc-end": End(2),
        "rpc-hello": Notify("rpc.hello", [["status"]], {}),
        "rpc-error-status": ErrorReply(
            4,
            ErrorCode.ERROR,
            "anyio_comm.rpc.ApplicationError",
            "no key k",
            {},
            ("not-found", {"key": "k"}),
        ),
        "rpc-ping": Ping(7),
        "rpc-pong": Pong(7),
    }
    assert set(blocks) == set(expected)
    for name, message in expected.items():
        body = bytes.fromhex(blocks[name])
        assert msgpack.packb(message.encode(), use_bin_type=True) == body, name
        assert decode(msgpack.unpackb(body, raw=False)) == message, name
