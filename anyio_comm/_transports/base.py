"""The transport interface the comm layer drives."""

from __future__ import annotations

from abc import ABCMeta, abstractmethod
from typing import TYPE_CHECKING

from anyio import TypedAttributeProvider
from anyio.abc import AsyncResource

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._sansio._buffer import Buffer

__all__ = ["Transport"]


class Transport(AsyncResource, TypedAttributeProvider, metaclass=ABCMeta):
    """A bidirectional byte transport with receive-into and gather-send.

    Checkpoint contract: a transport operation may complete without ever
    yielding to the event loop (the raw socket transport tries the system call
    first). It sets :attr:`yielded` to ``True`` whenever it did yield; the comm
    layer resets the flag, and yields once per message when nothing yielded
    (see the scheduling notes in ``_comm.py``), so a fast peer cannot starve
    the event loop.

    Attributes:
        yielded: set to ``True`` by any operation that yielded to the loop.
        send_interrupted: set to ``True`` when :meth:`send_all` was
            interrupted (cancelled or failed) after it may have written part
            of its data; the byte stream is then unusable for framing.
    """

    __slots__ = ("send_interrupted", "yielded")

    def __init__(self) -> None:
        self.yielded = False
        self.send_interrupted = False

    async def handshake(self) -> None:
        """Run the transport's own handshake, if any (TLS); a no-op by default."""

    @abstractmethod
    async def receive_into(self, buffer: memoryview) -> int:
        """Receive up to ``len(buffer)`` bytes into ``buffer``.

        Returns:
            the number of bytes written; 0 means the peer sent EOF.

        Raises:
            anyio.ClosedResourceError: the transport was closed by us.
            anyio.BrokenResourceError: the connection failed.
        """

    @abstractmethod
    async def send_all(self, buffers: Sequence[Buffer]) -> None:
        """Send every byte of ``buffers``, in order.

        If cancelled before any byte was written, nothing was sent; otherwise
        :attr:`send_interrupted` is set.

        Raises:
            anyio.ClosedResourceError: the transport was closed by us.
            anyio.BrokenResourceError: the connection failed.
        """

    @abstractmethod
    async def send_eof(self) -> None:
        """Half-close: tell the peer we will send nothing more."""

    @abstractmethod
    async def aclose(self) -> None:
        """Close the transport; idempotent."""

    @abstractmethod
    def abort(self) -> None:
        """Close the transport immediately, without any graceful exchange."""
