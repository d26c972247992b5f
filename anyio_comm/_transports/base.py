"""The transport interface: what moves bytes under a comm.

Receiving is split in two, so that the caller always knows whether it yielded
to the event loop, and so that the same non-blocking step can run in a task
(:class:`~anyio_comm._receivers.PullReceiver`) or in an event-loop callback
(:class:`~anyio_comm._receivers.PushReceiver`):

* :meth:`Transport.receive_into_nowait` never waits: it returns what it could
  receive now, or ``None``;
* :meth:`Transport.wait_readable` waits until the next attempt may succeed.

Sending is one call, :meth:`Transport.send_all`, which tries the system call
first and waits only when the socket is full; it returns whether it waited.
:meth:`Transport.send_later` queues a small send to be written with the next
one, or in the event loop's next pass, where the transport can;
:meth:`Transport.seal_later` queues bytes a transport above makes only then.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING

from anyio import TypedAttributeProvider
from anyio.abc import AsyncResource

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from .._sansio._buffer import Buffer

__all__ = ["Transport"]


class Transport(AsyncResource, TypedAttributeProvider, metaclass=ABCMeta):
    """A bidirectional byte transport with receive-into and gather-send."""

    __slots__ = ()

    #: the transport can hold received bytes of its own (OpenSSL's records, a
    #: byte stream's pending chunk), so a read that returned less than asked for
    #: does not mean nothing more can be received without waiting; a plain socket
    #: cannot, so there a short read means the socket is empty
    buffers_data: bool = True
    #: read right after :meth:`receive_into_nowait` returned a count: that read
    #: left the transport empty (a plain socket's receive came up short; over
    #: TLS, OpenSSL holds nothing either: no ciphertext, plaintext or end), so
    #: the next call answers ``None`` until :meth:`readable` or
    #: :meth:`wait_readable`, and whatever comes next (the peer's end included)
    #: makes the socket readable. False where the transport cannot tell.
    drained: bool = False

    async def handshake(self) -> None:
        """Run the transport's own handshake, if any (TLS); a no-op by default."""

    @abstractmethod
    def receive_into_nowait(self, buffer: memoryview) -> int | None:
        """Receive up to ``len(buffer)`` bytes into ``buffer`` without waiting.

        After a read that got less than it asked for, the socket was empty then
        and, in request/reply traffic, almost always still is: a socket
        transport then returns ``None`` without the system call (which would
        fail with ``EAGAIN``) until :meth:`wait_readable` or :meth:`readable`.

        Returns:
            The number of bytes written; 0 at the end of the peer's stream;
            ``None`` when nothing can be received now (then wait with
            :meth:`wait_readable`).

        Raises:
            anyio.ClosedResourceError: the transport was closed by us.
            anyio.BrokenResourceError: the connection failed.
        """

    @abstractmethod
    def wait_readable(self) -> Awaitable[None]:
        """Return an awaitable done when :meth:`receive_into_nowait` may return
        something (a coroutine, or any awaitable: one frame less per wake-up).
        Awaiting it always yields to the event loop, and is a cancellation point.

        Raises:
            anyio.ClosedResourceError: the transport was closed (by us, from
                any task, also while waiting).
            anyio.BrokenResourceError: the connection failed.
            anyio.BusyResourceError: another task is already waiting.
        """

    def start_reading(self, callback: Callable[[], None]) -> bool:  # noqa: ARG002
        """Have the event loop call ``callback()`` whenever bytes may be waiting,
        until :meth:`stop_reading`; the callback then receives them with
        :meth:`receive_into_nowait`. ``callback`` must be a bound method; the
        transport holds its object weakly, and that object going away stops the
        reading.

        Returns:
            False when the transport cannot (trio has no readiness callbacks; a
            byte stream has no socket): then wait with :meth:`wait_readable`.
        """
        return False

    def stop_reading(self) -> None:
        """Stop the callbacks of :meth:`start_reading` (no error if not reading)."""

    def peer_reset(self) -> bool:
        """True when the peer is known to have reset the connection, even though
        bytes it sent before may still wait to be received (TCP delivers them
        first). A cheap check, for a receiver about to do costly work for those
        bytes; False where the transport cannot tell."""
        return False

    def readable(self) -> None:
        """Called by the :meth:`start_reading` callback: the event loop reported
        the socket readable, so the next :meth:`receive_into_nowait` must try
        it even if the previous one found it empty."""

    async def receive_into(self, buffer: memoryview) -> int:
        """Receive at least one byte into ``buffer``, waiting if need be.

        Returns:
            The number of bytes written; 0 at the end of the peer's stream.

        Raises:
            anyio.ClosedResourceError: the transport was closed by us.
            anyio.BrokenResourceError: the connection failed.
        """
        while (n := self.receive_into_nowait(buffer)) is None:
            await self.wait_readable()
        return n

    @abstractmethod
    async def send_all(self, buffers: Sequence[Buffer]) -> bool:
        """Send every byte of ``buffers`` (flat byte buffers: ``bytes``, or
        one-dimensional byte views), in order.

        Tries to write at once, and waits only while the peer's socket buffer is
        full. If it fails or is cancelled after it may have written part of the
        data, :attr:`send_interrupted` becomes true: the byte stream is then
        unusable for framing.

        Returns:
            Whether it waited (yielded to the event loop) on the way.

        Raises:
            anyio.ClosedResourceError: the transport was closed by us.
            anyio.BrokenResourceError: the connection failed.
        """

    def send_waits(self) -> tuple[int, float]:
        """The sends that waited for the peer to take bytes sent before (its
        backpressure), and the seconds they waited: (0, 0.0) where the
        transport cannot tell (a byte stream's own waits are its business)."""
        return (0, 0.0)

    def send_later(self, buffers: Sequence[Buffer]) -> bool:  # noqa: ARG002
        """Queue ``buffers`` to be written after everything sent or queued before,
        without waiting and without a system call now: the next
        :meth:`send_all` writes them first (with its own), or else the event
        loop does within its next pass (see
        :mod:`~anyio_comm._transports.write_behind`). Only ``bytes`` are
        queued, never a caller's buffer.

        A failure of that write is raised by the next :meth:`send_all` (and
        sets :attr:`send_interrupted`); :meth:`aclose` writes the queue first,
        :meth:`abort` only what the socket takes at once.

        Returns:
            False when nothing was queued: the transport cannot write behind,
            a buffer is not ``bytes``, the queue would exceed
            :data:`~anyio_comm._transports.write_behind.BEHIND_LIMIT`, or an
            earlier queue is still being written (then send with
            :meth:`send_all`, which waits for it).
        """
        return False

    def seal_later(self, bound: int, seal: Callable[[], bytes]) -> bool:  # noqa: ARG002
        """Reserve room for ``bound`` bytes at the end of the queue of
        :meth:`send_later`, made only when the queue is written: whatever takes
        the queue (a write, :meth:`abort`) first calls ``seal()`` and queues
        what it returns there. Calling again before then adds ``bound`` to the
        reservation, and ``seal`` (the same callable: one transport above) is
        called once for all; :meth:`send_later` refuses meanwhile (its bytes
        would go ahead of what was reserved).

        This is how a transport above queues what it encodes as a whole at the
        last moment (TLS: one encryption for a batch of small sends). The
        queue's limit counts ``bound``, not what ``seal()`` returns: a caller
        keeps the two close. An exception from ``seal()`` fails the queue's
        write as a failed system call does.

        Returns:
            False when nothing was reserved (as for :meth:`send_later`).
        """
        return False

    @property
    def send_interrupted(self) -> bool:
        """True once a :meth:`send_all` failed or was cancelled after it may
        have written part of its data."""
        return False

    @abstractmethod
    async def send_eof(self) -> None:
        """Half-close: tell the peer we will send nothing more."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close the transport; idempotent."""

    @abstractmethod
    def abort(self) -> None:
        """Close the transport immediately, without any graceful exchange; idempotent.
        A task blocked in :meth:`wait_readable` or :meth:`send_all` gets
        :exc:`anyio.ClosedResourceError`."""
