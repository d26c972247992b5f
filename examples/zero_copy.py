"""Out-of-band frames, zero-copy receives and a custom allocator.

Bytes-like values of at least ``oob_threshold`` bytes travel as separate frames, sent
straight from your buffer and received into a buffer of their own, which you get as a
``memoryview``. ``allocator=`` chooses those buffers. ``send_frames`` /
``receive_frames`` are the raw layer under messages: the server below relays frames
without decoding them, so it echoes messages and frames alike.
"""

from __future__ import annotations

import anyio

import anyio_comm


async def relay(comm: anyio_comm.Comm) -> None:
    """Echo each message's frames back unchanged, until the client closes."""
    try:
        while True:
            await comm.send_frames(await comm.receive_frames())
    except anyio.EndOfStream:
        pass


class CountingAllocator:
    """Allocates receive buffers (``bytearray``s here) and counts them."""

    def __init__(self) -> None:
        self.calls = 0
        self.nbytes = 0

    def __call__(self, nbytes: int) -> bytearray:
        self.calls += 1
        self.nbytes += nbytes
        return bytearray(nbytes)  # e.g. numpy.empty(nbytes, "u1"), or a slot from a pool


async def exchange(comm: anyio_comm.Comm, allocator: CountingAllocator) -> None:
    """Send a message and a list of frames through the relay, report what came back."""
    block = bytearray(50_000_000)  # sent straight from this buffer: don't modify it meanwhile
    await comm.send({"small": b"s" * 100, "large": memoryview(block)})
    reply = await comm.receive()
    small, large = reply["small"], reply["large"]
    print(f"100-byte value: {type(small).__name__}, 50 MB value: {type(large).__name__}")
    print(f"  over its own {type(large.obj).__name__} of {large.nbytes:,} bytes")
    head = bytes(large[:1000])  # copy what you need, drop the views: the 50 MB are freed
    del reply, large
    print(f"message: {allocator.calls} buffers allocated, {allocator.nbytes:,} bytes")

    await comm.send_frames([b"header", memoryview(block)[:1_000_000], head])
    frames = await comm.receive_frames()
    print(f"frames: {[frame.nbytes for frame in frames]} bytes, first: {bytes(frames[0])!r}")
    print(f"total: {allocator.calls} buffers allocated, {allocator.nbytes:,} bytes")


async def main() -> None:
    allocator = CountingAllocator()
    async with anyio_comm.listen("tcp://127.0.0.1:0", relay) as listener:
        comm = await anyio_comm.connect(
            listener.address, timeout=10, allocator=allocator, oob_threshold=1024
        )
        async with comm:
            with anyio.fail_after(10):
                await exchange(comm, allocator)


if __name__ == "__main__":
    anyio.run(main)
