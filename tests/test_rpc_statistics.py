"""Server.statistics(), from its docstring and those of ServerStatistics,
MethodStatistics and Histogram, and serve()'s ``detailed_statistics``: each
counter checked against calls of known outcome, on every backend, over every
address transport and TLS."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

import anyio_comm
from anyio_comm import rpc
from anyio_comm.rpc._protocol import Call, Notify, decode

from .certs import client_context
from .helpers import ADDRESS_TRANSPORTS, rpc_server_and_client

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]


class Methods:
    def __init__(self) -> None:
        self.notes: list[Any] = []
        self.started = anyio.Event()

    async def echo(self, value: Any) -> Any:
        return value

    async def fail(self) -> None:
        raise ValueError("as asked")

    async def refuse(self) -> None:
        raise rpc.ApplicationError("NOT_FOUND", "no such thing")

    async def slow(self, seconds: float) -> str:
        self.started.set()
        await anyio.sleep(seconds)
        return "done"

    async def ticks(self, n: int) -> Any:
        for i in range(n):
            yield i

    async def note(self, value: Any) -> None:
        if value == "raise":
            raise RuntimeError("as asked")
        self.notes.append(value)


async def _call_with_deadline(server: rpc.Server, kind: str, calls: list[Call]) -> list[Any]:
    """Send ``calls`` as a client would, their timeouts without a deadline of
    the caller's own (which would cancel them first), and return the replies."""
    kwargs = {"ssl_context": client_context()} if kind == "tls" else {}
    async with await anyio_comm.connect(server.address, timeout=10, **kwargs) as comm:
        for call in calls:
            await comm.send(call.encode())
        return [decode(await comm.receive()) for _ in calls]


async def _until(condition: Any) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.01)


@pytest.mark.parametrize("kind", KINDS)
async def test_each_method_counts_its_calls_and_how_they_ended(kind: str) -> None:
    methods = Methods()
    async with rpc_server_and_client(kind, methods) as (server, client):
        fresh = server.statistics()
        assert set(fresh.methods) == {"echo", "fail", "refuse", "slow", "ticks", "note"}
        assert all(m.calls == m.in_flight == m.cancelled == 0 for m in fresh.methods.values())
        assert fresh.refused == {} and fresh.notifications_dropped == 0
        for i in range(5):
            assert await client.call("echo", i) == i
        for _ in range(2):
            with pytest.raises(rpc.RemoteError):
                await client.call("fail")
        with pytest.raises(rpc.ApplicationError):
            await client.call("refuse")
        with pytest.raises(rpc.InvalidArgumentsError):
            await client.call("echo", 1, 2, 3)
        (late,) = await _call_with_deadline(server, kind, [Call(1, "slow", [5], {}, 0.05)])
        assert late.code == "deadline-exceeded"
        async with client.stream("ticks", 3) as items:
            assert [item async for item in items] == [0, 1, 2]
        with pytest.raises(rpc.MethodNotFoundError):
            await client.call("nothing")
        await client.notify("note", 1)
        await client.notify("note", "raise")
        await client.notify("nothing")
        await _until(lambda: server.statistics().methods["note"].calls == 2)
        await _until(lambda: server.statistics().methods["note"].in_flight == 0)
        await _until(lambda: server.statistics().notifications_dropped == 1)
        stats = server.statistics()
    echo = stats.methods["echo"]
    assert (echo.calls, echo.in_flight, echo.cancelled) == (6, 0, 0)
    assert echo.errors == {"invalid-arguments": 1}
    assert stats.methods["fail"].errors == {"ValueError": 2}
    assert stats.methods["fail"].calls == 2
    assert stats.methods["refuse"].errors == {"anyio_comm.rpc.ApplicationError": 1}
    assert stats.methods["slow"].errors == {"deadline-exceeded": 1}
    assert (stats.methods["ticks"].calls, stats.methods["ticks"].errors) == (1, {})
    assert stats.methods["note"].errors == {"RuntimeError": 1}
    assert stats.refused == {"method-not-found": 1}
    assert stats.notifications_dropped == 1
    assert stats.calls_running == 0
    for method in stats.methods.values():
        assert method.latency is None and method.queue_wait is None


@pytest.mark.parametrize("kind", KINDS)
async def test_calls_in_flight_and_cancelled(kind: str) -> None:
    methods = Methods()
    async with rpc_server_and_client(kind, methods) as (server, client):
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.call, "slow", 30)
            await methods.started.wait()
            running = server.statistics()
            assert running.methods["slow"].in_flight == 1
            assert running.calls_running == 1
            tg.cancel_scope.cancel()
        await _until(lambda: server.statistics().methods["slow"].in_flight == 0)
        slow = server.statistics().methods["slow"]
    assert (slow.calls, slow.cancelled, slow.errors) == (1, 1, {})


@pytest.mark.parametrize("kind", KINDS)
async def test_refusals_before_any_handler_ran(kind: str) -> None:
    """At the server's one slot: a call refused as overloaded ("reject"), and
    one whose deadline passes while it waits ("wait")."""
    methods = Methods()
    async with rpc_server_and_client(kind, methods, max_calls=1, overload="reject") as (
        server,
        client,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.call, "slow", 0.3)
            await methods.started.wait()
            with pytest.raises(rpc.OverloadedError):
                await client.call("echo", 1)
        rejected = server.statistics()
    assert rejected.refused == {"overloaded": 1}
    assert rejected.methods["echo"].calls == 0  # (never admitted)

    methods = Methods()
    async with rpc_server_and_client(kind, methods, max_calls=1) as (server, client):
        replies = await _call_with_deadline(
            server, kind, [Call(0, "slow", [0.5], {}, None), Call(1, "echo", [1], {}, 0.1)]
        )
        (late,) = [reply for reply in replies if reply.id == 1]
        assert late.code == "deadline-exceeded"
        waited = server.statistics()
    assert waited.refused == {"deadline-exceeded": 1}
    assert waited.methods["echo"].errors == {"deadline-exceeded": 1}
    assert waited.methods["echo"].in_flight == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_detailed_statistics_time_each_call(kind: str) -> None:
    """With detailed_statistics: three calls of 50 ms each land in the
    latency buckets above 50 ms; with one slot, the second of two concurrent
    calls of 200 ms waits about that long for it."""
    methods = Methods()
    async with rpc_server_and_client(kind, methods, max_calls=1, detailed_statistics=True) as (
        server,
        client,
    ):
        for _ in range(3):
            assert await client.call("slow", 0.05) == "done"
        timed = server.statistics().methods["slow"]
        async with anyio.create_task_group() as tg:
            for _ in range(2):
                tg.start_soon(client.call, "slow", 0.2)
        queued = server.statistics().methods["slow"]
        assert server.statistics().methods["echo"].latency is not None
    latency = timed.latency
    assert latency is not None and timed.queue_wait is not None
    assert latency.bounds == rpc.Histogram(latency.bounds, (), 0, 0.0).bounds
    assert latency.bounds[:4] == (0.005, 0.01, 0.025, 0.05)
    assert len(latency.counts) == len(latency.bounds) + 1
    assert latency.count == sum(latency.counts) == 3
    assert sum(latency.counts[:3]) == 0  # (none at or below 25 ms)
    assert 0.14 <= latency.sum < 5
    assert timed.queue_wait.count == 3 and timed.queue_wait.sum < 0.15
    assert queued.queue_wait is not None and queued.latency is not None
    assert queued.queue_wait.count == queued.latency.count == 5
    assert max(queued.queue_wait.counts[6:]) == 1  # (one waited more than 100 ms)
    assert 0.14 <= queued.queue_wait.sum < 5


async def test_detailed_statistics_take_a_bool() -> None:
    async with rpc_server_and_client("tcp", Methods(), detailed_statistics=1) as (server, _):
        assert server.statistics().methods["echo"].latency is not None


@pytest.mark.parametrize("kind", KINDS)
async def test_calls_of_a_connection_that_ended_are_lost_not_in_flight(kind: str) -> None:
    """A connection that ends with a call running, and a call and a
    notification waiting for its worker, leaves none in flight: all ended,
    "lost"."""
    methods = Methods()
    async with rpc_server_and_client(kind, methods, max_calls_per_connection=1) as (server, _):
        kwargs = {"ssl_context": client_context()} if kind == "tls" else {}
        async with await anyio_comm.connect(server.address, timeout=10, **kwargs) as comm:
            await comm.send(Call(0, "slow", [30], {}, None).encode())
            await comm.send(Call(1, "echo", [1], {}, None).encode())
            await comm.send(Notify("note", [1], {}).encode())
            await methods.started.wait()
            await _until(lambda: server.statistics().methods["echo"].in_flight == 1)
            await _until(lambda: server.statistics().methods["note"].in_flight == 1)
        await _until(lambda: server.statistics().methods["slow"].in_flight == 0)
        await _until(lambda: server.statistics().methods["echo"].in_flight == 0)
        await _until(lambda: server.statistics().methods["note"].in_flight == 0)
        stats = server.statistics()
    assert stats.methods["note"].errors == {"lost": 1}
    assert stats.methods["slow"].errors == {"lost": 1}
    assert stats.methods["echo"].errors == {"lost": 1}
    assert stats.methods["echo"].calls == 1
