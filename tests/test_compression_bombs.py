"""Compressed frames from a hostile peer, on every backend, over TCP and TLS: a
large frame is decompressed in a worker thread, never on the event loop; it is
charged to the receive budget at its decompressed size and waits its turn; a
peer that reset the connection costs no more decompression; a message refused
after it arrived is not kept alive by the error raised for it."""

from __future__ import annotations

import socket
import struct
import threading
import weakref
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio import BrokenResourceError

import anyio_comm
from anyio_comm import Comm, Limits, ReceiveBudget, RemoteProtocolError
from anyio_comm._receivers import OFFLOAD_MIN
from anyio_comm._sansio import inflate as inflate_module
from anyio_comm._sansio.wire import encode_preamble

from .helpers import TLS_VERSIONS, connected_pair
from .test_protocol_v2 import client_options, compressible, port_of, server_options

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

cramjam = pytest.importorskip("cramjam")

RAW_KINDS = ["tcp", "tls1.2", "tls1.3"]
ZSTD = 2


def zstd_message(size: int, frames: int = 1) -> bytes:
    """A message of ``frames`` frames of ``size`` zeros each, compressed with
    Zstandard (its body is not valid msgpack: the receiver refuses it after
    decompressing it)."""
    compressed = bytes(cramjam.zstd.compress(bytes(size), level=1))
    entries = struct.pack(f"!I{frames}Q", frames, *[(ZSTD << 56) | size] * frames)
    return entries + (struct.pack("!Q", len(compressed)) + compressed) * frames


@pytest.fixture
def decompressions(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every decompression the receivers run: (frame length, thread id)."""
    seen: list[tuple[int, int]] = []
    real = inflate_module.decompress_into

    def spy(codec: int, data: Any, out: memoryview) -> None:
        seen.append((out.nbytes, threading.get_ident()))
        real(codec, data, out)

    monkeypatch.setattr(inflate_module, "decompress_into", spy)
    return seen


@asynccontextmanager
async def raw_peer(kind: str, port: int) -> AsyncIterator[anyio.abc.ByteStream]:
    """A TCP (or TLS) byte stream to the listener on ``port``, announcing zstd."""
    stream: anyio.abc.ByteStream = await anyio.connect_tcp("127.0.0.1", port)
    if kind in TLS_VERSIONS:
        stream = await anyio.streams.tls.TLSStream.wrap(
            stream, ssl_context=client_options(kind)["ssl_context"], hostname="localhost"
        )
    try:
        await stream.send(encode_preamble(Limits(), compression=("zstd",)))
        yield stream
    finally:
        await anyio.aclose_forcefully(stream)  # (no close_notify: the server may have gone)


async def reset(stream: anyio.abc.ByteStream) -> None:
    """Close ``stream`` so that the kernel sends a reset."""
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    await anyio.aclose_forcefully(stream)


@pytest.mark.parametrize("kind", ["tcp", "unix", "inproc", "memory", "tls1.3"])
async def test_large_frames_are_decompressed_off_the_event_loop(
    kind: str, decompressions: list[tuple[int, int]]
) -> None:
    """A compressed frame of OFFLOAD_MIN bytes or more is decompressed in a worker
    thread; a smaller one where it is decoded; both arrive intact."""
    large, small = compressible(OFFLOAD_MIN + 12345), compressible(200_000)
    async with connected_pair(kind, compression="zstd") as (client, server):
        with anyio.fail_after(10):
            for _ in range(2):
                await client.send_frames([b"\x90", large, small])
                assert [bytes(f) for f in await server.receive_frames()] == [b"\x90", large, small]
    loop_thread = threading.get_ident()
    assert sorted(size for size, _ in decompressions) == [len(small)] * 2 + [len(large)] * 2
    for size, thread in decompressions:
        assert (thread != loop_thread) == (size == len(large))


@pytest.mark.parametrize("kind", ["tcp", "tls1.3"])
async def test_a_cancelled_receive_keeps_the_frame_being_decompressed(
    kind: str, decompressions: list[tuple[int, int]]
) -> None:
    """A receive cancelled while its frame is decompressed in a thread waits for
    the thread; the next receive returns the message."""
    data = compressible(4 * OFFLOAD_MIN)
    async with connected_pair(kind, compression="zstd") as (client, server):
        for delay in [0.0005, 0.001, 0.002, 0.004, 0.008]:
            await client.send_frames([data])
            received = None
            with anyio.fail_after(10):
                while received is None:
                    with anyio.move_on_after(delay):  # cancelled wherever it waits
                        received = await server.receive_frames()
            assert [bytes(f) for f in received] == [data]
    assert [size for size, _ in decompressions] == [len(data)] * 5


@pytest.mark.parametrize("kind", RAW_KINDS)
async def test_a_compressed_message_waits_for_the_budget_at_its_decompressed_size(
    kind: str, decompressions: list[tuple[int, int]]
) -> None:
    """Two peers each send a message that decompresses to more than the whole
    budget (a few KB on the wire): the budget reserves it at its decompressed
    size before decompressing it, so the second waits until the first was taken
    and only one is ever decompressed at a time."""
    budget = ReceiveBudget(2 * OFFLOAD_MIN)
    size = 3 * OFFLOAD_MIN
    taken: list[int] = []

    async def handler(comm: Comm) -> None:
        with pytest.raises(RemoteProtocolError, match="malformed message body"):
            await comm.receive()
        taken.append(budget.in_use)

    address = "tls://127.0.0.1:0" if kind in TLS_VERSIONS else "tcp://127.0.0.1:0"
    async with anyio_comm.listen(
        address, handler, compression="zstd", receive_budget=budget, **server_options(kind)
    ) as listener:
        port = port_of(listener.address)
        async with raw_peer(kind, port) as first, raw_peer(kind, port) as second:
            message = zstd_message(size)
            await first.send(message[:-1])  # all but its last byte: it holds the budget
            with anyio.fail_after(10):
                while budget.in_use < size:
                    await anyio.sleep(0.01)
            await second.send(message)
            with anyio.fail_after(10):
                while budget.waiting < 1:
                    await anyio.sleep(0.01)
            assert decompressions == []  # (the first is not whole, the second waits)
            await first.send(message[-1:])
            with anyio.fail_after(10):
                while len(taken) < 2:
                    await anyio.sleep(0.01)
    assert [length for length, _ in decompressions] == [size, size]
    assert budget.in_use == 0


@pytest.mark.parametrize("kind", RAW_KINDS)
async def test_a_peer_that_reset_costs_no_more_decompression(
    kind: str, decompressions: list[tuple[int, int]]
) -> None:
    """A peer sends messages that decompress to a lot, then resets the connection
    before the server took them: the server decompresses none of them (TCP still
    delivers the bytes that came before the reset), and the receive fails."""
    outcome: list[BaseException] = []
    handler_may_go = anyio.Event()

    async def handler(comm: Comm) -> None:
        await handler_may_go.wait()
        try:
            while True:
                await comm.receive()
        except BaseException as exc:
            outcome.append(exc)
            raise

    address = "tls://127.0.0.1:0" if kind in TLS_VERSIONS else "tcp://127.0.0.1:0"
    async with anyio_comm.listen(
        address, handler, compression="zstd", **server_options(kind)
    ) as listener:
        async with raw_peer(kind, port_of(listener.address)) as peer:
            await peer.send(zstd_message(4 * OFFLOAD_MIN) * 4)
            await anyio.sleep(0.2)  # (the bytes are in the server's socket)
            await reset(peer)
            await anyio.sleep(0.1)
            handler_may_go.set()
            with anyio.fail_after(10):
                while not outcome:
                    await anyio.sleep(0.01)
    assert decompressions == []
    assert isinstance(outcome[0], BrokenResourceError)
    assert "reset" in str(outcome[0])


class Tracked(bytearray):
    """A frame buffer whose end a test can see (a weak reference)."""


@pytest.mark.parametrize("kind", ["tcp", "tls1.3"])
@pytest.mark.parametrize("compressed", [False, True], ids=["stored", "compressed"])
async def test_a_refused_message_is_not_kept_by_its_error(kind: str, compressed: bool) -> None:
    """A message whose body turns out malformed (a large frame of zeros: 0, then
    trailing bytes) is freed before the receive raises, and the error, however
    long it is kept, holds none of its buffers (nor a copy of them)."""
    buffers: list[tuple[int, weakref.ref[Tracked]]] = []

    def allocator(n: int) -> Tracked:
        buffer = Tracked(n)
        buffers.append((n, weakref.ref(buffer)))
        return buffer

    size = 2 * OFFLOAD_MIN
    errors: list[RemoteProtocolError] = []

    async def handler(comm: Comm) -> None:
        try:
            await comm.receive()
        except RemoteProtocolError as exc:
            errors.append(exc)

    address = "tls://127.0.0.1:0" if kind in TLS_VERSIONS else "tcp://127.0.0.1:0"
    async with anyio_comm.listen(
        address, handler, compression="zstd", allocator=allocator, **server_options(kind)
    ) as listener:
        async with raw_peer(kind, port_of(listener.address)) as peer:
            if compressed:
                await peer.send(zstd_message(size))
            else:
                await peer.send(struct.pack("!IQ", 1, size) + bytes(size))
            with anyio.fail_after(10):
                while not errors:
                    await anyio.sleep(0.01)
    assert "malformed message body" in str(errors[0])
    frames = [ref for n, ref in buffers if n == size]
    assert len(frames) == 1
    assert frames[0]() is None  # (while the error is still held, in errors)
    assert len(str(errors[0])) < 200
