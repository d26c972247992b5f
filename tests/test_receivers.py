"""The receive engines' reads and waits, driven by a scripted transport (no event
loop runs: the push engine's readiness callback is called by the tests)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

import anyio
import pytest

from anyio_comm import ReceiveBudget
from anyio_comm._receivers import (
    MAX_QUEUED_MESSAGES,
    RESUME_MESSAGES,
    PullReceiver,
    PushMode,
    PushReceiver,
)
from anyio_comm._sansio.connection import ReceiveStatus
from anyio_comm._sansio.errors import EndOfData

from .sansio.test_connection import Pair, joined

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator

    from anyio_comm._sansio.budget import BudgetAccount


class ScriptedTransport:
    """Answers each ``receive_into_nowait`` with the next step of its script and
    records the calls that matter here: reads, ``readable()``, waits and the
    readiness callback's registration. As a socket transport does, it answers
    ``None`` without trying (nothing logged) after a short read until
    ``readable()`` or a wait."""

    buffers_data = False  # a plain socket: a short read means it was empty

    def __init__(self) -> None:
        self.script: deque[bytes | None] = deque()
        self.log: list[str] = []
        self.drained = False
        self.callback: Callable[[], None] | None = None

    def receive_into_nowait(self, buffer: memoryview) -> int | None:
        if self.drained:
            return None
        chunk = self.script.popleft()
        if chunk is None:
            self.log.append("eagain")
            return None
        assert len(chunk) < buffer.nbytes  # every read here comes up short
        buffer[: len(chunk)] = chunk
        self.log.append("read")
        self.drained = True
        return len(chunk)

    def readable(self) -> None:
        self.log.append("readable")
        self.drained = False

    def wait_readable(self) -> Awaitable[None]:
        self.log.append("wait")
        self.drained = False
        return _Done()

    def start_reading(self, callback: Callable[[], None]) -> bool:
        self.log.append("start")
        self.callback = callback
        return True

    def stop_reading(self) -> None:
        self.log.append("stop")
        self.callback = None

    def fire(self) -> None:
        """The event loop reports the socket readable."""
        assert self.callback is not None
        self.log.append("callback")
        self.callback()


class _Done:
    def __await__(self):  # type: ignore[no-untyped-def]
        return iter(())


def scripted_receiver(
    account: BudgetAccount | None = None,
) -> tuple[PullReceiver, ScriptedTransport]:
    """A pull receiver after the preamble exchange, over a scripted transport."""
    conn = Pair(b_account=account).b
    transport = ScriptedTransport()

    def pause() -> Awaitable[None]:
        transport.log.append("pause")
        return _Done()

    receiver = PullReceiver(
        transport,  # type: ignore[arg-type]
        conn,
        on_asyncio=False,
        pause=pause,
    )
    return receiver, transport


def large_message() -> tuple[bytes, bytes]:
    """A message of one 200 KB frame (read straight into its buffer) and its bytes."""
    frame = bytes(range(256)) * 800
    return frame, joined(Pair().a.send_message([memoryview(frame)]))


def receive_whole(receiver: PullReceiver) -> list[memoryview]:
    """Read (and "wait": the scripted waits are done at once) until a message is whole."""
    while (frames := receiver.receive_nowait()) is None:
        receiver.wait()
    return frames


def chunks(data: bytes, size: int = 10_000) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def test_a_short_read_inside_a_message_yields_once_before_waiting() -> None:
    """Inside a message, a short read is followed by one pass of the event loop and
    a second look; only a second look that finds nothing waits for readiness."""
    frame, data = large_message()
    receiver, transport = scripted_receiver()
    pieces = chunks(data)
    transport.script.extend([pieces[0], pieces[1], None, *pieces[2:]])
    assert receiver.receive_nowait() is None  # read 1, short
    assert receiver.yield_due
    receiver.wait()
    assert transport.log == ["read", "readable", "pause"]
    assert receiver.receive_nowait() is None  # read 2 after the pause found bytes ...
    assert receiver.yield_due  # ... so the next short read pauses again
    receiver.wait()
    assert receiver.receive_nowait() is None  # EAGAIN after the pause
    assert not receiver.yield_due
    receiver.wait()
    assert transport.log[3:] == ["read", "readable", "pause", "eagain", "wait"]
    frames = receive_whole(receiver)
    assert bytes(frames[0]) == frame
    # between the first wait and the message, every wait was a pause after a read
    tail = transport.log[8:]
    assert "wait" not in tail and tail.count("pause") == len(pieces) - 3


def test_a_short_read_that_ends_a_message_waits_for_readiness() -> None:
    """At a message boundary, the socket a short read emptied stays empty in a
    request/reply exchange: the next wait is a readiness wait, no pause first."""
    frame, data = large_message()
    receiver, transport = scripted_receiver()
    pieces = chunks(data)
    transport.script.extend(pieces)
    frames = receive_whole(receiver)
    assert bytes(frames[0]) == frame
    assert receiver.at_message_boundary
    del transport.log[:]
    assert receiver.receive_nowait() is None  # no read: the last one came up short
    assert not receiver.yield_due
    receiver.wait()
    assert transport.log == ["wait"]


def test_a_message_waiting_for_the_budget_is_not_looked_at_again() -> None:
    """A short read that leaves the message waiting for the receive budget: the next
    wait is for the budget (under the comm's stall checks), not a pass of the loop."""
    budget = ReceiveBudget(1_000_000)
    holder = budget.account()
    assert holder.reserve(900_000)  # a 200 KB message does not fit beside it
    _, data = large_message()
    receiver, transport = scripted_receiver(budget.account())
    transport.script.append(chunks(data)[0])
    assert receiver.receive_nowait() is None
    assert receiver._conn.receiving.status is ReceiveStatus.WAIT_BUDGET  # type: ignore[attr-defined]
    assert not receiver.yield_due
    waiting = receiver.wait()
    assert transport.log == ["read"]  # neither a pause nor a readiness wait
    waiting.close()  # type: ignore[attr-defined]


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop that never runs: the push engine makes its futures there."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def scripted_push_receiver(
    loop: asyncio.AbstractEventLoop,
) -> tuple[PushReceiver, ScriptedTransport]:
    """A push receiver after the preamble exchange, over a scripted transport."""
    conn = Pair().b
    transport = ScriptedTransport()

    def pause() -> Awaitable[None]:
        transport.log.append("pause")
        return _Done()

    transport.script.append(None)  # nothing came with the peer's preamble
    receiver = PushReceiver.start(transport, conn, loop, pause=pause)  # type: ignore[arg-type]
    assert receiver is not None
    assert transport.log == ["start", "readable", "eagain"]
    del transport.log[:]
    return receiver, transport


def test_the_push_engine_leaves_a_large_frame_to_the_task(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """The readiness callback reads up to a large frame and hands the message to the
    task, which reads the rest straight into the frame's buffer: after a short read,
    one pass of the loop and a second look; after a look that finds nothing, a wait
    for the callback. The registration stays meanwhile."""
    frame, data = large_message()
    receiver, transport = scripted_push_receiver(loop)
    pieces = chunks(data)
    transport.script.extend([pieces[0], pieces[1], pieces[2], None, *pieces[3:]])
    waiter = receiver.wait()  # the task waits for a message
    transport.fire()  # the header and the frame's start, in a short read
    assert isinstance(waiter, asyncio.Future) and waiter.done()
    assert transport.log == ["callback", "readable", "read", "readable"]
    # The task's wake-up was a pass of the loop: it reads at once.
    assert receiver.receive_nowait() is None  # read 2, short
    assert receiver.yield_due
    receiver.wait()
    transport.fire()  # readable while the task takes its pass: it looks anyway
    assert receiver.receive_nowait() is None  # read 3 after the pause, short
    receiver.wait()
    assert receiver.receive_nowait() is None  # nothing after the pause ...
    assert not receiver.yield_due
    waiter = receiver.wait()  # ... so wait for the callback
    assert transport.log[4:] == [
        "read",
        "readable",
        "pause",
        "callback",
        "readable",
        "read",
        "readable",
        "pause",
        "eagain",
    ]
    assert not waiter.done()  # type: ignore[attr-defined]
    transport.fire()
    assert waiter.done()  # type: ignore[attr-defined]
    del transport.log[:]
    frames = None
    while frames is None:
        frames = receiver.receive_nowait()
        if frames is None:
            assert receiver.yield_due
            receiver.wait()
    assert bytes(frames[0]) == frame
    assert transport.log.count("read") == len(pieces) - 3
    assert "stop" not in transport.log and "eagain" not in transport.log
    assert not receiver.yield_due
    assert isinstance(receiver.wait(), asyncio.Future)  # a message boundary: the callback


def test_the_push_engine_stops_reading_when_the_task_leaves_a_large_frame(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A readiness callback while the task that reads a large frame neither waits
    nor takes its pass of the loop (its receive was cancelled, say): the
    registration is dropped (a level-triggered callback would come back at every
    pass of the loop) and made again when the task waits."""
    _, data = large_message()
    receiver, transport = scripted_push_receiver(loop)
    pieces = chunks(data)
    transport.script.extend([pieces[0], pieces[1], pieces[2], None, *pieces[3:]])
    assert receiver.mode is PushMode.LOOP_READS
    transport.fire()  # the start of the message: the task's to read
    assert receiver.mode is PushMode.TASK_READS
    assert receiver.receive_nowait() is None
    assert receiver.mode is PushMode.TASK_YIELD_DUE  # (a short read)
    receiver.wait()  # the pass of the loop ...
    assert receiver.mode is PushMode.TASK_YIELDING
    transport.fire()  # ... during which the socket is readable
    assert receiver.mode is PushMode.TASK_READS
    transport.fire()  # a second pass: the task did not look
    assert transport.log[-5:] == ["callback", "readable", "callback", "readable", "stop"]
    assert receiver.receive_nowait() is None  # the task comes back: read 3, short
    receiver.wait()  # a pass of the loop needs no registration
    assert receiver.receive_nowait() is None  # nothing after it
    assert receiver.mode is PushMode.TASK_YIELDING
    waiter = receiver.wait()
    assert receiver.mode is PushMode.TASK_READS
    assert transport.log[-5:] == ["read", "readable", "pause", "eagain", "start"]
    assert not waiter.done()  # type: ignore[attr-defined]
    transport.fire()
    assert waiter.done()  # type: ignore[attr-defined]
    while receiver.receive_nowait() is None:
        receiver.wait()
    assert receiver.mode is PushMode.LOOP_READS  # the message is complete


def test_a_flood_refilling_the_queue_changes_no_registration(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Under a flood, the receive that takes a full queue down to a quarter reads
    (and fills the queue) itself, and registers the callback again only when
    its read found the socket empty: no stop and start per refill."""
    receiver, transport = scripted_push_receiver(loop)
    sender = Pair().a
    small = joined(sender.send_message([memoryview(b"m")]))
    refills = 3
    total = MAX_QUEUED_MESSAGES + refills * (MAX_QUEUED_MESSAGES - RESUME_MESSAGES)
    transport.script.extend([small * total, None])
    transport.fire()
    assert receiver.mode is PushMode.QUEUE_FULL
    transport.fire()  # readable again while full: the registration dropped, once
    assert transport.log[-2:] == ["callback", "stop"]
    mark = len(transport.log)
    taken = 0
    while taken < total - MAX_QUEUED_MESSAGES:  # (the last refill took the rest)
        assert receiver.receive_nowait() is not None
        taken += 1
    # every refill came from what the connection held: no read, no registration
    assert receiver.mode is PushMode.QUEUE_FULL
    assert transport.log[mark:] == []
    while receiver.mode is PushMode.QUEUE_FULL:
        assert receiver.receive_nowait() is not None
    # the queue went down to a quarter with the connection empty: the socket is
    # read, found empty, and only then is the callback registered again
    assert transport.log[mark:] == ["readable", "eagain", "start"]
    assert receiver.mode is PushMode.LOOP_READS


def test_the_push_engine_modes_for_a_full_queue_the_end_and_close(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A full queue stops the callback (the registration is dropped at its next
    call) until receives take it down to a quarter; the stream's end is raised
    after the queued messages; close() ends every mode."""
    receiver, transport = scripted_push_receiver(loop)
    sender = Pair().a
    small = joined(sender.send_message([memoryview(b"m")]))
    count = MAX_QUEUED_MESSAGES + 1
    transport.script.extend([small * count, b""])
    transport.fire()
    assert receiver.mode is PushMode.QUEUE_FULL  # one message left in the connection
    transport.fire()  # readable again: nothing read, the registration dropped
    assert transport.log[-2:] == ["callback", "stop"]
    taken = 0
    while receiver.mode is PushMode.QUEUE_FULL:
        assert receiver.receive_nowait() is not None
        taken += 1
        if receiver.mode is PushMode.QUEUE_FULL:
            assert transport.log[-1] == "stop"  # no read, no registration meanwhile
    # down to a quarter: the message left in the connection is decoded, the
    # socket read again (the script's last step is the end): no registration
    # for a stream that ended
    assert taken == MAX_QUEUED_MESSAGES - RESUME_MESSAGES
    assert receiver.mode is PushMode.ENDED
    assert transport.log[-3:] == ["stop", "readable", "read"]
    for _ in range(count - taken):
        assert receiver.receive_nowait() is not None
    assert receiver.ended
    with pytest.raises(EndOfData):
        receiver.receive_nowait()
    receiver.close()
    assert receiver.mode is PushMode.CLOSED
    with pytest.raises(anyio.ClosedResourceError):
        receiver.receive_nowait()
