"""Receive-buffer allocation.

Buffer lifetime: every received frame lives in its own buffer, allocated once
with the exact frame size when the frame starts arriving. A ``memoryview``
handed to the user (a frame from ``receive_frames()``, or an out-of-band value
inside a message) keeps that buffer, and only that buffer, alive; no other
frame is pinned by it. To release the memory early, copy what you need
(``bytes(view)``) and drop the view. The exception: the frames shorter than 64
bytes of a message of more than 32 frames share one ``bytearray`` (not from
the allocator; see :mod:`~anyio_comm._sansio.frames`), which a view of any of
them keeps alive.

Memory committed: a frame's buffer is allocated when the frame starts to
arrive, before its bytes are there. The default allocator commits pages only
as bytes arrive for frames of :data:`LAZY_COMMIT_SIZE` bytes and more: it maps
anonymous memory, whose pages the kernel provides on first write, so a peer
that declares a 1 GiB frame and sends nothing costs address space, not
memory. Smaller frames get a ``bytearray`` (zero-filled, so committed at
once): the allocator reuses the memory of earlier frames for them, which
mapping anew would not (every page would fault in again: receiving 64 KiB to
16 MiB frames that way took 3.4 to 4.9 times as long, measured). From 32 MiB
the C allocator maps fresh memory anyway, and a ``bytearray`` then also
writes every page with zeros: the mapping is faster there (0.85x the time).

The allocator is pluggable: anything that maps a size to a writable,
C-contiguous buffer of exactly that many bytes (``bytearray``, a slot from a
pool, ``numpy.empty(n, "u1")``).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable
from typing import Final

from ._buffer import Buffer

__all__ = ["LAZY_COMMIT_SIZE", "Allocator", "allocate", "default_allocator", "map_anonymous"]

#: ``allocator(nbytes) -> writable buffer of exactly nbytes bytes``
Allocator = Callable[[int], Buffer]

#: frames of at least this many bytes get memory committed as their bytes arrive
LAZY_COMMIT_SIZE: Final = 32 * 1024 * 1024

# private anonymous memory (where the platform has the flag; else the default mapping)
_MAP_FLAGS: Final = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


def default_allocator(nbytes: int) -> bytearray | mmap.mmap:
    """Allocate a zero-filled buffer of ``nbytes`` bytes: a ``bytearray`` below
    :data:`LAZY_COMMIT_SIZE`, else an anonymous memory mapping whose pages are
    committed as they are written.

    Raises:
        MemoryError: the memory (or address space) is not available.
    """
    if nbytes < LAZY_COMMIT_SIZE:
        return bytearray(nbytes)
    return map_anonymous(nbytes)


def map_anonymous(nbytes: int) -> mmap.mmap:
    """Map ``nbytes`` bytes of private anonymous memory (zero-filled; each page is
    committed on its first write).

    Raises:
        MemoryError: the address space (or the overcommit limit) is exhausted.
    """
    try:
        if _MAP_FLAGS:
            return mmap.mmap(-1, nbytes, flags=_MAP_FLAGS)
        return mmap.mmap(-1, nbytes)  # pragma: no cover - platforms without the flags
    except OSError as exc:  # ENOMEM: the address space (or overcommit) is exhausted
        raise MemoryError(f"cannot map {nbytes} bytes: {exc}") from None


def allocate(allocator: Allocator, nbytes: int) -> memoryview:
    """Call ``allocator`` and return a flat byte view of its buffer.

    Raises:
        TypeError: the allocator returned a read-only buffer, one that is not
            C-contiguous, or one whose size is not ``nbytes``.
    """
    view = memoryview(allocator(nbytes))
    if view.readonly or not view.c_contiguous or view.nbytes != nbytes:
        raise TypeError(
            f"allocator must return a writable C-contiguous buffer of exactly "
            f"{nbytes} bytes, got {view.nbytes} bytes "
            f"(readonly={view.readonly}, c_contiguous={view.c_contiguous})"
        )
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
