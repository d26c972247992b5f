"""Comms receiving into a BufferPool, over every transport, on every backend:
frames arrive intact, memory is reused, and frames the application holds never change."""

from __future__ import annotations

import gc

import anyio
import pytest

from anyio_comm import BufferPool

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
