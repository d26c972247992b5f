"""Receive-buffer allocation.

Buffer lifetime: every received frame lives in its own buffer, allocated once
with the exact frame size when the frame starts arriving. A ``memoryview``
handed to the user (a frame from ``receive_frames()``, or an out-of-band value
inside a message) keeps that buffer, and only that buffer, alive; no other
frame is pinned by it. To release the memory early, copy what you need
(``bytes(view)``) and drop the view.

The allocator is pluggable: anything that maps a size to a writable,
C-contiguous buffer of exactly that many bytes (``bytearray``, a slot from a
pool, ``numpy.empty(n, "u1")``).
"""

from __future__ import annotations

from collections.abc import Callable

from ._buffer import Buffer

__all__ = ["Allocator", "allocate", "default_allocator"]

#: ``allocator(nbytes) -> writable buffer of exactly nbytes bytes``
Allocator = Callable[[int], Buffer]


def default_allocator(nbytes: int) -> bytearray:
    """Allocate a zero-filled ``bytearray`` of ``nbytes`` bytes."""
    return bytearray(nbytes)


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
