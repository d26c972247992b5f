"""The receive seam: whole messages out of a connection that a transport feeds.

Theory of operation
-------------------
A :class:`Receiver` joins a sans-IO :class:`~anyio_comm._sansio.connection.Connection`
and a :class:`~anyio_comm._transports.base.Transport` and hands the comm one
whole message at a time. Two engines do that:

* :class:`PullReceiver`: the receiving task does the reading. Its
  :meth:`~Receiver.receive_nowait` decodes what is buffered and tries the
  transport without waiting; :meth:`~Receiver.wait` waits for the socket.
  Used on trio (which has no readiness callbacks) and over byte streams.
  A read that came up short inside a message found the socket empty, but
  the peer is most likely still sending: the next wait is one pass of the
  event loop (:attr:`~Receiver.yield_due`), after which the socket has
  usually received more, and only a read that comes up empty after it
  waits for readiness (a 10 MB message over loopback on trio: about 15
  readiness waits instead of 25, each an ``epoll_ctl``, a task switch and
  the message's timer; four in five reads after a yield find bytes).
* :class:`PushReceiver`: the event loop does the reading (asyncio and uvloop).
  The loop's readiness callback receives straight into the buffer the connection
  hands out and decodes, as ``asyncio.BufferedProtocol`` does, and wakes the
  task only when a whole message is there. A small queue of decoded messages
  absorbs bursts; when it is full the callback stops reading (the kernel's
  buffers fill and the peer's sends block: backpressure), and the receive
  that takes it down to a quarter (:data:`RESUME_MESSAGES`,
  :data:`RESUME_BYTES`) reads again, itself, and registers the callback again
  only if that read found the socket empty: under a flood of small messages
  that fills the queue again every time, the registration is dropped once and
  the receiving task reads 48 messages' worth at a time, with no
  ``epoll_ctl`` (dropping and restoring it per refill was a tenth of the
  receiver's time at 100-byte messages). The queue holds at most
  :data:`MAX_QUEUED_MESSAGES` messages and :data:`MAX_QUEUED_BYTES` bytes (or
  one larger message). Stopping is lazy: the callback's registration is
  dropped only if the socket becomes readable while the queue is full, so a
  request/reply exchange of large messages, whose queue fills with every
  message and empties before the next arrives, never changes it.
  A large frame (one read directly into its own buffer, see
  :class:`~anyio_comm._sansio.connection.ReceiveStatus`
  ``TASK_READS_FRAME``) is left to the
  task: the callback stops at its header (after a short read, clearing the
  transport's "drained" mark: the task's wake-up is a pass of the loop, after
  which it looks again), and the task allocates the frame's buffer. On a
  plain socket the task then reads the rest of the message as the pull engine
  does, yielding once after a short read (:attr:`~Receiver.yield_due`), and
  the callback only wakes it when the socket is readable (the registration
  stays: no system call to switch). With one connection that measured ahead
  of the callback filling the buffer and waking the task once with the whole
  message (1 MB and 5 x 1 MB messages: 1.14-1.22x the round trips per second
  on asyncio and uvloop, 10 MB 1.04-1.09x). Over TLS the callback still
  fills the buffer and wakes the task with the whole message (the task does
  not look again after a pass there: the transport's "drained" mark stays).
  Either way a
  frame's buffer is allocated when its consumer asks for it, after the
  consumer let go of the previous message (allocated in the callback, it came
  while the consumer still held its last one: with several connections the
  heap then grew past what the allocator keeps and was trimmed again and
  again, every page of those buffers faulting in anew: 1 MB messages over
  four connections ran at 0.4x the floor), and the pages a stalled
  consumer's connection holds stay bounded by the queue. The frames of a
  message of more than 32 frames, some shorter than 64 bytes, are left to the
  task the same way (status ``TASK_READS_MANY``, in mode ``CALLBACK``): until the task
  takes it, the connection keeps its short frames back to back in one buffer,
  where they stay (a :class:`~anyio_comm._sansio.frames.PackedFrames`).

Compressed frames of :data:`OFFLOAD_MIN` bytes and more (decompressed) are
decompressed in a worker thread, never in the event loop's: the connection stops
at such a frame (``DECOMPRESS``), the push
engine leaves it to the task as it leaves a large frame, and the task's
:meth:`~Receiver.wait` runs it in a thread (a cancellation waits for the
thread, so the frame is kept for the next receive). The threads are shared
per event loop, one fewer than the CPUs (at least one). Smaller frames are
decompressed where they are decoded. Before a decompression in a thread, and
after every :data:`CHECK_EVERY` bytes decompressed otherwise, the receiver
asks the transport whether the peer reset the connection
(:meth:`~anyio_comm._transports.base.Transport.peer_reset`): the bytes a peer
sent before it reset still arrive, and a peer that sent compression bombs and
left would otherwise keep the process busy decompressing them.

Both receive the same bytes into the same buffers (a large frame's own buffer,
without copying) with the same system calls. The push engine saves the
receiving task a wake-up per read of a message of small frames that spans
several reads, and answers a readable socket within the loop's callback.

Errors: whatever ends the stream (its end, a protocol error, a failed
connection) is raised by :meth:`~Receiver.receive_nowait` once every message
before it was taken, and again by every later call.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import os
from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING, Final

import anyio
import anyio.to_thread
from anyio import BrokenResourceError, CapacityLimiter, ClosedResourceError
from anyio.lowlevel import RunVar

from ._compat import final
from ._sansio.budget import frames_cost
from ._sansio.connection import (
    CALLBACK,
    DECOMPRESS,
    PULL,
    TASK,
    TASK_READS_FRAME,
    TASK_READS_MANY,
    WAIT_BUDGET,
    EndOfData,
)
from ._sansio.errors import RemoteProtocolError

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from ._backend import Backend
    from ._sansio.budget import BudgetAccount
    from ._sansio.connection import Connection
    from ._sansio.frames import Frames
    from ._transports.base import Transport

__all__ = [
    "MAX_QUEUED_BYTES",
    "MAX_QUEUED_MESSAGES",
    "RESUME_BYTES",
    "RESUME_MESSAGES",
    "PullReceiver",
    "PushMode",
    "PushReceiver",
    "Receiver",
    "start_receiver",
]

#: a push receiver stops reading once this many decoded messages wait ...
MAX_QUEUED_MESSAGES: Final = 64
#: ... or once they cost this many bytes: their frames' bytes plus FRAME_COST per frame
#: (a larger message waits alone, and the next is not started: a stalled consumer
#: costs what it does with the pull engine, the message it holds and one more)
MAX_QUEUED_BYTES: Final = 64 * 1024
#: a full queue is read into again once it holds no more than this many messages ...
RESUME_MESSAGES: Final = MAX_QUEUED_MESSAGES // 4
#: ... and bytes
RESUME_BYTES: Final = MAX_QUEUED_BYTES // 4
#: compressed frames of at least this many bytes (decompressed) are decompressed in a
#: worker thread (smaller ones, a millisecond of work at most, by whoever decodes)
OFFLOAD_MIN: Final = 1024 * 1024
#: after this many bytes decompressed without a check, the next compressed frame
#: waits until the peer is seen to be still there (see _check_peer)
CHECK_EVERY: Final = 16 * 1024 * 1024

# the worker threads that decompress, per event loop: one fewer than the CPUs this
# process may run on (at least one), so that the event loop keeps a CPU
_decompressors: RunVar[CapacityLimiter] = RunVar("anyio_comm_decompressors")


def _decompression_limiter() -> CapacityLimiter:
    try:
        return _decompressors.get()
    except LookupError:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        limiter = CapacityLimiter(max(1, (cpus or 1) - 1))
        _decompressors.set(limiter)
        return limiter


def _check_peer(transport: Transport) -> None:
    """Raise BrokenResourceError if the peer reset the connection: the work its
    last bytes would cost (decompressing them) is not done for a peer that left.

    Raises:
        anyio.BrokenResourceError: the peer reset the connection.
    """
    if transport.peer_reset():
        raise BrokenResourceError(
            "the peer reset the connection (the rest of what it sent is dropped)"
        )


async def _decompress_in_thread(conn: Connection, transport: Transport) -> None:
    """Run the connection's due decompression in a worker thread (a cancellation
    waits for it: nothing is lost, the next receive goes on from there)."""
    _check_peer(transport)
    conn.prepare_decompression()
    await anyio.to_thread.run_sync(conn.decompress, limiter=_decompression_limiter())


def _read(conn: Connection, transport: Transport) -> tuple[int, bool]:
    """The read step of every engine: receive what ``transport`` holds, without
    waiting, into the buffer ``conn`` hands out, and report it to ``conn`` (the
    stream's end included).

    Returns:
        The bytes read (0: the stream ended; -1: the transport had nothing), and
        whether the read left the transport empty (``Transport.drained``: a plain
        socket's read came up short; over TLS, OpenSSL holds nothing either),
        so that a next read would find nothing without waiting.

    Raises:
        Exception: what the transport raises (the connection failed, say).
    """
    buffer = conn.get_buffer()
    n = transport.receive_into_nowait(buffer)
    if n is None:
        return -1, False
    if n:
        conn.buffer_updated(n)
    else:
        conn.receive_eof()
    return n, transport.drained


def _decompress_small(conn: Connection, transport: Transport) -> Frames | None:
    """Run the connection's due decompressions that are small enough to run here,
    and decode on; return a message completed meanwhile, or ``None`` (then a
    large one may be due: see :func:`_decompress_in_thread`).

    Raises:
        anyio.BrokenResourceError: the peer reset the connection.
        RemoteProtocolError, EndOfData: as ``conn.next_message()``.
    """
    while conn.receiving.status is DECOMPRESS and conn.decompression_size < OFFLOAD_MIN:
        _check_peer(transport)
        conn.prepare_decompression()
        conn.decompress()
        frames = conn.next_message()
        if frames is not None:
            return frames
    return None


class Receiver(metaclass=ABCMeta):
    """Delivers whole messages; at most one task uses it at a time."""

    __slots__ = ()

    #: the comm must check for a pending cancellation before :meth:`wait` (on
    #: asyncio, a wait whose wake-up is already scheduled when a cancellation
    #: comes does not raise it; see :class:`PushReceiver` for how it avoids that)
    check_before_wait: bool = False

    @property
    def yield_due(self) -> bool:
        """True when the next :meth:`wait` only yields to the event loop once
        (no timer needs to watch it)."""
        return False

    @property
    @abstractmethod
    def at_message_boundary(self) -> bool:
        """True when no part of a message is buffered or waiting to be taken."""

    @property
    @abstractmethod
    def ended(self) -> bool:
        """True when :meth:`receive_nowait` can return no more messages: the
        stream's end (or a failure) was seen, and every message before it taken."""

    @abstractmethod
    def receive_nowait(self) -> Frames | None:
        """Return the next message's frames, or ``None`` when none is complete.

        Raises:
            EndOfData: the stream ended (after every message before it).
            RemoteProtocolError: the peer broke the protocol.
            anyio.ClosedResourceError: the receiver (or its transport) was closed.
            anyio.BrokenResourceError: the connection failed.
        """

    @abstractmethod
    def wait(self) -> Awaitable[None]:
        """Return an awaitable done when :meth:`receive_nowait` may return
        something (with an idle timeout to enforce, also when any byte arrives).
        Awaiting it always yields. A plain method returning the awaitable (the
        push engine's is a future): one coroutine frame less per wake-up.

        Raises:
            anyio.ClosedResourceError: the receiver was closed (also while waiting).
            anyio.BrokenResourceError: the connection failed.
        """

    def queued(self) -> tuple[int, int]:
        """The messages decoded and waiting to be taken, and their cost (as the
        receive budget counts it)."""
        return (0, 0)

    @abstractmethod
    def close(self) -> None:
        """Stop receiving (before the transport closes); wake a waiting task,
        whose next :meth:`receive_nowait` raises :exc:`anyio.ClosedResourceError`."""

    @abstractmethod
    def keep_taken(self, keeper: BudgetAccount) -> None:
        """From now on, hand the budget reservation of each message
        :meth:`receive_nowait` returns to ``keeper`` (an account of the same
        budget) instead of giving it back: the message stays charged until
        ``keeper`` releases it. Only with a budget."""


@final
class PullReceiver(Receiver):
    """The receiving task reads: try the transport, wait for it when it is empty."""

    __slots__ = (
        "_conn",
        "_empty",
        "_pause",
        "_paused",
        "_transport",
        "_waited",
        "check_before_wait",
    )

    def __init__(
        self,
        transport: Transport,
        conn: Connection,
        *,
        on_asyncio: bool,
        pause: Callable[[], Awaitable[None]],
    ) -> None:
        self._transport = transport
        self._conn = conn
        conn.start_receiving(PULL, offload_min=OFFLOAD_MIN, check_every=CHECK_EVERY)
        # The last read left the transport empty (Transport.drained): do not
        # try it again before waiting.
        self._empty = False
        # one pass of the event loop (see the module)
        self._pause = pause
        # the last wait was that pass, and no read has found bytes since
        self._paused = False
        self._waited = False
        # trio's waits are checkpoints that check first
        self.check_before_wait = on_asyncio

    @property
    def at_message_boundary(self) -> bool:
        return self._conn.at_message_boundary

    @property
    def yield_due(self) -> bool:
        conn = self._conn
        if not self._empty or self._paused or conn.at_message_boundary:
            return False
        status = conn.receiving.status
        return status is not WAIT_BUDGET and status is not DECOMPRESS

    @property
    def ended(self) -> bool:
        # The connection reports the end once every message before it was taken;
        # only the receiving task reads (nothing does between its calls).
        return self._conn.end_error is not None

    def receive_nowait(self) -> Frames | None:
        conn = self._conn
        # After a wait, the connection holds what it held when the last call
        # found no message: go straight to the transport.
        frames = None if self._waited else conn.next_message()
        self._waited = False
        if frames is not None:
            return frames
        transport = self._transport
        status = conn.receiving.status
        if status is DECOMPRESS:
            frames = _decompress_small(conn, transport)
            if frames is not None:
                return frames
            status = conn.receiving.status
        if self._empty or status is WAIT_BUDGET or status is DECOMPRESS:
            return None
        while True:
            n, short = _read(conn, transport)
            if n < 0:
                return None
            self._paused = False
            frames = conn.next_message()
            if frames is None:
                status = conn.receiving.status
                if status is DECOMPRESS:
                    frames = _decompress_small(conn, transport)
                    status = conn.receiving.status
            if short:
                self._empty = True
                return frames
            if frames is not None or status is WAIT_BUDGET or status is DECOMPRESS:
                return frames

    def wait(self) -> Awaitable[None]:
        conn = self._conn
        status = conn.receiving.status
        if status is WAIT_BUDGET:
            return _wait_for_grant(conn)
        if status is DECOMPRESS:
            return _decompress_in_thread(conn, self._transport)
        self._waited = True
        if self.yield_due:
            # A short read inside a message: look again after one pass of the
            # event loop (see the module).
            self._empty = False
            self._paused = True
            self._transport.readable()
            return self._pause()
        self._empty = False
        self._paused = False
        return self._transport.wait_readable()

    def close(self) -> None:
        """Leave the budget; nothing else to stop: the task reads, and closing
        the transport wakes it."""
        self._conn.stop_receiving()

    def keep_taken(self, keeper: BudgetAccount) -> None:
        # (the connection hands a message's reservation over as it completes,
        # which is as this receiver returns it)
        self._conn.keep_taken(keeper)


async def _wait_for_grant(conn: Connection) -> None:
    """Wait until the budget granted the reservation ``conn`` waits for."""
    granted = anyio.Event()
    conn.on_budget_grant(granted.set)
    await granted.wait()


@final
class PushMode(enum.Enum):
    """What a :class:`PushReceiver` does next: who reads, and what stops it.

    ::

                            queue full
            ┌──────────▶ LOOP_READS ────────────────▶ QUEUE_FULL
            │               │  ▲                          │
            │ its message   │  └─ receives take it down ──┘
            │ is complete   │     to a quarter
            │               ▼ the next message is the task's to read
            └──────────── TASK_READS ◀──────────────────────────┐
                            │  ▲                                │ a callback, or a
                    a short │  │ a read that is not short       │ wait() that is not
                       read ▼  │                                │ a yield
                        TASK_YIELD_DUE ── wait(): one pass ──▶ TASK_YIELDING
                               ▲          of the event loop      │
                               └────────── a short read ─────────┘

            any mode ── the stream ends or fails ──▶ ENDED ── close() ──▶ CLOSED

    A message the task reads is complete in any ``TASK_*`` mode; what came
    after it in the same reads is decoded at once, which may fill the queue or
    leave the next message to the task again (a short last read carries over:
    ``TASK_YIELD_DUE``). Whether the transport's readiness callback is
    registered is kept apart (``_registered``): a callback that finds nothing
    to do drops it, and a wait or the receive that resumes reading registers
    again.
    """

    #: the readiness callback reads and decodes; the queue has room
    LOOP_READS = "loop reads"
    #: the queue is full: a callback drops the registration (the bytes wait in
    #: the kernel), and the receive that takes the queue down to a quarter
    #: (RESUME_MESSAGES, RESUME_BYTES) reads again
    QUEUE_FULL = "queue full"
    #: the next message is the task's to read (see the module): a callback wakes
    #: it, or with no task waiting (its receive was cancelled, say) drops the
    #: registration until it waits again
    TASK_READS = "task reads"
    #: as TASK_READS, and the task's last read came up short: its next wait is
    #: one pass of the event loop
    TASK_YIELD_DUE = "task yield due"
    #: as TASK_READS, in that pass: the first callback with no task waiting is
    #: absorbed (the task looks at the socket in this pass anyway)
    TASK_YIELDING = "task yielding"
    #: the stream ended or failed: what ended it is raised after the queue
    ENDED = "ended"
    #: close() was called
    CLOSED = "closed"


LOOP_READS: Final = PushMode.LOOP_READS
QUEUE_FULL: Final = PushMode.QUEUE_FULL
TASK_READS: Final = PushMode.TASK_READS
TASK_YIELD_DUE: Final = PushMode.TASK_YIELD_DUE
TASK_YIELDING: Final = PushMode.TASK_YIELDING
ENDED: Final = PushMode.ENDED
CLOSED: Final = PushMode.CLOSED


@final
class PushReceiver(Receiver):
    """The event loop reads and decodes; the task takes whole messages (asyncio).

    Create it with :meth:`start`, which returns ``None`` when the transport
    cannot deliver readiness callbacks. Its state is a :class:`PushMode`
    (:attr:`mode`), whose diagram is there.

    Cancellation: AnyIO delivers a cancellation to an asyncio task only while
    the future it waits for is still pending, retrying once per pass of the
    event loop. The readiness callback can complete the future first: on
    uvloop, which runs I/O callbacks before the retries, and on asyncio's own
    loops when the callback comes later in the same pass as the task that
    started waiting. So :attr:`check_before_wait` asks the comm to check for a
    pending cancellation before each wait, as the pull engine does on asyncio.
    """

    __slots__ = (
        "__weakref__",
        "_budget_min",
        "_conn",
        "_end",
        "_loop",
        "_pause",
        "_queue",
        "_queued_bytes",
        "_registered",
        "_timed",
        "_transport",
        "_waiter",
        "_wake_on_bytes",
        "_wake_on_partial",
        "check_before_wait",
        "mode",
    )

    def __init__(
        self,
        transport: Transport,
        conn: Connection,
        loop: asyncio.AbstractEventLoop,
        *,
        wake_on_bytes: bool = False,
        wake_on_partial: bool = False,
        pause: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._transport = transport
        self._conn = conn
        self._loop = loop
        self.mode = LOOP_READS
        # registered for the transport's readiness callbacks
        self._registered = False
        self._wake_on_bytes = wake_on_bytes
        # Wake the task once when a message is left incomplete by a callback (the
        # comm then times it: see ReceiveTimers.wait); False again once noted.
        self._timed = self._wake_on_partial = wake_on_partial
        self.check_before_wait = True
        # decoded messages, each with its cost (frames_cost: computed once)
        self._queue: collections.deque[tuple[Frames, int]] = collections.deque()
        self._queued_bytes = 0
        # what ended the stream (mode ENDED), raised after the queued messages
        self._end: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        # one pass of the event loop (mode TASK_YIELD_DUE)
        self._pause = _asyncio_pause if pause is None else pause
        # Messages costing at least this hold a reservation of the budget until
        # the task takes them (mode CALLBACK, set by start once this engine is
        # the one that runs).
        self._budget_min = conn.budget_min

    @classmethod
    def start(
        cls,
        transport: Transport,
        conn: Connection,
        loop: asyncio.AbstractEventLoop,
        *,
        wake_on_bytes: bool = False,
        wake_on_partial: bool = False,
        pause: Callable[[], Awaitable[None]] | None = None,
    ) -> PushReceiver | None:
        """Return a receiver reading from ``transport`` through the event loop's
        readiness callbacks, or ``None`` if the transport cannot do that.

        ``pause`` returns the awaitable of one pass of the event loop (by
        default ``asyncio.sleep(0)``)."""
        receiver = cls(
            transport,
            conn,
            loop,
            wake_on_bytes=wake_on_bytes,
            wake_on_partial=wake_on_partial,
            pause=pause,
        )
        if not transport.start_reading(receiver._on_readable):
            return None  # (the connection is left as the pull engine wants it)
        receiver._registered = True
        # (mode CALLBACK: the frames of a many-frame message are the task's to
        # read, and a reservation lasts until the task takes its message)
        conn.start_receiving(CALLBACK, offload_min=OFFLOAD_MIN, check_every=CHECK_EVERY)
        if conn.account is not None:
            conn.on_budget_grant(receiver._budget_granted)
        receiver._resume()  # bytes that came with the peer's preamble
        return receiver

    @property
    def at_message_boundary(self) -> bool:
        return not self._queue and self._conn.at_message_boundary

    def queued(self) -> tuple[int, int]:
        return (len(self._queue), self._queued_bytes)

    @property
    def ended(self) -> bool:
        mode = self.mode
        return (mode is ENDED or mode is CLOSED) and not self._queue

    @property
    def yield_due(self) -> bool:
        return self.mode is TASK_YIELD_DUE

    def _on_readable(self) -> None:
        """The event loop's callback: receive and decode until the socket is
        drained or the queue is full; wake the task if it has something."""
        mode = self.mode
        if mode is not LOOP_READS:
            if mode is TASK_READS or mode is TASK_YIELD_DUE or mode is TASK_YIELDING:
                self._task_readable()
            else:
                self._unregister()  # bytes wait in the kernel until there is room
            return
        # Bytes (or the end) arrived: with an idle timeout to enforce, that is
        # activity even when they complete no message (nor even a TLS record).
        got_bytes = self._wake_on_bytes
        conn = self._conn
        transport = self._transport
        transport.readable()
        try:
            while True:
                if conn.receiving.status is WAIT_BUDGET:
                    self._unregister()  # until the budget grants the message
                    break
                n, short = _read(conn, transport)
                if n < 0:
                    break
                if self._decode():
                    # The queue is full, or the task reads this message: if the
                    # socket is empty, the task's wake-up is the pass of the loop
                    # after which it looks again (see the module).
                    status = conn.receiving.status
                    if (
                        short
                        and not transport.buffers_data
                        and (status is TASK_READS_FRAME or status is TASK_READS_MANY)
                    ):
                        transport.readable()
                    break
                if not n or short:
                    break  # the stream ended, or the socket is empty
        except Exception as exc:  # the end, a protocol error, a failure: after the queue
            self._set_end(exc)
        waiter = self._waiter
        if waiter is not None and (
            self._queue
            or self.mode is not LOOP_READS
            or got_bytes
            or (self._wake_on_partial and not conn.at_message_boundary)
        ):
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _task_readable(self) -> None:
        """The socket is readable while the task reads its message: wake it.
        While it takes the pass of the loop it asked for, it looks at the
        socket in this pass anyway; otherwise (its receive was cancelled, say)
        stop until it waits again."""
        self._transport.readable()
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)
        elif self.mode is TASK_YIELDING:
            self.mode = TASK_READS  # (once: a second call stops)
        else:
            self._unregister()

    def _decode(self) -> bool:
        """Queue every message the connection can complete; return True if the
        callback is to stop reading: the queue became full (mode QUEUE_FULL),
        or the next message is the task's to read (mode TASK_READS)."""
        conn = self._conn
        next_message = conn.next_message
        queue = self._queue
        while True:
            while (frames := next_message()) is not None:
                cost = frames_cost(frames)
                queue.append((frames, cost))
                self._queued_bytes += cost
                if self._queued_bytes >= MAX_QUEUED_BYTES or len(queue) >= MAX_QUEUED_MESSAGES:
                    self.mode = QUEUE_FULL
                    return True
            status = conn.receiving.status
            if status is not DECOMPRESS:
                break
            frames = _decompress_small(conn, self._transport)
            if frames is None:
                status = conn.receiving.status  # (a large one is due: the task runs it)
                break
            cost = frames_cost(frames)
            queue.append((frames, cost))
            self._queued_bytes += cost
            if self._queued_bytes >= MAX_QUEUED_BYTES or len(queue) >= MAX_QUEUED_MESSAGES:
                self.mode = QUEUE_FULL
                return True
        if status is TASK_READS_FRAME or status is TASK_READS_MANY or status is DECOMPRESS:
            self.mode = TASK_READS  # the task reads this message (see the module)
            return True
        return False

    def _budget_granted(self) -> None:
        """The budget granted the message that waited: read it (called by the
        budget from the release of another connection, or of this one)."""
        mode = self.mode
        if mode is ENDED or mode is CLOSED:
            return
        if mode is not QUEUE_FULL:
            self._register()
        self._resume()
        waiter = self._waiter
        if waiter is not None and (self._queue or self.mode is not LOOP_READS):
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _resume(self) -> None:
        """Decode what the connection already holds, then read from the socket."""
        try:
            if self._decode():
                return
        except Exception as exc:
            self._set_end(exc)
            return
        self._on_readable()

    def _pull(self) -> Frames | None:
        """Read as the task, as :class:`PullReceiver` does, until the message is
        complete; then leave reading to the callback again."""
        conn = self._conn
        transport = self._transport
        conn.receiving.mode = TASK
        try:
            while (frames := conn.next_message()) is None:
                if conn.receiving.status is DECOMPRESS:
                    frames = _decompress_small(conn, transport)
                    if frames is not None:
                        break
                    if conn.decompression_size:
                        return None  # a large one is due: the task's wait() runs it
                    continue
                n, short = _read(conn, transport)
                if n < 0:
                    # (after a short read, without a system call: see
                    # SocketTransport.receive_into_nowait)
                    if transport.buffers_data and not conn.packing:
                        # TLS: the callback fills the frame's buffer from now
                        # on (get_buffer() made it) and wakes the task with the
                        # whole message (see the module).
                        self.mode = LOOP_READS
                    return None
                if n:
                    self.mode = TASK_YIELD_DUE if short else TASK_READS
        finally:
            conn.receiving.mode = CALLBACK
        short = self.mode is TASK_YIELD_DUE
        self.mode = LOOP_READS
        cost = frames_cost(frames)
        if cost >= self._budget_min:
            self._conn.message_taken(cost)
        if transport.buffers_data:
            # TLS: what OpenSSL holds makes the socket no more readable: read it now.
            self._resume()
            return frames
        # Queue what came after it in the same reads (the small frames of a
        # message read at once); its next large frame is the task's again.
        try:
            self._decode()
        except Exception as exc:
            self._set_end(exc)
        if short and self.mode is TASK_READS:
            # a short last read is inside the next message the task reads
            self.mode = TASK_YIELD_DUE
        return frames

    def keep_taken(self, keeper: BudgetAccount) -> None:
        self._conn.keep_taken(keeper)

    def _set_end(self, exc: Exception) -> None:
        """Keep what ended the stream (without its traceback, which holds this
        receiver's frame: a cycle) to raise after the queued messages."""
        exc.__traceback__ = None
        if self.mode is not CLOSED:
            self._end = exc
            self.mode = ENDED

    def _register(self) -> None:
        if not self._registered:
            self._registered = self._transport.start_reading(self._on_readable)

    def _unregister(self) -> None:
        if self._registered:
            self._registered = False
            self._transport.stop_reading()

    def receive_nowait(self) -> Frames | None:
        queue = self._queue
        if queue:
            frames, cost = queue.popleft()
            self._queued_bytes -= cost
            if cost >= self._budget_min:
                self._conn.message_taken(cost)
            if (
                self.mode is QUEUE_FULL
                and self._queued_bytes <= RESUME_BYTES
                and len(queue) <= RESUME_MESSAGES
            ):
                # The queue was full and is down to a quarter: read again, starting
                # with what the connection already holds (the socket may stay quiet).
                # Under a flood that fills the queue again: the callback is
                # registered only if the reads left it something to do.
                self.mode = LOOP_READS
                self._resume()
                if self.mode is LOOP_READS and self._conn.receiving.status is not WAIT_BUDGET:
                    self._register()
            return frames
        mode = self.mode
        if mode is LOOP_READS:
            return None
        if mode is CLOSED:
            raise ClosedResourceError
        end = self._end
        if end is None:
            return None if mode is QUEUE_FULL else self._pull()  # (a TASK_* mode)
        if isinstance(end, (EndOfData, RemoteProtocolError)):
            self._conn.next_message()  # it raises it again, as a new exception
        try:
            raise end
        finally:
            del end  # (this frame is in its traceback: no cycle)

    def wait(self) -> Awaitable[None]:
        mode = self.mode
        if mode is CLOSED:
            raise ClosedResourceError
        if mode is TASK_READS or mode is TASK_YIELD_DUE or mode is TASK_YIELDING:
            if self._conn.receiving.status is DECOMPRESS:
                return _decompress_in_thread(self._conn, self._transport)
            if mode is TASK_YIELD_DUE:
                # A short read inside the message the task reads: look again
                # after one pass of the event loop (see the module).
                self.mode = TASK_YIELDING
                self._transport.readable()
                return self._pause()
            self.mode = TASK_READS
        # Called at a message boundary: wake the task if a message begins and is
        # left incomplete. Called inside a message: the comm times it already.
        self._wake_on_partial = self._timed and self._conn.at_message_boundary
        if not self._registered and mode is not QUEUE_FULL and mode is not ENDED:
            # The callback stopped while the task, reading a large frame, was busy.
            self._registered = self._transport.start_reading(self._on_readable)
        waiter = self._waiter = self._loop.create_future()
        if self._queue or mode is ENDED:
            # Something came while the comm yielded between its last look and
            # this wait (its listener's shutdown checkpoint, say): it has
            # yielded already, so a done future (which does not yield) is right.
            waiter.set_result(None)
        return waiter

    def close(self) -> None:
        if self.mode is CLOSED:
            return
        self.mode = CLOSED
        # The end, raised by receive_nowait(), holds the frames it passed
        # through, which hold this receiver: drop it (no cycle outlives a comm).
        self._end = None
        self._unregister()
        self._conn.stop_receiving()
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def start_receiver(
    transport: Transport,
    conn: Connection,
    backend: Backend,
    *,
    push: bool = True,
    wake_on_bytes: bool = False,
    wake_on_partial: bool = False,
) -> Receiver:
    """The receive engine for a new comm: push where the event loop can drive the
    transport (asyncio and uvloop over a socket) unless ``push`` is False, pull
    otherwise.

    Args:
        push: use the push engine where it can run (``Options.receive_engine``
            ``"auto"``); False: the pull engine everywhere (``"pull"``).
        wake_on_bytes: the comm enforces an idle timeout: a push receiver wakes
            its waiting task whenever bytes arrive, not only with whole messages.
        wake_on_partial: the comm times messages that have begun: a push
            receiver wakes its task waiting between messages when a message
            begins and is left incomplete.
    """
    if push and backend.loop is not None:
        receiver = PushReceiver.start(
            transport,
            conn,
            backend.loop,
            wake_on_bytes=wake_on_bytes,
            wake_on_partial=wake_on_partial,
        )
        if receiver is not None:
            return receiver
    trio = backend.trio
    return PullReceiver(
        transport,
        conn,
        on_asyncio=trio is None,
        pause=_asyncio_pause if trio is None else trio.checkpoint,
    )


def _asyncio_pause() -> Awaitable[None]:
    return asyncio.sleep(0)
