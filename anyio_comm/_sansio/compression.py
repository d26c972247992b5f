"""Frame compression (protocol version 2; ``docs/wire-format.md``, section 6.1).

A side that announces the ``COMPRESSION`` capability lists the codecs it
decompresses. Towards it, a frame may travel compressed: its length-table entry
carries the codec in its top byte and the frame's *uncompressed* length below,
so that the receiver checks its limits and sizes the frame's buffer from the
header as for any frame; on the wire the frame is a u64 compressed length, then
that many bytes of the codec's output, which decompress straight into the
frame's exact-size buffer (anything else is a protocol error).

The sender compresses a frame only when it is worth it, the lesson of dask's
comms: frames below :data:`MIN_COMPRESSED_SIZE` are sent as they are, and so is
a frame whose sample of about 10 KB does not compress to 90 % of its size or
less (with LZ4, whatever the codec: it takes microseconds), or whose whole does
not.

Both codecs come from the ``cramjam`` package (the ``lz4`` and ``zstd``
extras), imported on first use.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any, Final

from .buffers import allocate, default_allocator
from .errors import RemoteProtocolError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ._buffer import Buffer

__all__ = [
    "CODECS",
    "CODEC_NAMES",
    "CODEC_SHIFT",
    "LENGTH_MASK",
    "MIN_COMPRESSED_SIZE",
    "Compressor",
    "check_codecs",
    "codec_ids",
    "decompress_into",
]

#: codec name -> its id on the wire
CODECS: Final = {"lz4": 1, "zstd": 2}
#: codec id -> its name
CODEC_NAMES: Final = {ident: name for name, ident in CODECS.items()}
_NAMES: Final = CODEC_NAMES
#: a length-table entry holds the codec above this bit ...
CODEC_SHIFT: Final = 56
#: ... and the frame's uncompressed length below it
LENGTH_MASK: Final = (1 << CODEC_SHIFT) - 1
#: frames shorter than this are never compressed by this implementation
MIN_COMPRESSED_SIZE: Final = 64 * 1024
#: a frame (or its sample) is sent compressed only if compression makes it at most
#: this fraction of its size
MAX_RATIO: Final = 0.9
#: the sample: this many slices of SLICE bytes, spread over the frame
SLICES: Final = 5
SLICE: Final = 2048
ZSTD_LEVEL: Final = 1
_PREFIX: Final = struct.Struct("!Q")


def _cramjam() -> Any:
    try:
        import cramjam  # (optional: imported when compression is used)
    except ImportError:
        raise ImportError(
            "compression needs the cramjam package: pip install cramjam, or, from a clone "
            'of the repository, pip install ".[lz4]"'
        ) from None
    return cramjam


def check_codecs(names: Iterable[str]) -> tuple[str, ...]:
    """Check codec names (and that their package is installed); return them.

    Raises:
        ValueError: an unknown codec, or one named twice.
        ImportError: the ``cramjam`` package is not installed.
    """
    checked = tuple(names)
    for name in checked:
        if name not in CODECS:
            raise ValueError(f"unknown compression codec {name!r}; known: {', '.join(CODECS)}")
    if len(set(checked)) != len(checked):
        raise ValueError(f"a compression codec is named twice: {checked}")
    if checked:
        _cramjam()
    return checked


def codec_ids(names: Iterable[str]) -> bytes:
    """The wire ids of the codecs ``names``, as a capability's value."""
    return bytes(CODECS[name] for name in names)


def decompress_into(codec: int, data: Buffer, out: memoryview) -> None:
    """Decompress ``data`` with ``codec`` into ``out``, which it must fill exactly.

    Raises:
        RemoteProtocolError: the data is not valid for the codec, or does not
            decompress to exactly ``out.nbytes`` bytes.
    """
    cramjam = _cramjam()
    size = out.nbytes
    try:
        if codec == 1:
            written = cramjam.lz4.decompress_block_into(data, out)
        else:
            written = cramjam.zstd.decompress_into(data, out)
    except Exception as exc:  # cramjam.DecompressionError, and friends
        raise RemoteProtocolError(
            f"a frame compressed with {_NAMES.get(codec, codec)} that does not "
            f"decompress to its {size} bytes: {exc}",
            rule="wire-format",
        ) from None
    if written != size:
        raise RemoteProtocolError(
            f"a {_NAMES.get(codec, codec)} frame decompressed to {written} bytes, not its {size}",
            rule="wire-format",
        )


class Compressor:
    """Compresses the frames worth it, with one codec.

    Args:
        name: the codec (``"lz4"`` or ``"zstd"``).
        min_size: frames shorter than this are never compressed.
    """

    __slots__ = ("_compress", "_sample", "codec", "min_size")

    def __init__(self, name: str, min_size: int = MIN_COMPRESSED_SIZE) -> None:
        self.codec = CODECS[name]
        self.min_size = min_size
        cramjam = _cramjam()
        # The sample is judged with LZ4 whatever the codec: a few microseconds,
        # where each Zstandard call costs a context (about 170 us here).
        self._sample = cramjam.lz4.compress_block_into
        if name == "lz4":
            module = cramjam.lz4

            def compress(data: Buffer, out: memoryview) -> int:
                return int(module.compress_block_into(data, out, store_size=False))

        else:
            module = cramjam.zstd

            def compress(data: Buffer, out: memoryview) -> int:
                return int(module.compress_into(data, out, level=ZSTD_LEVEL))

        self._compress = compress

    def __repr__(self) -> str:
        return f"<Compressor {_NAMES[self.codec]}>"

    def compress(self, frame: memoryview) -> memoryview | None:
        """The frame as it goes on the wire compressed (its u64 compressed length,
        then the codec's output), or ``None`` if it is not worth compressing."""
        size = frame.nbytes
        if size < self.min_size or not self._sample_compresses(frame):
            return None
        # The worst case of either codec is a little over the input; a frame that
        # does not fit in 0.9 of its size is sent as it is anyway.
        room = int(size * MAX_RATIO)
        # (from LAZY_COMMIT_SIZE, memory whose pages are committed as the codec
        # writes them: a frame that compresses well costs what it compresses to)
        out = allocate(default_allocator, _PREFIX.size + room + 1024)
        try:
            written = self._compress(frame, out[_PREFIX.size :])
        except Exception:  # the output did not fit: not worth it
            return None
        if written > room:
            return None
        _PREFIX.pack_into(out, 0, written)
        return out[: _PREFIX.size + written]

    def _sample_compresses(self, frame: memoryview) -> bool:
        size = frame.nbytes
        if size <= SLICES * SLICE * 2:
            return True  # small enough to try whole
        step = (size - SLICE) // (SLICES - 1)
        sample = b"".join(frame[i * step : i * step + SLICE] for i in range(SLICES))
        out = bytearray(len(sample) * 2 + 1024)
        try:
            written = self._sample(sample, out, store_size=False)
        except Exception:
            return False
        return bool(written <= len(sample) * MAX_RATIO)
