"""The receive seam: whole messages out of a connection that a transport feeds.

A :class:`Receiver` joins a sans-IO :class:`~anyio_comm._sansio.connection.Connection`
and a :class:`~anyio_comm._transports.base.Transport` and hands the comm one
whole message at a time, so that the comm does not depend on how the bytes are
read. :class:`PullReceiver` reads in the receiving task:
:meth:`~Receiver.receive_nowait` decodes what is buffered and tries the
transport without waiting, :meth:`~Receiver.wait` waits for the socket.

Errors: whatever ends the stream (its end, a protocol error, a failed
connection) is raised by :meth:`~Receiver.receive_nowait` once every message
before it was taken, and again by every later call.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING

from ._compat import final

if TYPE_CHECKING:
    from ._sansio.connection import Connection
    from ._transports.base import Transport

__all__ = ["PullReceiver", "Receiver"]


class Receiver(metaclass=ABCMeta):
    """Delivers whole messages; at most one task uses it at a time."""

    __slots__ = ()

    @property
    @abstractmethod
    def at_message_boundary(self) -> bool:
        """True when no part of a message is buffered or waiting to be taken."""

    @abstractmethod
    def receive_nowait(self) -> list[memoryview] | None:
        """Return the next message's frames, or ``None`` when none is complete.

        Raises:
            EndOfData: the stream ended (after every message before it).
            RemoteProtocolError: the peer broke the protocol.
            anyio.ClosedResourceError: the receiver (or its transport) was closed.
            anyio.BrokenResourceError: the connection failed.
        """

    @abstractmethod
    async def wait(self) -> None:
        """Wait until :meth:`receive_nowait` may return something (with an
        idle timeout to enforce, also until any byte arrives). Always yields.

        Raises:
            anyio.ClosedResourceError: the receiver was closed (also while waiting).
            anyio.BrokenResourceError: the connection failed.
        """

    @abstractmethod
    def close(self) -> None:
        """Stop receiving (before the transport closes); wake a waiting task,
        whose :meth:`wait` raises :exc:`anyio.ClosedResourceError`."""


@final
class PullReceiver(Receiver):
    """The receiving task reads: try the transport, wait for it when it is empty."""

    __slots__ = ("_conn", "_transport")

    def __init__(self, transport: Transport, conn: Connection) -> None:
        self._transport = transport
        self._conn = conn

    @property
    def at_message_boundary(self) -> bool:
        return self._conn.at_message_boundary

    def receive_nowait(self) -> list[memoryview] | None:
        conn = self._conn
        frames = conn.next_message()
        if frames is None:
            transport = self._transport
            while (n := transport.receive_into_nowait(conn.get_buffer())) is not None:
                if n:
                    conn.buffer_updated(n)
                else:
                    conn.receive_eof()
                frames = conn.next_message()
                if frames is not None:
                    break
        return frames

    async def wait(self) -> None:
        await self._transport.wait_readable()

    def close(self) -> None:
        """Nothing to stop: the task reads, and closing the transport wakes it."""
