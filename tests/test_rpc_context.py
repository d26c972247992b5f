"""anyio_comm.rpc.current_call(): what a handler may ask about the call it
serves (method, id, peer, TLS certificate, deadline, connection attributes),
for calls, streams and notifications, one call's never another's. Every
backend; TCP, TLS (with and without a client certificate) and the other
address transports."""

from __future__ import annotations

import math
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from anyio import TypedAttributeSet, typed_attribute

from anyio_comm import CommAttribute, rpc

from .certs import client_context, server_context
from .helpers import ADDRESS_TRANSPORTS, rpc_server_and_client

pytestmark = pytest.mark.anyio


class Unknown(TypedAttributeSet):
    thing: str = typed_attribute()


KINDS = [*ADDRESS_TRANSPORTS, "tls"]


def described() -> dict[str, Any]:
    call = rpc.current_call()
    return {
        "method": call.method,
        "id": call.id,
        "peer": call.peer_address,
        "peer_attribute": call.extra(CommAttribute.peer_address),
        "certificate": call.peer_certificate,
        "deadline": call.deadline,
        "remaining": call.remaining(),
    }


class Methods:
    def __init__(self) -> None:
        self.notified: list[dict[str, Any]] = []
        self.noticed = anyio.Event()

    def plain(self) -> dict[str, Any]:
        return described()

    async def coroutine(self, pause: float) -> dict[str, Any]:
        before = described()
        await anyio.sleep(pause)
        after = described()
        assert after["method"] == before["method"] and after["id"] == before["id"]
        return after

    async def in_a_task(self) -> dict[str, Any]:
        seen: list[dict[str, Any]] = []

        async def child() -> None:
            seen.append(described())

        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
        return seen[0]

    async def items(self, n: int) -> Any:
        for _ in range(n):
            yield described()
            await anyio.lowlevel.checkpoint()

    def notice(self) -> None:
        self.notified.append(described())
        self.noticed.set()

    def missing(self) -> Any:
        call = rpc.current_call()
        with pytest.raises(anyio.TypedAttributeLookupError):
            call.extra(Unknown.thing)
        return call.extra(Unknown.thing, "default")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_handler_sees_its_own_call(kind: str) -> None:
    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client(kind, methods) as (_server, client):
            ours = client.comm.local_address
            with anyio.CancelScope(shield=True):  # (no deadline goes with it)
                plain = await client.call("plain")
            assert plain == {
                "method": "plain",
                "id": plain["id"],
                "peer": ours,
                "peer_attribute": ours,
                "certificate": None,
                "deadline": math.inf,
                "remaining": math.inf,
            }
            assert isinstance(plain["id"], int)

            with anyio.fail_after(5):
                timed = await client.call("coroutine", 0.01)
            assert timed["method"] == "coroutine"
            assert timed["id"] != plain["id"]
            assert timed["deadline"] < math.inf
            assert 4.0 < timed["remaining"] <= 5.0

            child = await client.call("in_a_task")
            assert child["method"] == "in_a_task"

            async with client.stream("items", 3) as items:
                seen = [item async for item in items]
            assert {(item["method"], item["id"]) for item in seen} == {("items", seen[0]["id"])}

            await client.notify("notice")
            await methods.noticed.wait()
            assert methods.notified[0]["method"] == "notice"
            assert methods.notified[0]["id"] is None
            assert methods.notified[0]["deadline"] == math.inf

            assert await client.call("missing") == "default"


async def test_calls_at_once_each_see_their_own() -> None:
    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", methods) as (_server, client):
            results: list[dict[str, Any]] = []

            async def one(pause: float) -> None:
                results.append(await client.call("coroutine", pause))

            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(one, (i % 5) / 100)
            assert len({result["id"] for result in results}) == 20


@pytest.mark.parametrize("with_cert", [True, False], ids=["client-certificate", "none"])
async def test_the_callers_tls_certificate(with_cert: bool) -> None:
    methods = Methods()
    with anyio.fail_after(20):
        async with (
            rpc.serve(
                "tls://127.0.0.1:0",
                methods,
                ssl_context=server_context(require_client_cert=with_cert),
            ) as server,
            rpc.connect(server.address, ssl_context=client_context(with_cert=with_cert)) as client,
        ):
            certificate = (await client.call("plain"))["certificate"]
            if with_cert:
                assert certificate is not None
                names = [value for field in certificate["subjectAltName"] for value in field]
                assert "client@example.org" in names
            else:
                assert certificate is None


async def test_outside_a_handler_there_is_no_call() -> None:
    with pytest.raises(RuntimeError, match="inside an RPC handler"):
        rpc.current_call()
