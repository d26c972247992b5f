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
the last of them is gone; the callback of a weak reference to the handle then
gives the slab back, and only then may it serve another frame. The slab itself
is never handed out. (Code that keeps a raw address without holding the buffer,
such as ``ctypes.addressof``, is as unsafe here as with any buffer that gets
freed.)

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

Alignment: the kernel copies a socket's bytes to and from user memory several
times faster when source and destination lie at the same offset modulo 32 bytes
than when they do not (measured: a 10 MB frame echoed with one connection, 79-99
round trips a second at the worst phases, 205-218 at the matching one).
:meth:`BufferPool.aligned` places a frame at a chosen ``phase`` modulo
64 bytes (``ALIGNMENT``), and the decoder chooses the frame's offset in its message: a
message sent with one ``sendmsg`` lies in the sender's socket pages at its own
offsets whenever the kernel starts a page afresh for it (on loopback and Unix
sockets, in request/reply exchanges: the previous message's pages were
consumed), so its receive is copied in phase, and so is a frame sent on in a
message whose header has the same length (an echo, a forwarded message).
A frame whose phase would make it span one more page (a frame of a whole number
of pages) or leave the slab of its size class stays at phase 0: its memory is
never more than at phase 0. Calling the pool places a frame at phase 0.

Bounds: the pool keeps at most ``max_free_bytes`` of slabs that nothing holds
(counted in slab sizes), and :meth:`BufferPool.trim` releases those unused for
``free_for`` seconds (every allocation does too). A kept slab of 2 MiB or more
costs the system nothing it needs: when its frame is released, its pages are
marked free lazily (``MADV_FREE``, on Linux), so the kernel takes them back if
it runs short of memory (the slab's next use then faults fresh pages in), and
otherwise the next frame reuses them as they are, without a fault. Marking
costs about 1 us per MiB of huge pages but 4-13 us per smaller slab (a page
table walk per 4 KiB page), a tenth of the time it takes to receive 128 KiB,
so smaller slabs are kept as they are. Slabs in use are the application's
memory, as any frame buffer is, and are not bounded by the pool.

Frames below ``min_size`` are not pooled. The default, just over 64 KiB, pools
every frame that is received straight into its own buffer rather than copied
out of the read-ahead buffer: the C allocator serves small blocks well, but
large ones it maps and unmaps, or takes from the top of its heap and gives back
when they are freed together (``malloc_trim``), so a message of several large
frames faults all of its pages in again every time (measured: five 1 MB frames
echoed 165 times a second from ``bytearray``s, 390 from the pool; ten 100 KB
frames 950 against 2,100). A pooled frame costs about 2.4 us to hand out and
take back, against 1-2.5 us for a ``bytearray`` of 70-256 KB that the C
allocator reuses.

Smaller frames, from a page (``SMALL_MIN``, 4 KiB) to ``min_size``, have the
same problem in bulk: a client of many connections that takes one 8 KB reply
from each in a pass of its event loop frees them together, the C allocator
gives the top of its heap back, and the next pass faults it in again (measured:
1.0 to 1.75 page faults per round trip in such a client, 200 connections, and 3
to 5 us more system time per round trip than once they were reused). A slab and
a weak reference per frame would cost more than the fault, so these frames stay
``bytearray`` objects and the pool keeps each one it hands out (up to
``max_small_bytes``, 4 MiB, held or not) to reuse it once nothing else holds
it: a ``bytearray`` nothing refers to but the pool has the reference count of
one reference, and a ``memoryview`` or anything made from one refers to it (the
buffer protocol's exporter), as does whoever keeps the ``bytearray`` itself.
The pool looks at the buffer it handed out longest ago, then the next; a held
one goes to the back. Each is out of the pool's deque while it is looked at, so
two threads never take the same one. :meth:`~BufferPool.trim` stops keeping
them all. Where there are no reference counts to go by (an interpreter other
than CPython, or CPython without the GIL), small frames are plain ``bytearray``
objects.

Threads: call the pool (and :meth:`~BufferPool.trim`,
:meth:`~BufferPool.statistics`) from one thread at a time, the event loop's.
The frames may be dropped anywhere (a worker thread that deserializes them,
say): the weak reference's callback only takes the slab out of a ``dict`` and
appends it to a ``deque``, which are safe from any thread, and the allocating
thread takes it from there (a small frame's reference count drops under the
GIL, wherever it is dropped).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import mmap
import sys
import time
import weakref
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Final, final

from .buffers import allocate, map_anonymous

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._buffer import Buffer
    from .buffers import Allocator

__all__ = ["ALIGNMENT", "BufferPool", "PoolStatistics", "size_class"]

#: frames of at least this many bytes are pooled, by default: those larger than the
#: default read-ahead buffer (64 KiB), which are received straight into their own
#: buffer (smaller ones are copied out of the read-ahead buffer into a bytearray)
DEFAULT_MIN_SIZE: Final = 64 * 1024 + 1
#: the pool keeps at most this many bytes of slabs that nothing holds, by default
DEFAULT_MAX_FREE_BYTES: Final = 256 * 1024 * 1024
#: ... each for at most this many seconds after it was last released, by default
DEFAULT_FREE_FOR: Final = 10.0
#: slabs are multiples of this (a page)
_PAGE: Final = mmap.PAGESIZE
#: :meth:`BufferPool.aligned` places a buffer at a phase modulo this many bytes
#: (a cache line; the kernel's copies are sensitive to the phase modulo 32)
ALIGNMENT: Final = 64
#: slabs of at least a (transparent) huge page ask the kernel for huge pages
_HUGE_PAGE: Final = 2 * 1024 * 1024
_MADV_HUGEPAGE: Final = getattr(mmap, "MADV_HUGEPAGE", None)
#: released slabs are lazily freed: the kernel may take their pages when it needs memory
_MADV_FREE: Final = getattr(mmap, "MADV_FREE", None)
_NEVER: Final = float("inf")
#: frames below ``min_size`` are kept for reuse from this size (a page): smaller
#: blocks fault less than a page in each when the C allocator gives them back
SMALL_MIN: Final = 4096
#: the pool keeps at most this many bytes of such smaller frames for reuse, by default
DEFAULT_MAX_SMALL_BYTES: Final = 4 * 1024 * 1024


def _no_refcount(_obj: object) -> int:  # pragma: no cover - not CPython
    return -1  # (never _UNHELD, which is None there anyway)


_getrefcount: Final[Callable[[object], int]] = getattr(sys, "getrefcount", _no_refcount)


def _refs(item: tuple[bytearray, int]) -> int:
    """The reference count of a kept small buffer, as seen from here (one
    function, so that every caller sees the same count)."""
    return _getrefcount(item[0])


def _take_unheld(kept: collections.deque[tuple[bytearray, int]]) -> tuple[bytearray, int] | None:
    """Take out the kept small buffer handed out longest ago, and its size, if
    nothing else holds it, or else the next one; ``None`` if both are held (each
    goes to the back, to be looked at again after the others). Each is out of
    the deque while it is looked at, so a thread that takes it is the only one
    that can. (Unrolled: it runs for every small frame.)"""
    try:
        item = kept.popleft()
    except IndexError:
        return None
    if _refs(item) == _UNHELD:
        return item
    kept.append(item)
    try:
        item = kept.popleft()  # (itself again if it is the only one)
    except IndexError:  # (another thread took the rest)
        return None
    if _refs(item) == _UNHELD:
        return item
    kept.append(item)
    return None


def _unheld_refcount() -> int | None:
    """What :func:`_refs` returns for a kept small buffer that nothing else holds
    (measured, so that it holds for any interpreter's way of counting the
    reference an argument takes); ``None``: no reference counts to go by (then
    small frames are never kept)."""
    if sys.implementation.name != "cpython":  # pragma: no cover - not CPython
        return None
    if not getattr(sys, "_is_gil_enabled", lambda: True)():  # pragma: no cover
        return None  # (free-threaded: counts of other threads are merged lazily)
    item = (bytearray(1), 1)
    counts = {_refs(item) for _ in range(64)}  # (specialized after a few calls)
    held = item[0]
    counts_held = {_refs(item) for _ in range(64)}
    del held
    if len(counts) != 1 or counts_held != {next(iter(counts)) + 1}:  # pragma: no cover
        return None
    return next(iter(counts))


#: :func:`_refs` of a kept small buffer that nothing else holds
_UNHELD: Final = _unheld_refcount()


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
        small_kept_bytes: bytes of smaller frames' buffers kept for
            reuse, held elsewhere or not (at most ``max_small_bytes``).
        small_reused: smaller frames given the ``bytearray`` of an earlier one.
    """

    buffers_in_use: int
    bytes_in_use: int
    free_buffers: int
    free_bytes: int
    reused: int
    created: int
    released: int
    small_kept_bytes: int = 0
    small_reused: int = 0


@final
class BufferPool:
    """An allocator (``Options(allocator=BufferPool())``) that receives frames of
    ``min_size`` bytes and more into memory reused from frames nothing holds any
    more; smaller frames go to ``fallback``, or, without one, get a ``bytearray``
    that is reused too from 4 KiB (``SMALL_MIN``) once nothing holds it (see the
    module).

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
        max_small_bytes: bytes of smaller frames' buffers kept for
            reuse at most, held or not (0: none are kept; nor with a ``fallback``).
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
        "_kept",
        "_kept_bytes",
        "_live",
        "_max_small_bytes",
        "_oldest",
        "_released",
        "_returned",
        "_reused",
        "_small_reused",
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
        max_small_bytes: int = DEFAULT_MAX_SMALL_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (
            ("max_free_bytes", max_free_bytes),
            ("min_size", min_size),
            ("max_small_bytes", max_small_bytes),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        for name, value in (
            ("max_free_bytes", max_free_bytes),
            ("max_small_bytes", max_small_bytes),
        ):
            if value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
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
        # slabs nothing holds, per size class, released longest ago first:
        # [(release time, slab), ...]
        self._free: dict[int, list[tuple[float, mmap.mmap]]] = {}
        self._free_bytes = 0
        # no kept slab was released before this (a lower bound; inf: none kept)
        self._oldest = _NEVER
        # each frame handed out: id(weak reference to its handle) -> (that
        # reference, which must live as long as the handle; the frame's slab)
        self._live: dict[int, tuple[weakref.ref[ctypes.Array[ctypes.c_ubyte]], mmap.mmap]] = {}
        # slabs whose handle died, appended by the weak reference's callback
        # (from any thread)
        self._returned: collections.deque[mmap.mmap] = collections.deque()
        self._in_use = 0
        self._in_use_bytes = 0
        self._handle_types: dict[int, type[ctypes.Array[ctypes.c_ubyte]]] = {}
        self._reused = 0
        self._created = 0
        self._released = 0
        #: smaller frames' bytearrays are kept for reuse (a bound, and counts to go by)
        self._max_small_bytes = max_small_bytes if fallback is None and _UNHELD is not None else 0
        # those handed out, oldest first, each with its size as handed out (the
        # first is reused once only this deque holds it); the sum of the sizes
        self._kept: collections.deque[tuple[bytearray, int]] = collections.deque()
        self._kept_bytes = 0
        self._small_reused = 0

    def __call__(self, nbytes: int) -> Buffer:
        """A writable buffer of exactly ``nbytes`` bytes (not zero-filled when reused;
        below ``min_size``, or when no memory can be mapped, what ``fallback``
        returns, or without one a ``bytearray``, reused from ``SMALL_MIN``); a
        pooled one starts at a multiple of 64 bytes (``ALIGNMENT``).

        Raises:
            MemoryError: the memory (or address space) is not available, from
                the pool nor from ``fallback``.
        """
        return self.aligned(nbytes, 0)

    def frame_buffer(self, nbytes: int, offset: int) -> memoryview:
        """The buffer of a received frame of ``nbytes`` bytes at ``offset`` in its
        message (from the start of its frame count), placed at the phase of that
        offset (see :meth:`aligned`), as a flat ``memoryview``.

        Raises:
            MemoryError: as :meth:`aligned` raises it.
        """
        phase = offset % ALIGNMENT
        if nbytes >= self.min_size:
            view = self._slab(nbytes, phase)
            if view is not None:
                return view  # (flat, writable and exact: no checks to make)
            return allocate(self._fallback, nbytes)
        return allocate(partial(self.aligned, phase=phase), nbytes)

    def aligned(self, nbytes: int, phase: int) -> Buffer:
        """As calling the pool, but a pooled buffer starts ``phase`` bytes past a
        multiple of 64 bytes (``ALIGNMENT``) (see the module; ``fallback`` knows nothing
        of it), unless that would make it span one more page than at phase 0 (a
        huge page for slabs of 2 MiB and more) or not fit the slab of its size
        class: then at phase 0, so that a frame's memory never grows for its phase.

        Raises:
            ValueError: ``phase`` is not in ``range(ALIGNMENT)``.
            MemoryError: the memory (or address space) is not available, from
                the pool nor from ``fallback``.
        """
        if not 0 <= phase < ALIGNMENT:
            raise ValueError(f"phase must be in range({ALIGNMENT}), got {phase}")
        if nbytes < self.min_size:
            if nbytes < SMALL_MIN or not self._max_small_bytes:
                return self._fallback(nbytes)
            return self._small(nbytes)
        view = self._slab(nbytes, phase)
        return self._fallback(nbytes) if view is None else view

    def _slab(self, nbytes: int, phase: int) -> memoryview | None:
        """A frame of ``nbytes`` bytes (at least ``min_size``) at ``phase`` in a slab
        (see :meth:`aligned`), as a flat ``memoryview``; ``None`` if no memory can
        be mapped (the caller turns to ``fallback``)."""
        now = self._clock()
        if self._returned:
            self._take_returned(now)
        size = size_class(nbytes)
        if phase:
            page = _HUGE_PAGE if size >= _HUGE_PAGE else _PAGE
            if nbytes + phase > size or -(-nbytes // page) != -(-(nbytes + phase) // page):
                phase = 0
        kept = self._free.get(size)
        if kept:
            slab = kept.pop()[1]
            self._free_bytes -= size
            self._reused += 1
        else:
            try:
                slab = map_anonymous(size)
            except MemoryError:
                # Out of mappings (vm.max_map_count: slabs in use, with holes
                # between them, each take one) or of address space: the C
                # allocator may still have room.
                return None
            if size >= _HUGE_PAGE and _MADV_HUGEPAGE is not None:
                with contextlib.suppress(OSError):  # (THP off, or unsupported here)
                    slab.madvise(_MADV_HUGEPAGE)
            self._created += 1
        free_for = self.free_for
        if self._free_bytes > self.max_free_bytes or (
            free_for is not None and self._oldest <= now - free_for
        ):
            self._trim(now, free_for)
        handle_type = self._handle_types.get(size)
        if handle_type is None:
            handle_type = self._handle_types[size] = ctypes.c_ubyte * size
        handle = handle_type.from_buffer(slab)
        ref = weakref.ref(handle, self._release)
        self._live[id(ref)] = (ref, slab)
        self._in_use += 1
        self._in_use_bytes += size
        return memoryview(handle).cast("B")[phase : phase + nbytes]

    def copy_out(self, source: memoryview, start: int, end: int) -> memoryview:
        """A frame of its own with the bytes ``source[start:end]``, as a flat
        ``memoryview`` (a ``bytearray``'s, reused as calling the pool reuses them;
        from ``min_size``, or with a ``fallback``, a plain copy). For frames taken
        whole from a read-ahead buffer.

        Raises:
            MemoryError: the memory is not available.
        """
        nbytes = end - start
        if nbytes < SMALL_MIN or nbytes >= self.min_size or not self._max_small_bytes:
            return memoryview(bytearray(source[start:end]))
        buffer = self._unheld()
        if buffer is None:
            buffer = bytearray(source[start:end])
        else:
            if len(buffer) > nbytes:
                del buffer[nbytes:]  # (at the end: the block stays where it is)
            buffer[:] = source[start:end]
        self._keep(buffer, nbytes)
        return memoryview(buffer)

    def _small(self, nbytes: int) -> bytearray:
        """A small frame's buffer of exactly ``nbytes`` bytes: a kept one nothing
        else holds (see :func:`_take_unheld`), else a new one; kept in turn."""
        buffer = self._unheld()
        if buffer is None:
            buffer = bytearray(nbytes)
        else:
            length = len(buffer)
            if length > nbytes:
                del buffer[nbytes:]
            elif length < nbytes:
                buffer.extend(bytes(nbytes - length))
        self._keep(buffer, nbytes)
        return buffer

    def _unheld(self) -> bytearray | None:
        """A kept small buffer nothing else holds, no longer kept (see
        :func:`_take_unheld`; its size may not be the one it was handed out at,
        if its holder resized it), or ``None``."""
        item = _take_unheld(self._kept)
        if item is None:
            return None
        self._kept_bytes -= item[1]
        self._small_reused += 1
        return item[0]

    def _keep(self, buffer: bytearray, nbytes: int) -> None:
        """Keep a small buffer just handed out, to reuse it once nothing else holds
        it; stop keeping the ones handed out longest ago while more than
        ``max_small_bytes`` are kept (those held are their holders' from then on)."""
        kept = self._kept
        kept.append((buffer, nbytes))
        self._kept_bytes += nbytes
        while self._kept_bytes > self._max_small_bytes:
            self._kept_bytes -= kept.popleft()[1]

    @property
    def max_small_bytes(self) -> int:
        """Bytes of smaller frames' buffers kept for reuse at most, held or not (0:
        none are kept: so told, a ``fallback`` given, or no reference counts to go
        by)."""
        return self._max_small_bytes

    def _release(self, ref: weakref.ref[ctypes.Array[ctypes.c_ubyte]]) -> None:
        """The callback of a frame's handle's weak reference (nothing holds the
        frame any more; any thread): hand its slab to the allocating thread,
        marked lazily free if it is large (see the module)."""
        slab = self._live.pop(id(ref))[1]
        if len(slab) >= _HUGE_PAGE and _MADV_FREE is not None:
            with contextlib.suppress(OSError, ValueError):  # (unsupported; closed)
                slab.madvise(_MADV_FREE)
        self._returned.append(slab)

    def _take_returned(self, now: float) -> None:
        """Move the slabs whose frames were dropped to the free lists."""
        returned = self._returned
        free = self._free
        while returned:
            slab = returned.popleft()
            size = len(slab)
            self._in_use -= 1
            self._in_use_bytes -= size
            kept = free.get(size)
            if kept is None:
                kept = free[size] = []
            kept.append((now, slab))
            self._free_bytes += size
            if now < self._oldest:
                self._oldest = now

    def _trim(self, now: float, older_than: float | None) -> int:
        """Unmap kept slabs released before ``now - older_than`` (``None``: none),
        then the ones released longest ago while more than ``max_free_bytes``
        are kept; return the bytes unmapped."""
        free = self._free
        released = 0
        if older_than is not None:
            cutoff = now - older_than
            for kept in free.values():
                old = 0
                while old < len(kept) and kept[old][0] <= cutoff:
                    released += self._unmap(kept[old][1])
                    old += 1
                del kept[:old]
        while self._free_bytes > self.max_free_bytes:
            kept = min((k for k in free.values() if k), key=lambda k: k[0][0])
            released += self._unmap(kept.pop(0)[1])
        for size in [size for size, kept in free.items() if not kept]:
            del free[size]
        self._oldest = min((kept[0][0] for kept in free.values()), default=_NEVER)
        return released

    def _unmap(self, slab: mmap.mmap) -> int:
        """Unmap one kept slab; return its size."""
        size = len(slab)
        self._free_bytes -= size
        self._released += 1
        try:
            slab.close()
        except BufferError:  # pragma: no cover - a dying handle's export: unmapped with it
            pass
        return size

    def trim(self, older_than: float | None = 0.0) -> int:
        """Unmap the kept slabs released at least ``older_than`` seconds ago
        (``0``: every kept slab; ``None``: those older than ``free_for``), and stop
        keeping the smaller frames' buffers (whatever their age).

        Returns:
            The bytes unmapped.
        """
        self._kept.clear()
        self._kept_bytes = 0
        now = self._clock()
        self._take_returned(now)
        return self._trim(now, older_than if older_than is not None else self.free_for)

    @property
    def free_bytes(self) -> int:
        """Bytes of slabs kept for reuse (as of the last allocation or trim)."""
        return self._free_bytes

    def statistics(self) -> PoolStatistics:
        """What the pool holds now and has done so far (slabs released since the
        last call count as kept, within the bounds)."""
        now = self._clock()
        self._take_returned(now)
        self._trim(now, self.free_for)
        return PoolStatistics(
            buffers_in_use=self._in_use,
            bytes_in_use=self._in_use_bytes,
            free_buffers=sum(map(len, self._free.values())),
            free_bytes=self._free_bytes,
            reused=self._reused,
            created=self._created,
            released=self._released,
            small_kept_bytes=self._kept_bytes,
            small_reused=self._small_reused,
        )
