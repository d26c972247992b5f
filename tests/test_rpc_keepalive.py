"""anyio_comm.rpc keepalive, from the RPC guide ("Keepalive") and the docstrings
of ``open_client``, ``rpc.connect`` and ``Pool``: with ``ping_interval``, a
client pings while calls are in flight and nothing arrives; a server answers at
once, whatever runs, so slow calls survive; a peer that stops answering (a
half-open connection) is found within the configured time and the calls fail
with UnavailableError. Every backend; TCP, TLS and the other address
transports, and a TCP connection whose traffic stops in both directions."""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import pytest

import anyio_comm
from anyio_comm import rpc
from anyio_comm.rpc._protocol import Call, Ping, Pong, decode

from .helpers import ADDRESS_TRANSPORTS, listen_arguments, rpc_server_and_client

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]
INTERVAL = 0.1
TIMEOUT = 0.2
#: when a silent peer must have been found: a ping is due at most two intervals
#: after the last message, then the timeout, and slack for a loaded machine
FOUND_WITHIN = 2 * INTERVAL + TIMEOUT + 1.0


class Methods:
    async def slow(self, seconds: float) -> str:
        await anyio.sleep(seconds)
        return "done"

    async def ticks(self, n: int, seconds: float) -> Any:
        for i in range(n):
            await anyio.sleep(seconds)
            yield i


class SilentServer:
    """A peer that speaks the RPC wire format by hand: it answers the first
    ``answers`` pings, never a call, and then goes silent, its connection open
    (a half-open connection, as the client sees it)."""

    def __init__(self, answers: int) -> None:
        self.answers = answers
        self.pings: list[int] = []
        self.calls = 0
        self.silent_since = math.inf
        self.silent = anyio.Event()

    async def handle(self, comm: anyio_comm.Comm) -> None:
        async for message in comm:
            request = decode(message)
            if isinstance(request, Call):
                self.calls += 1
            elif isinstance(request, Ping):
                self.pings.append(request.token)
                if len(self.pings) <= self.answers:
                    await comm.send(Pong(request.token).encode())
                if len(self.pings) == self.answers:
                    self.silent_since = anyio.current_time()
                    self.silent.set()
                    await anyio.sleep_forever()  # reads nothing more, answers nothing


@asynccontextmanager
async def silent_server(kind: str, answers: int) -> AsyncIterator[tuple[SilentServer, str, dict]]:
    server = SilentServer(answers)
    async with listen_arguments(kind) as (address, server_kwargs, client_kwargs):
        async with anyio_comm.listen(address, server.handle, **server_kwargs) as listener:
            yield server, listener.address, client_kwargs


@pytest.mark.parametrize("kind", KINDS)
async def test_a_slow_call_survives_the_pings(kind: str) -> None:
    """Pings every 0.1 s answered within 0.2 s: a call of 0.6 s, and a stream
    whose items come every 0.25 s, end as they would without them (each lasts
    several intervals and longer than the timeout)."""
    with anyio.fail_after(20):
        async with rpc_server_and_client(
            kind,
            Methods(),
            connect_arguments={"ping_interval": INTERVAL, "ping_timeout": TIMEOUT},
        ) as (_, client):
            assert await client.call("slow", 0.6) == "done"
            async with client.stream("ticks", 2, 0.25) as items:
                assert [item async for item in items] == [0, 1]
            assert client.usable


@pytest.mark.parametrize("anyio_backend", [("asyncio", {})], ids=["asyncio"])
async def test_a_ten_second_call_survives_the_pings() -> None:
    """(Over TCP on asyncio, fifty pings answered: every backend and
    transport is checked with a call of 0.6 s above.)"""
    with anyio.fail_after(30):
        async with rpc_server_and_client(
            "tcp", Methods(), connect_arguments={"ping_interval": 0.2, "ping_timeout": 0.5}
        ) as (_, client):
            assert await client.call("slow", 10.0) == "done"


@pytest.mark.parametrize("kind", KINDS)
async def test_a_peer_that_stops_answering_is_found(kind: str) -> None:
    """The server answers three pings (the call goes on), then nothing: the call
    fails with UnavailableError within the configured time."""
    async with silent_server(kind, answers=3) as (server, address, client_kwargs):
        with anyio.fail_after(20):
            async with rpc.connect(
                address, ping_interval=INTERVAL, ping_timeout=TIMEOUT, **client_kwargs
            ) as client:
                with pytest.raises(rpc.UnavailableError) as caught:
                    await client.call("never_answered")
                found = anyio.current_time() - server.silent_since
                assert "no answer to a ping within 0.2 seconds" in str(caught.value)
                assert found < FOUND_WITHIN, f"found after {found:.2f} s"
                assert not client.usable
                with pytest.raises(rpc.UnavailableError):
                    await client.call("again")
    assert server.calls == 1
    assert server.pings == [0, 1, 2]  # (then it read nothing more)


@pytest.mark.parametrize("kind", ["tcp", "inproc"])
async def test_no_pings_without_calls_in_flight(kind: str) -> None:
    async with silent_server(kind, answers=100) as (server, address, client_kwargs):
        with anyio.fail_after(20):
            async with rpc.connect(
                address, ping_interval=INTERVAL, ping_timeout=TIMEOUT, **client_kwargs
            ) as client:
                await anyio.sleep(5 * INTERVAL)
                assert server.pings == []
                assert client.usable


async def test_a_pools_connections_ping() -> None:
    async with silent_server("tcp", answers=0) as (_, address, _kwargs):
        with anyio.fail_after(20):
            async with (
                rpc.Pool(ping_interval=INTERVAL, ping_timeout=TIMEOUT) as pool,
                pool.client(address) as client,
            ):
                with pytest.raises(rpc.UnavailableError, match="no answer to a ping"):
                    await client.call("never_answered")


class Blackhole:
    """A TCP proxy that forwards both ways until :meth:`stop`, then drops
    everything while keeping both connections open."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.forwarding = True

    def stop(self) -> None:
        self.forwarding = False

    async def handle(self, client: anyio.abc.SocketStream) -> None:
        async with (
            client,
            await anyio.connect_tcp("127.0.0.1", self.target_port) as server,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(self._pipe, client, server)
            await self._pipe(server, client)

    async def _pipe(self, source: anyio.abc.SocketStream, sink: anyio.abc.SocketStream) -> None:
        try:
            async for data in source:
                if self.forwarding:
                    await sink.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass


async def test_a_tcp_connection_whose_traffic_stops_is_found() -> None:
    """A real server behind a proxy that stops forwarding mid-call, in both
    directions, with both TCP connections open: the call fails within the
    configured time."""
    with anyio.fail_after(20):
        async with rpc.serve("tcp://127.0.0.1:0", Methods()) as server:
            port = int(server.address.rpartition(":")[2])
            proxy = Blackhole(port)
            async with (
                await anyio.create_tcp_listener(local_host="127.0.0.1") as listener,
                anyio.create_task_group() as tg,
            ):
                tg.start_soon(listener.serve, proxy.handle)
                proxy_port = listener.extra(anyio.abc.SocketAttribute.local_port)
                async with rpc.connect(
                    f"tcp://127.0.0.1:{proxy_port}",
                    ping_interval=INTERVAL,
                    ping_timeout=TIMEOUT,
                ) as client:
                    assert await client.call("slow", 0.5) == "done"  # pings answered
                    stopped_at = 0.0

                    async def stop_soon() -> None:
                        nonlocal stopped_at
                        await anyio.sleep(0.3)
                        proxy.stop()
                        stopped_at = anyio.current_time()

                    tg.start_soon(stop_soon)
                    with pytest.raises(rpc.UnavailableError, match="no answer to a ping"):
                        await client.call("slow", 30.0)
                    found = anyio.current_time() - stopped_at
                    assert found < FOUND_WITHIN, f"found after {found:.2f} s"
                tg.cancel_scope.cancel()


async def test_the_server_answers_a_ping_at_once_whatever_runs() -> None:
    with anyio.fail_after(20):
        async with (
            rpc.serve("tcp://127.0.0.1:0", Methods(), max_calls_per_connection=1) as server,
            await anyio_comm.connect(server.address) as comm,
        ):
            await comm.send(Call(1, "slow", [5.0], {}, None).encode())
            await comm.send(Ping(2**64 - 1).encode())
            with anyio.fail_after(1):
                assert decode(await comm.receive()) == Pong(2**64 - 1)


@pytest.mark.parametrize(("interval", "timeout"), [(0, 1), (-1, 1), (1, 0), (None, -2)])
async def test_bad_ping_settings_are_value_errors(interval: Any, timeout: Any) -> None:
    with pytest.raises(ValueError, match="ping_interval and ping_timeout"):
        async with rpc.connect("tcp://127.0.0.1:1", ping_interval=interval, ping_timeout=timeout):
            pass
    with pytest.raises(ValueError, match="ping_interval and ping_timeout"):
        rpc.Pool(ping_interval=interval, ping_timeout=timeout)
