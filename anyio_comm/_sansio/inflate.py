"""The compressed frames of the message being received (sans-IO), for the frame
decoder.

A compressed frame (spec 6.1) is its length table entry, whose top byte names
the codec and whose rest is the frame's decompressed length, then on the wire
its u64 compressed length and the codec's output. The decoder reads each part
into a buffer of its own and hands it over when it is full: :class:`Inflater`
checks it and says what comes next. After the prefix
(:meth:`Inflater.prefix_read`), the buffer of the compressed bytes, at most the
frame's length less one; after those (:meth:`Inflater.compressed_read`), the
frame, decompressed at once, or left to the I/O layer (:attr:`Inflater.job`):
frames of :attr:`~Inflater.offload_min` bytes and more, and the next one after
:attr:`~Inflater.check_every` bytes were decompressed here since the I/O layer
last ran one, so that it can check from time to time that the peer is still
there. The I/O layer then runs :meth:`Inflater.prepare` (in the event loop's
thread, when the frame is wanted) and :meth:`Inflater.run` (in a worker
thread, say: nothing else touches the decoder meanwhile).

The decoder's limits and the budget's reservation use the decompressed lengths,
so a compressed frame holds at most its length in compressed bytes beside its
frame while it is read: what a message of compressed frames holds is bounded by
the limits, not by the bytes that arrived.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .buffers import allocate, default_allocator
from .compression import CODEC_SHIFT, LENGTH_MASK, decompress_into
from .errors import RemoteProtocolError

if TYPE_CHECKING:
    from .buffers import Allocator

__all__ = ["Inflater"]


class Inflater:
    """The compressed frames of one connection's messages, one message at a time.

    Args:
        accepted: the codec ids we announced that we decompress.
        allocator: allocates the buffers of the compressed bytes and the frames.
    """

    __slots__ = (
        "_accepted",
        "_allocator",
        "_inline",
        "adjust",
        "check_every",
        "codecs",
        "compressed_bytes",
        "compressed_wire_bytes",
        "error",
        "job",
        "offload_min",
        "phase",
    )

    def __init__(self, accepted: frozenset[int], allocator: Allocator) -> None:
        self._accepted = accepted
        self._allocator = allocator
        #: the compressed frames of the message being received (index -> codec;
        #: ``None``: it has none)
        self.codecs: dict[int, int] | None = None
        #: the part of a compressed frame being read: 0 none, 1 its prefix, 2 its
        #: compressed bytes, 3 its decompression (left to the I/O layer: the
        #: decoder's target is the frame once :meth:`run` is done)
        self.phase = 0
        #: the decompression left to the I/O layer: codec, compressed bytes,
        #: length, and the frame's buffer (``None``: :meth:`run` allocates it)
        self.job: tuple[int, memoryview, int, memoryview | None] | None = None
        #: what that decompression raised (the decoder raises it next)
        self.error: RemoteProtocolError | None = None
        # bytes decompressed here since the I/O layer last ran a decompression
        self._inline = 0
        #: what the message's compressed frames took on the wire, less what the
        #: decoder counts them as (their decompressed lengths, their prefix while
        #: it is read)
        self.adjust = 0
        #: compressed frames of at least this length (decompressed) are left to
        #: the I/O layer ...
        self.offload_min = LENGTH_MASK + 1
        #: ... and so is the next one once this many bytes were decompressed here
        #: since the I/O layer last ran one
        self.check_every = LENGTH_MASK + 1
        #: the compressed frames received: their bytes (decompressed), and what
        #: they took on the wire (their prefixes included)
        self.compressed_bytes = 0
        self.compressed_wire_bytes = 0

    def forget_codecs(self) -> None:
        """Accept no compressed frame (a version-1 connection)."""
        self._accepted = frozenset()

    def begin(self, entries: tuple[int, ...]) -> tuple[int, ...]:
        """Begin a message: the frame lengths of its length table ``entries``
        (a compressed frame's codec in the top byte of its entry).

        Raises:
            RemoteProtocolError: a codec we did not announce, or a compressed
                frame of length 0.
        """
        self.codecs = None
        self.adjust = 0
        if not self._accepted or max(entries) <= LENGTH_MASK:
            return entries
        codecs = {}
        lengths = []
        for index, entry in enumerate(entries):
            codec = entry >> CODEC_SHIFT
            length = entry & LENGTH_MASK
            if codec:
                if codec not in self._accepted:
                    raise RemoteProtocolError(
                        f"frame {index} compressed with codec {codec}, which we did not announce",
                        rule="wire-format",
                    )
                if not length:
                    raise RemoteProtocolError(
                        f"compressed frame {index} of length 0", rule="wire-format"
                    )
                codecs[index] = codec
            lengths.append(length)
        self.codecs = codecs
        return tuple(lengths)

    def end(self) -> None:
        """The message is complete, or the stream ended: forget its frames (and
        any decompression left to the I/O layer)."""
        self.codecs = None
        self.adjust = 0
        self.phase = 0
        self.job = self.error = None

    def prefix(self) -> memoryview:
        """The buffer of a compressed frame's prefix (its compressed length)."""
        self.phase = 1
        return memoryview(bytearray(8))

    def prefix_read(self, prefix: memoryview, index: int, length: int) -> memoryview:
        """The buffer of the compressed bytes of frame ``index`` (``length`` bytes
        decompressed), whose ``prefix`` is full.

        Raises:
            RemoteProtocolError: a compressed length of 0 or not below the
                frame's length.
        """
        compressed = int.from_bytes(prefix, "big")
        if not 0 < compressed < length:
            raise RemoteProtocolError(
                f"compressed frame {index} of {length} bytes announces {compressed} "
                "compressed bytes (more than 0, fewer than its length, expected)",
                rule="wire-format",
            )
        self.phase = 2
        self.adjust += 8  # the prefix, no longer counted by the decoder
        return allocate(self._allocator, compressed)

    def compressed_read(self, data: memoryview, index: int, length: int) -> memoryview | None:
        """Frame ``index`` (``length`` bytes) from its compressed bytes ``data``,
        or ``None``: its decompression is left to the I/O layer (:attr:`job`).

        Raises:
            RemoteProtocolError: bytes that do not decompress to exactly
                ``length`` bytes.
        """
        self.adjust += data.nbytes - length  # on the wire: its compressed bytes
        self.compressed_bytes += length
        self.compressed_wire_bytes += 8 + data.nbytes
        assert self.codecs is not None
        codec = self.codecs[index]
        if length >= self.offload_min or self._inline + length > self.check_every:
            # (its buffer is allocated when the I/O layer runs it: see prepare)
            self.job = (codec, data, length, None)
            self.phase = 3
            self._inline = 0
            return None
        self.phase = 0
        self._inline += length
        frame = allocate(self._allocator, length)
        try:
            decompress_into(codec, data, frame)
        except RemoteProtocolError:
            del frame  # (the error's traceback must not hold the frame's buffer)
            raise
        return frame

    @property
    def job_size(self) -> int:
        """The decompressed length of the frame :attr:`job` is for (0: no job)."""
        job = self.job
        return 0 if job is None else job[2]

    def prepare(self) -> None:
        """Allocate the buffer of the frame :attr:`job` decompresses, unless
        :meth:`run` may do it in another thread (the default allocator: then it
        does, the zeroing of a ``bytearray`` being work too).

        Raises:
            RuntimeError: no decompression is due.
            MemoryError: as the allocator raises it.
        """
        job = self.job
        if job is None:
            raise RuntimeError("no decompression is due")
        if job[3] is None and self._allocator is not default_allocator:
            self.job = (*job[:3], allocate(self._allocator, job[2]))

    def run(self) -> memoryview | None:
        """Run the decompression :attr:`job` and return the frame, or ``None``
        with :attr:`error` set (it raises nothing else).

        Raises:
            RuntimeError: no decompression is due.
        """
        job = self.job
        if job is None:
            raise RuntimeError("no decompression is due")
        codec, data, length, frame = job
        self.job = None
        try:
            if frame is None:
                frame = allocate(default_allocator, length)
            decompress_into(codec, data, frame)
        except RemoteProtocolError as exc:
            self.error = exc.with_traceback(None)
            return None  # (the frame is not kept: the decoder raises the error next)
        except MemoryError:
            self.error = RemoteProtocolError(
                f"no memory for a compressed frame of {length} bytes", rule="wire-format"
            )
            return None
        return frame
