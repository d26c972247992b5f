"""A transport over any AnyIO byte stream (the generic, copying path)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import anyio
from anyio import ClosedResourceError, EndOfStream

from .base import Transport

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from anyio.abc import ByteStream

    from .._sansio._buffer import Buffer

__all__ = ["StreamTransport"]


class StreamTransport(Transport):
    """Adapts an :class:`anyio.abc.ByteStream` to the transport interface.

    A byte stream has no non-blocking receive: :meth:`wait_readable` receives
    a chunk (at most as large as the buffer of the last attempt) and keeps
    it, and :meth:`receive_into_nowait` copies from it. The stream decides how
    it sends; use the socket transport where speed matters.
    """

    __slots__ = ("_closed", "_eof", "_hint", "_pending", "_send_interrupted", "_stream")

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._pending = memoryview(b"")
        self._eof = False
        self._hint = 65536
        self._closed = False
        self._send_interrupted = False

    @property
    def stream(self) -> ByteStream:
        """The wrapped stream."""
        return self._stream

    @property
    def extra_attributes(self) -> Mapping[Any, Any]:
        return self._stream.extra_attributes

    def receive_into_nowait(self, buffer: memoryview) -> int | None:
        if self._closed:
            raise ClosedResourceError
        pending = self._pending
        if not pending:
            if self._eof:
                return 0
            self._hint = buffer.nbytes
            return None
        n = min(pending.nbytes, buffer.nbytes)
        buffer[:n] = pending[:n]
        self._pending = pending[n:]
        return n

    async def wait_readable(self) -> None:
        if self._closed:
            raise ClosedResourceError
        if self._pending or self._eof:
            await anyio.lowlevel.checkpoint()
            return
        try:
            data = await self._stream.receive(self._hint)
        except EndOfStream:
            self._eof = True
        else:
            self._pending = memoryview(data)

    @property
    def send_interrupted(self) -> bool:
        return self._send_interrupted

    async def send_all(self, buffers: Sequence[Buffer]) -> bool:
        if self._closed:
            raise ClosedResourceError
        try:
            for buffer in buffers:
                await self._stream.send(cast("bytes", buffer))
        except BaseException:
            # We cannot know how much of the data an arbitrary stream has
            # taken when it failed or was cancelled: assume the framing is lost.
            self._send_interrupted = True
            raise
        return True  # whether the stream yielded is its own business: assume it did

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    def abort(self) -> None:
        """Mark closed and close the stream if it can close synchronously (a
        stream without ``close()`` is closed by :meth:`aclose`)."""
        self._closed = True
        close = getattr(self._stream, "close", None)
        if callable(close):
            close()

    async def aclose(self) -> None:
        self._closed = True
        await self._stream.aclose()
