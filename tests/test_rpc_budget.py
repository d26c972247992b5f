"""anyio_comm.rpc: the arguments of queued calls stay charged to the listener's
receive budget until their handler starts; a spent budget stops the reading
(nothing is lost), and calls that leave the queue give their charge back.
Every backend; TCP, TLS and the other address transports."""

from __future__ import annotations

import contextlib
import os
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import anyio_comm
from anyio_comm import ReceiveBudget, rpc
from anyio_comm._sansio.budget import message_cost
from anyio_comm._sansio.serialization import Serializer
from anyio_comm.rpc._protocol import Call, Cancel, ErrorCode, ErrorReply, Result, decode
from anyio_comm.rpc._server import UNCHARGED_PER_CONNECTION

from .certs import client_context
from .helpers import ADDRESS_TRANSPORTS, listen_arguments

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]
KiB = 1024
MiB = 1024 * KiB
LARGE = 256 * KiB  # counted by the budget from its header on


class Methods:
    def __init__(self, budget: ReceiveBudget) -> None:
        self.budget = budget
        self.gate = anyio.Event()
        self.peak = 0

    async def block(self) -> str:
        await self.gate.wait()
        return "opened"

    def size(self, i: int, data: bytes) -> list[int]:
        self.peak = max(self.peak, self.budget.in_use)
        return [i, len(data)]


def cost(call: Call) -> int:
    """What the budget counts for ``call``'s message."""
    frames = Serializer().dumps(call.encode())
    return message_cost(sum(map(len, frames)), len(frames))


def large_calls(first: int, count: int, timeout: float | None = None) -> list[Call]:
    return [
        Call(i, "size", [i, os.urandom(LARGE)], {}, timeout) for i in range(first, first + count)
    ]


async def until(condition: Callable[[], bool], what: str) -> None:
    with anyio.move_on_after(10):
        while not condition():
            await anyio.sleep(0.01)
        return
    pytest.fail(f"timed out waiting until {what}")


def queued(server: rpc.Server) -> int:
    """Calls that wait or run on the server, all connections."""
    return sum(len(session.running) for session in server._sessions)


@asynccontextmanager
async def serving(
    kind: str, budget: ReceiveBudget, **serve_arguments: Any
) -> AsyncIterator[tuple[rpc.Server, anyio_comm.Comm, Methods]]:
    """A server whose one worker per connection is held by ``block``, and a
    raw comm to it (the test writes RPC messages by hand)."""
    methods = Methods(budget)
    async with listen_arguments(kind) as (address, server_kwargs, client_kwargs):
        async with (
            rpc.serve(
                address,
                methods,
                receive_budget=budget,
                max_calls_per_connection=1,
                **server_kwargs,
                **serve_arguments,
            ) as server,
            await anyio_comm.connect(server.address, timeout=10, **client_kwargs) as comm,
        ):
            await comm.send(Call(0, "block", [], {}, None).encode())
            yield server, comm, methods


async def replies(comm: anyio_comm.Comm, count: int) -> dict[int, Result | ErrorReply]:
    got: dict[int, Result | ErrorReply] = {}
    for _ in range(count):
        reply = decode(await comm.receive())
        assert isinstance(reply, (Result, ErrorReply))
        assert reply.id not in got  # one reply per call
        got[reply.id] = reply
    return got


def values(reply: Result | ErrorReply) -> Any:
    assert isinstance(reply, Result), reply
    return reply.value


@pytest.mark.parametrize("kind", KINDS)
async def test_queued_arguments_are_counted_in_the_budget(kind: str) -> None:
    """Large calls waiting for the worker hold exactly their messages' cost of the
    budget; a cancelled one gives its share back at once, the others when they
    start."""
    budget = ReceiveBudget(64 * MiB)
    with anyio.fail_after(30):
        async with serving(kind, budget) as (_server, comm, methods):
            calls = large_calls(1, 8)
            for call in calls:
                await comm.send(call.encode())
            expected = sum(map(cost, calls))
            await until(lambda: budget.in_use == expected, "queued calls charged")
            await comm.send(Cancel(3).encode())
            expected -= cost(calls[2])
            await until(lambda: budget.in_use == expected, "cancelled call uncharged")
            methods.gate.set()
            got = await replies(comm, 8)  # block's and 7 results (none for the cancelled)
            assert got[0] == Result(0, "opened")
            assert {i: values(r) for i, r in got.items() if i} == {
                i: [i, LARGE] for i in range(1, 9) if i != 3
            }
            assert budget.in_use == 0
    assert budget.in_use == 0 and budget.waiting == 0


@pytest.mark.parametrize("kind", ["tcp", "tls"])
async def test_small_calls_are_charged_beyond_the_connections_allowance(kind: str) -> None:
    """Calls too small for the budget to count cost it nothing until the
    connection queued UNCHARGED_PER_CONNECTION bytes of them; the rest are
    charged like large ones."""
    budget = ReceiveBudget(64 * MiB)
    calls = [Call(i, "size", [i, os.urandom(40_000)], {}, None) for i in range(1, 41)]
    allowance = UNCHARGED_PER_CONNECTION - cost(Call(0, "block", [], {}, None))
    charged = 0
    for call in calls:
        if cost(call) <= allowance:
            allowance -= cost(call)
        else:
            charged += cost(call)
    assert 0 < charged < sum(map(cost, calls))
    with anyio.fail_after(30):
        async with serving(kind, budget) as (server, comm, methods):
            for call in calls:
                await comm.send(call.encode())
            await until(lambda: queued(server) == 41, "calls queued")
            assert budget.in_use == charged
            methods.gate.set()
            got = await replies(comm, 41)
            assert all(isinstance(reply, Result) for reply in got.values())
            assert budget.in_use == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_a_spent_budget_stops_the_reading_and_nothing_is_lost(kind: str) -> None:
    """A client sends 10 MiB of calls to a server whose budget is 2 MiB and whose
    worker is busy: the server queues what the budget holds and stops reading
    (the rest waits in the kernel's buffers, then the client's sends block);
    once the worker is free every call runs, with the budget never over its
    size."""
    budget = ReceiveBudget(2 * MiB)
    calls = large_calls(1, 40)
    sent = 0
    with anyio.fail_after(60):
        async with serving(kind, budget) as (server, comm, methods):

            async def send_all() -> None:
                nonlocal sent
                for call in calls:
                    await comm.send(call.encode())
                    sent += 1

            async with anyio.create_task_group() as tg:
                tg.start_soon(send_all)
                await until(lambda: budget.waiting > 0, "the connection waits for the budget")
                await anyio.sleep(0.2)
                waiting_calls = queued(server) - 1  # (block runs)
                await anyio.sleep(0.2)
                assert queued(server) - 1 == waiting_calls  # nothing more is read
                assert budget.waiting > 0
                assert budget.in_use <= budget.max_bytes
                assert 0 < waiting_calls * cost(calls[0]) <= budget.max_bytes
                if kind == "inproc":  # (TCP's buffers on loopback may take it all)
                    assert sent < len(calls)  # the client's sends block
                methods.gate.set()
                got = await replies(comm, 41)
            assert sent == len(calls)
            assert {i: values(r) for i, r in got.items() if i} == {
                i: [i, LARGE] for i in range(1, 41)
            }
            assert 0 < methods.peak <= budget.max_bytes
    assert budget.in_use == 0 and budget.waiting == 0


@pytest.mark.parametrize("kind", ["tcp", "tls"])
async def test_queued_calls_past_their_deadline_give_their_charge_back(kind: str) -> None:
    """Calls whose deadline passes while they wait are answered and uncharged
    then, though the worker never gets to them: the reading that the spent
    budget stopped goes on, and every call is answered."""
    budget = ReceiveBudget(2 * MiB)
    calls = large_calls(1, 20, timeout=0.3)
    with anyio.fail_after(30):
        async with serving(kind, budget) as (_server, comm, methods):

            async def send_all() -> None:
                for call in calls:
                    await comm.send(call.encode())

            async with anyio.create_task_group() as tg:
                tg.start_soon(send_all)
                got = await replies(comm, 20)
            assert sorted(got) == list(range(1, 21))
            for reply in got.values():
                assert isinstance(reply, ErrorReply)
                assert reply.code is ErrorCode.DEADLINE_EXCEEDED
                assert "waited past its deadline" in reply.message
            assert budget.in_use == 0
            assert not methods.gate.is_set()
            methods.gate.set()
            assert await replies(comm, 1) == {0: Result(0, "opened")}


@pytest.mark.parametrize("kind", ["tcp", "tls"])
async def test_calls_of_a_client_that_leaves_give_their_charge_back(kind: str) -> None:
    budget = ReceiveBudget(64 * MiB)
    with anyio.fail_after(30):
        async with serving(kind, budget) as (server, comm, _methods):
            calls = large_calls(1, 6)
            for call in calls:
                await comm.send(call.encode())
            await until(lambda: budget.in_use == sum(map(cost, calls)), "calls charged")
            comm.abort()
            await until(lambda: not server._sessions, "the connection ended")
            assert budget.in_use == 0 and budget.waiting == 0


@pytest.mark.parametrize("kind", ["tcp", "tls"])
async def test_a_queue_holding_the_budget_without_progress_is_closed(kind: str) -> None:
    """A connection whose queued calls hold the budget while none of its calls
    starts or ends is closed after stall_timeout once another waits for the
    budget (its calls fail as the connection ends); the other's call goes on."""
    budget = ReceiveBudget(2 * MiB, stall_timeout=0.5)
    with anyio.fail_after(30):
        async with serving(kind, budget) as (server, comm, _methods):
            async with anyio.create_task_group() as tg:

                async def send_all() -> None:
                    for call in large_calls(1, 20):
                        await comm.send(call.encode())

                tg.start_soon(send_all)
                await until(lambda: budget.waiting > 0, "the hog waits for the budget")
                client_kwargs: dict[str, Any] = {}
                if kind == "tls":
                    client_kwargs["ssl_context"] = client_context()
                async with rpc.connect(server.address, timeout=10, **client_kwargs) as client:
                    payload = os.urandom(MiB)
                    started = anyio.current_time()
                    assert await client.call("size", 7, payload) == [7, MiB]
                    assert anyio.current_time() - started >= 0.4
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    while True:  # the hog was closed
                        await comm.receive()
                tg.cancel_scope.cancel()  # (its sends fail or block)
            assert budget.in_use == 0


def small_calls(count: int) -> list[Call]:
    """Calls too small for the budget to count as it arrives (40 KB)."""
    return [Call(i, "size", [i, os.urandom(40_000)], {}, None) for i in range(1, count + 1)]


@pytest.mark.parametrize("kind", ["tcp", "tls"])
async def test_small_calls_beyond_the_allowance_wait_for_a_spent_budget(kind: str) -> None:
    """Small calls beyond the connection's allowance that do not fit the budget
    stop the reading too, until the calls before them start; all of them run."""
    budget = ReceiveBudget(MiB)
    calls = small_calls(80)  # 3.2 MB: the allowance and the budget hold about 52
    with anyio.fail_after(30):
        async with serving(kind, budget) as (server, comm, methods):
            async with anyio.create_task_group() as tg:

                async def send_all() -> None:
                    for call in calls:
                        await comm.send(call.encode())

                tg.start_soon(send_all)
                await until(lambda: budget.waiting > 0, "a call waits for the budget")
                await anyio.sleep(0.2)
                waiting_calls = queued(server) - 1
                assert 40 < waiting_calls < 60
                assert budget.in_use <= budget.max_bytes
                methods.gate.set()
                got = await replies(comm, 81)
            assert {i: values(r) for i, r in got.items() if i} == {
                i: [i, 40_000] for i in range(1, 81)
            }
            assert 0 < methods.peak <= budget.max_bytes
    assert budget.in_use == 0 and budget.waiting == 0


@pytest.mark.parametrize("kind", ["tcp", "tls"])
async def test_small_calls_waiting_without_progress_are_closed(kind: str) -> None:
    """The stall rule holds for a connection whose small calls wait for the
    budget that its own waiting calls hold: it is closed after stall_timeout."""
    budget = ReceiveBudget(MiB, stall_timeout=0.5)
    with anyio.fail_after(30):
        async with serving(kind, budget) as (server, comm, _methods):
            async with anyio.create_task_group() as tg:

                async def send_all() -> None:
                    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                        for call in small_calls(200):
                            await comm.send(call.encode())

                tg.start_soon(send_all)
                await until(lambda: budget.waiting > 0, "a call waits for the budget")
                started = anyio.current_time()
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    while True:  # closed by the server
                        await comm.receive()
                assert anyio.current_time() - started >= 0.4
                tg.cancel_scope.cancel()
            await until(lambda: not server._sessions, "the connection ended")
    assert budget.in_use == 0 and budget.waiting == 0
