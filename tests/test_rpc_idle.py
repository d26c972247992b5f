"""anyio_comm.rpc and ``idle_timeout``: a connection with calls in flight is not
idle, however long they take, on either side; once the last call ended, nothing
arriving for ``idle_timeout`` closes it as before. Every backend; TCP, TLS and
the other address transports."""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from anyio_comm import rpc

from .helpers import ADDRESS_TRANSPORTS, listen_arguments

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]
IDLE = 0.15
#: how long the calls take: several times the idle timeout
SLOW = 4 * IDLE


class Methods:
    async def slow(self, tag: str) -> str:
        await anyio.sleep(SLOW)
        return tag

    async def count(self, n: int) -> Any:
        for i in range(n):
            await anyio.sleep(IDLE / 2)
            yield i


@asynccontextmanager
async def server_and_client(
    kind: str, server_idle: float | None, client_idle: float | None
) -> AsyncIterator[rpc.Client]:
    async with listen_arguments(kind) as (address, server_kwargs, client_kwargs):
        async with (
            rpc.serve(
                address,
                Methods(),
                max_calls_per_connection=1,
                idle_timeout=server_idle,
                **server_kwargs,
            ) as server,
            rpc.connect(
                server.address, timeout=10, idle_timeout=client_idle, **client_kwargs
            ) as client,
        ):
            yield client


async def closed_after(client: rpc.Client, at_least: float) -> float:
    """Seconds until the client's connection ends (failing if that is before
    ``at_least``, or not within 10 s)."""
    started = anyio.current_time()
    with anyio.move_on_after(10):
        while client.usable:
            await anyio.sleep(0.01)
        waited = anyio.current_time() - started
        assert waited >= at_least, f"closed {waited:.3f} s after the last call"
        return waited
    pytest.fail("the idle connection was not closed")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("side", ["server", "client"])
async def test_calls_in_flight_keep_the_connection_from_idling(kind: str, side: str) -> None:
    """Two calls, one running and one waiting for the connection's only worker,
    take 8 idle timeouts with nothing sent; both return. Once they did, the
    side with the timeout closes the connection an idle timeout later."""
    server_idle, client_idle = (IDLE, None) if side == "server" else (None, IDLE)
    with anyio.fail_after(30):
        async with server_and_client(kind, server_idle, client_idle) as client:
            results: list[str] = []

            async def call(tag: str) -> None:
                results.append(await client.call("slow", tag))

            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "first")
                tg.start_soon(call, "second")
            assert sorted(results) == ["first", "second"]
            assert client.usable
            await closed_after(client, at_least=IDLE - 0.05)
            with pytest.raises(rpc.UnavailableError):
                await client.call("slow", "third")


@pytest.mark.parametrize("kind", KINDS)
async def test_a_stream_that_sends_keeps_the_connection_open(kind: str) -> None:
    """A streamed call whose items come every half idle timeout outlives the
    timeout on both sides."""
    with anyio.fail_after(30):
        async with server_and_client(kind, IDLE, IDLE) as client:
            async with client.stream("count", 8) as items:
                assert [item async for item in items] == list(range(8))
            await closed_after(client, at_least=IDLE - 0.05)


async def test_without_calls_the_idle_timeout_is_unchanged() -> None:
    """A connection that never had a call is closed an idle timeout after it
    opened, as any comm is."""
    with anyio.fail_after(30):
        async with server_and_client("tcp", IDLE, None) as client:
            waited = await closed_after(client, at_least=IDLE - 0.1)
            assert waited < 5 * IDLE


@pytest.mark.parametrize("kind", KINDS)
async def test_a_pool_replaces_a_connection_closed_for_idling(kind: str) -> None:
    with anyio.fail_after(30):
        async with listen_arguments(kind) as (address, server_kwargs, client_kwargs):
            async with (
                rpc.serve(address, Methods(), idle_timeout=IDLE, **server_kwargs) as server,
                rpc.Pool(**client_kwargs) as pool,
            ):
                async with pool.client(server.address) as client:
                    assert await client.call("slow", "long") == "long"  # not idle
                await closed_after(client, at_least=IDLE - 0.05)
                async with pool.client(server.address) as again:
                    assert again is not client
                    assert await again.call("slow", "again") == "again"
