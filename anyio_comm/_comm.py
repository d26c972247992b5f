"""The Comm: codec + serializer + transport, following AnyIO's ObjectStream contract.

State machine::

    OPEN ──aclose()──────────────────────────────► CLOSED
      │                                               ▲
      └─ connection error, protocol error from the ───┘ aclose()
         peer, EOF inside a message, or a send
         cancelled after part of it was written ──► BROKEN

Scheduling: every ``send`` and ``receive`` is a cancellation point, and no
more than two operations in a row on a comm complete without letting other
tasks run (so a fast peer cannot starve the event loop).

* receive: a receive that waited for the socket has yielded already, and the
  wait was its cancellation point (on asyncio preceded by
  ``checkpoint_if_cancelled()``: asyncio delivers a cancellation only to a
  task whose future is still pending, which a wait on a socket that is
  already readable is not for long). A receive that got its message without
  waiting yields once after taking it; when cancelled there, it keeps the
  message, and the next receive returns it: nothing is lost. Every receive
  therefore yields.
* send: a cancellation point before anything is written
  (``checkpoint_if_cancelled()``). A send that follows an operation that
  yielded (in request/reply traffic: the receive that got the request) does
  not yield again when the socket takes the message at once, which saves a
  pass of the event loop per message. A send that follows one that did not
  yield does: on trio with trio's ``cancel_shielded_checkpoint()`` after the
  write; on asyncio, where a shielded checkpoint costs a cancel scope (8.5 us
  measured, against 3.2 us for a plain yield), with one plain yield before
  the write, where a cancellation loses nothing.

Receiving and sending are independent (one task may receive while another
sends), but at most one task receives and one task sends at a time.
``send_eof()`` closes our sending direction only; receiving goes on until
the peer's EOF, which every later ``receive()`` reports as ``EndOfStream``.
"""

from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING, Any, Final

from anyio import (
    BrokenResourceError,
    BusyResourceError,
    CancelScope,
    ClosedResourceError,
    EndOfStream,
    aclose_forcefully,
    move_on_after,
)
from anyio.abc import ObjectStream
from anyio.lowlevel import cancel_shielded_checkpoint, checkpoint, checkpoint_if_cancelled

from ._backend import current_backend
from ._compat import final
from ._exceptions import IdleTimeoutError, RemoteProtocolError
from ._sansio.decoder import EndOfData, FrameDecoder
from ._sansio.wire import Handshake, encode_message, encode_preamble

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from ._options import CommOptions
    from ._sansio._buffer import Buffer
    from ._sansio.serialization import Serializer
    from ._transports.base import Transport

__all__ = ["Comm", "establish"]


class _State(enum.Enum):
    OPEN = "open"
    BROKEN = "broken"
    CLOSED = "closed"


_OPEN: Final = _State.OPEN


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
        "_decoder",
        "_eof_sent",
        "_idle_timeout",
        "_local_address",
        "_on_idle",
        "_peer",
        "_peer_address",
        "_pending",
        "_receiving",
        "_send_max",
        "_sending",
        "_serializer",
        "_state",
        "_transport",
        "_trio",
        "_waiting_idle",
        "_watched",
    )

    def __init__(
        self,
        transport: Transport,
        decoder: FrameDecoder,
        serializer: Serializer,
        peer: Handshake,
        *,
        local_address: str,
        peer_address: str,
        idle_timeout: float | None = None,
    ) -> None:
        self._transport = transport
        self._decoder = decoder
        self._serializer = serializer
        self._peer = peer
        self._local_address = local_address
        self._peer_address = peer_address
        self._state = _State.OPEN
        self._eof_sent = False
        # trio's lowlevel module on trio, None on asyncio (the checkpoints are
        # called directly: AnyIO's wrappers look up the backend on every call).
        self._trio = current_backend().trio
        # At most one task receives and one sends (anyio.BusyResourceError).
        self._receiving = False
        self._sending = False
        # The last send completed without yielding to the event loop: the
        # next send yields (see the module docstring).
        self._yield_due = False
        # A message taken out of the decoder by a receive that was then
        # cancelled in its final checkpoint; the next receive returns it.
        self._pending: list[memoryview] | None = None
        # The largest one-frame message the peer's limits accept (-1: none),
        # so a one-frame send skips the general limit check.
        limits = peer.limits
        self._send_max = (
            min(limits.max_frame_size, limits.max_message_size) if limits.max_frames >= 1 else -1
        )
        self._idle_timeout = idle_timeout
        # Listener shutdown: ``_waiting_idle`` is true while receive() waits at
        # a message boundary; ``_on_idle`` (set by the listener) is called when
        # receive() is about to wait there. ``_watched`` selects that path.
        self._watched = idle_timeout is not None
        self._waiting_idle = False
        self._on_idle: Callable[[], object] | None = None

    def __repr__(self) -> str:
        return f"<Comm {self._local_address} -> {self._peer_address} ({self._state.value})>"

    # -- attributes --------------------------------------------------------

    @property
    def local_address(self) -> str:
        """Our end of the connection as an address string (``tcp://127.0.0.1:5000``)."""
        return self._local_address

    @property
    def peer_address(self) -> str:
        """The peer's end of the connection as an address string."""
        return self._peer_address

    @property
    def peer_handshake(self) -> Handshake:
        """What the peer announced in its preamble (version and receive limits)."""
        return self._peer

    @property
    def idle_timeout(self) -> float | None:
        """Seconds :meth:`receive` waits for the next byte before failing with
        :exc:`IdleTimeoutError` (``None``: no limit)."""
        return self._idle_timeout

    @property
    def closed(self) -> bool:
        """True after :meth:`aclose` (or once the connection broke)."""
        return self._state is not _State.OPEN

    @property
    def extra_attributes(self) -> Mapping[Any, Any]:
        return self._transport.extra_attributes

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
        except RemoteProtocolError:
            await self._fail()
            raise

    async def receive_frames(self) -> list[memoryview]:
        """Receive the next message as a list of frames.

        Returns:
            One ``memoryview`` per frame sent, each over its own exact-size
            buffer (from the comm's allocator).

        Raises:
            anyio.EndOfStream: the peer closed (or sent EOF) cleanly.
            anyio.ClosedResourceError: this comm was closed by us.
            anyio.BrokenResourceError: the connection failed.
            anyio.BusyResourceError: another task is already receiving.
            RemoteProtocolError: the peer violated the wire format or our
                limits; the connection is closed.
            IdleTimeoutError: nothing arrived for ``idle_timeout`` seconds;
                the connection is closed.
        """
        if self._receiving:
            raise BusyResourceError("receiving from")
        self._receiving = True
        try:
            if self._state is not _OPEN:
                self._check_state()
            frames = self._pending
            if frames is not None:
                self._pending = None
                yielded = False
            else:
                decoder = self._decoder
                transport = self._transport
                transport.yielded = False
                try:
                    frames = decoder.next_message()
                    if frames is None and self._trio is None:
                        # asyncio: a cancellation is delivered to a waiting
                        # task only while its future is pending, so a wait on
                        # an already readable socket would not raise it:
                        # check before waiting (trio's waits are checkpoints).
                        await checkpoint_if_cancelled()
                    while frames is None:
                        if not self._watched:
                            n = await transport.receive_into(decoder.get_buffer())
                        elif self._idle_timeout is None and self._on_idle is None:
                            # A listener's comm with no idle timeout and no
                            # shutdown under way: only record whether this wait
                            # is at a message boundary, as _receive_watched
                            # does, without its extra coroutine frame.
                            self._waiting_idle = decoder.at_message_boundary
                            try:
                                n = await transport.receive_into(decoder.get_buffer())
                            finally:
                                self._waiting_idle = False
                        else:
                            n = await self._receive_watched(decoder.get_buffer())
                        if n:
                            decoder.buffer_updated(n)
                        else:
                            decoder.receive_eof()
                        frames = decoder.next_message()
                except EndOfData as exc:
                    if exc.truncated:
                        await self._fail()
                        raise BrokenResourceError(str(exc)) from None
                    raise EndOfStream from None
                except RemoteProtocolError:
                    await self._fail()
                    raise
                except ClosedResourceError:
                    self._check_state()
                    raise
                except BrokenResourceError:
                    await self._fail()
                    raise
                yielded = transport.yielded
            if not yielded:
                # Nothing waited: yield now. The message is already out of the
                # decoder, so a cancellation here keeps it for the next call.
                try:
                    if self._trio is None:
                        await asyncio.sleep(0)
                    else:
                        await self._trio.checkpoint()
                except BaseException:
                    self._pending = frames
                    raise
            self._yield_due = False
            return frames
        finally:
            self._receiving = False

    async def _receive_watched(self, buffer: memoryview) -> int:
        """``transport.receive_into`` with the idle timeout and the shutdown hook."""
        idle = self._decoder.at_message_boundary
        if idle and self._on_idle is not None:
            self._on_idle()  # cancels the listener's handler task ...
            await checkpoint()  # ... here, before anything is read
        self._waiting_idle = idle
        try:
            if self._idle_timeout is None:
                return await self._transport.receive_into(buffer)
            with move_on_after(self._idle_timeout):
                return await self._transport.receive_into(buffer)
        finally:
            self._waiting_idle = False
        # Between messages the peer loses nothing: close gracefully (it sees
        # the end of the stream); inside a message, break the connection.
        await self._fail(graceful=idle)
        raise IdleTimeoutError(f"nothing received for {self._idle_timeout:g} s")

    # -- sending -----------------------------------------------------------

    async def send(self, item: Any) -> None:
        """Send a message.

        Bytes-like values at or above the comm's ``oob_threshold`` are sent
        out-of-band without copying: do not modify them until ``send``
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
        await self._send(self._serializer.dumps(item))

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
        await self._send([_as_frame(buffer) for buffer in buffers])

    async def _send(self, frames: list[memoryview]) -> None:
        if self._sending:
            raise BusyResourceError("sending to")
        self._sending = True
        try:
            if self._state is not _OPEN:
                self._check_state()
            if self._eof_sent:
                raise ClosedResourceError
            if len(frames) != 1 or frames[0].nbytes > self._send_max:
                self._peer.limits.check_send([frame.nbytes for frame in frames])
            iov = encode_message(frames)
            trio_lowlevel = self._trio
            yield_due = self._yield_due
            if trio_lowlevel is not None:
                await trio_lowlevel.checkpoint_if_cancelled()
            elif yield_due:
                await asyncio.sleep(0)
            else:
                await checkpoint_if_cancelled()
            transport = self._transport
            transport.yielded = False
            try:
                await transport.send_all(iov)
            except ClosedResourceError:
                self._check_state()
                raise
            except BaseException:
                if transport.send_interrupted:
                    await self._fail()
                raise
            if transport.yielded:
                self._yield_due = False
            elif trio_lowlevel is None:
                self._yield_due = not yield_due
            elif yield_due:
                self._yield_due = False
                await trio_lowlevel.cancel_shielded_checkpoint()
            else:
                self._yield_due = True
        finally:
            self._sending = False

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
        if self._sending:
            raise BusyResourceError("sending to")
        self._sending = True
        try:
            self._check_state()
            if self._eof_sent:
                return
            try:
                await self._transport.send_eof()
            except BrokenResourceError:
                await self._fail()
                raise
            self._eof_sent = True
        finally:
            self._sending = False

    # -- closing -----------------------------------------------------------

    async def aclose(self) -> None:
        """Close the connection. Idempotent; tasks blocked in :meth:`receive`
        or :meth:`send` get :exc:`anyio.ClosedResourceError`.
        """
        if self._state is _State.CLOSED:
            await cancel_shielded_checkpoint()
            return
        self._state = _State.CLOSED
        await self._transport.aclose()

    async def _fail(self, *, graceful: bool = False) -> None:
        """Mark the comm broken and close the transport, even under cancellation.

        ``graceful`` closes it as :meth:`aclose` does (TLS sends close_notify);
        otherwise it is aborted.
        """
        if self._state is _State.OPEN:
            self._state = _State.BROKEN
            with CancelScope(shield=True):
                if graceful:
                    await self._transport.aclose()
                else:
                    self._transport.abort()
                    await aclose_forcefully(self._transport)

    def _check_state(self) -> None:
        if self._state is _State.CLOSED:
            raise ClosedResourceError
        if self._state is _State.BROKEN:
            raise BrokenResourceError("the connection is broken")


async def establish(
    transport: Transport,
    options: CommOptions,
    *,
    local_address: str,
    peer_address: str,
) -> Comm:
    """Exchange preambles over ``transport`` and return the comm.

    Both sides send their preamble at once, then read the peer's. The caller
    owns ``transport`` and must close it if this raises.

    Raises:
        RemoteProtocolError: the peer does not speak this protocol.
        anyio.BrokenResourceError: the connection failed or closed during
            the handshake.
        ssl.SSLError: the TLS handshake failed (TLS transports only).
    """
    decoder = options.decoder()
    await transport.handshake()
    await transport.send_all([encode_preamble(options.limits)])
    try:
        while (handshake := decoder.next_handshake()) is None:
            n = await transport.receive_into(decoder.get_buffer())
            if n:
                decoder.buffer_updated(n)
            else:
                decoder.receive_eof()
    except EndOfData as exc:
        raise BrokenResourceError(f"handshake failed: {exc}") from None
    return Comm(
        transport,
        decoder,
        options.serializer(),
        handshake,
        local_address=local_address,
        peer_address=peer_address,
        idle_timeout=options.idle_timeout,
    )
