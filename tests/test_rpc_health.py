"""anyio_comm.rpc's health service: every server answers ``rpc.health`` at once,
whatever its calls do, for itself and for named services, and says NOT_SERVING
once it shuts down. Every backend; TCP, TLS and the other address transports."""

from __future__ import annotations

import anyio
import pytest

import anyio_comm
from anyio_comm import rpc
from anyio_comm.rpc._protocol import Call, ErrorCode, ErrorReply, Result, decode

from .helpers import ADDRESS_TRANSPORTS, rpc_server_and_client

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]
SERVING, NOT_SERVING, UNKNOWN = (
    rpc.HealthStatus.SERVING,
    rpc.HealthStatus.NOT_SERVING,
    rpc.HealthStatus.UNKNOWN,
)


class Methods:
    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.started = anyio.Event()

    async def block(self) -> str:
        self.started.set()
        await self.gate.wait()
        return "opened"

    def add(self, a: int, b: int) -> int:
        return a + b


@pytest.mark.parametrize("kind", KINDS)
async def test_the_health_service(kind: str) -> None:
    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client(kind, methods, max_calls_per_connection=1) as (
            server,
            client,
        ):
            assert await client.check_health() is SERVING
            assert await client.check_health("db") is UNKNOWN
            server.set_serving(False, "db")
            assert await client.check_health("db") is NOT_SERVING
            server.set_serving(True, "db")
            assert await client.check_health("db") is SERVING

            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call, "block")
                await methods.started.wait()
                # the connection's only worker is taken: answered all the same
                with anyio.fail_after(2):
                    assert await client.check_health() is SERVING
                server.set_serving(False)
                assert await client.check_health() is NOT_SERVING
                assert await client.check_health("db") is SERVING
                methods.gate.set()
            assert await client.call("add", 1, 2) == 3  # calls go on regardless


async def test_a_server_shutting_down_is_not_serving() -> None:
    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", methods) as (server, client):
            server.set_serving(True, "db")
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call, "block")
                await methods.started.wait()
                tg.start_soon(server.shutdown, 10)  # waits for block
                await anyio.sleep(0.05)
                assert await client.check_health() is NOT_SERVING
                assert await client.check_health("db") is NOT_SERVING
                with pytest.raises(rpc.UnavailableError):
                    await client.call("add", 1, 2)
                methods.gate.set()


async def test_malformed_health_calls_are_refused() -> None:
    with anyio.fail_after(20):
        async with (
            rpc.serve("tcp://127.0.0.1:0", Methods()) as server,
            await anyio_comm.connect(server.address) as comm,
        ):
            for call in (
                Call(1, rpc.HEALTH_METHOD, [1], {}, None),
                Call(2, rpc.HEALTH_METHOD, ["a", "b"], {}, None),
                Call(3, rpc.HEALTH_METHOD, [], {"service": "a"}, None),
            ):
                await comm.send(call.encode())
                reply = decode(await comm.receive())
                assert isinstance(reply, ErrorReply) and reply.id == call.id
                assert reply.code is ErrorCode.INVALID_ARGUMENTS
            await comm.send(Call(4, rpc.HEALTH_METHOD, [], {}, None, True).encode())
            reply = decode(await comm.receive())
            assert isinstance(reply, ErrorReply) and reply.code is ErrorCode.BAD_CALL
            await comm.send(Call(5, rpc.HEALTH_METHOD, [""], {}, None).encode())
            assert decode(await comm.receive()) == Result(5, "serving")


async def test_the_health_method_name_is_reserved() -> None:
    with pytest.raises(ValueError, match="health"):
        async with rpc.serve("tcp://127.0.0.1:0", {rpc.HEALTH_METHOD: lambda: None}):
            pass
    async with rpc.serve("tcp://127.0.0.1:0", {}) as server:
        with pytest.raises(TypeError):
            server.set_serving(True, 5)  # type: ignore[arg-type]
