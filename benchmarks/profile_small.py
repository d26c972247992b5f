"""Per-call costs of anyio-comm's small-message path, in one process.

Four modes, for one backend at a time:

* ``micro`` (default): the pure-Python pieces of one 1 KB round trip, timed
  in isolation with ``time.perf_counter_ns`` (best of several batches):
  ``Serializer.dumps`` / ``loads``, the header and gather-list layout,
  ``FrameDecoder.next_message`` on a message already in the read-ahead
  buffer, and the checkpoints the comm takes per operation.
* ``roundtrip``: ``--count`` request/reply round trips of ``{"data": payload}``
  between a client and an echo server in the same process over loopback TCP
  (both ends on one CPU): process CPU time per round trip is the cost of
  both ends together, system calls included (CPU time rather than wall time,
  so other processes on a busy machine do not count). ``--system raw`` runs
  the floor instead (asyncio ``BufferedProtocol`` answering in its callback,
  or trio socket ``recv_into``, with an 8-byte length prefix);
  ``--system task-floor`` the least a task-based API can cost (asyncio and
  uvloop: a readiness callback frames each message and wakes the connection's
  task, which answers; no library). ``--warmup 0`` under ``strace -c -f``
  gives system calls per round trip.
* ``profile``: the same round trips under :mod:`cProfile`; prints the
  functions with the most own time, as microseconds per call and per round
  trip.
* ``instructions``: user-space instructions per round trip of the same
  workload, counted by valgrind's callgrind (the difference between a run of
  200 and one of 1200 round trips). Unlike times, the count repeats to a
  fraction of a percent on a busy or noisy machine, so it shows what a change
  to the per-message path gains; it leaves out the kernel's share.

Run from the repository root::

    python -m benchmarks.profile_small --backend asyncio --mode micro
    python -m benchmarks.profile_small --backend trio --mode roundtrip --count 20000
    python -m benchmarks.profile_small --backend uvloop --mode profile --count 20000
    python -m benchmarks.profile_small --backend uvloop --mode instructions --concurrency 4
    python -m benchmarks.profile_small --backend uvloop --mode instructions --system task-floor
    python -m benchmarks.profile_small --backend trio --mode instructions --concurrency 4 --tls 1.3
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import re
import shutil
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
from anyio.lowlevel import cancel_shielded_checkpoint, checkpoint, checkpoint_if_cancelled

import anyio_comm
from anyio_comm._bench._tls import TLS_VERSIONS, certificates, client_context, server_context
from anyio_comm._sansio import wire as wire_format
from anyio_comm._sansio.decoder import FrameDecoder
from anyio_comm._sansio.serialization import Serializer
from anyio_comm._sansio.wire import Limits, encode_header, encode_preamble, frames_to_iov
from anyio_comm.bench import BACKENDS, run_backend

if TYPE_CHECKING:
    import ssl
    from collections.abc import Awaitable, Callable

MAX_COUNT = 1_000_000
#: the task floor keeps a message in one 64 KiB buffer and sends it with one send()
TASK_FLOOR_MAX = 60_000


def _payload(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + bytes(size % 256)


def _best_ns(func: Callable[[], object], count: int, batches: int = 5) -> float:
    """Best per-call nanoseconds of ``func`` over ``batches`` batches of ``count`` calls."""
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(count):
            func()
        best = min(best, (time.perf_counter_ns() - t0) / count)
    return best


async def _best_async_ns(func: Callable[[], Awaitable[object]], count: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(count):
            await func()
        best = min(best, (time.perf_counter_ns() - t0) / count)
    return best


def micro(backend: str, size: int, count: int) -> list[tuple[str, float]]:
    """Time each pure-Python step of a round trip; return ``(name, us per call)``."""
    serializer = Serializer()
    message = {"data": _payload(size)}
    frames = serializer.dumps(message)
    lengths = [f.nbytes for f in frames]
    header = encode_header(lengths)
    wire = b"".join([header, *frames])
    limits = Limits()

    decoder = FrameDecoder()
    decoder.feed(encode_preamble(limits))
    decoder.next_handshake()

    def decode_one() -> object:
        buf = decoder.get_buffer()
        buf[: len(wire)] = wire
        decoder.buffer_updated(len(wire))
        return decoder.next_message()

    def encode_one() -> object:
        ls = [f.nbytes for f in frames]
        limits.check_send(ls)
        return frames_to_iov(encode_header(ls), frames)

    refill = decoder.get_buffer
    encode_message = getattr(wire_format, "encode_message", None)
    results = [
        ("Serializer.dumps", _best_ns(lambda: serializer.dumps(message), count)),
        ("Serializer.loads", _best_ns(lambda: serializer.loads(frames), count)),
        ("lengths+check_send+encode_header+frames_to_iov", _best_ns(encode_one, count)),
        ("get_buffer+copy-in+buffer_updated+next_message", _best_ns(decode_one, count)),
        ("get_buffer (empty read-ahead)", _best_ns(refill, count)),
    ]
    if encode_message is not None:
        results.append(
            ("encode_message (one-frame layout)", _best_ns(lambda: encode_message(frames), count))
        )

    async def loop_costs() -> None:
        results.append(("anyio checkpoint()", await _best_async_ns(checkpoint, count)))
        results.append(
            (
                "anyio checkpoint_if_cancelled()",
                await _best_async_ns(checkpoint_if_cancelled, count),
            )
        )
        results.append(
            (
                "anyio cancel_shielded_checkpoint()",
                await _best_async_ns(cancel_shielded_checkpoint, count),
            )
        )
        if backend == "trio":
            import trio.lowlevel

            for func in (
                trio.lowlevel.checkpoint,
                trio.lowlevel.checkpoint_if_cancelled,
                trio.lowlevel.cancel_shielded_checkpoint,
            ):
                results.append(
                    (f"trio.lowlevel.{func.__name__}()", await _best_async_ns(func, count))
                )
        else:
            results.append(
                ("asyncio.sleep(0)", await _best_async_ns(lambda: asyncio.sleep(0), count))
            )

    run_backend(backend, loop_costs)
    return [(n, ns / 1000) for n, ns in results]


async def _roundtrips(
    size: int, count: int, warmup: int, concurrency: int = 1, tls: str | None = None
) -> float:
    """Run ``count`` echo round trips in this process, spread over
    ``concurrency`` connections (``tls://`` of that TLS version with ``tls``);
    return the CPU seconds taken."""
    with certificates("profile-small-" if tls else None) as files:
        return await _roundtrips_over(
            size,
            count,
            warmup,
            concurrency,
            server_context(files, tls),
            client_context(files, tls),
        )


async def _roundtrips_over(
    size: int,
    count: int,
    warmup: int,
    concurrency: int,
    server_ssl: ssl.SSLContext | None,
    client_ssl: ssl.SSLContext | None,
) -> float:
    payload = _payload(size)
    message = {"data": payload}

    async def echo(comm: anyio_comm.Comm) -> None:
        async for received in comm:
            await comm.send(received)

    async def client(comm: anyio_comm.Comm, n: int) -> None:
        for _ in range(n):
            await comm.send(message)
            reply = await comm.receive()
        if n and len(reply["data"]) != size:
            raise RuntimeError("echo came back with the wrong size")

    scheme = "tcp" if server_ssl is None else "tls"
    async with anyio_comm.listen(
        f"{scheme}://127.0.0.1:0", echo, ssl_context=server_ssl
    ) as listener:
        comms = [
            await anyio_comm.connect(listener.address, timeout=10, ssl_context=client_ssl)
            for _ in range(concurrency)
        ]
        await client(comms[0], warmup)
        t0 = time.process_time()
        async with anyio.create_task_group() as tg:
            for i, comm in enumerate(comms):
                tg.start_soon(client, comm, count // concurrency + (i < count % concurrency))
        elapsed = time.process_time() - t0
        for comm in comms:
            await comm.aclose()
        await listener.shutdown(1.0)
    return elapsed


async def _floor_asyncio(size: int, count: int, warmup: int, concurrency: int = 1) -> float:
    """The raw floor on asyncio/uvloop: ``BufferedProtocol`` echo, 8-byte length prefix,
    answered inside the protocol callback; ``concurrency`` connections."""
    loop = asyncio.get_running_loop()

    class Echo(asyncio.BufferedProtocol):
        def __init__(self, reply: bool) -> None:
            self.buf = bytearray(max(65536, 8 + size))
            self.view = memoryview(self.buf)
            self.end = 0
            self.reply = reply
            self.transport: Any = None
            self.waiter: asyncio.Future[None] | None = None

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def get_buffer(self, sizehint: int) -> memoryview:  # noqa: ARG002
            return self.view[self.end :]

        def buffer_updated(self, nbytes: int) -> None:
            # One message in flight per connection (request/reply), so the
            # buffer is empty again once a message is complete.
            self.end += nbytes
            if self.end < 8 or self.end < 8 + int.from_bytes(self.buf[:8], "big"):
                return
            message = bytes(self.view[: self.end])
            self.end = 0
            if self.reply:
                self.transport.write(message)
            elif self.waiter is not None and not self.waiter.done():
                self.waiter.set_result(None)

    server = await loop.create_server(lambda: Echo(True), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    request = len(_payload(size)).to_bytes(8, "big") + _payload(size)
    clients = [
        await loop.create_connection(lambda: Echo(False), "127.0.0.1", port)
        for _ in range(concurrency)
    ]

    async def round_trips(transport: Any, client: Echo, n: int) -> None:
        for _ in range(n):
            client.waiter = loop.create_future()
            transport.write(request)
            await client.waiter

    elapsed = await _timed(
        [lambda t=t, c=c: round_trips(t, c, warmup) for t, c in clients[:1]],
        [
            lambda t=t, c=c, i=i: round_trips(t, c, _share(count, concurrency, i))
            for i, (t, c) in enumerate(clients)
        ],
    )
    for transport, _ in clients:
        transport.close()
    server.close()
    return elapsed


def _share(count: int, concurrency: int, i: int) -> int:
    """Connection ``i``'s share of ``count`` round trips."""
    return count // concurrency + (i < count % concurrency)


async def _timed(
    warmups: list[Callable[[], Awaitable[object]]], runs: list[Callable[[], Awaitable[object]]]
) -> float:
    """Run the ``warmups`` one after the other, then the ``runs`` concurrently; return the
    process CPU seconds the runs took."""
    for warmup in warmups:
        await warmup()
    t0 = time.process_time()
    await asyncio.gather(*(run() for run in runs))
    return time.process_time() - t0


async def _task_floor(size: int, count: int, warmup: int, concurrency: int) -> float:
    """The least a task-based API can cost on asyncio/uvloop, with no library: a readiness
    callback receives and frames each message (8-byte length prefix) and wakes the
    connection's task through a future; the task answers. Both ends in this process over
    loopback TCP, ``concurrency`` connections."""
    loop = asyncio.get_running_loop()

    class Connection:
        def __init__(self, sock: socket.socket) -> None:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = sock
            self.buf = bytearray(65536)
            self.view = memoryview(self.buf)
            self.end = 0
            self.messages: list[bytes] = []
            self.waiter: asyncio.Future[None] | None = None
            loop.add_reader(sock.fileno(), self.readable)

        def readable(self) -> None:
            try:
                self.end += self.sock.recv_into(self.view[self.end :])
            except BlockingIOError:
                return
            # one message in flight per connection (request/reply)
            if self.end < 8 or self.end < 8 + int.from_bytes(self.buf[:8], "big"):
                return
            self.messages.append(bytes(self.view[8 : self.end]))
            self.end = 0
            waiter, self.waiter = self.waiter, None
            if waiter is not None:
                waiter.set_result(None)

        async def receive(self) -> bytes:
            if not self.messages:
                self.waiter = loop.create_future()
                await self.waiter
            return self.messages.pop()

        def send(self, message: bytes) -> None:
            # at most 60 KB: the socket's buffer always takes it whole
            self.sock.sendall(len(message).to_bytes(8, "big") + message)

        def close(self) -> None:
            loop.remove_reader(self.sock.fileno())
            self.sock.close()

    listener = socket.create_server(("127.0.0.1", 0))
    pairs = []
    for _ in range(concurrency):
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        pairs.append((Connection(client), Connection(accepted)))
    listener.close()

    async def serve(server: Connection) -> None:
        while True:
            server.send(await server.receive())

    async def round_trips(client: Connection, n: int) -> None:
        payload = _payload(size)
        for _ in range(n):
            client.send(payload)
            await client.receive()

    servers = [loop.create_task(serve(server)) for _, server in pairs]
    elapsed = await _timed(
        [lambda: round_trips(pairs[0][0], warmup)],
        [
            lambda c=c, i=i: round_trips(c, _share(count, concurrency, i))
            for i, (c, _) in enumerate(pairs)
        ],
    )
    for task in servers:
        task.cancel()
    for pair in pairs:
        for connection in pair:
            connection.close()
    return elapsed


async def _floor_trio(size: int, count: int, warmup: int) -> float:
    """The raw floor on trio: socket ``recv_into`` echo, 8-byte length prefix."""
    import trio

    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    request = len(_payload(size)).to_bytes(8, "big") + _payload(size)

    async def read_message(sock: Any, buf: bytearray) -> None:
        view = memoryview(buf)
        got = 0
        while got < 8 or got < 8 + int.from_bytes(buf[:8], "big"):
            n = await sock.recv_into(view[got:])
            if not n:
                raise EOFError
            got += n

    async def send_all(sock: Any, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[await sock.send(view) :]

    async def serve(sock: Any) -> None:
        buf = bytearray(max(65536, len(request)))
        with sock:
            for _ in range(warmup + count):
                await read_message(sock, buf)
                await send_all(sock, request)

    async with trio.open_nursery() as nursery:
        client = trio.socket.socket()
        await client.connect(listener.getsockname())
        sock, _ = await listener.accept()
        nursery.start_soon(serve, sock)
        buf = bytearray(max(65536, len(request)))
        t0 = 0.0
        for i in range(warmup + count):
            if i == warmup:
                t0 = time.process_time()
            await send_all(client, request)
            await read_message(client, buf)
        elapsed = time.process_time() - t0
        client.close()
    listener.close()
    return elapsed


def roundtrip(
    backend: str,
    size: int,
    count: int,
    repeat: int,
    system: str,
    warmup: int | None,
    concurrency: int = 1,
    tls: str | None = None,
) -> float:
    """Best CPU microseconds per round trip over ``repeat`` runs (``tls``: anyio-comm
    over ``tls://`` of that TLS version)."""
    if warmup is None:
        warmup = min(count // 10 + 1, 2000)
    warmup = max(0, min(warmup, MAX_COUNT))
    if tls is not None and system != "anyio-comm":
        raise SystemExit("--tls measures anyio-comm: --system anyio-comm")
    if system == "raw" and backend == "trio":
        if concurrency != 1:
            raise SystemExit("--system raw on trio runs one connection: --concurrency 1")
        func: Callable[..., Awaitable[float]] = _floor_trio
        args: tuple[int, ...] = (size, count, warmup)
    elif system == "raw":
        func, args = _floor_asyncio, (size, count, warmup, concurrency)
    elif system == "task-floor":
        if backend == "trio":
            raise SystemExit("--system task-floor runs on asyncio and uvloop")
        if size > TASK_FLOOR_MAX:
            raise SystemExit(f"--system task-floor takes --size up to {TASK_FLOOR_MAX}")
        func, args = _task_floor, (size, count, warmup, concurrency)
    else:
        func = _roundtrips
        args = (size, count, warmup, concurrency, tls)
    best = min(run_backend(backend, func, *args) for _ in range(repeat))
    return best / count * 1e6


def instructions(
    backend: str,
    size: int,
    system: str,
    concurrency: int,
    counts: tuple[int, int] = (200, 1200),
    tls: str | None = None,
) -> float:
    """User-space instructions per round trip, counted by valgrind's callgrind: the
    difference between runs of ``counts`` round trips, so that start-up cancels out.
    Repeatable to a fraction of a percent whatever else the machine does (it counts
    instructions, not time); the kernel's share is not in it.

    Raises:
        SystemExit: valgrind is not installed, or a run failed.
    """
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise SystemExit("--mode instructions needs valgrind (callgrind) on PATH")
    collected = []
    for count in counts:
        command = [
            valgrind,
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "benchmarks.profile_small",
            *("--backend", backend, "--mode", "roundtrip", "--repeat", "1"),
            *("--count", str(count), "--warmup", "50", "--size", str(size)),
            *("--system", system, "--concurrency", str(concurrency)),
            *(("--tls", tls) if tls else ()),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
        found = re.search(r"Collected : (\d+)", done.stderr)
        if done.returncode or found is None:
            raise SystemExit(f"callgrind run failed:\n{done.stdout}\n{done.stderr}")
        collected.append(int(found.group(1)))
    return (collected[1] - collected[0]) / (counts[1] - counts[0])


def profile(
    backend: str, size: int, count: int, top: int, concurrency: int = 1, tls: str | None = None
) -> str:
    """Profile ``count`` round trips; return a table of the costliest functions."""
    profiler = cProfile.Profile()
    profiler.enable()
    run_backend(backend, _roundtrips, size, count, 0, concurrency, tls)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows: list[tuple[float, float, int, str]] = []
    for (filename, line, func), (_cc, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{os.path.basename(filename)}:{line}({func})"
        rows.append((tottime, cumtime, calls, where))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [
        (
            f"cProfile of {count} round trips ({backend}, {size} B, both ends in one process);"
            f" profiled total {total / count * 1e6:.1f} us per round trip"
        ),
        f"{'own us/rt':>10} {'cum us/rt':>10} {'calls/rt':>9} {'us/call':>8}  function",
    ]
    for tottime, cumtime, calls, where in rows[:top]:
        lines.append(
            f"{tottime / count * 1e6:10.2f} {cumtime / count * 1e6:10.2f} "
            f"{calls / count:9.2f} {tottime / max(calls, 1) * 1e6:8.2f}  {where}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=sorted(BACKENDS), default="asyncio")
    parser.add_argument(
        "--mode", choices=("micro", "roundtrip", "profile", "instructions"), default="micro"
    )
    parser.add_argument("--size", type=int, default=1000, help="payload bytes (default 1000)")
    parser.add_argument("--count", type=int, default=20000, help="calls or round trips")
    parser.add_argument("--repeat", type=int, default=3, help="roundtrip: best of N runs")
    parser.add_argument("--top", type=int, default=30, help="profile: rows shown")
    parser.add_argument(
        "--concurrency", type=int, default=1, help="anyio-comm connections (default 1)"
    )
    parser.add_argument(
        "--system",
        choices=("anyio-comm", "raw", "task-floor"),
        default="anyio-comm",
        help="roundtrip, instructions: anyio-comm; the raw floor (asyncio BufferedProtocol "
        "answering in its callback, trio socket); or the task floor (asyncio/uvloop: a task "
        "woken per message, no library)",
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="roundtrip: warm-up round trips (0 for strace)"
    )
    parser.add_argument(
        "--tls",
        choices=sorted(TLS_VERSIONS),
        default=None,
        help="roundtrip, profile, instructions: anyio-comm over tls:// of this TLS version "
        "(test certificates made with trustme)",
    )
    args = parser.parse_args(argv)
    count = max(1, min(args.count, MAX_COUNT))
    concurrency = max(1, min(args.concurrency, 64))
    print(f"Python {sys.version.split()[0]}, backend {args.backend}, payload {args.size} B")
    if args.mode == "micro":
        for name, us in micro(args.backend, args.size, count):
            print(f"{us:8.3f} us  {name}")
    elif args.mode == "roundtrip":
        us = roundtrip(
            args.backend,
            args.size,
            count,
            max(1, min(args.repeat, 20)),
            args.system,
            args.warmup,
            concurrency,
            args.tls,
        )
        print(
            f"{us:8.2f} CPU us per round trip ({args.system}, both ends, one process),"
            f" {1e6 / us:,.0f} rt/s"
        )
    elif args.mode == "instructions":
        per_rt = instructions(args.backend, args.size, args.system, concurrency, tls=args.tls)
        print(
            f"{per_rt:10,.0f} instructions per round trip ({args.system}, both ends, "
            f"c={concurrency}{f', TLS {args.tls}' if args.tls else ''}, user space, callgrind)"
        )
    else:
        print(
            profile(
                args.backend, args.size, count, max(1, min(args.top, 200)), concurrency, args.tls
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
