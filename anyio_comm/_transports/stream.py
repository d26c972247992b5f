"""A transport over any AnyIO byte stream (the generic, copying path)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, TypeVar, cast

import anyio
from anyio import BrokenResourceError, CancelScope, ClosedResourceError, EndOfStream

from .base import Transport
from .memory import MemoryByteStream

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping, Sequence

    from anyio.abc import ByteStream

    from .._sansio._buffer import Buffer

__all__ = ["StreamTransport"]

T = TypeVar("T")


class StreamTransport(Transport):
    """Adapts an :class:`anyio.abc.ByteStream` to the transport interface.

    A byte stream has no non-blocking receive: :meth:`wait_readable` receives
    a chunk (at most as large as the buffer of the last attempt) and keeps
    it, and :meth:`receive_into_nowait` copies from it. The stream decides how
    it sends; use the socket transport where speed matters.

    :meth:`abort` closes a stream that has a synchronous ``close()`` (the
    memory streams of ``inproc://`` and the test kit); for one that can only
    close asynchronously (an AnyIO socket or TLS stream), it cancels the
    stream operations in progress, each run in a cancel scope for that
    purpose, and :meth:`aclose` then closes the stream. A stream that broke
    (a receive raised :exc:`anyio.BrokenResourceError`, or a send was
    interrupted) is closed forcefully: a graceful close of a broken TLS
    session would only raise.
    """

    __slots__ = (
        "_broken",
        "_close",
        "_closed",
        "_eof",
        "_hint",
        "_pending",
        "_scopes",
        "_send_interrupted",
        "_stream",
    )

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._pending = memoryview(b"")
        self._eof = False
        self._hint = 65536
        self._closed = False
        self._broken = False
        self._send_interrupted = False
        # abort(): an in-memory stream is reset (its other end sees a broken
        # stream, as after a TCP reset); other streams are closed if they can be
        # synchronously
        close = (
            stream.abort
            if isinstance(stream, MemoryByteStream)
            else getattr(stream, "close", None)
        )
        self._close: Callable[[], object] | None = close if callable(close) else None
        # the operations in progress, for abort() to cancel (streams without close())
        self._scopes: set[CancelScope] = set()

    async def _run(self, operation: Callable[[], Awaitable[T]]) -> T:
        """``await operation()``, which :meth:`abort` can interrupt.

        Raises:
            anyio.ClosedResourceError: :meth:`abort` interrupted it.
        """
        if self._close is not None:
            return await operation()
        with CancelScope() as scope:
            self._scopes.add(scope)
            try:
                return await operation()
            finally:
                self._scopes.discard(scope)
        raise ClosedResourceError  # only abort() cancels that scope

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
            data = await self._run(lambda: self._stream.receive(self._hint))
        except EndOfStream:
            self._eof = True
        except BrokenResourceError:
            self._broken = True
            raise
        else:
            self._pending = memoryview(data)

    @property
    def send_interrupted(self) -> bool:
        return self._send_interrupted

    async def send_all(self, buffers: Sequence[Buffer]) -> bool:
        if self._closed:
            raise ClosedResourceError
        send = self._stream.send
        try:
            for buffer in buffers:
                await self._run(functools.partial(send, cast("bytes", buffer)))
        except BaseException:
            # We cannot know how much of the data an arbitrary stream has
            # taken when it failed or was cancelled: assume the framing is lost.
            self._send_interrupted = True
            raise
        return True  # whether the stream yielded is its own business: assume it did

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    def abort(self) -> None:
        """Mark closed; close the stream if it can close synchronously, else
        interrupt its operations in progress (:meth:`aclose` closes it)."""
        self._closed = True
        if self._close is not None:
            self._close()
        for scope in self._scopes:
            scope.cancel()

    async def aclose(self) -> None:
        self._closed = True
        if self._broken or self._send_interrupted:
            await anyio.aclose_forcefully(self._stream)
        else:
            await self._stream.aclose()
