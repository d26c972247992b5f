"""The pull engine's reads and waits, driven by a scripted transport (no event loop)."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from anyio_comm import ReceiveBudget
from anyio_comm._receivers import PullReceiver

from .sansio.test_connection import Pair, joined

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from anyio_comm._sansio.budget import BudgetAccount


class ScriptedTransport:
    """Answers each ``receive_into_nowait`` with the next step of its script and
    records the calls that matter here: reads, ``readable()`` and waits."""

    buffers_data = False  # a plain socket: a short read means it was empty

    def __init__(self) -> None:
        self.script: deque[bytes | None] = deque()
        self.log: list[str] = []

    def receive_into_nowait(self, buffer: memoryview) -> int | None:
        chunk = self.script.popleft()
        if chunk is None:
            self.log.append("eagain")
            return None
        assert len(chunk) < buffer.nbytes  # every read here comes up short
        buffer[: len(chunk)] = chunk
        self.log.append("read")
        return len(chunk)

    def readable(self) -> None:
        self.log.append("readable")

    def wait_readable(self) -> Awaitable[None]:
        self.log.append("wait")
        return _Done()


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
    assert receiver._decoder.waiting_for_budget  # type: ignore[attr-defined]
    assert not receiver.yield_due
    waiting = receiver.wait()
    assert transport.log == ["read"]  # neither a pause nor a readiness wait
    waiting.close()  # type: ignore[attr-defined]
