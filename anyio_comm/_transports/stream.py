"""A transport over any AnyIO byte stream (the generic, copying path)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from anyio import ClosedResourceError, EndOfStream

from .base import Transport

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from anyio.abc import ByteStream

    from .._sansio._buffer import Buffer

__all__ = ["StreamTransport"]


class StreamTransport(Transport):
    """Adapts an :class:`anyio.abc.ByteStream` to the transport interface.

    Every received chunk is copied into the decoder's buffer, and the stream
    decides how it sends; use the socket transport where speed matters.
    """

    __slots__ = ("_closed", "_pending", "_stream")

    def __init__(self, stream: ByteStream) -> None:
        super().__init__()
        self._stream = stream
        self._pending = memoryview(b"")
        self._closed = False

    @property
    def stream(self) -> ByteStream:
        """The wrapped stream."""
        return self._stream

    @property
    def extra_attributes(self) -> Mapping[Any, Any]:
        return self._stream.extra_attributes

    async def receive_into(self, buffer: memoryview) -> int:
        self.yielded = True
        pending = self._pending
        if not pending:
            if self._closed:
                raise ClosedResourceError
            try:
                data = await self._stream.receive(buffer.nbytes)
            except EndOfStream:
                return 0
            pending = memoryview(data)
        n = min(pending.nbytes, buffer.nbytes)
        buffer[:n] = pending[:n]
        self._pending = pending[n:]
        return n

    async def send_all(self, buffers: Sequence[Buffer]) -> None:
        self.yielded = True
        if self._closed:
            raise ClosedResourceError
        try:
            for buffer in buffers:
                await self._stream.send(cast("bytes", buffer))
        except BaseException:
            # We cannot know how much of the data an arbitrary stream has
            # taken when it failed or was cancelled: assume the framing is lost.
            self.send_interrupted = True
            raise

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    def abort(self) -> None:
        self._closed = True
        close = getattr(self._stream, "close", None)
        if callable(close):
            close()

    async def aclose(self) -> None:
        self._closed = True
        await self._stream.aclose()
