"""Load and resource limits: bounded memory under backpressure, 1000 connections at once."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import resource
import socket
import struct
import tracemalloc
import zlib
from collections import Counter
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio.abc import SocketAttribute

import anyio_comm
from anyio_comm import Comm
from benchmarks.backpressure import read_memory, reset_peak_rss

from .conftest import HAVE_UNIX
from .helpers import connected_pair, listen_address, open_fds, running_tasks

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

MiB = 2**20


@contextlib.contextmanager
def _asyncio_debug_off() -> Iterator[None]:
    """Switch asyncio's debug mode off for the block (a no-op on trio)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        yield
        return
    debug = loop.get_debug()
    loop.set_debug(False)
    try:
        yield
    finally:
        loop.set_debug(debug)


@contextlib.contextmanager
def _tracing() -> Iterator[None]:
    """Trace allocations for the block (unless tracing already)."""
    started = tracemalloc.is_tracing()
    if not started:
        tracemalloc.start()
    try:
        yield
    finally:
        if not started:
            tracemalloc.stop()


class _Peak:
    """Traced memory at the start of a :func:`_traced_peak` block and its peak during
    it; ``rss_grown``: how far resident memory rose above its level at the start
    (``None`` where the platform does not tell), which sees what tracemalloc does
    not: frames in mapped memory."""

    baseline = peak = 0
    rss_grown: int | None = None


@contextlib.contextmanager
def _traced_peak() -> Iterator[_Peak]:
    """Measure the peak of traced memory over the block, asyncio's debug mode off."""
    measured = _Peak()
    with _asyncio_debug_off():
        tracemalloc.reset_peak()
        measured.baseline, _ = tracemalloc.get_traced_memory()
        rss_before = read_memory()["rss"] if reset_peak_rss() else None
        yield measured
        _, measured.peak = tracemalloc.get_traced_memory()
        rss_peak = read_memory()["hwm"]
        if rss_before is not None and rss_peak is not None:
            measured.rss_grown = rss_peak - rss_before


# -- backpressure -------------------------------------------------------------

#: size of every message (its one out-of-band frame)
MESSAGE = MiB
#: messages per transfer: 64 MiB in all
MESSAGES = 64
#: the consumer's pause after each message (so it is the slow side)
CONSUMER_PAUSE = 0.004
#: the read-ahead buffer of each end (the default of ``connect`` and ``listen``)
READ_AHEAD = 64 * 1024
#: what ``inproc://`` buffers per direction (16 chunks of 64 KiB)
INPROC_PIPE = 16 * 64 * 1024
#: the TLS transport's chunk (ciphertext receive buffer and flush size)
TLS_CHUNK = 256 * 1024


def _kernel_buffered(producer: Comm, consumer: Comm) -> int:
    """Most bytes the kernel can hold between the two ends: the producer's
    send buffer plus the consumer's receive buffer, as they stand now (Linux
    auto-tuning only grows them, so the final values bound the whole run).
    """
    try:
        sender = producer.extra(SocketAttribute.raw_socket)
        receiver = consumer.extra(SocketAttribute.raw_socket)
    except anyio.TypedAttributeLookupError:
        return 0  # inproc: no kernel buffers
    return sender.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) + receiver.getsockopt(
        socket.SOL_SOCKET, socket.SO_RCVBUF
    )


@pytest.mark.parametrize("kind", ["tcp", "inproc", "tls1.3"])
async def test_backpressure_bounds_memory(kind: str) -> None:
    """A fast producer and a slow consumer: memory stays bounded and the producer waits.

    The producer sends ``MESSAGES`` messages of ``MESSAGE`` bytes, each one
    out-of-band frame viewing the same reused payload buffer (its first 8 bytes
    hold the sequence number, rewritten after each ``send`` returns). The
    consumer checks every message and pauses after each.

    Memory bound, from the design (``tracemalloc`` sees every Python
    allocation; the kernel's socket buffers are not traced):

    * producer: the one payload buffer, ``1 x MESSAGE``; sends are zero-copy
      (only the small header and msgpack body are new bytes);
    * consumer: each frame has one exact-size buffer and the decoder keeps no
      queue; the previous message is still referenced while the next one is
      being filled: ``2 x MESSAGE``;
    * read-ahead buffers: 64 KiB per end;
    * ``inproc://``: the memory pipe holds 16 chunks of 64 KiB (``1 MiB``) per
      direction, plus one chunk being copied and one being read;
    * TLS: a ciphertext receive buffer of at most 256 KiB per end, plus at most one
      flushed ciphertext chunk of about 256 KiB; OpenSSL's own buffers are
      not Python allocations.

    Worst case: ``4 x MESSAGE + 0.4 MiB`` (inproc), ``3 x MESSAGE + 1 MiB``
    (TLS). The assertion is ``peak < 4 x MESSAGE + 2 MiB``, the remainder being
    room for interpreter and event-loop objects. Buffering without bound
    anywhere in the library would drive the peak towards the 64 MiB sent.

    Backpressure: the producer's completed sends never run more than what the
    pipe between the two ends can hold ahead of the consumer's completed
    receives: the kernel's send and receive buffers (or the inproc pipe, or a
    TLS chunk) in whole messages, plus the message the consumer is filling,
    plus one for the counters' update order.

    asyncio's debug mode (``python -X dev``) is off during the transfer: it
    records a traceback for every scheduled callback, which triples the run
    time and is not what is measured here.
    """
    producer_ahead: list[int] = []
    checked: list[int] = []
    sent = received = 0
    with _tracing():
        async with connected_pair(kind) as (producer, consumer):
            payload = bytearray(MESSAGE)
            view = memoryview(payload)

            async def produce() -> None:
                nonlocal sent
                for seq in range(MESSAGES):
                    view[:8] = seq.to_bytes(8, "big")
                    view[-1] = seq % 251
                    await producer.send({"seq": seq, "data": view})
                    sent += 1
                    producer_ahead.append(sent - received)

            async def consume() -> None:
                nonlocal received
                for _ in range(MESSAGES):
                    message = await consumer.receive()
                    data = message["data"]
                    assert isinstance(data, memoryview) and data.nbytes == MESSAGE
                    seq = int.from_bytes(data[:8], "big")
                    assert seq == message["seq"] and data[-1] == seq % 251
                    checked.append(seq)
                    received += 1
                    await anyio.sleep(CONSUMER_PAUSE)

            with _traced_peak() as traced, anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(consume)
                    tg.start_soon(produce)
            kernel = _kernel_buffered(producer, consumer)
    peak, baseline = traced.peak, traced.baseline

    assert checked == list(range(MESSAGES))  # nothing lost, duplicated or reordered
    bound = 4 * MESSAGE + 2 * MiB
    assert peak < bound, (
        f"traced peak {peak / MiB:.2f} MiB (baseline {baseline / MiB:.2f} MiB) over "
        f"the {bound / MiB:.0f} MiB bound"
    )
    pipe = kernel + (INPROC_PIPE + READ_AHEAD if kind == "inproc" else 0)
    pipe += TLS_CHUNK if kind.startswith("tls") else 0
    most_ahead = math.ceil(pipe / MESSAGE) + 2
    if most_ahead >= MESSAGES // 2:  # seen at 9-12 MB; Linux allows up to 36 MiB
        pytest.skip(
            f"the kernel's socket buffers grew to {kernel} bytes: {MESSAGES} messages are "
            "too few to tell backpressure from buffering"
        )
    assert max(producer_ahead) <= most_ahead, (
        f"the producer ran {max(producer_ahead)} messages ahead; at most {most_ahead} fit "
        f"between the ends ({pipe} bytes buffered)"
    )


# -- one large message ---------------------------------------------------------

#: the payload of the large message: big enough that a copy of it would show
LARGE = 64 * MiB


@pytest.mark.parametrize("frames", [1, 4])
@pytest.mark.parametrize("kind", ["tcp", "inproc", "tls1.3"])
async def test_large_message_allocations(kind: str, frames: int) -> None:
    """Sending and receiving a 64 MiB message allocates little beyond the received frames.

    Both ends run in this process, so the peaks count both: the receiver's frame
    buffers (the payload, once), its read-ahead and TLS buffers, and whatever
    the sender allocates (the payload itself was allocated before). The bound,
    1.1x the payload, is the receive target of ``benchmarks/memory.py``, which
    measures each side in its own process; one extra copy of the payload
    anywhere would double the peak. It holds for ``tracemalloc``'s peak and for
    resident memory's (frames of 32 MiB and more are mapped memory, which
    tracemalloc does not see).
    """
    sizes = [LARGE // frames] * frames
    with _tracing():
        async with connected_pair(
            kind, limits=anyio_comm.Limits(max_message_size=2 * LARGE, max_frame_size=LARGE)
        ) as (sender, receiver):
            payload = [
                bytearray(random.Random(i).randbytes(64)) * (n // 64) for i, n in enumerate(sizes)
            ]
            received: list[Any] = []

            async def receive() -> None:
                received.append(await receiver.receive())

            with _traced_peak() as traced, anyio.fail_after(30):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(receive)
                    await sender.send({"data": [memoryview(p) for p in payload]})
    peak, baseline = traced.peak, traced.baseline

    (message,) = received
    assert [frame.nbytes for frame in message["data"]] == sizes
    for frame, original in zip(message["data"], payload, strict=True):
        assert frame == memoryview(original)
    bound = 1.1 * LARGE
    assert peak - baseline < bound, (
        f"traced peak {(peak - baseline) / MiB:.2f} MiB over the {bound / MiB:.1f} MiB bound"
    )
    if traced.rss_grown is not None:
        assert traced.rss_grown < bound, (
            f"resident memory grew by {traced.rss_grown / MiB:.2f} MiB, over the "
            f"{bound / MiB:.1f} MiB bound"
        )


# -- 1000 connections ---------------------------------------------------------

CONNECTIONS = 1000
ROUND_TRIPS = 3
CONNECT_CONCURRENCY = 100  # well under the listener's backlog of 1024
#: payload sizes after the 8-byte tag: tiny to 100 KB (the read-ahead and direct paths)
SIZES = (0, 1, 100, 2000, 5000, 100_000)
TAG = struct.Struct("!II")
#: file descriptors needed: two per connection plus the test process's own
FDS_NEEDED = 2 * CONNECTIONS + 256


@pytest.fixture
def enough_fds() -> Iterator[None]:
    """Raise the soft RLIMIT_NOFILE to the hard limit if it is below 4096 (restored
    after), or skip when even the hard limit cannot hold every connection.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FDS_NEEDED:
        pytest.skip(
            f"RLIMIT_NOFILE hard limit is {hard}: {CONNECTIONS} connections with both ends "
            f"in this process need about {FDS_NEEDED} file descriptors"
        )
    if soft != resource.RLIM_INFINITY and soft < max(FDS_NEEDED, 4096):
        raised = hard if hard != resource.RLIM_INFINITY else 65536
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    else:
        yield


async def _settle(what: str, measure: Callable[[], int], expected: int) -> None:
    """Wait (0.01 s steps, 5 s at most) until ``measure()`` returns ``expected``."""
    for _ in range(500):
        if measure() == expected:
            return
        await anyio.sleep(0.01)
    assert measure() == expected, f"{what}: {measure()} != {expected}"


def _checksum(data: Any) -> int:
    return zlib.crc32(data)


@pytest.mark.usefixtures("enough_fds")
@pytest.mark.parametrize(
    "kind",
    ["tcp", pytest.param("unix", marks=pytest.mark.skipif(not HAVE_UNIX, reason="no Unix"))],
)
async def test_thousand_connections(kind: str) -> None:
    """1000 client comms open at once against one listener, each pipelining tagged,
    checksummed requests: every reply matches its request, nothing lost or
    duplicated, no error on either side; then everything is released.

    asyncio's debug mode (on under ``python -X dev``) records a traceback for
    every callback it schedules, which makes this test about five times
    slower on asyncio and uvloop; it is switched off for the test's duration.
    """
    with _asyncio_debug_off():
        await _thousand_connections(kind)


async def _thousand_connections(kind: str) -> None:
    fds_before = open_fds()
    tasks_before = running_tasks()
    rng = random.Random(1000)
    filler = {size: rng.randbytes(size) for size in SIZES}
    plan = {
        (cid, seq): rng.choice(SIZES) for cid in range(CONNECTIONS) for seq in range(ROUND_TRIPS)
    }

    def payload(cid: int, seq: int) -> bytes:
        """Unique to its request: the tag, then filler of the planned size."""
        return TAG.pack(cid, seq) + filler[plan[cid, seq]]

    server_seen: Counter[tuple[int, int]] = Counter()
    server_errors: list[str] = []
    client_seen: Counter[tuple[int, int]] = Counter()

    async def handler(comm: Comm) -> None:
        async for request in comm:
            key = (request["cid"], request["seq"])
            server_seen[key] += 1
            data = request["data"]
            if _checksum(data) != request["crc"] or data != payload(*key):
                server_errors.append(f"request {key} arrived corrupted")
            await comm.send({**request, "server_crc": _checksum(data)})

    async with listen_address(kind) as address, anyio_comm.listen(address, handler) as listener:
        async with contextlib.AsyncExitStack() as stack:
            comms: dict[int, Comm] = {}
            limiter = anyio.CapacityLimiter(CONNECT_CONCURRENCY)

            async def open_one(cid: int) -> None:
                async with limiter:
                    comm = await anyio_comm.connect(listener.address, timeout=30)
                stack.push_async_callback(comm.aclose)
                comms[cid] = comm

            with anyio.fail_after(15):
                async with anyio.create_task_group() as tg:
                    for cid in range(CONNECTIONS):
                        tg.start_soon(open_one, cid)
                while listener.active_connections < CONNECTIONS:
                    await anyio.sleep(0.01)
            assert listener.active_connections == CONNECTIONS
            if kind == "tcp":  # 1000 distinct client ports
                assert len({comm.local_address for comm in comms.values()}) == CONNECTIONS

            async def send_all(cid: int, comm: Comm) -> None:
                for seq in range(ROUND_TRIPS):
                    data = payload(cid, seq)
                    message = {"cid": cid, "seq": seq, "crc": _checksum(data), "data": data}
                    await comm.send(message)

            async def receive_all(cid: int, comm: Comm) -> None:
                for seq in range(ROUND_TRIPS):
                    reply = await comm.receive()
                    key = (reply["cid"], reply["seq"])
                    client_seen[key] += 1
                    assert key == (cid, seq), f"connection {cid} got {key} for request {seq}"
                    expected = payload(cid, seq)
                    assert reply["crc"] == reply["server_crc"] == _checksum(expected)
                    assert reply["data"] == expected

            with anyio.fail_after(15):
                async with anyio.create_task_group() as tg:
                    for cid, comm in comms.items():
                        tg.start_soon(send_all, cid, comm)
                        tg.start_soon(receive_all, cid, comm)
            # still all open at once after the exchanges
            assert listener.active_connections == CONNECTIONS
        # every client comm is closed now: the server sides see the end
        await _settle("active connections", lambda: listener.active_connections, 0)

    assert not server_errors
    expected_keys = set(plan)
    assert set(server_seen) == expected_keys and set(server_seen.values()) == {1}
    assert set(client_seen) == expected_keys and set(client_seen.values()) == {1}
    await _settle("open file descriptors", open_fds, fds_before)
    await _settle("running tasks", running_tasks, tasks_before)
