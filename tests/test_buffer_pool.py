"""Comms receiving into a BufferPool (their event loop's by default), over every
transport, on every backend: frames arrive intact, memory is reused, and frames the
application holds never change."""

from __future__ import annotations

import gc

import anyio
import pytest

from anyio_comm import BufferPool, current_buffer_pool
from anyio_comm._sansio.pool import SMALL_MIN

from .helpers import TRANSPORTS, connected_pair

MiB = 1024 * 1024


def frame(seed: int, nbytes: int) -> bytes:
    return (bytes([seed % 251, 255 - seed % 251]) * (nbytes // 2 + 1))[:nbytes]


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_frames_received_into_a_pool(kind: str) -> None:
    pool = BufferPool()
    sizes = [MiB, 3 * MiB + 5, MiB]
    held: list[tuple[memoryview, bytes]] = []
    async with connected_pair(kind, allocator=pool) as (client, server):

        async def send() -> None:
            for seed in range(24):
                payload = frame(seed, sizes[seed % len(sizes)])
                await client.send({"seed": seed, "data": memoryview(payload)})

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            for seed in range(24):
                message = await server.receive()
                assert message["seed"] == seed
                data = message["data"]
                assert data == frame(seed, sizes[seed % len(sizes)])
                if seed % 5 == 0:
                    held.append((data[7:], frame(seed, sizes[seed % len(sizes)])[7:]))
                del message, data
        gc.collect()
        for view, expected in held:
            assert view == expected  # never reused while held
        stats = pool.statistics()
        assert stats.reused >= 12
        assert stats.buffers_in_use == len(held)
        # replies to the client go through the same pool and the same rules
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.send_frames, [frame(99, 2 * MiB)])
            (reply,) = await client.receive_frames()
        assert reply == frame(99, 2 * MiB)


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("nbytes", [4096, 8000, 40_000])
@pytest.mark.parametrize("layer", ["messages", "frames"])
async def test_small_frames_nothing_holds_are_reused_and_held_ones_never_change(
    kind: str, nbytes: int, layer: str
) -> None:
    """Frames below the pool's min_size (copied out of the read-ahead buffer, or
    received into their own buffer when they arrive in pieces; a message's
    out-of-band value, or the one frame of a message of the frames layer) get
    the memory of earlier frames once nothing holds those; a held frame keeps its
    bytes."""
    pool = BufferPool()
    held: list[tuple[memoryview, bytes]] = []
    # (every value out-of-band: the default threshold keeps values under 16 KiB in the body)
    async with connected_pair(kind, allocator=pool, oob_threshold=SMALL_MIN) as (client, server):

        async def send() -> None:
            for seed in range(200):
                payload = frame(seed, nbytes + seed % 7)
                if layer == "frames":
                    await client.send_frames([payload])
                else:
                    await client.send({"seed": seed, "data": memoryview(payload)})

        async with anyio.create_task_group() as tg:
            tg.start_soon(send)
            for seed in range(200):
                if layer == "frames":
                    (data,) = await server.receive_frames()
                    message = {"seed": seed, "data": data}
                else:
                    message = await server.receive()
                assert message["seed"] == seed
                data = message["data"]
                expected = frame(seed, nbytes + seed % 7)
                assert data == expected
                if seed % 9 == 0:
                    held.append((data[3:], expected[3:]))
                elif seed % 9 == 1:
                    held.append((memoryview(data.obj)[:5], expected[:5]))
                del message, data
        for view, expected in held:
            assert view == expected  # never reused while held
        stats = pool.statistics()
        assert stats.small_reused >= 100
        assert stats.small_kept_bytes <= pool.max_small_bytes
        assert stats.created == 0  # nothing as large as min_size


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_comms_without_an_allocator_share_the_event_loops_pool(kind: str) -> None:
    pool = current_buffer_pool()
    assert current_buffer_pool() is pool
    before = pool.statistics()
    async with connected_pair(kind) as (client, server):
        for seed in range(6):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.send_frames, [frame(seed, 2 * MiB), b"small"])
                big, small = await server.receive_frames()
            assert big == frame(seed, 2 * MiB) and small == b"small"
            assert type(small.obj) is bytearray  # small frames stay plain bytearrays
            del big, small
    after = pool.statistics()
    assert after.reused - before.reused >= 4
    assert after.created - before.created <= 2


async def test_an_allocator_of_ones_own_is_used_instead() -> None:
    sizes: list[int] = []

    def allocator(n: int) -> bytearray:
        sizes.append(n)
        return bytearray(n)

    before = current_buffer_pool().statistics()
    async with connected_pair("tcp", allocator=allocator) as (client, server):
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames, [frame(1, 2 * MiB)])
            (big,) = await server.receive_frames()
        assert big == frame(1, 2 * MiB) and type(big.obj) is bytearray
    assert 2 * MiB in sizes
    after = current_buffer_pool().statistics()
    assert (after.created, after.reused) == (before.created, before.reused)
