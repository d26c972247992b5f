"""BufferPool: exact-size writable frames, memory reused only once nothing holds it,
bounded by max_free_bytes and free_for (no event loop)."""

from __future__ import annotations

import ctypes
import gc
import mmap
import pickle
import random
import sys
import threading
from functools import partial
from typing import Any

import pytest

from anyio_comm import BufferPool, PoolStatistics
from anyio_comm._sansio.buffers import allocate
from anyio_comm._sansio.pool import ALIGNMENT, SMALL_MIN, size_class

MiB = 1024 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def address(view: Any) -> int:
    """Where a writable buffer's memory starts."""
    return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(view)))


def fill(view: Any, seed: int) -> bytes:
    view = memoryview(view)
    pattern = bytes([seed % 251]) * 7 + seed.to_bytes(8, "little")
    data = (pattern * (view.nbytes // len(pattern) + 1))[: view.nbytes]
    view[:] = data
    return data


@pytest.mark.parametrize("nbytes", [1, 4095, MiB, MiB + 1, 3 * MiB + 17, 40 * MiB])
def test_size_class(nbytes: int) -> None:
    size = size_class(nbytes)
    assert nbytes <= size <= max(nbytes * 9 // 8 + 4096, 4096)
    assert size % 4096 == 0
    assert size_class(size) == size


@pytest.mark.parametrize("nbytes", [0, 100, 65536, 65537, MiB - 1, MiB, 5 * MiB + 3])
def test_frames_are_exact_writable_flat_buffers(nbytes: int) -> None:
    pool = BufferPool()
    view = allocate(pool, nbytes)  # the decoder's own check
    assert view.nbytes == nbytes and not view.readonly and view.format == "B"
    view[:] = b"\xab" * nbytes
    assert bytes(view) == b"\xab" * nbytes
    # by default, frames larger than the default read-ahead buffer are pooled
    pooled = nbytes > 65536
    assert (type(view.obj) is bytearray) is not pooled
    assert pool.statistics().buffers_in_use == int(pooled)
    assert pool.statistics().created == int(pooled)


def test_smaller_frames_go_to_the_fallback() -> None:
    sizes: list[int] = []

    def fallback(n: int) -> bytearray:
        sizes.append(n)
        return bytearray(n)

    pool = BufferPool(min_size=1000, fallback=fallback)
    pool(999)
    pool(1000)
    assert sizes == [999]
    assert pool.statistics().created == 1


def test_memory_of_a_dropped_frame_is_reused() -> None:
    pool = BufferPool()
    view = pool(3 * MiB)
    first = address(view)
    del view
    again = pool(3 * MiB - 100)  # same size class
    assert address(again) == first
    stats = pool.statistics()
    assert (stats.created, stats.reused, stats.buffers_in_use) == (1, 1, 1)
    other = pool(8 * MiB)  # another class: a slab of its own
    assert address(other) != first
    assert pool.statistics().created == 2


def _hold_slice(view: memoryview) -> Any:
    return view[10:20]


def _hold_view_of_slice(view: memoryview) -> Any:
    return memoryview(view[5:])


def _hold_cast(view: memoryview) -> Any:
    return view.cast("I")


def _hold_pickle_buffer(view: memoryview) -> Any:
    return pickle.PickleBuffer(view)


def _hold_underlying_object(view: memoryview) -> Any:
    return view.obj


def _hold_numpy(view: memoryview) -> Any:
    np = pytest.importorskip("numpy")
    return np.frombuffer(view, dtype="u1")[3:]


def _hold_numpy_view_of_view(view: memoryview) -> Any:
    np = pytest.importorskip("numpy")
    return np.frombuffer(view, dtype="u1").reshape(-1, 4)[1:, 2:].view("u2")[::3]


#: every way of holding a frame that a pool must see
HOLDS = [
    _hold_slice,
    _hold_view_of_slice,
    _hold_cast,
    _hold_pickle_buffer,
    _hold_underlying_object,
    _hold_numpy,
    _hold_numpy_view_of_view,
]


@pytest.mark.parametrize("hold", HOLDS)
def test_a_frame_anything_holds_is_never_reused(hold: Any) -> None:
    pool = BufferPool()
    view = pool(2 * MiB)
    fill(view, 1)
    held = hold(view)
    before = memoryview(held).tobytes()
    first = address(view)
    del view
    gc.collect()
    for seed in range(2, 6):
        other = pool(2 * MiB)
        assert address(other) != first
        fill(other, seed)  # writes every byte of the frame it got
        del other
    assert memoryview(held).tobytes() == before
    assert pool.statistics().buffers_in_use == 1
    del held
    gc.collect()
    assert pool.statistics().buffers_in_use == 0
    assert address(pool(2 * MiB)) == first  # released last: reused first


def test_thousands_of_frames_some_held_keep_their_bytes() -> None:
    """Frames kept at random across thousands of allocations never change."""
    rng = random.Random(7)
    pool = BufferPool(max_free_bytes=64 * MiB)
    kept: dict[int, tuple[Any, bytes]] = {}
    sizes = [MiB, MiB + 4096, 2 * MiB, 3 * MiB]
    for seed in range(3000):
        view = pool(rng.choice(sizes))
        data = fill(view, seed)
        if rng.random() < 0.05:
            # held through a derived object, the frame's own view dropped
            kept[seed] = (view[1:], data[1:]) if rng.random() < 0.5 else (view, data)
        del view
        if kept and rng.random() < 0.03:
            del kept[rng.choice(list(kept))]
        if seed % 500 == 0:
            for held, expected in kept.values():
                assert held == expected
    for held, expected in kept.values():
        assert held == expected
    stats = pool.statistics()
    assert stats.reused > 2500
    assert stats.buffers_in_use == len(kept)
    assert stats.free_bytes <= 64 * MiB


def test_free_memory_is_bounded_by_max_free_bytes() -> None:
    pool = BufferPool(max_free_bytes=5 * MiB, free_for=None)
    frames = [pool(2 * MiB) for _ in range(6)]
    del frames
    stats = pool.statistics()
    assert stats == PoolStatistics(
        buffers_in_use=0,
        bytes_in_use=0,
        free_buffers=2,
        free_bytes=4 * MiB,
        reused=0,
        created=6,
        released=4,
        small_kept_bytes=0,
        small_reused=0,
    )


def test_free_memory_is_released_after_free_for() -> None:
    clock = Clock()
    pool = BufferPool(free_for=10.0, clock=clock)
    view = pool(2 * MiB)
    del view
    pool.statistics()  # noticed as free at time 0
    clock.now = 9.0
    assert pool.trim(None) == 0
    assert pool.free_bytes == 2 * MiB
    clock.now = 10.0
    held = pool(MiB)  # any allocation trims what waited free_for
    assert pool.statistics().released == 1
    assert pool.statistics().free_bytes == 0
    assert pool.statistics().bytes_in_use == len(memoryview(held).obj) == MiB


def test_slabs_of_every_class_are_kept_and_the_oldest_go_first() -> None:
    clock = Clock()
    pool = BufferPool(max_free_bytes=6 * MiB, free_for=10.0, clock=clock)
    sizes = [MiB, 2 * MiB, 3 * MiB, MiB, 2 * MiB]
    frames = [pool(n) for n in sizes]
    addresses = [address(f) for f in frames]
    for when, index in enumerate([0, 1, 2, 3, 4]):  # released one a second
        clock.now = float(when)
        frames[index] = None  # type: ignore[call-overload]
        pool.statistics()
    # 9 MiB released, 6 kept: the 1 MiB (t=0) and 2 MiB (t=1) ones released first went
    stats = pool.statistics()
    assert (stats.free_bytes, stats.free_buffers, stats.released) == (6 * MiB, 3, 2)
    # each class serves the slab released last first
    again = [pool(2 * MiB), pool(MiB)]
    assert [address(f) for f in again] == [addresses[4], addresses[3]]
    clock.now = 12.5  # the 3 MiB one, released at t=2, is older than free_for
    assert pool.trim(None) == 3 * MiB
    assert pool.statistics().free_buffers == 0
    assert pool.statistics().buffers_in_use == 2


def linux_lazy_free_bytes() -> int:
    """The LazyFree line of /proc/self/smaps_rollup (memory marked MADV_FREE)."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("LazyFree:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no LazyFree in smaps_rollup")


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_FREE"),
    reason="MADV_FREE and smaps_rollup are Linux's",
)
def test_large_kept_slabs_are_lazily_free() -> None:
    """A released slab of 2 MiB or more is marked MADV_FREE (the kernel may take its
    pages back), and its next frame still gets the bytes written into it, whatever
    the kernel did; smaller slabs are kept as they are (marking costs more)."""
    pool = BufferPool()
    small = pool(MiB)
    large = pool(8 * MiB)
    fill(small, 1)
    fill(large, 2)
    before = linux_lazy_free_bytes()
    del small
    pool.statistics()
    assert linux_lazy_free_bytes() == before
    del large
    pool.statistics()
    assert linux_lazy_free_bytes() >= before + 7 * MiB
    again = pool(8 * MiB)
    assert pool.statistics().reused == 1
    data = fill(again, 3)
    assert bytes(again) == data


def test_trim() -> None:
    clock = Clock()
    pool = BufferPool(free_for=None, clock=clock)
    frames = [pool(MiB), pool(2 * MiB)]
    del frames
    pool.statistics()
    clock.now = 100.0
    assert pool.trim(None) == 0  # free_for None: kept
    assert pool.trim(200.0) == 0
    assert pool.trim() == 3 * MiB
    assert pool.statistics().free_buffers == 0


def test_frames_may_be_dropped_in_another_thread() -> None:
    pool = BufferPool()
    view = pool(2 * MiB)
    first = address(view)
    box = [view]
    del view
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    assert address(pool(2 * MiB)) == first


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"max_free_bytes": -1}, ValueError),
        ({"max_free_bytes": 1.5}, TypeError),
        ({"min_size": 0}, ValueError),
        ({"min_size": True}, TypeError),
        ({"free_for": 0}, ValueError),
        ({"free_for": "10"}, TypeError),
        ({"fallback": 3}, TypeError),
        ({"max_small_bytes": -1}, ValueError),
        ({"max_small_bytes": 4.0}, TypeError),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        BufferPool(**kwargs)


def test_address_space_exhausted_is_memory_error() -> None:
    pool = BufferPool()
    with pytest.raises(MemoryError):
        pool(1 << 62)


def test_frames_go_to_the_fallback_when_no_memory_can_be_mapped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of mappings (each slab in use may take one of vm.max_map_count's) the
    frame comes from the fallback, which may still have room."""
    import anyio_comm._sansio.pool as pool_module

    def no_mapping(nbytes: int) -> mmap.mmap:
        raise MemoryError(f"cannot map {nbytes} bytes")

    pool = BufferPool()
    kept = pool(MiB)
    monkeypatch.setattr(pool_module, "map_anonymous", no_mapping)
    frame = pool(2 * MiB)
    assert type(frame) is bytearray and len(frame) == 2 * MiB
    del kept
    assert type(memoryview(pool(MiB)).obj) is not bytearray  # a kept slab: no mapping
    assert pool.statistics().created == 1


@pytest.mark.parametrize("nbytes", [4096, 65536, 100_000, 3 * MiB + 17])
@pytest.mark.parametrize("offset", [0, 12, 12 + 64 * 3 + 5])
def test_a_frame_buffer_is_the_aligned_buffer_as_a_flat_view(nbytes: int, offset: int) -> None:
    """frame_buffer(n, offset): a flat, writable memoryview of n bytes, placed as
    aligned(n, offset % ALIGNMENT) places it, from a kept slab the second time."""
    pool = BufferPool()
    expected = memoryview(pool.aligned(nbytes, offset % ALIGNMENT))
    expected_address = address(expected)
    del expected
    for _ in range(2):
        view = pool.frame_buffer(nbytes, offset)
        assert type(view) is memoryview and view.format == "B" and view.ndim == 1
        assert view.nbytes == nbytes and not view.readonly
        assert address(view) == expected_address
        data = fill(view, offset)
        assert bytes(view) == data
        del view


def test_a_frame_buffer_from_the_fallback_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no memory to map, frame_buffer takes the fallback's buffer, checked as
    any allocator's (a fallback that breaks the contract is a TypeError)."""
    import anyio_comm._sansio.pool as pool_module

    def no_mapping(nbytes: int) -> mmap.mmap:
        raise MemoryError(f"cannot map {nbytes} bytes")

    monkeypatch.setattr(pool_module, "map_anonymous", no_mapping)
    view = BufferPool().frame_buffer(MiB, 40)
    assert type(view.obj) is bytearray and view.nbytes == MiB
    with pytest.raises(TypeError, match="exactly 1048576 bytes"):
        BufferPool(fallback=lambda n: bytearray(n + 1)).frame_buffer(MiB, 40)
    with pytest.raises(TypeError, match="exactly 10000 bytes"):  # below min_size too
        BufferPool(fallback=lambda n: bytearray(n + 1)).frame_buffer(10_000, 40)


def test_the_decoders_fast_paths_stay_on_with_a_pool() -> None:
    """Frames that fit in the read-ahead buffer are copied out as bytearrays by the
    decoder itself when the pool would give bytearrays for them anyway."""
    from anyio_comm._sansio.decoder import FrameDecoder

    assert FrameDecoder(allocator=BufferPool())._fast_alloc
    assert not FrameDecoder(allocator=BufferPool(fallback=bytearray))._fast_alloc
    assert not FrameDecoder(allocator=BufferPool(min_size=4096))._fast_alloc


@pytest.mark.parametrize("nbytes", [65537, MiB - 100, 3 * MiB + 17, 10_000_000])
@pytest.mark.parametrize("phase", [0, 1, 33, ALIGNMENT - 1])
def test_aligned_frames_start_at_their_phase(nbytes: int, phase: int) -> None:
    pool = BufferPool()
    for _ in range(2):  # a fresh slab, then the same slab reused
        view = allocate(partial(pool.aligned, phase=phase), nbytes)
        assert view.nbytes == nbytes and not view.readonly
        assert address(view) % ALIGNMENT == phase
        assert len(view.obj) == size_class(nbytes)  # the slab of its own class
        data = fill(view, phase)
        assert bytes(view) == data
        del view
    assert pool.statistics().reused == 1
    # calling the pool places a frame at phase 0 (a slab is page-aligned)
    assert address(pool(nbytes)) % mmap.PAGESIZE == 0


def test_a_phase_outside_the_alignment_is_rejected() -> None:
    pool = BufferPool()
    for phase in (-1, ALIGNMENT):
        with pytest.raises(ValueError, match="phase must be in range"):
            pool.aligned(MiB, phase)
    # frames below min_size come from the fallback, which knows nothing of phases
    assert type(pool.aligned(100, 7)) is bytearray


@pytest.mark.parametrize(
    ("nbytes", "page"),
    [
        (128 * 1024, 4096),
        (MiB, 4096),
        (2 * MiB, 2 * MiB),
        (16 * MiB, 2 * MiB),
        (3 * MiB, 2 * MiB),  # in its second huge page, but its class is exactly 3 MiB
        (4 * MiB - 7, 2 * MiB),
    ],
)
def test_a_phase_that_would_take_one_more_page_is_not_used(nbytes: int, page: int) -> None:
    """A frame of a whole number of pages (huge pages from 2 MiB) at a phase would
    span one more page, which the receive would fault in, and one of a whole size
    class would leave its slab: it stays at phase 0."""
    pool = BufferPool()
    view = memoryview(pool.aligned(nbytes, 33))
    assert address(view) % mmap.PAGESIZE == 0  # at the start of its slab
    assert len(view.obj) == size_class(nbytes)
    # at phase 33 it would have ended past the last page a frame of its size needs,
    # or past its slab
    assert -(-nbytes // page) < -(-(nbytes + 33) // page) or nbytes + 33 > size_class(nbytes)


# -- frames below min_size: bytearrays reused once nothing holds them ----------------


def test_a_small_frame_nothing_holds_is_reused() -> None:
    pool = BufferPool()
    assert pool.max_small_bytes == 4 * MiB  # the default, as documented
    view = allocate(pool, 8000)
    assert type(view.obj) is bytearray
    fill(view, 1)
    first = address(view)
    del view
    again = allocate(pool, 8000)
    assert address(again) == first and again.nbytes == 8000
    assert pool.statistics().small_reused == 1
    del again
    # another size: the same bytearray, resized to exactly that size
    for nbytes in (5000, 8100, SMALL_MIN, 65536):
        view = allocate(pool, nbytes)
        assert view.nbytes == nbytes and not view.readonly
        fill(view, nbytes)
        del view
    stats = pool.statistics()
    assert stats.small_reused == 5
    assert stats.created == 0  # (no slab: these are below min_size)


def test_small_frames_copied_out_are_reused_and_exact() -> None:
    pool = BufferPool()
    source = memoryview(bytes(range(256)) * 64)
    view = pool.copy_out(source, 100, 6100)
    assert view.tobytes() == source[100:6100].tobytes()
    del view
    view = pool.copy_out(source, 3, 7003)  # reused, and grown to size
    assert view.tobytes() == source[3:7003].tobytes()
    del view
    view = pool.copy_out(source, 10, SMALL_MIN + 10)  # reused, shrunk to size
    assert view.tobytes() == source[10 : SMALL_MIN + 10].tobytes()
    assert view.nbytes == SMALL_MIN and type(view.obj) is bytearray
    del view
    assert pool.statistics().small_reused == 2
    reused = pool.copy_out(source, 0, 5000)
    assert reused.tobytes() == source[:5000].tobytes()
    assert pool.statistics().small_reused == 3


def test_a_small_frame_reused_smaller_keeps_its_memory() -> None:
    pool = BufferPool()
    source = memoryview(bytes(range(256)) * 64)
    view = pool.copy_out(source, 0, 8000)
    first = address(view)
    del view
    for nbytes in (7000, 8000, 6000, 8000):
        view = pool.copy_out(source, 1, 1 + nbytes)
        assert address(view) == first  # shrunk at its end, grown back in place
        assert view.tobytes() == source[1 : 1 + nbytes].tobytes()
        del view


@pytest.mark.parametrize("hold", HOLDS)
@pytest.mark.parametrize("copied", [False, True], ids=["allocated", "copied"])
def test_a_small_frame_anything_holds_is_never_reused(hold: Any, copied: bool) -> None:
    pool = BufferPool()
    source = memoryview(bytes(range(256)) * 40)
    view = pool.copy_out(source, 0, 8000) if copied else allocate(pool, 8000)
    fill(view, 1)
    held = hold(view)
    before = memoryview(held).tobytes()
    del view
    gc.collect()
    for seed in range(2, 12):
        other = pool.copy_out(source, 1, 8001) if copied else allocate(pool, 8000)
        other[:] = fill(bytearray(8000), seed)  # writes every byte of the frame it got
        del other
    assert memoryview(held).tobytes() == before
    assert pool.statistics().small_reused == 9  # the others were reused


def test_small_frames_below_small_min_are_not_kept() -> None:
    pool = BufferPool()
    for _ in range(4):
        view = allocate(pool, SMALL_MIN - 1)
        del view
    stats = pool.statistics()
    assert (stats.small_reused, stats.small_kept_bytes) == (0, 0)


def test_small_frames_kept_are_bounded_by_max_small_bytes() -> None:
    pool = BufferPool(max_small_bytes=10 * 8000)
    held = [allocate(pool, 8000) for _ in range(25)]
    assert pool.statistics().small_kept_bytes <= 10 * 8000
    for index, view in enumerate(held):
        fill(view, index)
    # the kept ones are all held: none is reused, whatever is allocated meanwhile
    for _ in range(30):
        allocate(pool, 8000)[:] = bytes(8000)
    for index, view in enumerate(held):
        assert view.tobytes() == fill(bytearray(8000), index)
    stats = pool.statistics()
    assert stats.small_kept_bytes <= 10 * 8000


@pytest.mark.parametrize("kwargs", [{"max_small_bytes": 0}, {"fallback": bytearray}])
def test_small_frames_are_not_kept_when_told_so(kwargs: dict[str, Any]) -> None:
    pool = BufferPool(**kwargs)
    source = memoryview(bytes(9000))
    for _ in range(5):
        view = allocate(pool, 8000)
        copied = pool.copy_out(source, 0, 8000)
        del view, copied
    stats = pool.statistics()
    assert (stats.small_reused, stats.small_kept_bytes) == (0, 0)


def test_a_held_small_frame_does_not_stop_the_others_from_being_reused() -> None:
    pool = BufferPool()
    held = allocate(pool, 8000)  # the first handed out, held throughout
    expected = fill(held, 1)
    for seed in range(2, 22):
        view = allocate(pool, 8000)
        fill(view, seed)
        del view
    assert held.tobytes() == expected
    stats = pool.statistics()
    assert stats.small_reused >= 18
    assert stats.small_kept_bytes <= 2 * 8000


def test_a_held_small_frame_resized_by_its_holder_keeps_the_bound() -> None:
    pool = BufferPool(max_small_bytes=100_000)
    view = allocate(pool, 8000)
    underlying = view.obj
    del view
    assert isinstance(underlying, bytearray)
    underlying.extend(bytes(1_000_000))  # its holder's, to do as it likes
    del underlying  # then dropped: reused at the size it is asked for
    held = [allocate(pool, 8000) for _ in range(100)]
    assert all(view.nbytes == 8000 for view in held)
    stats = pool.statistics()
    assert stats.small_reused == 1
    assert 0 <= stats.small_kept_bytes <= 100_000


def test_trim_stops_keeping_small_frames() -> None:
    pool = BufferPool()
    for _ in range(3):
        allocate(pool, 8000)
    assert pool.statistics().small_kept_bytes == 8000
    pool.trim()
    assert pool.statistics().small_kept_bytes == 0
    allocate(pool, 8000)
    assert pool.statistics().small_reused == 2  # (before the trim)


def test_small_frames_are_plain_without_reference_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    import anyio_comm._sansio.pool as pool_module

    monkeypatch.setattr(pool_module, "_UNHELD", None)
    pool = BufferPool()
    assert pool.max_small_bytes == 0
    for _ in range(4):
        view = allocate(pool, 8000)
        del view
    assert pool.statistics().small_reused == 0


def test_small_frames_taken_by_two_threads_at_once_are_never_shared() -> None:
    """Each kept buffer is out of the pool while a thread looks at it: threads
    switching as often as they can never get a frame the other holds."""
    pool = BufferPool()
    errors: list[str] = []

    def churn(seed: int) -> None:
        held: list[tuple[memoryview, bytes]] = []
        for index in range(1500):
            view = allocate(pool, 8000)
            data = fill(view, seed * 10_000 + index)
            held.append((view, data))
            if len(held) > 3:
                view, data = held.pop(0)
                if view.tobytes() != data:
                    errors.append(f"thread {seed}: frame {index - 3} changed")
                del view

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=churn, args=(seed,)) for seed in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert pool.statistics().small_reused > 1000


def test_small_frames_may_be_dropped_in_another_thread() -> None:
    pool = BufferPool()
    frames = [allocate(pool, 8000) for _ in range(8)]
    thread = threading.Thread(target=frames.clear)
    thread.start()
    thread.join()
    for _ in range(8):
        allocate(pool, 8000)
    assert pool.statistics().small_reused == 8
