"""Plain AnyIO streams: what a user would write over ``anyio.connect_tcp``.

Same framing as the floors (count, lengths, frames), read with
``BufferedByteReceiveStream.receive_exactly``; a small reply is sent as one
joined buffer, a large one as the header then each frame. TLS wraps the
listener in :class:`anyio.streams.tls.TLSListener` and connects with
``anyio.connect_tcp(..., ssl_context=...)`` (AnyIO's ``TLSStream``).
"""

from __future__ import annotations

import contextlib
import struct
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.tls import TLSListener

from anyio_comm.bench import run_backend
from benchmarks.systems.framing import Checker, host_port, outgoing, request

if TYPE_CHECKING:
    import ssl
    from collections.abc import Awaitable, Callable

    from anyio.abc import ByteStream

    Echo = Callable[[BufferedByteReceiveStream, ByteStream], Awaitable[None]]

CONNECT_TIMEOUT = 30.0
#: what ends a connection: the peer closed it, cut a message short or reset it
GONE = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError)


async def connect(address: str, ssl_context: ssl.SSLContext | None) -> ByteStream:
    """A TCP stream to ``tcp://host:port``; AnyIO's ``TLSStream`` over it with ``ssl_context``."""
    host, port = host_port(address)
    with anyio.fail_after(CONNECT_TIMEOUT):
        if ssl_context is None:
            return await anyio.connect_tcp(host, port)
        return await anyio.connect_tcp(
            host, port, ssl_context=ssl_context, tls_standard_compatible=False
        )


async def serve(
    echo: Echo, ssl_context: ssl.SSLContext | None, ready: Callable[[str], object]
) -> None:
    """Listen on a free port of 127.0.0.1, report ``tcp://host:port`` to ``ready``, then run
    ``echo(reader, stream)`` on each connection until the peer goes away.

    With ``ssl_context`` the listener is wrapped in :class:`anyio.streams.tls.TLSListener`.
    """

    async def handle(stream: ByteStream) -> None:
        async with stream:
            with contextlib.suppress(*GONE):
                await echo(BufferedByteReceiveStream(stream), stream)

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        ready(f"tcp://127.0.0.1:{listener.extra(SocketAttribute.local_port)}")
        if ssl_context is None:
            await listener.serve(handle)
        else:
            await TLSListener(listener, ssl_context, standard_compatible=False).serve(handle)


async def _read(reader: BufferedByteReceiveStream) -> tuple[bytes, list[bytes]]:
    count_bytes = await reader.receive_exactly(8)
    (count,) = struct.unpack("<Q", count_bytes)
    lengths_bytes = await reader.receive_exactly(8 * count)
    lengths = struct.unpack(f"<{count}Q", lengths_bytes)
    frames = [await reader.receive_exactly(length) for length in lengths]
    return count_bytes + lengths_bytes, frames


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Echo every message back until the process ends."""

    async def echo(reader: BufferedByteReceiveStream, stream: ByteStream) -> None:
        while True:
            header, frames = await _read(reader)
            for buf in outgoing(header, frames):
                await stream.send(buf)
            counter.n += 1

    run_backend(case.backend, serve, echo, ssl_context, ready)


async def open_client(
    stack: contextlib.AsyncExitStack, address: str, case: Any, ssl_context: ssl.SSLContext | None
) -> Callable[[], Awaitable[None]]:
    """One stream; round trips send the framed message and read the echo."""
    stream = await connect(address, ssl_context)
    stack.push_async_callback(stream.aclose)
    reader = BufferedByteReceiveStream(stream)
    buffers, _ = request(case)
    checker = Checker(case.size, case.frames)

    async def roundtrip() -> None:
        for buf in buffers:
            await stream.send(buf)
        _, reply = await _read(reader)
        if checker.due():
            checker.check([len(f) for f in reply])

    return roundtrip
