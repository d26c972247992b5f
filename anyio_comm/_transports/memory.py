"""An in-memory byte stream pair with bounded buffering.

Used by ``inproc://`` addresses and by tests. Bytes sent are copied (the
sender may reuse its buffers as soon as ``send`` returns) into chunks of at
most ``chunk_size`` bytes; at most ``max_chunks`` chunks wait in each
direction, so a receiver that stops reading blocks the sender. ``close()``
ends the stream cleanly for the other end; ``abort()`` resets it, as a TCP
reset does: the other end reads what was sent before, then gets
:exc:`anyio.BrokenResourceError` instead of :exc:`anyio.EndOfStream`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream
from anyio.abc import ByteStream

if TYPE_CHECKING:
    from collections.abc import Mapping

    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

    from .._sansio._buffer import Buffer

__all__ = ["MemoryByteStream", "memory_byte_stream_pair"]


class _Direction:
    """What one direction of a pair shares between its two ends."""

    __slots__ = ("reset",)

    def __init__(self) -> None:
        self.reset = False


class MemoryByteStream(ByteStream):
    """One end of a :func:`memory_byte_stream_pair`."""

    __slots__ = (
        "_chunk_size",
        "_closed",
        "_incoming",
        "_outgoing",
        "_pending",
        "_receiver",
        "_sender",
    )

    def __init__(
        self,
        sender: MemoryObjectSendStream[bytes],
        receiver: MemoryObjectReceiveStream[bytes],
        chunk_size: int,
        outgoing: _Direction | None = None,
        incoming: _Direction | None = None,
    ) -> None:
        self._sender = sender
        self._receiver = receiver
        self._chunk_size = chunk_size
        self._pending = b""
        self._closed = False
        self._outgoing = outgoing or _Direction()
        self._incoming = incoming or _Direction()

    @property
    def extra_attributes(self) -> Mapping[Any, Any]:
        return {}

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._closed:
            raise ClosedResourceError
        if not self._pending:
            try:
                self._pending = await self._receiver.receive()
            except anyio.EndOfStream:
                if self._incoming.reset:
                    raise BrokenResourceError("the other end reset the stream") from None
                raise EndOfStream from None
        data = self._pending[:max_bytes]
        self._pending = self._pending[max_bytes:]
        return data

    async def send(self, item: Buffer) -> None:
        if self._closed:
            raise ClosedResourceError
        view = memoryview(item).cast("B")
        size = self._chunk_size
        try:
            for offset in range(0, view.nbytes, size):
                await self._sender.send(bytes(view[offset : offset + size]))
        except ClosedResourceError:
            if self._closed:
                raise
            raise BrokenResourceError("the stream was closed for sending") from None

    async def send_eof(self) -> None:
        await self._sender.aclose()

    def close(self) -> None:
        """Close both directions at once (the synchronous form of ``aclose()``)."""
        self._closed = True
        self._sender.close()
        self._receiver.close()

    def abort(self) -> None:
        """Close both directions at once, as a reset: the other end reads what
        was sent before, then gets :exc:`anyio.BrokenResourceError`."""
        self._outgoing.reset = True
        self.close()

    async def aclose(self) -> None:
        self.close()
        await anyio.lowlevel.checkpoint()


def memory_byte_stream_pair(
    *, max_chunks: int = 16, chunk_size: int = 65536
) -> tuple[MemoryByteStream, MemoryByteStream]:
    """Return two connected :class:`anyio.abc.ByteStream` objects.

    Args:
        max_chunks: chunks that may wait unread in each direction.
        chunk_size: largest chunk, in bytes (so at most
            ``max_chunks * chunk_size`` bytes are buffered per direction).

    Raises:
        ValueError: a size is below 1.
    """
    if max_chunks < 1 or chunk_size < 1:
        raise ValueError("max_chunks and chunk_size must be at least 1")
    a_send, b_receive = anyio.create_memory_object_stream[bytes](max_chunks)
    b_send, a_receive = anyio.create_memory_object_stream[bytes](max_chunks)
    a_to_b, b_to_a = _Direction(), _Direction()
    return (
        MemoryByteStream(a_send, a_receive, chunk_size, a_to_b, b_to_a),
        MemoryByteStream(b_send, b_receive, chunk_size, b_to_a, a_to_b),
    )
