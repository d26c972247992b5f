"""Scheduling promises of send and receive, on every transport and backend.

* Every ``send`` and ``receive`` is a cancellation point, even when the data
  could go out or was already buffered: in a cancelled scope it raises, and
  nothing is sent or lost.
* No more than ``YIELD_EVERY`` (8) operations in a row on a comm complete
  without letting other tasks run, so a producer whose socket always has room, or a consumer
  whose messages are always buffered, cannot starve the event loop.

A *ticker* task counts its own checkpoints: it runs once per turn of the
event loop, so a count that did not move means the operations in between
never let it run. trio runs the tasks of a scheduling batch in random order,
so a task that yields may resume before the ticker's next step; after two
yields the ticker has always run. The tests therefore record the count after
every operation and require it to move within every window of operations
that must contain two yields: twice ``YIELD_EVERY`` sends or receives of
buffered messages, ``YIELD_EVERY`` request/reply rounds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio
import pytest
from anyio import CancelScope, get_cancelled_exc_class
from anyio.lowlevel import checkpoint

from anyio_comm._comm import YIELD_EVERY

from .helpers import TRANSPORTS, connected_pair

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

pytestmark = pytest.mark.anyio

ROUNDS = 100


class Ticker:
    """A task that counts turns of the event loop."""

    def __init__(self) -> None:
        self.ticks = 0

    async def run(self) -> None:
        while True:
            self.ticks += 1
            await checkpoint()


async def with_ticker(
    body: Callable[[Ticker], Awaitable[None]], peer: Callable[[], Awaitable[None]]
) -> None:
    """Run ``body`` while the ticker counts and ``peer`` runs the other end."""
    ticker = Ticker()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker.run)
            tg.start_soon(peer)
            await checkpoint()  # let them start
            await body(ticker)
            tg.cancel_scope.cancel()


def assert_moves(ticks: list[int], window: int, what: str) -> None:
    """The ticker ran within every ``window`` consecutive operations."""
    for start in range(len(ticks) - window):
        assert ticks[start + window] > ticks[start], (
            f"{window} {what} in a row (from #{start}) never let another task run"
        )


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_back_to_back_sends_let_other_tasks_run(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        received: list[object] = []

        async def peer() -> None:
            while True:
                received.append(await server.receive())

        async def body(ticker: Ticker) -> None:
            ticks = [ticker.ticks]
            for i in range(2 * ROUNDS):
                await client.send(i)
                ticks.append(ticker.ticks)
            assert_moves(ticks, 2 * YIELD_EVERY, "sends")
            while len(received) < 2 * ROUNDS:
                await checkpoint()

        await with_ticker(body, peer)
        assert received == list(range(2 * ROUNDS))


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_receive_of_a_buffered_message_lets_other_tasks_run(kind: str) -> None:
    async with connected_pair(kind) as (client, server):

        async def peer() -> None:
            for i in range(ROUNDS):
                await client.send(i)

        async def body(ticker: Ticker) -> None:
            await anyio.sleep(0.05)  # let messages pile up in the read-ahead
            ticks = [ticker.ticks]
            for i in range(ROUNDS):
                assert await server.receive() == i
                ticks.append(ticker.ticks)
            assert_moves(ticks, 2 * YIELD_EVERY, "receives")

        await with_ticker(body, peer)


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_request_reply_lets_other_tasks_run(kind: str) -> None:
    """A receive then a send, over and over, with the peer always ahead."""
    async with connected_pair(kind) as (client, server):
        replies: list[object] = []

        async def peer() -> None:
            async with anyio.create_task_group() as tg:

                async def read_replies() -> None:
                    while True:
                        replies.append(await client.receive())

                tg.start_soon(read_replies)
                for i in range(ROUNDS):
                    await client.send(i)

        async def body(ticker: Ticker) -> None:
            ticks = [ticker.ticks]
            for _ in range(ROUNDS):
                await server.send(await server.receive())
                ticks.append(ticker.ticks)
            assert_moves(ticks, YIELD_EVERY, "request/reply rounds")
            while len(replies) < ROUNDS:
                await checkpoint()

        await with_ticker(body, peer)
        assert replies == list(range(ROUNDS))


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_send_in_a_cancelled_scope_sends_nothing(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        for i in range(3):  # also after a send that did not yield
            with CancelScope() as scope:
                scope.cancel()
                with pytest.raises(get_cancelled_exc_class()):
                    await client.send("cancelled")
            await client.send(i)
        with anyio.fail_after(10):
            assert [await server.receive() for _ in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_receive_in_a_cancelled_scope_loses_nothing(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        for i in range(3):
            await client.send(i)
        await server.receive()
        with anyio.fail_after(10):
            await anyio.wait_all_tasks_blocked()
        with CancelScope() as scope:
            scope.cancel()
            await server.receive()  # the message is buffered: raises at its checkpoint
        assert scope.cancelled_caught
        with anyio.fail_after(10):
            assert [await server.receive() for _ in range(2)] == [1, 2]
