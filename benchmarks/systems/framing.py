"""The wire format of the floors and of anyio-streams, and shared helpers.

A message is an 8-byte little-endian frame count ``n``, ``n`` 8-byte
little-endian frame lengths, then the frames back to back.
:class:`FrameReader` parses it with as few copies and system calls as a
hand-written transport would: small pieces land in a 64 KiB scratch buffer
(one ``recv_into`` can bring a whole small message), and the rest of a large
frame is received directly into that frame's own buffer, allocated once its
length is known.
"""

from __future__ import annotations

import struct
from typing import Any

_COUNT = struct.Struct("<Q")
SCRATCH_SIZE = 65536
MAX_FRAMES = 1024
JOIN_BELOW = 65536  # messages smaller than this are sent as one joined buffer
CHECK_EVERY = 256  # round trips between checks of the reply's frame sizes


def pack_header(frames: list[Any]) -> bytes:
    """The header (count and lengths) of a message made of ``frames``."""
    return struct.pack(f"<{len(frames) + 1}Q", len(frames), *(len(f) for f in frames))


def make_frames(size: int, count: int) -> list[bytes]:
    """``count`` frames of ``size`` bytes (the same object, as a client would resend)."""
    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    return [payload] * count


def host_port(address: str) -> tuple[str, int]:
    """The host and port of a ``tcp://host:port`` address."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    return host, int(port)


class Checker:
    """Checks the frame sizes of every ``CHECK_EVERY``-th reply."""

    def __init__(self, size: int, frames: int) -> None:
        self.expected = [size] * frames
        self.count = 0

    def due(self) -> bool:
        """Count one round trip; True when its reply should be checked."""
        self.count += 1
        return self.count % CHECK_EVERY == 1

    def check(self, sizes: list[int]) -> None:
        """Raise if the reply's frame sizes are not the ones sent."""
        if sizes != self.expected:
            raise RuntimeError(f"sent frames of {self.expected} bytes, got back {sizes}")


class FrameReader:
    """Incremental parser fed through ``get_buffer()`` / ``buffer_updated(n)``.

    ``buffer_updated`` returns the messages completed, each as
    ``(header, frames)`` where ``header`` is the raw count and lengths (ready to
    be sent back as is) and ``frames`` the frame buffers.

    With ``reuse``, a frame that does not come whole with the scratch buffer
    goes into the same buffer as the frame of the same place and length in the
    previous message (allocated, and faulted in, once): only for callers done
    with a message before they read the next.
    """

    def __init__(self, *, reuse: bool = False) -> None:
        self._reuse: dict[tuple[int, int], bytearray] | None = {} if reuse else None
        self._scratch = bytearray(SCRATCH_SIZE)
        self._view = memoryview(self._scratch)
        self._start = 0  # first unparsed byte in the scratch buffer
        self._end = 0  # end of the received bytes in the scratch buffer
        self._header: bytes | None = None
        self._lengths: tuple[int, ...] = ()
        self._frames: list[Any] = []
        self._target: memoryview | None = None  # unfilled rest of a large frame

    def get_buffer(self) -> memoryview:
        """Where the next received bytes should go."""
        if self._target is not None:
            return self._target
        if self._start == self._end:
            self._start = self._end = 0
        elif SCRATCH_SIZE - self._end < 8 * (MAX_FRAMES + 1):
            pending = self._end - self._start
            self._scratch[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> list[tuple[bytes, list[Any]]]:
        """Account for ``nbytes`` written into the last buffer; return completed messages."""
        if self._target is not None:
            if nbytes < len(self._target):
                self._target = self._target[nbytes:]
                return []
            self._target = None
        else:
            self._end += nbytes
        return self._parse()

    def _parse(self) -> list[tuple[bytes, list[Any]]]:
        done: list[tuple[bytes, list[Any]]] = []
        scratch, view = self._scratch, self._view
        while True:
            if self._header is None:
                start, available = self._start, self._end - self._start
                if available < 8:
                    return done
                (count,) = _COUNT.unpack_from(scratch, start)
                if not 0 < count <= MAX_FRAMES:
                    raise ValueError(f"bad frame count {count}")
                header_size = 8 + 8 * count
                if available < header_size:
                    return done
                self._header = bytes(view[start : start + header_size])
                self._lengths = struct.unpack_from(f"<{count}Q", scratch, start + 8)
                self._frames = []
                self._start = start + header_size
            frames, lengths = self._frames, self._lengths
            while len(frames) < len(lengths):
                length = lengths[len(frames)]
                start = self._start
                available = self._end - start
                if available >= length:  # small frame: one copy out of the scratch buffer
                    frames.append(scratch[start : start + length])
                    self._start = start + length
                    continue
                frame = self._new_frame(len(frames), length)
                frame[:available] = view[start : self._end]
                self._start = self._end
                frames.append(frame)
                self._target = memoryview(frame)[available:]
                return done
            done.append((self._header, frames))
            self._header = None

    def _new_frame(self, index: int, length: int) -> bytearray:
        if self._reuse is None:
            return bytearray(length)
        frame = self._reuse.get((index, length))
        if frame is None:
            frame = self._reuse[index, length] = bytearray(length)
        return frame


def advance(buffers: list[Any], sent: int) -> list[Any]:
    """What is left of ``buffers`` after the first ``sent`` bytes went out."""
    rest = []
    for i, buf in enumerate(buffers):
        size = len(buf) if not isinstance(buf, memoryview) else buf.nbytes
        if sent < size:
            rest.append(memoryview(buf).cast("B")[sent:] if sent else buf)
            rest.extend(buffers[i + 1 :])
            return rest
        sent -= size
    return rest


def outgoing(header: bytes, frames: list[Any]) -> list[Any]:
    """The buffers to send for one message: joined when small, else header then frames."""
    if len(header) + sum(len(f) for f in frames) < JOIN_BELOW:
        return [b"".join([header, *frames])]
    return [header, *frames]


def request(case: Any) -> tuple[list[Any], int]:
    """The buffers a client sends for each round trip of ``case``, and their total size."""
    frames = make_frames(case.size, case.frames)
    buffers = outgoing(pack_header(frames), frames)
    return buffers, sum(len(b) for b in buffers)
