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

from benchmarks.systems.framing import Checker, make_frames, outgoing, pack_header, run_backend

if TYPE_CHECKING:
    import ssl
    from collections.abc import Awaitable, Callable

    from anyio.abc import ByteStream

CONNECT_TIMEOUT = 30.0


async def _read(reader: BufferedByteReceiveStream) -> tuple[bytes, list[bytes]]:
    count_bytes = await reader.receive_exactly(8)
    (count,) = struct.unpack("<Q", count_bytes)
    lengths_bytes = await reader.receive_exactly(8 * count)
    lengths = struct.unpack(f"<{count}Q", lengths_bytes)
    frames = [await reader.receive_exactly(length) for length in lengths]
    return count_bytes + lengths_bytes, frames


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Echo every message back until the process ends."""

    async def echo(stream: ByteStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        errors = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError)
        async with stream:
            with contextlib.suppress(*errors):
                while True:
                    header, frames = await _read(reader)
                    for buf in outgoing(header, frames):
                        await stream.send(buf)
                    counter.n += 1

    async def main() -> None:
        async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
            host, port = listener.extra(SocketAttribute.local_address)[:2]
            ready(f"tcp://{host}:{port}")
            if ssl_context is None:
                await listener.serve(echo)
            else:
                await TLSListener(listener, ssl_context, standard_compatible=False).serve(echo)

    run_backend(case.backend, main)


async def open_client(
    stack: contextlib.AsyncExitStack, address: str, case: Any, ssl_context: ssl.SSLContext | None
) -> Callable[[], Awaitable[None]]:
    """One stream; round trips send the framed message and read the echo."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    stream: ByteStream
    with anyio.fail_after(CONNECT_TIMEOUT):
        if ssl_context is None:
            stream = await anyio.connect_tcp(host, int(port))
        else:
            stream = await anyio.connect_tcp(
                host, int(port), ssl_context=ssl_context, tls_standard_compatible=False
            )
    stack.push_async_callback(stream.aclose)
    reader = BufferedByteReceiveStream(stream)
    frames = make_frames(case.size, case.frames)
    buffers = outgoing(pack_header(frames), frames)
    checker = Checker(case.size, case.frames)

    async def roundtrip() -> None:
        for buf in buffers:
            await stream.send(buf)
        _, reply = await _read(reader)
        if checker.due():
            checker.check([len(f) for f in reply])

    return roundtrip
