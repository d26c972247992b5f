"""The receive budget and the decoder's reservations, without an event loop."""

from __future__ import annotations

import math
import mmap
import resource

import pytest

from anyio_comm import Limits, ReceiveBudget
from anyio_comm._sansio.budget import FRAME_COST, message_cost
from anyio_comm._sansio.buffers import LAZY_COMMIT_SIZE, default_allocator
from anyio_comm._sansio.decoder import EndOfData, FrameDecoder, ReceiveMode, ReceiveStatus
from anyio_comm._sansio.errors import RemoteProtocolError
from anyio_comm._sansio.wire import encode_header, encode_preamble

MiB = 1024 * 1024


def test_budget_arguments_are_checked() -> None:
    with pytest.raises(TypeError):
        ReceiveBudget(1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ReceiveBudget(True)
    with pytest.raises(ValueError, match="negative"):
        ReceiveBudget(-1)
    with pytest.raises(ValueError, match="greater than 0"):
        ReceiveBudget(10, stall_timeout=0)
    with pytest.raises(TypeError):
        ReceiveBudget(10, stall_timeout="1")  # type: ignore[arg-type]
    budget = ReceiveBudget(10, stall_timeout=None)
    assert budget.max_bytes == 10
    assert budget.stall_timeout is None
    assert "0 of 10 bytes" in repr(budget)


def test_reservations_that_do_not_fit_wait_and_are_granted_in_order() -> None:
    budget = ReceiveBudget(100)
    a, b, c, d = (budget.account() for _ in range(4))
    granted: list[str] = []
    b.on_grant = lambda: granted.append("b")
    c.on_grant = lambda: granted.append("c")
    assert a.reserve(60)
    assert not b.reserve(50)  # does not fit
    assert d.reserve(10)  # fits: first fit, b does not hold it up
    assert not c.reserve(40)
    assert (budget.in_use, budget.waiting) == (70, 2)
    with pytest.raises(RuntimeError):
        b.reserve(1)
    a.release(60)
    assert granted == ["b", "c"]
    assert (budget.in_use, budget.waiting) == (100, 0)
    assert (b.held, c.held, d.held) == (50, 40, 10)


def test_a_starving_waiter_is_overtaken_by_nobody() -> None:
    budget = ReceiveBudget(100, stall_timeout=5)
    a, big, small = (budget.account() for _ in range(3))
    assert a.reserve(60)
    assert not big.reserve(80)
    assert small.reserve(10)  # overtakes: big has not waited long
    small.release(10)
    assert budget.check_stalls(0.0) == []
    progress = iter(range(1000))
    a.progress = lambda: next(progress)
    assert budget.check_stalls(5.0) == []  # big has waited 5 s: starving now
    assert not small.reserve(10)  # nobody overtakes it
    a.release(60)
    assert (big.held, small.held) == (80, 10)


def test_messages_larger_than_the_budget_have_a_lane_of_their_own() -> None:
    budget = ReceiveBudget(100)
    a, b, c = budget.account(), budget.account(), budget.account()
    assert a.reserve(10)
    assert b.reserve(1000)  # larger than the budget: its own lane, free
    assert budget.in_use == 1010
    assert a.reserve(1)  # the others go on beside it
    assert not c.reserve(2000)  # the lane is taken
    d = budget.account()
    assert d.reserve(50)
    b.release(1000)
    assert c.held == 2000 and budget.waiting == 0
    c.close()
    assert budget.in_use == 10 + 1 + 50


def test_closing_an_account_releases_it_and_leaves_the_line() -> None:
    budget = ReceiveBudget(100)
    a, b, c = budget.account(), budget.account(), budget.account()
    assert a.reserve(100)
    assert not b.reserve(100)
    assert not c.reserve(50)
    b.close()  # leaves the line: c still waits for a
    assert budget.waiting == 1
    a.close()
    assert (budget.in_use, c.held, budget.waiting) == (50, 50, 0)
    a.release(10)  # after close: ignored
    assert budget.in_use == 50
    assert a.reserve(10)  # a closing connection is not accounted any more
    assert budget.in_use == 50


def test_cancel_leaves_the_line() -> None:
    budget = ReceiveBudget(100)
    a, b, c = budget.account(), budget.account(), budget.account()
    assert a.reserve(90)
    assert not b.reserve(50)
    assert not c.reserve(20)
    b.cancel()
    assert budget.waiting == 1
    a.release(90)
    assert (b.held, c.held, budget.waiting) == (0, 20, 0)
    b.cancel()  # not waiting: nothing happens


def test_a_transfer_keeps_the_bytes_reserved_under_another_account() -> None:
    """What a taken message held moves to the account that keeps it charged (an
    RPC server's queue): nothing is granted, the budget's total is unchanged,
    and the bytes go back when the new holder releases them or closes."""
    budget = ReceiveBudget(100)
    comm, keeper, waiter, other = (budget.account() for _ in range(4))
    granted: list[str] = []
    waiter.on_grant = lambda: granted.append("waiter")
    assert comm.reserve(60)
    assert not waiter.reserve(50)
    comm.transfer(60, keeper)
    assert (comm.held, keeper.held, budget.in_use, granted) == (0, 60, 60, [])
    assert comm.released == 1  # progress for comm's stall check
    keeper.release(60)
    assert granted == ["waiter"] and budget.in_use == 50
    # the lane of messages larger than the budget moves with its message
    assert comm.reserve(500)
    comm.transfer(500, keeper)
    assert not other.reserve(600)  # the lane is still taken
    keeper.close()
    assert other.held == 600 and budget.in_use == 650
    # to a closed account: given back
    assert comm.reserve(20)
    comm.transfer(20, keeper)
    assert comm.held == 0 and budget.in_use == 650
    with pytest.raises(ValueError, match="different budgets"):
        comm.transfer(1, ReceiveBudget(10).account())


def test_stall_check_picks_the_largest_holders_without_progress() -> None:
    budget = ReceiveBudget(100, stall_timeout=10)
    small, large, moving, waiter = (budget.account() for _ in range(4))
    progress = {"moving": 0}
    moving.progress = lambda: progress["moving"]
    stalled: list[str] = []
    small.on_stall = stalled.append
    assert small.reserve(20)
    assert large.reserve(50)
    assert moving.reserve(30)
    assert budget.check_stalls(0.0) == []  # nobody waits
    assert not waiter.reserve(40)
    assert budget.check_stalls(0.0) == []  # first look
    progress["moving"] += 1
    assert budget.check_stalls(9.9) == []
    progress["moving"] += 1
    assert budget.check_stalls(10.0) == [large]  # large alone frees enough
    waiter.cancel()
    assert not waiter.reserve(90)
    assert budget.check_stalls(10.0) == [large, small]  # both, largest first
    small.stall("held it")
    assert stalled == ["held it"]
    assert small.held == 0 and budget.in_use == 80


def test_a_stalled_large_message_is_closed_for_the_next_large_one() -> None:
    budget = ReceiveBudget(100, stall_timeout=1)
    holder, regular, next_large = (budget.account() for _ in range(3))
    assert holder.reserve(500)
    assert regular.reserve(90)
    assert not next_large.reserve(600)
    assert budget.check_stalls(0.0) == []
    assert budget.check_stalls(1.0) == [holder]  # regular holds nothing the waiter needs
    holder.stall("stalled")
    assert next_large.held == 600


def test_stall_check_off_and_released_counts_as_progress() -> None:
    budget = ReceiveBudget(10, stall_timeout=None)
    a, b = budget.account(), budget.account()
    assert a.reserve(10)
    assert not b.reserve(10)
    assert budget.check_stalls(0.0) == []
    assert budget.check_stalls(1e9) == []
    timed = ReceiveBudget(10, stall_timeout=1)
    c, d = timed.account(), timed.account()
    assert c.reserve(5) and c.reserve(5)
    assert not d.reserve(10)
    assert timed.check_stalls(0.0) == []
    c.release(5)  # a message was taken: progress
    assert timed.check_stalls(5.0) == []
    assert timed.check_stalls(6.0) == [c]


def test_close_stalled_closes_what_check_stalls_picks_and_says_why() -> None:
    budget = ReceiveBudget(100, stall_timeout=8)
    assert budget.check_interval == 1.0  # a quarter of stall_timeout, at most 1 s
    assert ReceiveBudget(100, stall_timeout=2).check_interval == 0.5
    assert ReceiveBudget(100, stall_timeout=None).check_interval == math.inf
    holder, moving, waiter = (budget.account() for _ in range(3))
    reasons: dict[str, list[str]] = {"holder": [], "moving": []}
    holder.on_stall = reasons["holder"].append
    moving.on_stall = reasons["moving"].append
    steps = iter(range(100))
    moving.progress = lambda: next(steps)
    assert holder.reserve(60) and moving.reserve(40)
    assert not waiter.reserve(50)
    budget.close_stalled(0.0)
    budget.close_stalled(7.9)
    assert reasons == {"holder": [], "moving": []}
    budget.close_stalled(8.0)
    assert reasons["moving"] == []
    (reason,) = reasons["holder"]
    assert reason == (
        "held 60 bytes of the receive budget (100 bytes) without progress for 8 s "
        "while 1 connections waited for it"
    )
    assert holder.held == 0 and waiter.held == 50


# -- the decoder's reservations ------------------------------------------------


def header(*lengths: int) -> bytes:
    return encode_header(list(lengths))


def pump(decoder: FrameDecoder, data: bytes) -> list[list[memoryview]]:
    """Write ``data`` through get_buffer/buffer_updated, draining as a comm does."""
    messages = []
    view = memoryview(data)
    while view:
        buffer = decoder.get_buffer()
        n = min(len(buffer), len(view))
        buffer[:n] = view[:n]
        decoder.buffer_updated(n)
        view = view[n:]
        while (frames := decoder.next_message()) is not None:
            messages.append(frames)
    return messages


def decoder_for(budget: ReceiveBudget, limits: Limits | None = None) -> FrameDecoder:
    decoder = FrameDecoder(limits, account=budget.account())
    decoder.feed(encode_preamble(Limits()))
    assert decoder.next_handshake() is not None
    return decoder


def test_small_messages_are_not_reserved() -> None:
    budget = ReceiveBudget(0)
    decoder = decoder_for(budget)
    small = 1000
    assert message_cost(small, 1) < decoder.budget_min
    decoder.feed(header(small) + b"x" * small)
    assert decoder.next_message() is not None
    assert budget.in_use == 0


def test_large_message_is_reserved_at_its_header_and_released_when_complete() -> None:
    budget = ReceiveBudget(10 * MiB)
    decoder = decoder_for(budget)
    size = 1 * MiB
    decoder.feed(header(size, 5))
    assert decoder.next_message() is None
    assert budget.in_use == message_cost(size + 5, 2) == size + 5 + 2 * FRAME_COST
    assert decoder.received_in_message == 4 + 16
    decoder.feed(b"a" * 100_000)
    assert decoder.next_message() is None
    assert decoder.received_in_message == 4 + 16 + 100_000
    decoder.feed(b"a" * (size - 100_000) + b"bbbbb")
    frames = decoder.next_message()
    assert frames is not None and bytes(frames[1]) == b"bbbbb"
    assert budget.in_use == 0
    assert decoder.received_in_message == 0


@pytest.mark.parametrize("before", [b"", b"body"])
def test_a_message_waiting_for_budget_is_not_started(before: bytes) -> None:
    """Also a message of a body and a large frame (its body waits with it)."""
    budget = ReceiveBudget(2 * MiB)
    holder = budget.account()
    assert holder.reserve(2 * MiB)
    decoder = decoder_for(budget)
    granted: list[bool] = []
    assert decoder.account is not None
    decoder.account.on_grant = lambda: granted.append(True)
    lengths = [len(before)] if before else []
    decoder.feed(header(*lengths, MiB) + before + b"z" * 1000)
    assert decoder.next_message() is None
    assert decoder.state.status is ReceiveStatus.WAIT_BUDGET  # nothing allocated while waiting
    assert budget.waiting == 1
    assert decoder.next_message() is None  # still in line
    holder.release(2 * MiB)
    assert granted == [True]
    assert budget.in_use == message_cost(len(before) + MiB, len(lengths) + 1)
    assert decoder.next_message() is None  # the message goes on
    assert decoder.state.status is ReceiveStatus.TASK_READS_FRAME
    decoder.feed(b"z" * (MiB - 1000))
    frames = decoder.next_message()
    assert frames is not None and [len(f) for f in frames] == [*lengths, MiB]
    assert bytes(frames[0]) == (before or b"z" * MiB)
    assert budget.in_use == 0


def test_held_reservations_are_left_to_the_io_layer() -> None:
    budget = ReceiveBudget(10 * MiB)
    decoder = decoder_for(budget)
    decoder.state.mode = ReceiveMode.TASK
    assert len(pump(decoder, header(MiB) + b"q" * MiB)) == 1
    assert budget.in_use == message_cost(MiB, 1)  # the queue releases it when taken
    assert decoder.account is not None
    decoder.account.taken(message_cost(MiB, 1))
    assert budget.in_use == 0


@pytest.mark.parametrize("waiting", [False, True])
def test_end_of_stream_gives_the_reservation_back(waiting: bool) -> None:
    budget = ReceiveBudget(MiB)
    holder = budget.account()
    if waiting:
        assert holder.reserve(2 * MiB)  # takes the lane of messages over the budget
    decoder = decoder_for(budget)
    decoder.feed(header(MiB) + b"x" * 10)
    assert decoder.next_message() is None
    assert (decoder.state.status is ReceiveStatus.WAIT_BUDGET) is waiting
    decoder.receive_eof()
    with pytest.raises(EndOfData):
        decoder.next_message()
    assert budget.waiting == 0
    assert budget.in_use == (2 * MiB if waiting else 0)


def test_protocol_error_after_a_reserved_message_releases_it() -> None:
    budget = ReceiveBudget(10 * MiB)
    decoder = decoder_for(budget, limits=Limits(max_frames=2))
    with pytest.raises(RemoteProtocolError):
        pump(decoder, header(MiB) + b"x" * MiB + header(1, 1, 1))
    assert budget.in_use == 0


def test_many_empty_frames_are_reserved_for_their_bookkeeping() -> None:
    budget = ReceiveBudget(10 * MiB)
    decoder = decoder_for(budget)
    decoder.feed(header(*([0] * 1000)))
    frames = decoder.next_message()
    assert frames is not None and len(frames) == 1000
    assert budget.in_use == 0  # complete: released


# -- memory committed as bytes arrive -------------------------------------------


def test_large_frames_get_pages_as_their_bytes_arrive() -> None:
    buffer = default_allocator(LAZY_COMMIT_SIZE)
    assert isinstance(buffer, mmap.mmap)
    assert len(buffer) == LAZY_COMMIT_SIZE
    view = memoryview(buffer)
    assert not view.readonly
    assert isinstance(default_allocator(LAZY_COMMIT_SIZE - 1), bytearray)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not hasattr(mmap, "MAP_PRIVATE"), reason="needs anonymous mappings")
def test_a_declared_1_gib_frame_commits_only_what_arrived() -> None:
    decoder = FrameDecoder(Limits())
    decoder.feed(encode_preamble(Limits()))
    assert decoder.next_handshake() is not None
    before = _rss()
    decoder.feed(header(2**30) + b"y" * 1000)
    assert decoder.next_message() is None
    buffer = decoder.get_buffer()  # allocates the frame's buffer
    assert buffer.nbytes == 2**30 - 1000
    buffer[: 4 * MiB] = b"y" * (4 * MiB)
    decoder.buffer_updated(4 * MiB)
    assert decoder.next_message() is None
    grown = _rss() - before
    assert grown < 64 * MiB, grown


def test_a_closed_account_drops_its_callbacks() -> None:
    # They refer to the connection, which refers to the account: kept, they
    # would make a cycle that outlives the connection.
    budget = ReceiveBudget(100)
    decoder = FrameDecoder(account=budget.account())
    account = decoder.account
    assert account is not None
    account.on_grant = lambda: None
    account.on_stall = lambda reason: None
    decoder.feed(encode_preamble(Limits()))
    assert decoder.next_handshake() is not None
    decoder.feed(encode_header([40]) + b"x" * 20)  # a message under way: progress counts it
    first = account.progress()
    decoder.feed(b"x" * 10)
    assert account.progress() != first
    account.close()
    assert account.on_grant is None and account.on_stall is None
    assert account.progress() is None


def test_statistics_count_waits_their_time_and_stalls() -> None:
    """Without an event loop: the budget's and each account's waits, their
    seconds (the current wait's included), and the connections closed for
    stalling."""
    budget = ReceiveBudget(100, stall_timeout=1)
    holder, waiter, other = (budget.account() for _ in range(3))
    holder.on_stall = lambda reason: None
    fresh = budget.statistics()
    assert (fresh.max_bytes, fresh.in_use, fresh.waiting, fresh.waits) == (100, 0, 0, 0)
    assert (fresh.wait_seconds, fresh.stalls_closed) == (0.0, 0)
    assert holder.reserve(80)
    assert not waiter.reserve(50)
    assert not other.reserve(30)
    waiting = budget.statistics()
    assert (waiting.in_use, waiting.waiting, waiting.waits) == (80, 2, 2)
    assert waiting.wait_seconds >= 0
    assert (waiter.waits, other.waits, holder.waits) == (1, 1, 0)
    assert budget.statistics().wait_seconds >= waiting.wait_seconds  # (still growing)
    budget.close_stalled(0.0)
    budget.close_stalled(1.0)  # the holder made no progress for 1 s: closed
    done = budget.statistics()
    assert (done.in_use, done.waiting, done.waits, done.stalls_closed) == (80, 0, 2, 1)
    assert done.wait_seconds == waiter.wait_seconds + other.wait_seconds
    ended = waiter.wait_seconds
    assert waiter.wait_seconds == ended  # (no longer growing)
    # A wait that ends without a grant, by cancel() or close(), is counted too.
    for leave in ("cancel", "close"):
        leaving = budget.account()
        assert not leaving.reserve(50)
        assert budget.statistics().waiting == 1
        getattr(leaving, leave)()
        assert leaving.waits == 1 and leaving.wanted == 0
        left = budget.statistics()
        assert left.waiting == 0 and left.in_use == 80
        assert left.wait_seconds >= done.wait_seconds
    assert budget.statistics().waits == 4
