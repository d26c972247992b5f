"""A receive-buffer pool: frame memory reused once nothing holds it.

Theory of operation
-------------------
Every large frame is received into fresh memory by default, and fresh memory
costs: the kernel provides each page on its first write (a page fault and a
page of zeros), 0.4-0.5 ms per MiB measured here, and on a virtual machine
whose host takes back the memory its guest frees (free page reporting, as on
the machine measured) the first write also waits for the host: up to 2 ms
per MiB, where receiving into memory already in use costs 0.13 ms per MiB. A
process that receives a 250 MB frame, hands it on and drops it, then receives
the next, pays that for every byte, more than the receive itself costs.
:class:`BufferPool` keeps the memory of dropped frames and receives the next
frames of the same size class into it: no fault, no zeroing.

A frame is never reused while anything holds it. Each buffer the pool hands
out is a view of a *handle*, a ``ctypes`` array over one *slab* (an anonymous
memory mapping of the frame's size class). Python's buffer protocol makes
every consumer of a buffer hold a reference to the object that exported it:
a ``memoryview`` of the frame, a slice of it, a NumPy array made from it, a
``PickleBuffer``, all keep the handle alive, directly or through each other
(views of a ``memoryview`` share its exporter). So the handle dies only when
the last of them is gone; a ``weakref.finalize`` on the handle then gives the
slab back, and only then may it serve another frame. The slab itself is never
handed out. (Code that keeps a raw address without holding the buffer, such as
``ctypes.addressof``, is as unsafe here as with any buffer that gets freed.)

Fresh slabs of 2 MiB and more ask the kernel for transparent huge pages
(``MADV_HUGEPAGE``, as NumPy does for its large arrays): where the kernel has
them, a slab's first use faults 2 MiB at a time, about three times faster
than page by page (measured: 250 MB received into fresh memory took 35-45 ms
with huge pages against 105-120 ms without, 32 ms into reused memory).

Size classes: a frame of ``n`` bytes gets a slab of ``n`` rounded up to a
multiple of an eighth of the power of two below it (at most 12.5 % more
address space; the pages past ``n`` are not touched by the receive, so they
cost no memory until a larger frame of the same class uses them). A slab
serves frames of its class only.

Bounds: the pool keeps at most ``max_free_bytes`` of slabs that nothing holds
(counted in slab sizes), and :meth:`BufferPool.trim` releases those unused for
``free_for`` seconds (every allocation does too). A kept slab costs the system
nothing it needs: when a frame is released, its slab's pages are marked free
lazily (``MADV_FREE``, on Linux), so the kernel takes them back if it runs short
of memory (the slab's next use then faults fresh pages in), and otherwise the
next frame reuses them as they are, without a fault (measured: 0.1 ms to mark
256 MB). So an idle process that holds slabs costs no memory the system wants,
though they count in its resident size until the kernel takes them. Slabs in use are the
application's memory, as any frame buffer is, and are not bounded by the pool.
Frames below ``min_size`` are not pooled: the C allocator already reuses small
blocks, and a mapping per small frame would cost more than it saves.

Threads: call the pool (and :meth:`~BufferPool.trim`,
:meth:`~BufferPool.statistics`) from one thread at a time, the event loop's.
The frames may be dropped anywhere (a worker thread that deserializes them,
say): the handle's finalizer only appends the slab to a ``deque``, which is
safe from any thread, and the allocating thread takes it from there.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, final

from .buffers import map_anonymous

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._buffer import Buffer
    from .buffers import Allocator

__all__ = ["BufferPool", "PoolStatistics", "size_class"]

#: frames of at least this many bytes are pooled, by default
DEFAULT_MIN_SIZE: Final = 1024 * 1024
#: the pool keeps at most this many bytes of slabs that nothing holds, by default
DEFAULT_MAX_FREE_BYTES: Final = 256 * 1024 * 1024
#: ... each for at most this many seconds after it was last released, by default
DEFAULT_FREE_FOR: Final = 10.0
#: slabs are multiples of this (a page)
_PAGE: Final = mmap.PAGESIZE
#: slabs of at least a (transparent) huge page ask the kernel for huge pages
_HUGE_PAGE: Final = 2 * 1024 * 1024
_MADV_HUGEPAGE: Final = getattr(mmap, "MADV_HUGEPAGE", None)
#: released slabs are lazily freed: the kernel may take their pages when it needs memory
_MADV_FREE: Final = getattr(mmap, "MADV_FREE", None)


def size_class(nbytes: int) -> int:
    """The slab size for a frame of ``nbytes`` bytes: ``nbytes`` rounded up to a
    multiple of an eighth of the power of two at or below it (and of a page), so at
    most 12.5 % more."""
    step = max(1 << max(nbytes.bit_length() - 4, 0), _PAGE)
    return -(-nbytes // step) * step


@final
@dataclass(frozen=True, slots=True)
class PoolStatistics:
    """What a :class:`BufferPool` holds and has done (:meth:`BufferPool.statistics`).

    Attributes:
        buffers_in_use: frames handed out that something still holds.
        bytes_in_use: the slab bytes behind them.
        free_buffers: slabs kept for reuse.
        free_bytes: their bytes (at most ``max_free_bytes``).
        reused: frames received into a kept slab.
        created: slabs mapped anew.
        released: slabs unmapped (trimmed, or over ``max_free_bytes``).
    """

    buffers_in_use: int
    bytes_in_use: int
    free_buffers: int
    free_bytes: int
    reused: int
    created: int
    released: int


@final
class BufferPool:
    """An allocator (``Options(allocator=BufferPool())``) that receives frames of
    ``min_size`` bytes and more into memory reused from frames nothing holds any
    more; smaller frames go to ``fallback``.

    Each frame is a writable buffer of exactly its size, as from any allocator,
    and can be held, sliced and turned into NumPy arrays freely: its memory
    serves another frame only once nothing refers to it (see the module for
    how that is known). One pool may serve many connections.

    Args:
        max_free_bytes: slab bytes kept for reuse at most; beyond it the slabs
            released longest ago are unmapped.
        free_for: seconds a slab is kept after it was released, if no frame
            reuses it (``None``: until :meth:`trim` or ``max_free_bytes``).
        min_size: frames of at least this many bytes are pooled.
        fallback: the allocator of smaller frames (``None``: ``bytearray``).
        clock: the time source, in seconds (for tests).

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: a size is negative, ``min_size`` is 0, or ``free_for`` is
            not positive.
    """

    __slots__ = (
        "_clock",
        "_created",
        "_fallback",
        "_free",
        "_free_bytes",
        "_handle_types",
        "_in_use",
        "_in_use_bytes",
        "_released",
        "_returned",
        "_reused",
        "free_for",
        "max_free_bytes",
        "min_size",
        "small_frames_are_bytearrays",
    )

    def __init__(
        self,
        *,
        max_free_bytes: int = DEFAULT_MAX_FREE_BYTES,
        free_for: float | None = DEFAULT_FREE_FOR,
        min_size: int = DEFAULT_MIN_SIZE,
        fallback: Allocator | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("max_free_bytes", max_free_bytes), ("min_size", min_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        if max_free_bytes < 0:
            raise ValueError(f"max_free_bytes must not be negative, got {max_free_bytes}")
        if min_size < 1:
            raise ValueError(f"min_size must be at least 1, got {min_size}")
        if free_for is not None:
            if isinstance(free_for, bool) or not isinstance(free_for, (int, float)):
                raise TypeError(f"free_for must be a number of seconds or None, not {free_for!r}")
            if not free_for > 0:
                raise ValueError(f"free_for must be positive, not {free_for!r}")
        if fallback is not None and not callable(fallback):
            raise TypeError("fallback must be callable (fallback(n) -> buffer) or None")
        #: frames below ``min_size`` are plain ``bytearray``s (no ``fallback`` given)
        self.small_frames_are_bytearrays = fallback is None
        self.max_free_bytes = max_free_bytes
        self.free_for = free_for
        self.min_size = min_size
        self._fallback: Allocator = fallback if fallback is not None else bytearray
        self._clock = clock
        # slabs nothing holds, released longest ago first: (release time, slab)
        self._free: collections.deque[tuple[float, mmap.mmap]] = collections.deque()
        self._free_bytes = 0
        # slabs whose handle died, appended by its finalizer (from any thread)
        self._returned: collections.deque[mmap.mmap] = collections.deque()
        self._in_use = 0
        self._in_use_bytes = 0
        self._handle_types: dict[int, type[ctypes.Array[ctypes.c_ubyte]]] = {}
        self._reused = 0
        self._created = 0
        self._released = 0

    def __call__(self, nbytes: int) -> Buffer:
        """A writable buffer of exactly ``nbytes`` bytes (not zero-filled when reused;
        below ``min_size``, what ``fallback`` returns).

        Raises:
            MemoryError: the memory (or address space) is not available.
        """
        if nbytes < self.min_size:
            return self._fallback(nbytes)
        now = self._clock()
        self._take_returned(now)
        size = size_class(nbytes)
        slab = self._take_free(size)
        self._trim(now)
        if slab is None:
            slab = map_anonymous(size)
            if size >= _HUGE_PAGE and _MADV_HUGEPAGE is not None:
                with contextlib.suppress(OSError):  # (THP off, or unsupported here)
                    slab.madvise(_MADV_HUGEPAGE)
            self._created += 1
        else:
            self._reused += 1
        handle_type = self._handle_types.get(size)
        if handle_type is None:
            handle_type = self._handle_types[size] = ctypes.c_ubyte * size
        handle = handle_type.from_buffer(slab)
        weakref.finalize(handle, self._release, slab).atexit = False
        self._in_use += 1
        self._in_use_bytes += size
        return memoryview(handle).cast("B")[:nbytes]

    def _release(self, slab: mmap.mmap) -> None:
        """The finalizer of a frame's handle (nothing holds the frame any more; any
        thread): let the kernel take the slab's pages back if it needs memory, and
        hand the slab to the allocating thread."""
        if _MADV_FREE is not None:
            with contextlib.suppress(OSError, ValueError):  # (unsupported; closed)
                slab.madvise(_MADV_FREE)
        self._returned.append(slab)

    def _take_returned(self, now: float) -> None:
        """Move the slabs whose frames were dropped to the free list."""
        returned = self._returned
        while returned:
            slab = returned.popleft()
            self._in_use -= 1
            self._in_use_bytes -= len(slab)
            self._free.append((now, slab))
            self._free_bytes += len(slab)

    def _take_free(self, size: int) -> mmap.mmap | None:
        """A kept slab of ``size`` bytes, the one released last (its pages are
        the likeliest to be in the caches), or None."""
        free = self._free
        for index in range(len(free) - 1, -1, -1):
            slab = free[index][1]
            if len(slab) == size:
                del free[index]
                self._free_bytes -= size
                return slab
        return None

    def _trim(self, now: float, older_than: float | None = None) -> int:
        """Unmap kept slabs over ``max_free_bytes`` and those released before
        ``now - older_than`` (default ``free_for``); return the bytes unmapped."""
        if older_than is None:
            older_than = self.free_for
        free = self._free
        released = 0
        while free and (
            self._free_bytes > self.max_free_bytes
            or (older_than is not None and free[0][0] <= now - older_than)
        ):
            slab = free.popleft()[1]
            self._free_bytes -= len(slab)
            released += len(slab)
            self._released += 1
            try:
                slab.close()
            except BufferError:  # pragma: no cover - a dying handle's export: unmapped with it
                pass
        return released

    def trim(self, older_than: float | None = 0.0) -> int:
        """Unmap the kept slabs released at least ``older_than`` seconds ago
        (``0``: every kept slab; ``None``: those older than ``free_for``).

        Returns:
            The bytes unmapped.
        """
        now = self._clock()
        self._take_returned(now)
        return self._trim(now, older_than)

    @property
    def free_bytes(self) -> int:
        """Bytes of slabs kept for reuse (as of the last allocation or trim)."""
        return self._free_bytes

    def statistics(self) -> PoolStatistics:
        """What the pool holds now and has done so far (slabs released since the
        last call count as kept, within the bounds)."""
        now = self._clock()
        self._take_returned(now)
        self._trim(now)
        return PoolStatistics(
            buffers_in_use=self._in_use,
            bytes_in_use=self._in_use_bytes,
            free_buffers=len(self._free),
            free_bytes=self._free_bytes,
            reused=self._reused,
            created=self._created,
            released=self._released,
        )
