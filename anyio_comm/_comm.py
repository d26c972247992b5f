"""The Comm: AnyIO's ObjectStream over a connection, a serializer and a receive engine.

The Comm is thin glue. The protocol (preamble, framing, limits, per-direction
state, sticky errors) is the sans-IO :class:`~anyio_comm._sansio.connection.Connection`;
bytes move through a :class:`~anyio_comm._transports.base.Transport`; whole
messages come out of a :class:`~anyio_comm._receivers.Receiver` (the receive
engine). The Comm adds the AnyIO contract: states, errors, one receiver and
one sender at a time, cancellation and scheduling.

State machine::

    OPEN ──aclose() / abort()────────────────────► CLOSED
      │                                               ▲
      └─ connection error, protocol error from the ───┘ aclose()
         peer, EOF inside a message, a send
         cancelled after part of it was written,
         or the peer's close record ──────────────► BROKEN

Close records: when the peer announced the ``CLOSE_REASONS`` capability, a
comm that closes for a reason of its own (the peer broke the protocol or a
limit, a timeout, ``aclose(reason)``, a listener's handler failing or its
shutdown) first writes a close record saying why, if no send is under way (a
record cannot go in the middle of a message), within
``CLOSE_RECORD_TIMEOUT`` (1 second). The peer's record is reported by ``receive()``
after every message before it, as :exc:`PeerClosedOK` or
:exc:`PeerClosedError`.

Scheduling: every ``send`` and ``receive`` is a cancellation point, and no
more than ``YIELD_EVERY`` (8) operations in a row on a comm complete without
letting other tasks run (so a fast peer cannot starve the event loop). A pass
of the event loop per message was most of the cost of a stream of small
messages, and one per 8 keeps another task's wait under about 50 us of such a
stream.

* receive: a receive that waited for the engine has yielded already, and the
  wait was its cancellation point (on asyncio preceded by the backend's
  ``checkpoint_if_cancelled()``: AnyIO does not deliver a cancellation to a
  wait whose wake-up is already scheduled, which the event loop's readiness
  callback may have done first). A receive that got its message without
  waiting yields once after taking it if the operations since the last yield
  make ``YIELD_EVERY``, and otherwise only checks for a cancellation; when
  cancelled there, it keeps the message, and the next receive returns it:
  nothing is lost.
* send: a cancellation point before anything is written
  (``checkpoint_if_cancelled()``). A send whose socket takes the message at
  once yields only when the operations since the last yield make
  ``YIELD_EVERY``: on trio with trio's ``cancel_shielded_checkpoint()`` after
  the write; on asyncio, where a shielded checkpoint costs a cancel scope
  (8.5 us measured, against 3.2 us for a plain yield), with one plain yield
  before the write, where a cancellation loses nothing. In request/reply
  traffic the send follows a receive that waited, so the reply goes out
  without a second pass of the event loop.
* writing behind: a send whose message is small and the comm's own bytes (no
  out-of-band buffer of the caller), made when the comm's previous operation
  did not wait for the peer, is queued by a socket transport instead of
  written (``Transport.send_later``; over TLS, the queue is encrypted as a
  whole when it is written): the next send that writes writes the queue
  with its own message in one gather write, or else the event loop does in
  its next pass, which the yield of every ``YIELD_EVERY``-th operation
  provides (on trio the yielding send queues its message too, and its
  shielded yield lets the flusher write the queue). A stream of small
  messages then costs a system call, and over TLS one encryption, per
  ``YIELD_EVERY`` messages rather than per message, while a send after a
  wait (a reply) is written at once. A failure of the queued write is raised
  by a later send; ``aclose()`` and ``send_eof()`` write the queue first,
  ``abort()`` what the socket takes at once.

Receiving and sending are independent (one task may receive while another
sends), but at most one task receives and one task sends at a time.
``send_eof()`` closes our sending direction only; receiving goes on until
the peer's EOF, which every later ``receive()`` reports as ``EndOfStream``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from typing import TYPE_CHECKING, Any, Final, NoReturn, cast

from anyio import (
    BrokenResourceError,
    CancelScope,
    ClosedResourceError,
    EndOfStream,
    TypedAttributeSet,
    current_time,
    move_on_after,
    typed_attribute,
)
from anyio.abc import ObjectStream
from anyio.lowlevel import RunVar, checkpoint

from ._backend import current_backend
from ._closing import close_transport, send_close_record
from ._compat import final
from ._exceptions import (
    LocalProtocolError,
    PeerClosed,
    PeerClosedError,
    ReceiveBudgetError,
    RemoteProtocolError,
)
from ._receive_timers import Expired, ReceiveTimers
from ._receivers import start_receiver
from ._sansio.budget import frames_cost
from ._sansio.close import CloseReason, reason_for_protocol_error
from ._sansio.connection import Connection, ConnectionState, EndOfData
from ._sansio.pool import BufferPool
from ._sansio.wire import Capability
from ._statistics import CommStatistics
from ._util import ConflictDetector

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

    from ._options import Options
    from ._receivers import Receiver
    from ._sansio._buffer import Buffer
    from ._sansio.budget import BudgetAccount, ReceiveBudget
    from ._sansio.frames import Frames
    from ._sansio.serialization import Serializer
    from ._sansio.wire import Handshake
    from ._transports.base import Transport

__all__ = [
    "Comm",
    "CommAttribute",
    "IdleHook",
    "count_work",
    "current_buffer_pool",
    "establish",
    "keep_taken",
    "receive_with_cost",
]

logger = logging.getLogger("anyio_comm")


class _State(enum.Enum):
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


#: the most operations in a row on a comm that complete without yielding to the
#: event loop (see the module docstring)
YIELD_EVERY: Final = 8
_YIELD_AFTER: Final = YIELD_EVERY - 1
_OPEN: Final = _State.OPEN
_CONN_OPEN: Final = ConnectionState.OPEN
_NONE_REFUSED: Final[list[tuple[int, LocalProtocolError]]] = []  # (never changed)


class CommAttribute(TypedAttributeSet):
    """Typed attributes of a :class:`Comm` (``comm.extra(CommAttribute.peer_address)``).

    A comm also passes through its transport's attributes:
    :class:`anyio.abc.SocketAttribute` for socket addresses, and
    :class:`anyio.streams.tls.TLSAttribute` over TLS.
    """

    #: our end of the connection as an address string (``tcp://127.0.0.1:5000``)
    local_address: str = typed_attribute()
    #: the peer's end of the connection as an address string
    peer_address: str = typed_attribute()
    #: what the peer announced in its preamble (protocol version, receive limits)
    peer_handshake: Handshake = typed_attribute()


@final
class IdleHook:
    """What the owner of a comm (a listener) learns about its receives.

    A listener passes one to the comm it creates; during a graceful shutdown it
    calls :meth:`call_when_idle` to stop the handler as soon as its comm waits
    between messages, when stopping it loses nothing. The comm marks each wait
    in :attr:`waiting` and reads :attr:`callback` and :attr:`stopped_idle` (plain
    attributes: two method calls per wait measured 1 % of a small round trip),
    and reports the rest through the methods below.
    """

    __slots__ = ("callback", "stopped_idle", "waiting")

    def __init__(self) -> None:
        #: what stops the handler, once :meth:`call_when_idle` was called (the
        #: comm then calls :meth:`stop_if_idle` before each wait)
        self.callback: Callable[[], object] | None = None
        #: the receiver while a ``receive()`` waits, else None (set by the comm)
        self.waiting: Receiver | None = None
        #: the last receive() was interrupted while it waited between messages
        #: (by the callback, or by any exception) and no message has been taken
        #: since: stopping the handler there lost nothing
        self.stopped_idle = False

    @property
    def idle(self) -> bool:
        """True while a ``receive()`` waits and no part of a message has arrived."""
        waiting = self.waiting
        return waiting is not None and waiting.at_message_boundary

    def call_when_idle(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` now if the comm is idle, else as soon as a
        ``receive()`` is about to wait between messages (in that receive's task,
        which then checkpoints: a cancellation by the callback is raised there)."""
        self.callback = callback
        if self.idle:
            self.stopped_idle = True
            callback()

    # -- called by the comm's receive ------------------------------------------

    def stop_if_idle(self, receiver: Receiver) -> bool:
        """A receive is about to wait on ``receiver``: if no part of a message
        has arrived, call the callback and return True (the receive then
        checkpoints, where the handler's cancellation is raised)."""
        callback = self.callback
        if callback is None or not receiver.at_message_boundary:
            return False
        self.stopped_idle = True
        callback()
        return True

    def wait_interrupted(self, receiver: Receiver) -> None:
        """The wait on ``receiver`` raised (anything)."""
        if receiver.at_message_boundary:
            self.stopped_idle = True

    def message_taken(self) -> None:
        """A receive took a message (the comm calls it only after an interruption
        was noted)."""
        self.stopped_idle = False


@final
class _Deferred:
    """What ended a batch of received messages, raised by the next receive."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _not_sent(
    conn: Connection,
    messages: Sequence[list[memoryview]],
    counted: tuple[int, int, int, int, int, int] | None,
) -> None:
    """Take back the send counts of ``messages``, whose write failed before any
    byte of it went (``counted``: the counters before a batch; ``None``: one
    message, the last counted)."""
    if counted is not None:
        conn.send_undo(counted)
    else:
        conn.unsend_last(messages[0])


def _as_frame(buffer: Buffer) -> memoryview:
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise TypeError("frames must be C-contiguous buffers")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


@final
class Comm(ObjectStream[Any]):
    """A message connection to one peer.

    Obtained from :func:`anyio_comm.connect`, from a listener's handler, or
    from :func:`anyio_comm.from_stream`; not constructed directly. Use it as
    an async context manager, or call :meth:`aclose`.

    Messages (:meth:`send` / :meth:`receive`) are msgpack-serializable objects
    whose large bytes-like values travel out-of-band. Frames
    (:meth:`send_frames` / :meth:`receive_frames`) are the raw layer under
    messages: lists of buffers delivered as they were sent. Both ends of a
    connection must agree on which layer a given exchange uses.
    """

    __slots__ = (
        "_cancel_due",
        "_check_cancelled",
        "_close_reason",
        "_conn",
        "_connect_seconds",
        "_error",
        "_handshake_seconds",
        "_hook",
        "_idle_timeout",
        "_local_address",
        "_peer_address",
        "_peer_reason",
        "_pending",
        "_receive_guard",
        "_receiver",
        "_send_guard",
        "_serializer",
        "_state",
        "_timers",
        "_transport",
        "_trio",
        "_unyielded",
        "_waited",
    )

    def __init__(
        self,
        transport: Transport,
        conn: Connection,
        receiver: Receiver,
        serializer: Serializer,
        *,
        local_address: str,
        peer_address: str,
        timers: ReceiveTimers,
        hook: IdleHook | None = None,
    ) -> None:
        if conn.peer is None and not conn.early:
            raise ValueError("the connection's handshake is not complete")
        self._transport = transport
        self._conn = conn
        self._receiver = receiver
        self._serializer = serializer
        self._local_address = local_address
        self._peer_address = peer_address
        self._state = _State.OPEN
        backend = current_backend()
        # trio's lowlevel module on trio, None on asyncio (the checkpoints are
        # called directly: AnyIO's wrappers look up the backend on every call).
        self._trio = backend.trio
        self._check_cancelled = backend.checkpoint_if_cancelled
        # Asked first: the check is awaited only when a cancellation is due.
        self._cancel_due = backend.cancel_due
        self._receive_guard = ConflictDetector("receiving from")
        self._send_guard = ConflictDetector("sending to")
        # The operations completed since the last yield to the event loop: the
        # one after YIELD_EVERY - 1 of them yields (see the module docstring).
        self._unyielded = 0
        # The last operation waited for the peer (or none was made): a send now is
        # likely a reply, written at once rather than behind (see the module
        # docstring).
        self._waited = True
        # A message taken by a receive that was then cancelled in its final
        # checkpoint (the next receive returns it), or what a batch stopped at
        # (the next receive raises it: _Deferred).
        self._pending: Frames | _Deferred | None = None
        self._timers = timers
        self._idle_timeout = timers.idle_timeout  # (read by every receive)
        # why the comm broke, when it was closed for a reason of its own
        self._error: BrokenResourceError | None = None
        # what the peer's close record said, once a receive reached it
        self._peer_reason: CloseReason | None = None
        # the reason we closed with
        self._close_reason: CloseReason | None = None
        # how long opening the connection (ours to open) and the handshakes took
        self._connect_seconds: float | None = None
        self._handshake_seconds = 0.0
        self._hook = hook
        account = conn.account
        if account is not None:
            account.on_stall = self._stalled

    def __repr__(self) -> str:
        return f"<Comm {self._local_address} -> {self._peer_address} ({self._state.value})>"

    # -- attributes --------------------------------------------------------

    @property
    def local_address(self) -> str:
        """Our end of the connection as an address string (``tcp://127.0.0.1:5000``).
        Also ``comm.extra(CommAttribute.local_address)``."""
        return self._local_address

    @property
    def peer_address(self) -> str:
        """The peer's end of the connection as an address string.
        Also ``comm.extra(CommAttribute.peer_address)``."""
        return self._peer_address

    @property
    def peer_handshake(self) -> Handshake:
        """What the peer announced in its preamble (version, receive limits and
        capabilities). Also ``comm.extra(CommAttribute.peer_handshake)``.

        Raises:
            RuntimeError: the comm was opened with ``early_data`` and no
                :meth:`receive` has read the peer's preamble yet.
        """
        peer = self._conn.peer
        if peer is None:
            raise RuntimeError(
                "the peer's preamble has not arrived yet (a comm opened with early_data "
                "reads it in its first receive)"
            )
        return peer

    @property
    def handshake_complete(self) -> bool:
        """Whether the peer's preamble has arrived (always the case, except on a
        comm opened with ``early_data`` before a :meth:`receive` read it)."""
        return self._conn.peer is not None

    @property
    def idle_timeout(self) -> float | None:
        """Seconds :meth:`receive` waits for the next byte before failing with
        :exc:`IdleTimeoutError` (``None``: no limit)."""
        return self._idle_timeout

    @property
    def peer_close_reason(self) -> CloseReason | None:
        """What the peer's close record said, once :meth:`receive` reached it
        (``None`` before, and when the peer closed without one). Its ``name`` and
        ``text`` are exactly what the peer sent: ``str()`` of the reason escapes
        their control characters, they themselves do not."""
        return self._peer_reason

    @property
    def closed(self) -> bool:
        """True after :meth:`aclose` or :meth:`abort` (or once the connection broke)."""
        return self._state is not _State.OPEN

    @property
    def receive_ended(self) -> bool:
        """True when :meth:`receive` can return no more messages: the peer closed
        the connection or sent EOF (or the connection failed, or this comm was
        closed), and every message that came before was received.

        Over a socket on asyncio and uvloop, the event loop reads while no task
        receives, so the peer's close is seen here as soon as it arrives, on an
        idle comm too (a pool can drop connections its peer closed before
        handing them out; messages not yet received keep it False). On trio, and
        over ``inproc://`` and :func:`~anyio_comm.from_stream` streams, only a
        :meth:`receive` reads: it turns True once a receive reached the end.
        """
        return self._state is not _OPEN or self._receiver.ended

    def statistics(self) -> CommStatistics:
        """What this comm has sent and received so far (see
        :class:`~anyio_comm.CommStatistics`); also after it was closed."""
        conn = self._conn
        sent_bytes, sent, sent_extra, largest_sent, packed, packed_wire = conn.sent_counters()
        received_bytes, received, received_extra, largest_received, unpacked, unpacked_wire = (
            conn.received_counters()
        )
        queued_messages, queued_bytes = self._receiver.queued()
        send_waits, send_wait_seconds = self._transport.send_waits()
        account = conn.account
        return CommStatistics(
            messages_sent=sent,
            frames_sent=sent + sent_extra,
            bytes_sent=sent_bytes,
            largest_message_sent=largest_sent,
            messages_received=received,
            frames_received=received + received_extra,
            bytes_received=received_bytes,
            largest_message_received=largest_received,
            compressed_bytes_sent=packed,
            compressed_wire_bytes_sent=packed_wire,
            compressed_bytes_received=unpacked,
            compressed_wire_bytes_received=unpacked_wire,
            queued_messages=queued_messages,
            queued_bytes=queued_bytes,
            send_waits=send_waits,
            send_wait_seconds=send_wait_seconds,
            budget_waits=0 if account is None else account.waits,
            budget_wait_seconds=0.0 if account is None else account.wait_seconds,
            connect_seconds=self._connect_seconds,
            handshake_seconds=self._handshake_seconds,
            close_reason=self._close_reason,
            peer_close_reason=self._peer_reason,
        )

    @property
    def extra_attributes(self) -> Mapping[Any, Callable[[], Any]]:
        attributes: dict[Any, Callable[[], Any]] = {
            **self._transport.extra_attributes,
            CommAttribute.local_address: lambda: self._local_address,
            CommAttribute.peer_address: lambda: self._peer_address,
        }
        if self._conn.peer is not None:  # (early data: not before the preamble came)
            attributes[CommAttribute.peer_handshake] = lambda: self.peer_handshake
        return attributes

    # -- receiving ---------------------------------------------------------

    async def receive(self) -> Any:
        """Receive the next message.

        Cancellation is safe: a cancelled ``receive`` loses nothing, and the
        next call resumes the partially received message.

        Returns:
            The message; bytes-like values that travelled out-of-band are
            ``memoryview`` objects over their own frame buffer.

        Raises:
            anyio.EndOfStream: the peer closed (or sent EOF) cleanly.
            PeerClosedOK: the peer closed cleanly and said why (an
                :exc:`anyio.EndOfStream`).
            PeerClosedError: the peer closed because of an error and said
                which (an :exc:`anyio.BrokenResourceError`).
            anyio.ClosedResourceError: this comm was closed by us.
            anyio.BrokenResourceError: the connection failed.
            anyio.BusyResourceError: another task is already receiving.
            RemoteProtocolError: the peer sent invalid data; the connection
                is closed.
            IdleTimeoutError: nothing arrived for ``idle_timeout`` seconds;
                the connection is closed.
        """
        frames = await self.receive_frames()
        try:
            return self._serializer.loads(frames)
        except RemoteProtocolError as exc:
            error = exc.with_traceback(None)  # (its frames hold the message's buffers)
        del frames  # (the message goes before the close record does)
        await self._refuse(error)

    async def __anext__(self) -> Any:
        """The next message of ``async for``: as :meth:`receive`, and the end of
        the loop where it raises :exc:`anyio.EndOfStream` (written out rather
        than calling it: a coroutine frame less per message).

        Raises:
            StopAsyncIteration: where :meth:`receive` raises
                :exc:`anyio.EndOfStream`.
            Exception: what else :meth:`receive` raises.
        """
        try:
            frames = await self.receive_frames()
        except EndOfStream:
            raise StopAsyncIteration from None
        try:
            return self._serializer.loads(frames)
        except RemoteProtocolError as exc:
            error = exc.with_traceback(None)
        del frames
        await self._refuse(error)

    async def _refuse(self, error: RemoteProtocolError) -> NoReturn:
        """Close the connection for a message whose body cannot be decoded (its
        frames already dropped: the error must not keep them), and raise ``error``.

        Raises:
            RemoteProtocolError: ``error``.
        """
        error.rule = "message-layer"
        await self._fail(reason=reason_for_protocol_error(error))
        raise error

    async def receive_batch(self, max_messages: int = 64) -> list[Any]:
        """Receive the next message and those that arrived after it: a batch.

        Waits for the next message as :meth:`receive` does, then takes, without
        waiting and without yielding again, the messages that have arrived
        complete behind it, up to ``max_messages`` in all. For streams of small
        messages: one call (one task switch, one cancellation point) for what
        one wake-up brought, where a loop over :meth:`receive` pays each
        message's. Cancellation is safe as with :meth:`receive`: a cancelled
        call takes nothing. What ends the stream (or breaks it) after the
        first message of a batch ends the batch; the next call raises it.

        Returns:
            The messages in order, at least one and at most ``max_messages``.

        Raises:
            ValueError: ``max_messages`` is less than 1.
            Exception: what :meth:`receive` raises.
        """
        if max_messages.__class__ is not int or max_messages < 1:
            raise ValueError(f"max_messages must be an int of at least 1, not {max_messages!r}")
        batch = [await self.receive()]
        if max_messages > 1:
            self._take_arrived(batch, max_messages, self._serializer.loads)
        return batch

    async def receive_frames_batch(self, max_messages: int = 64) -> list[Sequence[memoryview]]:
        """Receive the next message as frames and those that arrived after it,
        as :meth:`receive_batch` does for messages.

        Returns:
            The messages' frames in order (each as :meth:`receive_frames`
            returns them), at least one and at most ``max_messages``.

        Raises:
            ValueError: ``max_messages`` is less than 1.
            Exception: what :meth:`receive_frames` raises.
        """
        if max_messages.__class__ is not int or max_messages < 1:
            raise ValueError(f"max_messages must be an int of at least 1, not {max_messages!r}")
        batch: list[Sequence[memoryview]] = [await self.receive_frames()]
        if max_messages > 1:
            self._take_arrived(batch, max_messages, None)
        return batch

    def _take_arrived(
        self, batch: list[Any], max_messages: int, loads: Callable[[Frames], Any] | None
    ) -> None:
        """Append to ``batch`` the messages that arrived (decoded with ``loads``,
        unless None), until ``max_messages`` or one is not there. What stops it
        otherwise (an error, a message that cannot be decoded) waits in
        ``_pending`` for the next receive, which raises it."""
        if self._state is not _OPEN:
            return
        receiver = self._receiver
        while len(batch) < max_messages:
            try:
                frames = receiver.receive_nowait()
            except Exception as exc:
                self._pending = _Deferred(exc.with_traceback(None))
                return
            if frames is None:
                return
            if loads is None:
                batch.append(frames)
                continue
            try:
                batch.append(loads(frames))
            except RemoteProtocolError as exc:
                # the next receive refuses it (as receive() does: see _refuse)
                exc.rule = "message-layer"
                self._pending = _Deferred(exc.with_traceback(None))
                return

    async def receive_frames(self) -> Sequence[memoryview]:
        """Receive the next message as a sequence of frames.

        Returns:
            One writable ``memoryview`` per frame sent, in a ``list``, each
            over its own exact-size buffer (from the comm's allocator). A
            message of more than 32 frames some of which are shorter than 64
            bytes comes as a :class:`PackedFrames` instead: a read-only
            sequence whose short frames share one buffer (so that a peer's
            many tiny frames cost no more than 8 times their wire size); call
            ``list()`` on it for a list.

        Raises:
            anyio.EndOfStream: the peer closed (or sent EOF) cleanly.
            PeerClosedOK: the peer closed cleanly and said why (an
                :exc:`anyio.EndOfStream`).
            PeerClosedError: the peer closed because of an error and said
                which (an :exc:`anyio.BrokenResourceError`).
            anyio.ClosedResourceError: this comm was closed by us.
            anyio.BrokenResourceError: the connection failed.
            anyio.BusyResourceError: another task is already receiving.
            RemoteProtocolError: the peer violated the wire format or our
                limits; the connection is closed.
            IdleTimeoutError: nothing arrived for ``idle_timeout`` seconds;
                the connection is closed.
        """
        guard = self._receive_guard
        if guard.held:
            guard.raise_busy()
        guard.held = True
        try:
            if self._state is not _OPEN:
                self._check_state(receiving=True)
            frames = self._pending
            if frames is None or isinstance(frames, _Deferred):
                receiver = self._receiver
                try:
                    if frames is not None:  # what ended the last batch: raise it now
                        self._pending = None
                        raise frames.error
                    frames = receiver.receive_nowait()
                    if frames is None:
                        # Wait (the wait is this receive's yield). Written out
                        # here rather than in a helper: every coroutine frame on
                        # the way costs each wake-up.
                        hook = self._hook
                        while True:
                            if receiver.check_before_wait and self._cancel_due():
                                await self._check_cancelled()
                            if hook is not None:
                                if hook.callback is not None and hook.stop_if_idle(receiver):
                                    await checkpoint()  # (cancelled here, before a read)
                                hook.waiting = receiver
                            try:
                                if receiver.yield_due or (
                                    self._idle_timeout is None and receiver.at_message_boundary
                                ):
                                    await receiver.wait()
                                else:
                                    await self._timers.wait(receiver, self._conn)
                            except BaseException:
                                if hook is not None:
                                    hook.wait_interrupted(receiver)
                                raise
                            finally:
                                if hook is not None:
                                    hook.waiting = None
                            frames = receiver.receive_nowait()
                            if frames is not None:
                                self._unyielded = 0
                                self._waited = True
                                self._timers.message_waited = 0.0
                                if hook is not None and hook.stopped_idle:
                                    hook.message_taken()
                                return frames
                except EndOfData as exc:
                    if exc.truncated:
                        await self._fail()
                        raise BrokenResourceError(str(exc)) from None
                    if exc.reason is not None:
                        self._peer_reason = exc.reason
                        await self._fail(graceful=True)
                        raise PeerClosed.of(exc.reason) from None
                    raise EndOfStream from None
                except RemoteProtocolError as exc:
                    await self._fail(reason=reason_for_protocol_error(exc))
                    raise
                except BrokenResourceError:
                    await self._fail()
                    raise
                except ClosedResourceError:
                    self._check_state(receiving=True)
                    raise
                except Expired as exc:
                    await self._fail(graceful=exc.graceful, reason=exc.reason)
                    raise exc.error from None
            else:
                self._pending = None
            # Nothing waited: yield now if this operation makes YIELD_EVERY since
            # the last yield, else only check for a cancellation (written out
            # here, as in _send_nothing: a helper would be a coroutine frame per
            # message). The message is already taken, so a cancellation here
            # keeps it for the next call.
            try:
                if self._unyielded >= _YIELD_AFTER:
                    if self._trio is None:
                        await asyncio.sleep(0)
                    else:
                        await self._trio.checkpoint()
                    self._unyielded = 0
                else:
                    if self._cancel_due():
                        await self._check_cancelled()
                    self._unyielded += 1
            except BaseException:
                self._pending = frames
                raise
            self._waited = False
            self._timers.message_waited = 0.0
            hook = self._hook
            if hook is not None and hook.stopped_idle:
                hook.message_taken()
            return frames
        finally:
            guard.held = False

    def _stalled(self, reason: str) -> None:
        """Close the connection for holding receive budget while stalled (called by
        the budget's stall check, from another comm's task)."""
        if self._state is _OPEN:
            logger.warning("closing the connection from %s: it %s", self._peer_address, reason)
            self._error = ReceiveBudgetError(f"closed to free the receive budget: it {reason}")
            self._state = _State.BROKEN
            self._receiver.close()
            self._transport.abort()

    # -- sending -----------------------------------------------------------

    async def send(self, item: Any) -> None:
        """Send a message.

        Bytes-like values at or above the comm's ``oob_threshold`` are sent
        out-of-band without copying: do not modify them until ``send``
        returns.

        ``send`` returns once the message is written to the connection, or,
        over ``tcp://``, ``unix://`` and ``tls://``, for a small message sent when this
        comm's previous operation did not wait for the peer (a stream, not a
        reply), once it is queued: the queue is written by the next send that
        writes, at the latest in the event loop's next pass, one system call for
        many messages. A failure of that write is raised by a later send
        (:exc:`anyio.BrokenResourceError`); :meth:`aclose` and
        :meth:`send_eof` write the queue first, :meth:`abort` only what the
        socket takes at once.
        Messages with out-of-band buffers are always written before ``send``
        returns.

        .. warning::
           If ``send`` is cancelled after part of the message was written, the
           comm is marked broken and closed (the byte stream cannot be
           resynchronized); later calls raise :exc:`anyio.BrokenResourceError`.
           A send cancelled before any byte was written leaves the comm usable.
           Over TLS, a send cancelled once the message was encrypted also
           breaks the comm, even if no byte reached the socket yet (the TLS
           record sequence cannot be rewound).

        Raises:
            SerializationError: the message cannot be serialized; nothing sent.
            LocalProtocolError: the message exceeds the peer's announced
                limits; nothing sent.
            anyio.ClosedResourceError: this comm was closed, or ``send_eof()``
                was called.
            anyio.BrokenResourceError: the connection failed.
            anyio.BusyResourceError: another task is already sending.
        """
        refused = await self._send_messages((self._serializer.dumps(item),))
        if refused:
            raise refused[0][1]

    async def send_frames(self, buffers: Iterable[Buffer]) -> None:
        """Send a list of buffers as one message of frames.

        Any C-contiguous buffer-protocol objects are accepted; they are sent
        without copying (small neighbours are coalesced), so do not modify
        them until this returns. Same cancellation rule as :meth:`send`.

        Raises:
            TypeError: a buffer is not C-contiguous.
            LocalProtocolError: the message exceeds the peer's announced
                limits; nothing sent.
            anyio.ClosedResourceError: this comm was closed, or ``send_eof()``
                was called.
            anyio.BrokenResourceError: the connection failed.
            anyio.BusyResourceError: another task is already sending.
        """
        refused = await self._send_messages(([_as_frame(buffer) for buffer in buffers],))
        if refused:
            raise refused[0][1]

    async def send_batch(self, items: Iterable[Any]) -> None:
        """Send several messages at once, in order: one gather write (one system
        call where the socket takes them all), one cancellation point.

        For streams of small messages, where a write per message costs more than
        the message: what is sent is exactly what as many :meth:`send` calls
        would send. Every message is serialized and checked against the peer's
        limits before any byte is written, so a message that fails sends none
        of the batch. Same cancellation rule as :meth:`send` (a batch is one
        write). An empty batch sends nothing.

        Raises:
            SerializationError: a message cannot be serialized; nothing sent.
            LocalProtocolError: a message exceeds the peer's announced limits
                (the error says which); nothing sent.
            anyio.ClosedResourceError: this comm was closed, or ``send_eof()``
                was called.
            anyio.BrokenResourceError: the connection failed.
            anyio.BusyResourceError: another task is already sending.
        """
        dumps = self._serializer.dumps
        await self._send_batch([dumps(item) for item in items])

    async def send_frames_batch(self, messages: Iterable[Iterable[Buffer]]) -> None:
        """Send several messages of frames at once, as :meth:`send_batch` does
        for messages (each one a list of buffers, as :meth:`send_frames` takes).

        Raises:
            TypeError: a buffer is not C-contiguous; nothing sent.
            LocalProtocolError: a message exceeds the peer's announced limits
                (the error says which); nothing sent.
            anyio.ClosedResourceError: this comm was closed, or ``send_eof()``
                was called.
            anyio.BrokenResourceError: the connection failed.
            anyio.BusyResourceError: another task is already sending.
        """
        await self._send_batch([[_as_frame(buffer) for buffer in frames] for frames in messages])

    async def _send_batch(self, messages: list[list[memoryview]]) -> None:
        if not messages:
            await self._send_nothing()
            return
        refused = await self._send_messages(messages, partial=False)
        if refused:
            index, error = refused[0]
            raise LocalProtocolError(f"message {index} of the batch: {error}") from error

    async def _send_nothing(self) -> None:
        """An empty batch: the checks and the scheduling of a send, and no write
        (a producer looping on empty batches still lets other tasks run)."""
        if self._state is not _OPEN:
            self._check_state()
        guard = self._send_guard
        if guard.held:
            guard.raise_busy()
        if self._conn.our_state is not _CONN_OPEN:
            raise ClosedResourceError  # after send_eof()
        guard.held = True
        try:
            if self._unyielded >= _YIELD_AFTER:
                if self._trio is None:
                    await asyncio.sleep(0)
                else:
                    await self._trio.checkpoint()
                self._unyielded = 0
            else:
                if self._cancel_due():
                    await self._check_cancelled()
                self._unyielded += 1
            self._waited = False
        finally:
            guard.held = False

    async def _send_messages(
        self, messages: Sequence[list[memoryview]], *, partial: bool = True
    ) -> list[tuple[int, LocalProtocolError]]:
        """Send messages with one gather write, in order: one message, a batch, or
        the messages of many calls the RPC writer queued. A message over the
        peer's limits is left out (nothing of it is sent); the others go, unless
        ``partial`` is False: then nothing is sent.

        Returns:
            The messages left out: their index and why.

        Raises:
            anyio.ClosedResourceError: this comm was closed, or ``send_eof()``
                was called.
            anyio.BrokenResourceError: the connection failed.
            anyio.BusyResourceError: another task is already sending.
        """
        if self._state is not _OPEN:
            self._check_state()
        guard = self._send_guard
        if guard.held:
            guard.raise_busy()
        guard.held = True
        try:
            # The write, here rather than in a helper: a coroutine frame per send.
            # (A cancellation is raised before the messages are encoded and
            # counted as sent: after that, only the write can fail.)
            trio_lowlevel = self._trio
            yield_due = self._unyielded >= _YIELD_AFTER
            if trio_lowlevel is None and yield_due:
                await asyncio.sleep(0)
            elif self._cancel_due():
                await self._check_cancelled()
            conn = self._conn
            refused = _NONE_REFUSED
            counted = None
            if len(messages) == 1:  # (the common case, without the loop's cost)
                try:
                    iov = conn.send_message(messages[0])
                except LocalProtocolError as exc:
                    if conn.our_state is not _CONN_OPEN:
                        raise ClosedResourceError from None  # after send_eof()
                    return [(0, exc)]
            else:
                iov = []
                refused = []
                counted = conn.send_mark()
                for index, frames in enumerate(messages):
                    try:
                        iov += conn.send_message(frames)
                    except LocalProtocolError as exc:
                        if conn.our_state is not _CONN_OPEN:
                            raise ClosedResourceError from None
                        refused.append((index, exc))
                if not iov or (refused and not partial):
                    conn.send_undo(counted)  # (nothing of them is sent)
                    return refused
            transport = self._transport
            if not self._waited and transport.send_later(iov):
                # Not a reply: written behind, with the next send that writes or
                # in the event loop's next pass (see the module docstring). On
                # asyncio a yield above wrote what was queued before; on trio
                # the yield below lets the flusher write the queue.
                if yield_due:
                    self._unyielded = 0
                    if trio_lowlevel is not None:
                        await trio_lowlevel.cancel_shielded_checkpoint()
                else:
                    self._unyielded += 1
                return refused
            try:
                waited = await transport.send_all(iov)
            except ClosedResourceError:
                _not_sent(conn, messages, counted)
                self._check_state()
                raise
            except BaseException as exc:
                if transport.send_interrupted:
                    conn.send_failed()
                    await self._fail()
                else:
                    _not_sent(conn, messages, counted)
                if isinstance(exc, BrokenResourceError):
                    # The peer may have said why it closed (the event loop's
                    # reader found its record already): report that, for good.
                    end = conn.end_error
                    if isinstance(end, EndOfData) and end.reason is not None:
                        self._peer_reason = end.reason
                        await self._fail()
                        raise PeerClosedError(end.reason) from exc
                raise
            if waited:
                self._unyielded = 0
                self._waited = True
                return refused
            self._waited = False
            if yield_due:
                self._unyielded = 0
                if trio_lowlevel is not None:
                    await trio_lowlevel.cancel_shielded_checkpoint()
            else:
                self._unyielded += 1
            return refused
        finally:
            guard.held = False

    async def send_eof(self) -> None:
        """Tell the peer we will send no more messages; we can still receive.

        The peer's ``receive()`` raises :exc:`anyio.EndOfStream` once it has
        read everything sent before. Calling it twice is a no-op.

        Raises:
            anyio.ClosedResourceError: this comm was closed.
            anyio.BrokenResourceError: the connection failed.
            anyio.BusyResourceError: another task is sending.
            NotImplementedError: the underlying stream of a
                :func:`~anyio_comm.from_stream` comm cannot half-close (the
                comm stays usable).
        """
        self._check_state()
        with self._send_guard:
            if self._conn.our_state is ConnectionState.CLOSED:
                return
            transport = self._transport
            try:
                await transport.send_eof()  # (writes the sends queued behind first)
            except BrokenResourceError:
                await self._fail()
                raise
            except BaseException:
                if transport.send_interrupted:  # cancelled in the middle of the queue
                    self._conn.send_failed()
                    await self._fail()
                raise
            self._conn.send_eof()

    # -- closing -----------------------------------------------------------

    def abort(self) -> None:
        """Close the connection at once, without a graceful exchange (no TLS
        ``close_notify``; the peer may see a reset). Synchronous, so it can run
        where no await is possible (a ``__del__``, a callback, another
        framework's close). Idempotent; tasks blocked in :meth:`receive` or
        :meth:`send` get :exc:`anyio.ClosedResourceError`.
        """
        if self._state is not _State.CLOSED:
            self._state = _State.CLOSED
            self._receiver.close()
            self._transport.abort()

    async def aclose(self, reason: CloseReason | None = None) -> None:
        """Close the connection. Idempotent; tasks blocked in :meth:`receive`
        or :meth:`send` get :exc:`anyio.ClosedResourceError`. Messages
        :meth:`send` queued to write behind (over ``tcp://``, ``unix://`` and
        ``tls://``)
        are written first, within 1 second, even when the caller is cancelled;
        a failure of that write is not reported (call :meth:`send_eof` first,
        which raises it, to know).

        Args:
            reason: tell the peer why, in a close record, before closing: when
                the peer announced the ``CLOSE_REASONS`` capability, the comm
                is open, and neither a send is under way nor :meth:`send_eof`
                was called. The record is given ``CLOSE_RECORD_TIMEOUT`` (1
                second) to be written, even when the caller is cancelled. The
                peer's receive then raises :exc:`PeerClosedOK` or
                :exc:`PeerClosedError`, by ``reason.clean``. When the peer
                accepts records but this one could not be written and the
                reason is an error, the connection is aborted (a reset), so
                that the peer never takes it for a clean end. Without a reason,
                or towards a peer that does not accept records, the peer sees
                the end of the stream.

        Raises:
            TypeError: ``reason`` is not a :class:`CloseReason`.
        """
        if reason is not None and not isinstance(reason, CloseReason):
            raise TypeError(f"reason must be a CloseReason, not {type(reason).__name__}")
        if self._state is not _State.CLOSED:
            was_open = self._state is _OPEN
            self._state = _State.CLOSED
            self._receiver.close()
            if reason is not None and was_open:
                self._close_reason = reason
                with CancelScope(shield=True):
                    told = await send_close_record(
                        self._transport, self._conn, self._send_guard, reason, self._peer_address
                    )
                    await close_transport(
                        self._transport, graceful=told is not False or reason.clean
                    )
                return
        # Every transport's aclose() is idempotent; after abort() it still closes
        # what abort() could not (a byte stream without a synchronous close()).
        await self._transport.aclose()

    async def _fail(self, *, graceful: bool = False, reason: CloseReason | None = None) -> None:
        """Mark the comm broken and close the transport, even under cancellation.

        ``graceful`` closes it as :meth:`aclose` does (TLS sends close_notify),
        within ``CLOSE_RECORD_TIMEOUT``; otherwise it is aborted. With a
        ``reason``, a close record says it to the peer first where one can be
        sent (then the close is graceful; if the peer accepts records but this
        one could not be written, it is aborted).
        """
        if self._state is _State.OPEN:
            self._state = _State.BROKEN
            self._receiver.close()
            with CancelScope(shield=True):
                if reason is not None:
                    self._close_reason = reason
                    told = await send_close_record(
                        self._transport, self._conn, self._send_guard, reason, self._peer_address
                    )
                    if told is not None:
                        graceful = told
                await close_transport(self._transport, graceful=graceful)

    def _check_state(self, *, receiving: bool = False) -> None:
        if self._state is _State.CLOSED:
            raise ClosedResourceError
        if self._state is _State.BROKEN:
            reason = self._peer_reason
            if reason is not None:
                raise PeerClosed.of(reason) if receiving else PeerClosedError(reason)
            error = self._error
            if error is not None:
                raise type(error)(*error.args)
            raise BrokenResourceError("the connection is broken")


# -- for anyio_comm.rpc, whose calls wait in a queue ---------------------------


def bytes_sent(comm: Comm) -> int:
    """``comm.statistics().bytes_sent``, without the rest (for anyio_comm.dask)."""
    return comm._conn.sent_counters()[0]


async def receive_with_cost(comm: Comm) -> tuple[Any, int]:
    """:meth:`Comm.receive`, and what the message costs as the receive budget
    counts it (:func:`~anyio_comm._sansio.budget.message_cost`: its frames'
    bytes plus 256 per frame).

    Raises:
        Exception: what :meth:`Comm.receive` raises.
    """
    frames = await comm.receive_frames()
    cost = frames_cost(cast("Frames", frames))
    try:
        return comm._serializer.loads(frames), cost
    except RemoteProtocolError as exc:
        error = exc.with_traceback(None)
    del frames
    await comm._refuse(error)


def count_work(comm: Comm, working_until: Callable[[], float]) -> None:
    """Let ``comm``'s ``idle_timeout`` see its owner's work on the connection:
    ``working_until()`` returns ``math.inf`` while some is under way (calls in
    flight), else when the last of it ended (``anyio.current_time()``, or
    ``-math.inf`` for never). The comm is then idle only once nothing arrived,
    and no work was under way, for ``idle_timeout``."""
    comm._timers.working_until = working_until


def keep_taken(comm: Comm) -> tuple[BudgetAccount, int] | None:
    """Keep the messages ``comm`` receives charged to its receive budget after
    they are taken.

    From now on the reservation of each message that :meth:`Comm.receive`
    returns (those costing at least the returned threshold; smaller ones are
    never reserved) goes to a new account of the comm's budget, returned,
    instead of back to the budget: its owner releases it, and closes the
    account when done with the comm. The budget's stall check closes this comm
    for that account too. ``None`` when the comm has no budget.
    """
    conn = comm._conn
    account = conn.account
    if account is None:
        return None
    keeper = account.budget.account()
    keeper.on_stall = comm._stalled
    comm._receiver.keep_taken(keeper)
    return keeper, conn.budget_min


async def establish(
    transport: Transport,
    options: Options,
    *,
    local_address: str,
    peer_address: str,
    hook: IdleHook | None = None,
    budget: ReceiveBudget | None = None,
    early_data: bool = False,
) -> Comm:
    """Run the handshakes over ``transport`` and return the comm.

    With a ``budget``, messages of the comm's peer are reserved from it (see
    :class:`~anyio_comm.ReceiveBudget`).

    The transport's own handshake (TLS) first; then both sides send their
    preamble at once and read the peer's. All of it within
    ``options.handshake_timeout``. With ``early_data``, the comm is returned
    once our preamble is written: its first receive reads the peer's (by the
    same deadline), and its sends do not wait for it. The caller owns
    ``transport`` and must close it if this raises.

    Raises:
        TimeoutError: the handshakes took longer than ``handshake_timeout``.
        RemoteProtocolError: the peer does not speak this protocol.
        anyio.BrokenResourceError: the connection failed or closed during
            the handshake.
        ssl.SSLError: the TLS handshake failed (TLS transports only).
    """
    account = budget.account() if budget is not None else None
    timeout = options.handshake_timeout
    started = current_time()
    deadline = math.inf if timeout is None else started + timeout
    try:
        with move_on_after(timeout) as scope:
            conn = await _exchange_preambles(transport, options, account, early_data=early_data)
        if scope.cancelled_caught:
            raise TimeoutError(
                f"the handshake with {peer_address} took longer than "
                f"handshake_timeout ({options.handshake_timeout:g} s)"
            )
    except BaseException:
        if account is not None:
            account.close()
        raise
    receiver = start_receiver(
        transport,
        conn,
        current_backend(),
        push=options.receive_engine == "auto",
        wake_on_bytes=options.idle_timeout is not None,
        wake_on_partial=options.message_timeout is not None,
    )
    peer = conn.peer
    comm = Comm(
        transport,
        conn,
        receiver,
        # (early data: nothing is pickled before the peer said it accepts it)
        options.serializer(peer_accepts_pickle=peer is not None and _accepts_pickle(peer)),
        local_address=local_address,
        peer_address=peer_address,
        timers=ReceiveTimers(
            peer_address=peer_address,
            idle_timeout=options.idle_timeout,
            message_timeout=options.message_timeout,
            min_receive_rate=options.min_receive_rate,
            handshake_deadline=deadline,
        ),
        hook=hook,
    )
    comm._handshake_seconds = current_time() - started
    if peer is None:

        def peer_arrived(peer: Handshake) -> None:
            comm._serializer = options.serializer(peer_accepts_pickle=_accepts_pickle(peer))

        conn.on_peer = peer_arrived
    return comm


def _accepts_pickle(peer: Handshake) -> bool:
    # A version-1 peer says nothing: pickle is agreed outside the protocol.
    return peer.version < 2 or Capability.PICKLE in peer.capabilities


#: the buffer pool of each event loop's comms that were given no allocator
_LOOP_POOL: RunVar[BufferPool] = RunVar("anyio_comm.buffer_pool")


def current_buffer_pool() -> BufferPool:
    """The :class:`BufferPool` that the running event loop's comms receive their
    large frames into, unless they were given an ``allocator`` (made on first use,
    with the default bounds; gone with the event loop).

    Raises:
        RuntimeError: no event loop is running in this thread.
    """
    pool = _LOOP_POOL.get(None)
    if pool is None:
        pool = BufferPool()
        _LOOP_POOL.set(pool)
    return pool


async def _exchange_preambles(
    transport: Transport, options: Options, account: BudgetAccount | None, *, early_data: bool
) -> Connection:
    # (the protocol state, and its read-ahead buffer, only once the transport's
    # handshake is done: a TLS peer that never completes it costs neither)
    await transport.handshake()
    capabilities = {Capability.CLOSE_REASONS}
    if options.allow_pickle:
        capabilities.add(Capability.PICKLE)
    conn = Connection(
        options.limits,
        read_buffer_size=options.read_buffer_size,
        allocator=options.allocator or current_buffer_pool(),
        account=account,
        capabilities=capabilities,
        compression=options.compression,
    )
    await transport.send_all([conn.preamble()])
    if early_data:
        conn.send_early()
        return conn
    try:
        while conn.next_handshake() is None:
            n = await transport.receive_into(conn.get_buffer())
            if n:
                conn.buffer_updated(n)
            else:
                conn.receive_eof()
    except EndOfData as exc:
        raise BrokenResourceError(f"handshake failed: {exc}") from None
    return conn
