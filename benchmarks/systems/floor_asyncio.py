"""Floor on asyncio and uvloop: a ``BufferedProtocol`` and nothing else.

The event loop calls ``recv_into`` on the buffer :class:`FrameReader` hands
out (the scratch buffer, or the rest of a large frame allocated once its length
is known); replies are written with ``transport.write`` (one joined buffer for
small messages; the header then each frame for large ones, with ``writelines``
where it sends without joining, in flow-controlled chunks on older asyncio).
TLS uses ``loop.create_server(ssl=...)`` / ``loop.create_connection(ssl=...)``,
which keep the buffered protocol.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import sys
from typing import TYPE_CHECKING, Any

from benchmarks.systems.framing import Checker, FrameReader, host_port, outgoing, request

if TYPE_CHECKING:
    import ssl
    from collections.abc import Awaitable, Callable, Coroutine

# Python 3.12+ selector transports send a list of buffers with sendmsg, without joining
_WRITELINES = sys.version_info >= (3, 12)
# Before 3.12 a selector transport copies what a write could not send at once into a
# bytearray and deletes each sent prefix from its front, which costs a memmove of the
# rest per send: a 10 MB write becomes quadratic. Large buffers are therefore fed to
# those transports in chunks, so that its buffer stays under about two chunks.
_CHUNK = 1024 * 1024


class _Sender:
    """Writes messages to the transport; chunked with flow control where that is faster."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.pending: collections.deque[memoryview] = collections.deque()
        self.paused = False
        self.chunked = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.chunked = not _WRITELINES and type(transport).__name__ == "_SelectorSocketTransport"
        if self.chunked:
            transport.set_write_buffer_limits(high=_CHUNK)  # type: ignore[attr-defined]

    def send(self, buffers: list[Any]) -> None:
        """Send one message's buffers (or queue them behind the ones still pending)."""
        transport = self.transport
        if self.chunked:
            for buf in buffers:
                view = memoryview(buf)
                for start in range(0, len(view), _CHUNK):
                    self.pending.append(view[start : start + _CHUNK])
            self._pump()
        elif len(buffers) == 1:
            transport.write(buffers[0])
        elif _WRITELINES and type(transport).__module__.startswith("asyncio"):
            transport.writelines(buffers)
        else:
            for buf in buffers:
                transport.write(buf)

    def _pump(self) -> None:
        pending, write = self.pending, self.transport.write
        while pending and not self.paused:
            write(pending.popleft())

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._pump()


class _EchoProtocol(_Sender, asyncio.BufferedProtocol):
    def __init__(self, counter: Any, reuse: bool) -> None:
        super().__init__()
        self.counter = counter
        self.reader = FrameReader(reuse=reuse)

    def get_buffer(self, sizehint: int) -> memoryview:  # noqa: ARG002
        return self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        for header, frames in self.reader.buffer_updated(nbytes):
            self.send(outgoing(header, frames))
            self.counter.n += 1

    def eof_received(self) -> bool:
        return False


def run_loop(case: Any, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run ``main()`` on asyncio, or on uvloop for a case of the ``uvloop`` backend."""
    if case.backend == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def run_server(
    case: Any,
    ssl_context: ssl.SSLContext | None,
    counter: Any,
    ready: Any,
    *,
    reuse: bool = False,
) -> None:
    """Serve on asyncio (or uvloop for the ``uvloop`` backend) until the process ends
    (``reuse``: see :class:`FrameReader`)."""
    serve_protocol(case, ssl_context, ready, lambda: _EchoProtocol(counter, reuse))


def serve_protocol(
    case: Any,
    ssl_context: ssl.SSLContext | None,
    ready: Any,
    protocol: Callable[[], asyncio.BaseProtocol],
) -> None:
    """Serve ``protocol()`` per connection on 127.0.0.1 (asyncio, or uvloop for the
    ``uvloop`` backend) until the process ends; ``ready(address)`` once listening."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(protocol, "127.0.0.1", 0, ssl=ssl_context)
        host, port = server.sockets[0].getsockname()[:2]
        ready(f"tcp://{host}:{port}")
        await loop.create_future()  # forever

    run_loop(case, main)


class _ClientProtocol(_Sender, asyncio.BufferedProtocol):
    def __init__(self, reuse: bool) -> None:
        super().__init__()
        self.reader = FrameReader(reuse=reuse)
        self.waiter: asyncio.Future[list[Any]] | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def get_buffer(self, sizehint: int) -> memoryview:  # noqa: ARG002
        return self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        for _, frames in self.reader.buffer_updated(nbytes):
            assert self.waiter is not None
            self.waiter.set_result(frames)

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))
        if not self.lost.done():
            self.lost.set_result(None)


async def open_client(
    stack: contextlib.AsyncExitStack,
    address: str,
    case: Any,
    ssl_context: ssl.SSLContext | None,
    *,
    reuse: bool = False,
) -> Callable[[], Awaitable[None]]:
    """One connection; runs on the asyncio loop of the calling (AnyIO asyncio) task."""
    host, port = host_port(address)
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.create_connection(
        lambda: _ClientProtocol(reuse),
        host,
        port,
        ssl=ssl_context,
        server_hostname=host if ssl_context is not None else None,
    )

    async def close() -> None:
        transport.close()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(protocol.lost), 5)

    stack.push_async_callback(close)
    buffers, _ = request(case)
    checker = Checker(case.size, case.frames)

    async def roundtrip() -> None:
        protocol.waiter = waiter = loop.create_future()
        protocol.send(buffers)
        reply = await waiter
        if checker.due():
            checker.check([len(f) for f in reply])

    return roundtrip
