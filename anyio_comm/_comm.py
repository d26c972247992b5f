"""The Comm: codec + serializer + transport, following AnyIO's ObjectStream contract.

State machine::

    OPEN ──aclose()──────────────────────────────► CLOSED
      │                                               ▲
      └─ connection error, protocol error from the ───┘ aclose()
         peer, EOF inside a message, or a send
         cancelled after part of it was written ──► BROKEN

Scheduling: every ``send`` and ``receive`` is a cancellation point and lets
other tasks run at least once, even when the data was already there (so a
fast peer cannot starve the event loop). On trio this is trio's own pattern:
``checkpoint_if_cancelled()`` before, and ``cancel_shielded_checkpoint()``
after an operation that never blocked. On asyncio a shielded checkpoint costs
a cancel scope (8.5 us measured, against 3.2 us for a plain yield), so there
the operation starts with one plain ``checkpoint()`` instead: a yield before
anything was read or written, where a cancellation loses nothing.

Receiving and sending are independent (one task may receive while another
sends), but at most one task receives and one task sends at a time.
``send_eof()`` closes our sending direction only; receiving goes on until
the peer's EOF, which every later ``receive()`` reports as ``EndOfStream``.
"""

from __future__ import annotations

import asyncio
import enum
from typing import TYPE_CHECKING, Any

from anyio import (
    BrokenResourceError,
    CancelScope,
    ClosedResourceError,
    EndOfStream,
    ResourceGuard,
    aclose_forcefully,
    move_on_after,
)
from anyio.abc import ObjectStream
from anyio.lowlevel import cancel_shielded_checkpoint, checkpoint, checkpoint_if_cancelled

from ._compat import final
from ._exceptions import IdleTimeoutError, RemoteProtocolError
from ._sansio.decoder import EndOfData, FrameDecoder
from ._sansio.wire import Handshake, encode_header, encode_preamble, frames_to_iov

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
        "_asyncio",
        "_decoder",
        "_eof_sent",
        "_idle_timeout",
        "_local_address",
        "_on_idle",
        "_peer",
        "_peer_address",
        "_receive_guard",
        "_send_guard",
        "_serializer",
        "_state",
        "_transport",
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
        self._asyncio = _on_asyncio()
        self._receive_guard = ResourceGuard("receiving from")
        self._send_guard = ResourceGuard("sending to")
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
        with self._receive_guard:
            self._check_state()
            await self._checkpoint_before()
            decoder = self._decoder
            transport = self._transport
            transport.yielded = False
            try:
                while (frames := decoder.next_message()) is None:
                    if self._watched:
                        n = await self._receive_watched(decoder.get_buffer())
                    else:
                        n = await transport.receive_into(decoder.get_buffer())
                    if n:
                        decoder.buffer_updated(n)
                    else:
                        decoder.receive_eof()
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
            if not transport.yielded and not self._asyncio:
                await cancel_shielded_checkpoint()
            return frames

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
        with self._send_guard:
            self._check_state()
            if self._eof_sent:
                raise ClosedResourceError
            lengths = [frame.nbytes for frame in frames]
            self._peer.limits.check_send(lengths)
            iov = frames_to_iov(encode_header(lengths), frames)
            await self._checkpoint_before()
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
            if not transport.yielded and not self._asyncio:
                await cancel_shielded_checkpoint()

    async def _checkpoint_before(self) -> None:
        if self._asyncio:
            await checkpoint()
        else:
            await checkpoint_if_cancelled()

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
        with self._send_guard:
            self._check_state()
            if self._eof_sent:
                return
            try:
                await self._transport.send_eof()
            except BrokenResourceError:
                await self._fail()
                raise
            self._eof_sent = True

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


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


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
