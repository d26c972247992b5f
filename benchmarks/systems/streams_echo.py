"""Plain AnyIO streams written the plainest way: what a user writes first.

A message is an 8-byte little-endian length, then that many bytes (here the
floors' framing of the case's frames, joined into one blob). The reader
accumulates ``stream.receive()`` chunks into a ``bytearray`` and cuts
messages off its front; the writer sends the prefix and the blob joined, with
one ``stream.send()``. No ``BufferedByteReceiveStream``, no ``receive_exactly``
(see ``streams.py`` for that variant). TLS as in ``streams.py``.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from anyio_comm.bench import run_backend
from benchmarks.systems.framing import Checker, make_frames, pack_header
from benchmarks.systems.streams import connect, serve

if TYPE_CHECKING:
    import contextlib
    import ssl
    from collections.abc import Awaitable, Callable

    from anyio.abc import ByteStream

_LENGTH = struct.Struct("<Q")


class Reader:
    """Whole messages out of ``stream.receive()`` chunks, accumulated in a bytearray."""

    def __init__(self, stream: ByteStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def receive(self) -> bytes:
        """The next message's bytes (its length prefix removed).

        Raises:
            anyio.EndOfStream: the peer closed the connection.
        """
        buffer = self._buffer
        while True:
            if len(buffer) >= 8:
                (length,) = _LENGTH.unpack_from(buffer)
                end = 8 + length
                if len(buffer) >= end:
                    message = bytes(buffer[8:end])
                    del buffer[:end]
                    return message
            buffer += await self._stream.receive()


def frame_sizes(message: bytes) -> list[int]:
    """The frame lengths of a message in the floors' framing."""
    (count,) = _LENGTH.unpack_from(message)
    return list(struct.unpack_from(f"<{count}Q", message, 8))


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Echo every message back until the process ends."""

    async def echo(_: Any, stream: ByteStream) -> None:
        reader = Reader(stream)
        while True:
            message = await reader.receive()
            await stream.send(_LENGTH.pack(len(message)) + message)
            counter.n += 1

    run_backend(case.backend, serve, echo, ssl_context, ready)


async def open_client(
    stack: contextlib.AsyncExitStack, address: str, case: Any, ssl_context: ssl.SSLContext | None
) -> Callable[[], Awaitable[None]]:
    """One stream; round trips send the length-prefixed message and read the echo."""
    stream = await connect(address, ssl_context)
    stack.push_async_callback(stream.aclose)
    reader = Reader(stream)
    frames = make_frames(case.size, case.frames)
    blob = b"".join([pack_header(frames), *frames])
    outgoing = _LENGTH.pack(len(blob)) + blob
    checker = Checker(case.size, case.frames)

    async def roundtrip() -> None:
        await stream.send(outgoing)
        reply = await reader.receive()
        if checker.due():
            checker.check(frame_sizes(reply))

    return roundtrip
