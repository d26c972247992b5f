"""A version-1 peer: the frames layer of ``docs/wire-format.md`` as version 1
defines it, written apart from the package (no anyio_comm import), over any AnyIO
byte stream.

It is what a deployed version-1 implementation looks like on the wire: its
preamble has version 1 and a 20-byte body, it skips whatever follows the limits
in the peer's preamble, and it knows nothing of capabilities or close records (a
frame count of ``FF FF FF FF`` is, to it, a count over its limits).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from anyio import EndOfStream
from anyio.streams.buffered import BufferedByteReceiveStream

if TYPE_CHECKING:
    from anyio.abc import ByteStream

MAGIC = b"\x89ACOMM\r\n"
LIMITS = (16_384, 2**30, 2**31)


class V1ProtocolError(Exception):
    """The peer broke a rule of version 1."""


class V1Peer:
    """One side of a version-1 connection over ``stream``."""

    def __init__(self, stream: ByteStream, limits: tuple[int, int, int] = LIMITS) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.limits = limits
        #: what the peer's preamble announced: (version, limits, the body after them)
        self.peer: tuple[int, tuple[int, int, int], bytes] | None = None

    def preamble(self) -> bytes:
        return MAGIC + struct.pack("!HHIQQ", 1, 20, *self.limits)

    async def handshake(self) -> tuple[int, tuple[int, int, int], bytes]:
        """Send our preamble, then read the peer's (section 4)."""
        await self.stream.send(self.preamble())
        head = await self.reader.receive_exactly(12)
        if head[:8] != MAGIC:
            raise V1ProtocolError(f"bad magic {head[:8]!r}")
        version, length = struct.unpack("!HH", head[8:])
        if version == 0 or not 20 <= length <= 1024:
            raise V1ProtocolError(f"version {version}, body length {length}")
        body = await self.reader.receive_exactly(length)
        limits = struct.unpack("!IQQ", body[:20])
        self.peer = (version, limits, body[20:])  # version 1: the rest is ignored
        return self.peer

    async def send_frames(self, frames: list[bytes]) -> None:
        assert self.peer is not None
        max_frames, max_frame_size, max_message_size = self.peer[1]
        assert len(frames) <= max_frames and sum(map(len, frames)) <= max_message_size
        assert all(len(frame) <= max_frame_size for frame in frames)
        header = struct.pack(f"!I{len(frames)}Q", len(frames), *map(len, frames))
        await self.stream.send(header + b"".join(frames))

    async def receive_frames(self) -> list[bytes] | None:
        """The next message's frames; ``None`` at a clean end of stream.

        Raises:
            V1ProtocolError: a header over our limits.
            anyio.IncompleteRead: the stream ended inside a message.
        """
        try:
            first = await self.reader.receive(4)
        except EndOfStream:
            return None  # at a message boundary: a clean end
        rest = await self.reader.receive_exactly(4 - len(first)) if len(first) < 4 else b""
        (count,) = struct.unpack("!I", first + rest)
        max_frames, max_frame_size, max_message_size = self.limits
        if count > max_frames:
            raise V1ProtocolError(f"{count} frames; our limit is {max_frames}")
        lengths = struct.unpack(f"!{count}Q", await self.reader.receive_exactly(8 * count))
        if max(lengths, default=0) > max_frame_size or sum(lengths) > max_message_size:
            raise V1ProtocolError(f"frames of {lengths} bytes are over our limits")
        return [await self.reader.receive_exactly(n) if n else b"" for n in lengths]
