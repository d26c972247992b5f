"""Server memory against hostile peers, and against idle connections.

A server process runs :func:`anyio_comm.listen` with an echo handler (default
options, or ``--unprotected``: no receive budget and every frame buffer a
``bytearray``, committed whole when its header arrives, as anyio-comm did
before the budget). A client process opens raw TCP (or TLS) connections that
send a valid preamble and then, per ``--scenario``:

* ``declare``: one message header declaring a single frame of ``--declare``
  bytes (1 GiB by default) and 1,000 bytes of it, then nothing (they hold the
  connection open);
* ``frames``: the header of one message of ``--frames`` frames (16,384, the
  default limit), all empty but the last, which is declared 1,000 bytes long
  and never sent: 128 KiB each, which as frame objects would cost the server
  about 6 MB (it holds them as bytes until the message is taken);
* ``taken``: ``--messages`` (4) whole messages of ``--frames`` empty frames
  (128 KiB each), which the server's handler takes with ``receive_frames()``
  and keeps while the connection is open: what a taken message holds (as frame
  objects, 6.4 MB each);
* ``idle``: nothing after the preamble;
* ``bomb``: compression on both sides (``compression=("zstd",)``), and each peer
  sends ``--bombs`` (1) messages of a nil body and one frame compressed with
  Zstandard that declares ``--declare`` bytes (1 GiB) of zeros: about 32 KB on
  the wire (the server's handler echoes the nil). It runs its own
  steps: a legitimate client does a 1 KB round trip every 10 ms throughout; the
  peers connect together, stay ``--attack`` seconds (5), then leave (they never
  read, so their sockets reset). Reported: the server's peak and resident memory,
  the legitimate round trips' p50, p99 and worst during the attack and after it,
  and the server's CPU time in the second after the peers left and in the
  second after that (``idle``: under 5 % of a CPU);
* ``rpc-queue``: the server is :func:`anyio_comm.rpc.serve` instead, and each
  peer an RPC connection that sends 1,100 calls (``max_calls_per_connection``
  plus ``max_waiting_per_connection``, all admitted) of a 256 KiB argument to
  a method that sleeps 60 s, without reading replies: what waiting calls make
  the server hold (``--peers 0,2`` by default; the legitimate client makes RPC
  calls);
* ``silent``: nothing at all, not even a preamble (with ``--transport tls``
  not even a TLS ClientHello: a plain TCP connection to the TLS listener),
  until the server drops them at its ``handshake_timeout`` (10 s by default;
  each step is measured well before that).

``tls-storm`` is a scenario of its own (always ``tls://``): a TLS handshake
storm from a third process, ``--stalled`` peers (100) that send a ClientHello
and then nothing until the server drops them, then reconnect, and
``--looping`` peers (100) that do full TLS handshakes in a loop, each
connection closed as soon as its handshake completes. A legitimate client
keeps one established connection and does a 1 KB round trip on it every
10 ms, and opens a new connection (TLS and preamble) every 0.25 s. Quiet
phases (no storm) and storm phases of ``--seconds`` alternate ``--rounds``
times in the same run; each reports the server's CPU (cores: CPU time over
wall time), its resident memory, the storm's full handshakes per second, the
round trips' p50/p99/max, the new connects' times, the server's event-loop
lag (how much later than asked a task sleeping 5 ms wakes up) and its garbage
collections (how many, and how long they paused it). Target: the p99 of the
storm phases' round trips, all rounds pooled, is at most 3 times the quiet
phases' (each round's own ratio is shown too), and every new connect during a
storm completes within 1 s. The attackers and the
legitimate client share the second CPU. So that the legitimate client's
figures are the server's, not the waits of a client that shares its CPU with a
busy process, the attackers run at niceness 10 and the client at real-time
priority (``SCHED_FIFO``) where that is allowed (root, or ``CAP_SYS_NICE``);
the output says which. Without it, about one round trip in a hundred waits
3-5 ms for the attackers' time slice to end before the client reads its reply.

They are opened in steps (``--peers``, cumulative counts); after each step
and a settling second the server reports its resident set size (``VmRSS``),
its peak (``VmHWM``) and its receive budget, and a legitimate client does
``--round-trips`` round trips of 1 KB and one of 1 MB, whose latencies are
reported. The server is pinned to the first CPU, the client to the second
(``os.sched_setaffinity``), as in ``benchmarks.echo``; the output says which.

Targets (default options): 64 peers declaring 1 GiB frames grow the server by
less than 512 MiB, and the legitimate client's round trips all succeed; 64 peers
sending 1 GiB bombs grow it by less than the receive budget plus one larger
message plus the pool's slabs (256 MiB + 1 GiB + 1 GiB: the bound), the worst
legitimate round trip during the attack is under 100 ms, and the server is idle
in the second that begins one second after the peers left.

Run from the repository root::

    python -m benchmarks.hostile_peers                          # declare, 0-256 peers, tcp
    python -m benchmarks.hostile_peers --transport tls --backend uvloop
    python -m benchmarks.hostile_peers --scenario frames --peers 0,16,64
    python -m benchmarks.hostile_peers --scenario taken --peers 0,16,64
    python -m benchmarks.hostile_peers --scenario idle --peers 0,1000
    python -m benchmarks.hostile_peers --scenario bomb --peers 0,1,64
    python -m benchmarks.hostile_peers --scenario bomb --peers 0,4 --declare 16MiB \
        --bombs 100000 --attack 10
    python -m benchmarks.hostile_peers --scenario rpc-queue --backend asyncio
    python -m benchmarks.hostile_peers --scenario silent --peers 0,2000 --transport tls
    python -m benchmarks.hostile_peers --unprotected --peers 0,1,4   # the old behaviour
    python -m benchmarks.hostile_peers --scenario tls-storm --backend uvloop --rounds 3
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import math
import os
import struct
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

import anyio_comm
from anyio_comm import rpc
from anyio_comm._sansio.budget import DEFAULT_RECEIVE_BUDGET
from anyio_comm._sansio.compression import CODEC_SHIFT, CODECS
from anyio_comm._sansio.wire import SMALL_COUNT, encode_header, encode_preamble
from anyio_comm.bench import (
    Child,
    TLSFiles,
    byte_size,
    client_context,
    run_backend,
    server_context,
    whole_number,
    write_json,
)
from anyio_comm.rpc._protocol import Call

from . import _harness
from ._harness import STARTUP_TIMEOUT, ProcessPair, csv_list
from .backpressure import read_memory, reset_peak_rss
from .many_connections import FD_MARGIN, raise_fd_limit

if TYPE_CHECKING:
    import argparse
    import ssl
    from multiprocessing.connection import Connection

TRANSPORTS = ("tcp", "tls")
SCENARIOS = ("declare", "frames", "taken", "idle", "silent", "bomb", "rpc-queue", "tls-storm")
TLS_VERSION = "1.3"
SETTLE = 1.0  # seconds between opening a step's peers and measuring
STEP_TIMEOUT = 120.0  # seconds for one step (opening peers and the round trips)
GROWTH_TARGET = 512 * 2**20  # bytes: 64 peers declaring 1 GiB must grow the server less
TARGET_PEERS = 64
BOMB_CODEC = "zstd"
BOMB_INTERVAL = 0.01  # seconds between the legitimate client's round trips
IDLE_CPU = 0.05  # CPU seconds in a second: the server is idle below it
UNPROTECTED_MAX = 8  # peers x 1 GiB committed: keep the machine alive


@dataclass(frozen=True)
class Case:
    """One backend's run."""

    backend: str
    transport: str
    scenario: str
    peers: tuple[int, ...]
    declare: int
    frames: int
    messages: int
    round_trips: int
    unprotected: bool
    attack: float = 5.0
    bombs: int = 1


# -- server ---------------------------------------------------------------------


async def _server(
    conn: Connection, case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> None:
    async def echo(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)

    async def keep(comm: anyio_comm.Comm) -> None:
        """Keep the hostile peers' messages of many frames; echo the others."""
        kept = []
        while True:
            try:
                frames = await comm.receive_frames()
            except anyio.EndOfStream:
                return
            if len(frames) > SMALL_COUNT:
                kept.append(frames)
            else:
                await comm.send_frames(frames)

    options: dict[str, Any] = {"ssl_context": ssl_context}
    if case.scenario == "bomb":
        options["compression"] = (BOMB_CODEC,)
    if case.unprotected:
        options.update(receive_budget=None, allocator=bytearray, message_timeout=None)
    lifetime = STARTUP_TIMEOUT + STEP_TIMEOUT * (len(case.peers) + 1)
    with anyio.move_on_after(lifetime):
        handler = keep if case.scenario == "taken" else echo
        async with anyio_comm.listen(address, handler, **options) as listener:
            conn.send(("ready", listener.address))
            while True:
                try:
                    command = await anyio.to_thread.run_sync(conn.recv, abandon_on_cancel=True)
                except EOFError:
                    return
                if command == "stop":
                    return
                if command == "reset peak":
                    reset_peak_rss()
                budget = listener.receive_budget
                times = os.times()
                conn.send(
                    {
                        **read_memory(),
                        "cpu": times.user + times.system,
                        "budget_in_use": budget.in_use if budget else None,
                        "budget_waiting": budget.waiting if budget else None,
                        "connections": listener.active_connections,
                    }
                )


def server_main(conn: Connection, case: Case, tls: TLSFiles | None) -> None:
    """Entry point of the server process."""
    raise_fd_limit(max(case.peers) + FD_MARGIN)
    ssl_context = server_context(tls, TLS_VERSION if case.transport == "tls" else None)
    serve = _rpc_queue_server if case.scenario == "rpc-queue" else _server
    run_backend(case.backend, serve, conn, case, f"{case.transport}://127.0.0.1:0", ssl_context)


# -- client ---------------------------------------------------------------------


async def _open_silent_peer(host: str, port: int) -> anyio.abc.ByteStream:
    """The ``silent`` scenario's peer: a TCP connection that sends nothing (no TLS
    handshake either, whatever the transport)."""
    return await anyio.connect_tcp(host, port)


async def _open_peer(
    host: str, port: int, ssl_context: ssl.SSLContext | None, first_bytes: bytes
) -> anyio.abc.ByteStream:
    stream: anyio.abc.ByteStream
    if ssl_context is not None:
        stream = await anyio.connect_tcp(
            host, port, tls=True, ssl_context=ssl_context, tls_hostname="localhost"
        )
    else:
        stream = await anyio.connect_tcp(host, port)
    await stream.send(first_bytes)
    return stream


async def _client(
    conn: Connection, case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> None:
    if case.scenario == "bomb":
        await _bomb_client(conn, case, address, ssl_context)
        return
    host, port = address.split("://")[1].rsplit(":", 1)
    first = encode_preamble(anyio_comm.Limits())
    if case.scenario == "declare":
        first += struct.pack("!IQ", 1, case.declare) + b"\0" * 1000
    elif case.scenario == "frames":
        first += encode_header([0] * (case.frames - 1) + [1000])
    elif case.scenario == "taken":
        first += encode_header([0] * case.frames) * case.messages
    options: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context is not None else {}
    small, large = b"x" * 1000, os.urandom(2**20)
    limiter = anyio.CapacityLimiter(100)  # connects in flight, under the listen backlog
    async with contextlib.AsyncExitStack() as stack:
        opened = 0
        while True:
            command = await anyio.to_thread.run_sync(conn.recv)
            if command == "stop":
                return
            with anyio.fail_after(STEP_TIMEOUT):

                async def open_one() -> None:
                    async with limiter:
                        if case.scenario == "silent":
                            stream = await _open_silent_peer(host, int(port))
                        else:
                            stream = await _open_peer(host, int(port), ssl_context, first)
                    stack.push_async_callback(anyio.aclose_forcefully, stream)

                async with anyio.create_task_group() as tg:
                    for _ in range(command - opened):
                        tg.start_soon(open_one)
                opened = command
                await anyio.sleep(SETTLE)
                conn.send("opened")
                await anyio.to_thread.run_sync(conn.recv)  # the server has reported
                latencies = []
                errors = 0
                try:
                    async with await anyio_comm.connect(
                        address, timeout=STARTUP_TIMEOUT, **options
                    ) as comm:
                        for payload in [small] * case.round_trips + [large]:
                            t0 = time.perf_counter()
                            await comm.send(payload)
                            if bytes(await comm.receive()) != payload:
                                errors += 1
                            latencies.append(time.perf_counter() - t0)
                except Exception:
                    errors += 1
                ordered = sorted(latencies[:-1])
                conn.send(
                    {
                        "small_p50_ms": ordered[len(ordered) // 2] * 1e3 if ordered else None,
                        "large_ms": latencies[-1] * 1e3
                        if len(latencies) > case.round_trips
                        else None,
                        "errors": errors,
                    }
                )


def bomb_message(size: int) -> bytes:
    """A valid message: a nil body and an out-of-band frame it does not refer to,
    compressed with Zstandard, that declares ``size`` bytes (``size`` zeros)."""
    import cramjam  # (the lz4 extra)

    zeros = bytearray(size)
    compressed = bytes(cramjam.zstd.compress(zeros, level=1))
    del zeros
    entry = (CODECS[BOMB_CODEC] << CODEC_SHIFT) | size
    header = struct.pack("!IQQ", 2, 1, entry)
    return header + b"\xc0" + struct.pack("!Q", len(compressed)) + compressed


async def _bomb_client(
    conn: Connection, case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> None:
    """The bomb scenario's client: per step, the legitimate client's round trips
    before, during and after the peers' attack (see the module)."""
    bomb = bomb_message(case.declare)
    options: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context is not None else {}
    async with await anyio_comm.connect(address, timeout=STARTUP_TIMEOUT, **options) as comm:
        while (command := await anyio.to_thread.run_sync(conn.recv)) != "stop":
            with anyio.fail_after(STEP_TIMEOUT + case.attack):
                conn.send(await _bomb_step(conn, case, comm, address, command, bomb, ssl_context))


async def _bomb_step(
    conn: Connection,
    case: Case,
    comm: anyio_comm.Comm,
    address: str,
    count: int,
    bomb: bytes,
    ssl_context: ssl.SSLContext | None,
) -> dict[str, Any]:
    """One step: ``count`` peers bomb the server while ``comm`` does round trips."""
    host, port = address.split("://")[1].rsplit(":", 1)
    peers: list[anyio.abc.ByteStream] = []
    samples: list[tuple[float, float]] = []  # (start, round trip)
    errors = 0
    payload = b"x" * 1000
    limiter = anyio.CapacityLimiter(100)

    async def ping() -> None:
        nonlocal errors
        while True:
            start = time.monotonic()
            try:
                await comm.send(payload)
                if bytes(await comm.receive()) != payload:
                    errors += 1
            except (anyio.BrokenResourceError, anyio.EndOfStream):
                errors += 1
                return
            samples.append((start, time.monotonic() - start))
            await anyio.sleep(BOMB_INTERVAL)

    preamble = encode_preamble(anyio_comm.Limits(), compression=(BOMB_CODEC,))

    async def attacker() -> None:
        async with limiter:
            stream = await _open_peer(host, int(port), ssl_context, preamble + bomb)
        peers.append(stream)
        for _ in range(case.bombs - 1):  # (their sends block once the kernel's buffers fill)
            await stream.send(bomb)
        await anyio.sleep_forever()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ping)
        await anyio.sleep(SETTLE)
        attack = time.monotonic()
        async with anyio.create_task_group() as attackers:
            for _ in range(count):
                attackers.start_soon(attacker)
            await anyio.sleep(case.attack)
            attackers.cancel_scope.cancel()
        for stream in peers:
            await anyio.aclose_forcefully(stream)  # (unread bytes: their sockets reset)
        left = time.monotonic()
        conn.send("left")
        await anyio.to_thread.run_sync(conn.recv)  # the server reported
        tg.cancel_scope.cancel()

    def figures(lo: float, hi: float) -> dict[str, float | None]:
        ordered = sorted(rtt for start, rtt in samples if lo <= start < hi)
        if not ordered:
            return {"p50_ms": None, "p99_ms": None, "max_ms": None}
        return {
            "p50_ms": ordered[len(ordered) // 2] * 1e3,
            "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
            "max_ms": ordered[-1] * 1e3,
        }

    return {"attack": figures(attack, left), "after": figures(left, math.inf), "errors": errors}


def format_bomb_table(results: list[dict[str, Any]]) -> str:
    """One row per step and backend (the bomb scenario)."""
    head = (
        f"{'peers':>6}{'growth MiB':>12}{'RSS MiB':>10}{'attack p50/p99/max ms':>24}"
        f"{'after p99/max ms':>18}{'CPU +0-1 s':>12}{'+1-2 s':>8}{'errors':>8}"
    )

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def figures(r: dict[str, Any]) -> list[str]:
        rows = []
        for s in r["steps"]:
            a, b = s["attack"], s["after"]
            attack = f"{ms(a['p50_ms'])}/{ms(a['p99_ms'])}/{ms(a['max_ms'])}"
            after = f"{ms(b['p99_ms'])}/{ms(b['max_ms'])}"
            rows.append(
                f"{s['peers']:>6}{_mib(s['growth']):>12}{_mib(s['rss']):>10}{attack:>24}"
                f"{after:>18}{s['cpu_first_s']:>12.2f}{s['cpu_next_s']:>8.2f}{s['errors']:>8}"
            )
        return rows[:1] + [" " * 19 + row for row in rows[1:]]

    return _harness.backend_table(head, results, figures)


def client_main(conn: Connection, case: Case, tls: TLSFiles | None, address: str) -> None:
    """Entry point of the client process."""
    raise_fd_limit(max(case.peers) + FD_MARGIN)
    ssl_context = client_context(tls, TLS_VERSION if case.transport == "tls" else None)
    client = _rpc_queue_client if case.scenario == "rpc-queue" else _client
    run_backend(case.backend, client, conn, case, address, ssl_context)


# -- the rpc-queue scenario -----------------------------------------------------

RPC_CALLS = 1100  # per peer: the default max_calls_per_connection + max_waiting_per_connection
RPC_ARGUMENT = 256 * 1024  # bytes of each call's argument
RPC_HOLD = 60.0  # seconds the method sleeps: longer than a step (and than stall_timeout)
RPC_MAX_PEERS = 8  # peers x 275 MiB queued where nothing bounds it: keep the machine alive


async def _rpc_queue_server(
    conn: Connection, case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> None:
    """``rpc.serve`` with default options (or unprotected); report as :func:`_server`
    does, with the calls waiting or running on all connections."""

    async def hold(_argument: bytes) -> None:
        await anyio.sleep(RPC_HOLD)

    async def echo(value: Any) -> Any:
        return value

    options: dict[str, Any] = {"ssl_context": ssl_context}
    if case.unprotected:
        options.update(receive_budget=None, allocator=bytearray, message_timeout=None)
    lifetime = STARTUP_TIMEOUT + STEP_TIMEOUT * (len(case.peers) + 1)
    with anyio.move_on_after(lifetime), contextlib.suppress(EOFError):
        async with rpc.serve(address, {"hold": hold, "echo": echo}, **options) as server:
            conn.send(("ready", server.address))
            while await anyio.to_thread.run_sync(conn.recv, abandon_on_cancel=True) != "stop":
                budget = server.listener.receive_budget
                conn.send(
                    {
                        **read_memory(),
                        "budget_in_use": budget.in_use if budget else None,
                        "budget_waiting": budget.waiting if budget else None,
                        "connections": server.listener.active_connections,
                        "calls": sum(len(session.running) for session in server._sessions),
                    }
                )


async def _rpc_queue_client(
    conn: Connection, case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> None:
    """Each step's new peers send their calls in tasks of their own (they block once
    the server stops reading); the step is measured once no call went out for
    twice SETTLE seconds; then a legitimate client's RPC round trips."""
    options: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context is not None else {}
    argument = os.urandom(RPC_ARGUMENT)
    sent = 0

    async def flood(comm: anyio_comm.Comm) -> None:
        nonlocal sent
        with contextlib.suppress(Exception):  # (closed by the server, or at the end)
            for i in range(RPC_CALLS):
                await comm.send(Call(i, "hold", [argument], {}, None).encode())
                sent += 1

    async with anyio.create_task_group() as tg, contextlib.AsyncExitStack() as stack:
        opened = 0
        while (command := await anyio.to_thread.run_sync(conn.recv)) != "stop":
            with anyio.fail_after(STEP_TIMEOUT):
                for _ in range(command - opened):
                    comm = await anyio_comm.connect(address, timeout=STARTUP_TIMEOUT, **options)
                    stack.callback(comm.abort)
                    tg.start_soon(flood, comm)
                opened = command
                quiet = 0  # settling periods in a row without a call sent
                while quiet < 2:
                    before = sent
                    await anyio.sleep(SETTLE)
                    quiet = quiet + 1 if sent == before else 0
            conn.send("opened")
            await anyio.to_thread.run_sync(conn.recv)  # the server has reported
            conn.send({**await _rpc_round_trips(address, case, options), "calls_sent": sent})
        tg.cancel_scope.cancel()


async def _rpc_round_trips(address: str, case: Case, options: dict[str, Any]) -> dict[str, Any]:
    """The legitimate client: ``round_trips`` calls of 1 KB and one of 1 MB."""
    latencies = []
    errors = 0
    try:
        with anyio.fail_after(STEP_TIMEOUT):
            async with rpc.connect(address, timeout=STARTUP_TIMEOUT, **options) as client:
                for payload in [b"x" * 1000] * case.round_trips + [os.urandom(2**20)]:
                    t0 = time.perf_counter()
                    if bytes(await client.call("echo", payload)) != payload:
                        errors += 1
                    latencies.append(time.perf_counter() - t0)
    except Exception:
        errors += 1
    ordered = sorted(latencies[: case.round_trips])
    return {
        "small_p50_ms": ordered[len(ordered) // 2] * 1e3 if ordered else None,
        "large_ms": latencies[-1] * 1e3 if len(latencies) > case.round_trips else None,
        "errors": errors,
    }


def _rpc_queue_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The rpc-queue scenario's default and bound of ``--peers``."""
    if args.scenario == "rpc-queue":
        args.peers = [0, 2] if args.peers is None else args.peers
        if args.peers[-1] > RPC_MAX_PEERS:
            parser.error(f"--peers: at most {RPC_MAX_PEERS} for rpc-queue")


# -- tls-storm: a TLS handshake storm --------------------------------------------
#
# Three processes: the server (first CPU); the attackers (second CPU), ``--stalled``
# peers that send a ClientHello and then nothing until the server drops them (and
# then reconnect), and ``--looping`` peers that do full TLS handshakes in a loop
# (and close at once); and a legitimate client (second CPU too), which keeps one
# established connection for round trips and makes new connections beside them.
# Phases alternate, ``--rounds`` times: quiet (no attackers), then storm.

STORM_WARMUP = 1.0  # seconds of storm before a storm phase is measured
STORM_SETTLE = 1.0  # seconds after a storm before the next phase
STORM_INTERVAL = 0.01  # seconds between the legitimate client's round trips
STORM_CONNECT_INTERVAL = 0.25  # seconds between its new connects
STORM_CONNECT_TARGET = 1.0  # seconds: every new connect during a storm completes sooner
STORM_P99_TARGET = 3.0  # the storm's round-trip p99 is at most this times the quiet one
STORM_LAG_TICK = 0.005  # seconds: the server measures how late its loop wakes a sleeper
STORM_NICENESS = 10  # of the attackers, so that the legitimate client runs when it wakes up
STORM_CLIENT_FIFO = 1  # the legitimate client's real-time priority, where allowed


@dataclass(frozen=True)
class StormCase:
    """One backend's run of the tls-storm scenario."""

    backend: str
    transport: str
    stalled: int
    looping: int
    seconds: float
    rounds: int
    handshake_threads: int | None  # the listener's option (None: its default)
    realtime_client: bool  # the legitimate client at SCHED_FIFO where allowed


async def _storm_server(
    conn: Connection, case: StormCase, address: str, ssl_context: ssl.SSLContext | None
) -> None:
    async def echo(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)

    lags: list[float] = []
    pauses = _GCPauses()
    gc.callbacks.append(pauses.callback)

    async def watch_lag() -> None:
        # how late the event loop runs a task that sleeps STORM_LAG_TICK seconds
        while True:
            t0 = anyio.current_time()
            await anyio.sleep(STORM_LAG_TICK)
            lags.append(anyio.current_time() - t0 - STORM_LAG_TICK)

    options: dict[str, Any] = {"ssl_context": ssl_context}
    if case.handshake_threads is not None:
        options["handshake_threads"] = case.handshake_threads
    async with (
        anyio_comm.listen(address, echo, **options) as listener,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(watch_lag)
        conn.send(("ready", listener.address))
        while True:
            command = await anyio.to_thread.run_sync(conn.recv, abandon_on_cancel=True)
            if command == "stop":
                tg.cancel_scope.cancel()
                return
            ordered = sorted(lags)
            lags.clear()
            conn.send(
                {
                    "cpu": time.process_time(),
                    "time": time.monotonic(),
                    **read_memory(),
                    "connections": listener.active_connections,
                    "lag_p99_ms": _quantile_ms(ordered, 0.99),
                    "lag_max_ms": _quantile_ms(ordered, 1.0),
                    **pauses.take(),
                }
            )


class _GCPauses:
    """The cyclic garbage collector's runs in the server, and how long each paused
    its event loop (a gc.callbacks entry)."""

    def __init__(self) -> None:
        self._start = 0.0
        self.count = 0
        self.total = 0.0
        self.longest = 0.0

    def callback(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        self.count += 1
        self.total += pause
        self.longest = max(self.longest, pause)

    def take(self) -> dict[str, float]:
        """The figures since the last call (cumulative count, total and longest)."""
        figures = {
            "gc_runs": self.count,
            "gc_ms": self.total * 1e3,
            "gc_max_ms": self.longest * 1e3,
        }
        self.longest = 0.0
        return figures


def _storm_server_main(conn: Connection, case: StormCase, tls: TLSFiles | None) -> None:
    raise_fd_limit(case.stalled + case.looping + FD_MARGIN)
    ssl_context = server_context(tls, TLS_VERSION)
    run_backend(case.backend, _storm_server, conn, case, "tls://127.0.0.1:0", ssl_context)


def _client_hello(ssl_context: ssl.SSLContext) -> bytes:
    """A ClientHello from ``ssl_context`` (the stalled peers all send the same one)."""
    import ssl

    outgoing = ssl.MemoryBIO()
    sslobj = ssl_context.wrap_bio(ssl.MemoryBIO(), outgoing, server_hostname="localhost")
    with contextlib.suppress(ssl.SSLWantReadError):
        sslobj.do_handshake()
    return outgoing.read()


async def _stall(host: str, port: int, hello: bytes, counts: dict[str, int]) -> None:
    """Send a ClientHello, read what comes until the server drops us; again."""
    while True:
        try:
            async with await anyio.connect_tcp(host, port) as stream:
                await stream.send(hello)
                counts["stalled"] += 1
                while True:
                    await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            await anyio.sleep(0.01)


async def _handshake_loop(
    host: str, port: int, ssl_context: ssl.SSLContext, counts: dict[str, int]
) -> None:
    """Full TLS handshakes, each connection closed as soon as its handshake completes."""
    while True:
        try:
            stream = await anyio.connect_tcp(
                host, port, tls=True, ssl_context=ssl_context, tls_hostname="localhost"
            )
        except Exception:
            counts["failed"] += 1
            await anyio.sleep(0.01)
            continue
        counts["handshakes"] += 1
        await anyio.aclose_forcefully(stream)


async def _storm_attackers(
    conn: Connection, case: StormCase, address: str, ssl_context: ssl.SSLContext
) -> None:
    host, port = address.split("://")[1].rsplit(":", 1)
    hello = _client_hello(ssl_context)
    while await anyio.to_thread.run_sync(conn.recv) == "start":
        counts = {"handshakes": 0, "failed": 0, "stalled": 0}
        start = time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(case.stalled):
                tg.start_soon(_stall, host, int(port), hello, counts)
            for _ in range(case.looping):
                tg.start_soon(_handshake_loop, host, int(port), ssl_context, counts)
            await anyio.to_thread.run_sync(conn.recv)  # "end"
            tg.cancel_scope.cancel()
        conn.send({**counts, "seconds": time.monotonic() - start})


def _storm_attackers_main(
    conn: Connection, case: StormCase, tls: TLSFiles | None, address: str
) -> None:
    raise_fd_limit(case.stalled + case.looping + FD_MARGIN)
    # The legitimate client shares the CPU: it must measure the server, not this process.
    os.nice(STORM_NICENESS)
    ssl_context = client_context(tls, TLS_VERSION)
    assert ssl_context is not None
    # the fastest backend installed, whatever the server's: the same storm for each
    backend = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    run_backend(backend, _storm_attackers, conn, case, address, ssl_context)


async def _storm_phase(
    comm: anyio_comm.Comm, address: str, ssl_context: ssl.SSLContext | None, seconds: float
) -> dict[str, Any]:
    """The legitimate client's figures over ``seconds``: round trips on ``comm``, one every
    :data:`STORM_INTERVAL`, and new connects beside them."""
    payload = b"x" * 1000
    end = anyio.current_time() + seconds
    round_trips: list[float] = []
    connects: list[float] = []
    failed = 0

    async def connect_loop() -> None:
        # (a connect still running at the end is waited for: the slow ones count)
        nonlocal failed
        while anyio.current_time() < end:
            t0 = time.perf_counter()
            try:
                async with await anyio_comm.connect(
                    address, ssl_context=ssl_context, timeout=STEP_TIMEOUT
                ):
                    connects.append(time.perf_counter() - t0)
            except Exception:
                failed += 1
            await anyio.sleep(STORM_CONNECT_INTERVAL)

    async with anyio.create_task_group() as tg:
        tg.start_soon(connect_loop)
        next_at = anyio.current_time()
        while (now := anyio.current_time()) < end:
            next_at = max(next_at + STORM_INTERVAL, now)
            t0 = time.perf_counter()
            await comm.send(payload)
            if bytes(await comm.receive()) != payload:
                failed += 1
            round_trips.append(time.perf_counter() - t0)
            await anyio.sleep(max(0.0, next_at - anyio.current_time()))
    return {"round_trips": round_trips, "connects": connects, "failed": failed}


async def _storm_client(
    conn: Connection, address: str, ssl_context: ssl.SSLContext | None, priority: str
) -> None:
    async with await anyio_comm.connect(
        address, ssl_context=ssl_context, timeout=STARTUP_TIMEOUT
    ) as comm:
        conn.send(priority)
        while (command := await anyio.to_thread.run_sync(conn.recv)) != "stop":
            conn.send(await _storm_phase(comm, address, ssl_context, command))


def _storm_client_main(
    conn: Connection, case: StormCase, tls: TLSFiles | None, address: str
) -> None:
    ssl_context = client_context(tls, TLS_VERSION)
    priority = _storm_client_priority(case.realtime_client)
    run_backend(case.backend, _storm_client, conn, address, ssl_context, priority)


def _storm_client_priority(realtime: bool) -> str:
    """Run this process ahead of the attackers on their shared CPU; say how.

    Real-time (``SCHED_FIFO``) if ``realtime`` and where allowed: then a round
    trip's reply is read as soon as it arrives, and the figures are the server's.
    Otherwise the attackers' niceness alone, under which the client may wait a
    time slice of theirs (some milliseconds) after a wake-up."""
    if not realtime:
        return f"nice 0 (the attackers' {STORM_NICENESS}; --client-nice)"
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(STORM_CLIENT_FIFO))
    except (AttributeError, OSError):  # not Linux, or not allowed
        return f"nice 0 (the attackers' {STORM_NICENESS}; SCHED_FIFO not allowed)"
    return f"SCHED_FIFO {STORM_CLIENT_FIFO}"


def _quantile_ms(ordered: list[float], q: float) -> float | None:
    return ordered[round(q * (len(ordered) - 1))] * 1e3 if ordered else None


def run_storm_case(
    ctx: Any, case: StormCase, cpus: tuple[int | None, int | None], tls: TLSFiles | None
) -> dict[str, Any]:
    """Run one backend: quiet and storm phases, alternately; return the phases."""
    phases = []
    quiet: list[float] = []  # the round trips of every quiet phase
    stormy: list[float] = []  # and of every storm phase
    with ProcessPair(ctx, "storm", cpus) as pair, contextlib.ExitStack() as stack:
        server, address = pair.start_server(_storm_server_main, case, tls)
        client = pair.start_client(_storm_client_main, case, tls, address)
        attackers = Child(
            ctx, "storm-attackers", _storm_attackers_main, (case, tls, address), cpu=cpus[1]
        )
        stack.callback(attackers.stop)
        stack.callback(attackers.conn.close)
        priority = client.receive(time.monotonic() + STARTUP_TIMEOUT)  # connected
        for round_ in range(case.rounds):
            for storm in (False, True):
                if storm:
                    attackers.send("start")
                    time.sleep(STORM_WARMUP)
                server.send("report")
                before = server.receive(time.monotonic() + STARTUP_TIMEOUT)
                client.send(case.seconds)
                legit = client.receive(time.monotonic() + case.seconds + STEP_TIMEOUT)
                server.send("report")
                after = server.receive(time.monotonic() + STARTUP_TIMEOUT)
                attack: dict[str, Any] = {}
                if storm:
                    attackers.send("end")
                    attack = attackers.receive(time.monotonic() + STEP_TIMEOUT)
                    time.sleep(STORM_SETTLE)
                ordered = sorted(legit["round_trips"])
                (stormy if storm else quiet).extend(ordered)
                phases.append(
                    {
                        "round": round_,
                        "storm": storm,
                        "server_cores": (after["cpu"] - before["cpu"])
                        / (after["time"] - before["time"]),
                        "rss": after["rss"],
                        "hwm": after["hwm"],
                        "handshakes_per_s": attack["handshakes"] / attack["seconds"]
                        if storm
                        else None,
                        "stalled_opened": attack.get("stalled"),
                        "attack_failed": attack.get("failed"),
                        "lag_p99_ms": after["lag_p99_ms"],
                        "lag_max_ms": after["lag_max_ms"],
                        "gc_runs": after["gc_runs"] - before["gc_runs"],
                        "gc_ms": after["gc_ms"] - before["gc_ms"],
                        "gc_max_ms": after["gc_max_ms"],
                        "round_trips": len(ordered),
                        "p50_ms": _quantile_ms(ordered, 0.5),
                        "p99_ms": _quantile_ms(ordered, 0.99),
                        "max_ms": _quantile_ms(ordered, 1.0),
                        "connects": sorted(legit["connects"]),
                        "failed": legit["failed"],
                    }
                )
        client.send("stop")
        server.send("stop")
    return {
        **asdict(case),
        "client_priority": priority,
        "phases": phases,
        **_storm_verdict(phases, quiet, stormy),
    }


def _storm_verdict(
    phases: list[dict[str, Any]], quiet: list[float], stormy: list[float]
) -> dict[str, Any]:
    """The p99 of every storm phase's round trips over the p99 of every quiet
    phase's (and each round's own ratio), the slowest connect in a storm, and
    whether the targets were met.

    The target is judged on the rounds pooled: a phase's p99 is its 4th-slowest
    round trip of 400, which one collection of the garbage collector or one
    burst of the machine's other work moves; pooled, it is the 12th of 1,200
    (with 3 rounds)."""
    ratios = []
    for quiet_phase, storm_phase in zip(phases[::2], phases[1::2], strict=True):
        if quiet_phase["p99_ms"] and storm_phase["p99_ms"] is not None:
            ratios.append(storm_phase["p99_ms"] / quiet_phase["p99_ms"])
    quiet_p99 = _quantile_ms(sorted(quiet), 0.99)
    storm_p99 = _quantile_ms(sorted(stormy), 0.99)
    ratio = storm_p99 / quiet_p99 if quiet_p99 and storm_p99 is not None else None
    slowest = max((max(p["connects"], default=0.0) for p in phases if p["storm"]), default=None)
    failed = sum(p["failed"] for p in phases)
    met = (
        ratio is not None
        and ratio <= STORM_P99_TARGET
        and slowest is not None
        and slowest < STORM_CONNECT_TARGET
        and not failed
    )
    return {
        "p99_ratio": ratio,
        "quiet_p99_ms": quiet_p99,
        "storm_p99_ms": storm_p99,
        "p99_ratios": ratios,
        "slowest_storm_connect_s": slowest,
        "target_met": met,
    }


def format_storm_table(results: list[dict[str, Any]]) -> str:
    """One row per phase and backend."""
    head = (
        f"{'phase':>7}{'srv cores':>10}{'RSS MiB':>9}{'hs/s':>6}{'rt p50 ms':>10}"
        f"{'p99 ms':>8}{'max ms':>8}{'conn p50 s':>11}{'conn max s':>11}{'fail':>5}"
        f"{'lag p99':>8}{'lag max':>8}{'gc runs':>8}{'gc ms':>7}{'gc max':>7}"
    )

    def figures(r: dict[str, Any]) -> list[str]:
        rows = []
        for p in r["phases"]:
            connects = p["connects"]
            rate = p["handshakes_per_s"]
            rows.append(
                f"{'storm' if p['storm'] else 'quiet':>7}{p['server_cores']:>10.2f}"
                f"{_mib(p['rss']):>9}{'-' if rate is None else f'{rate:.0f}':>6}"
                f"{_harness_num(p['p50_ms'], '.2f'):>10}{_harness_num(p['p99_ms'], '.2f'):>8}"
                f"{_harness_num(p['max_ms'], '.1f'):>8}"
                f"{_harness_num(connects[len(connects) // 2] if connects else None, '.3f'):>11}"
                f"{_harness_num(max(connects, default=None), '.3f'):>11}{p['failed']:>5}"
                f"{_harness_num(p['lag_p99_ms'], '.1f'):>8}"
                f"{_harness_num(p['lag_max_ms'], '.1f'):>8}"
                f"{p['gc_runs']:>8}{p['gc_ms']:>7.1f}{p['gc_max_ms']:>7.1f}"
            )
        ratios = ", ".join(f"{x:.1f}" for x in r["p99_ratios"])
        rows.append(
            f"{'':>7}storm p99 / quiet p99, rounds pooled: "
            f"{_harness_num(r['storm_p99_ms'], '.2f')} / {_harness_num(r['quiet_p99_ms'], '.2f')}"
            f" ms = {_harness_num(r['p99_ratio'], '.1f')} (each round: {ratios}); slowest "
            f"storm connect {_harness_num(r['slowest_storm_connect_s'], '.3f')} s; target met: "
            f"{r['target_met']}; client priority: {r['client_priority']}"
        )
        return rows[:1] + [" " * 19 + row for row in rows[1:]]

    return _harness.backend_table(head, results, figures)


def storm_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Run the tls-storm scenario on each backend; return the exit status."""
    args.transport = "tls"
    if (backends := _harness.backends_for(args)) is None:
        return 2
    run = _harness.start_run("hostile_peers", "TLS handshake storm", argv, args.no_pin)
    limit = "default" if args.handshake_threads is None else args.handshake_threads
    print(
        f"tls {TLS_VERSION}; storm: {args.stalled} peers stalling after their ClientHello, "
        f"{args.looping} doing full handshakes in a loop; handshake_threads {limit}; "
        f"{args.rounds} x ({args.seconds:g} s quiet, {args.seconds:g} s storm)",
        flush=True,
    )
    cases = [
        StormCase(
            backend,
            "tls",
            args.stalled,
            args.looping,
            args.seconds,
            args.rounds,
            args.handshake_threads,
            not args.client_nice,
        )
        for backend in backends
    ]
    results = _harness.run_backends(
        cases,
        run_storm_case,
        run.cpus,
        "hostile-tls-",
        lambda r: (
            f"p99 ratio {_harness_num(r['p99_ratio'], '.1f')} "
            f"(rounds {', '.join(f'{x:.1f}' for x in r['p99_ratios'])})"
        ),
    )
    print(format_storm_table(results))
    print(
        "\nsrv cores: the server's CPU time over the phase's time; hs/s: the looping peers' "
        "full handshakes per second; rt: the legitimate client's 1 KB round trips on its "
        f"established connection (one every {STORM_INTERVAL * 1e3:g} ms); conn: its new "
        f"connects (TLS and preamble, one every {STORM_CONNECT_INTERVAL:g} s); lag: how late "
        f"(ms) the server's event loop wakes a task sleeping {STORM_LAG_TICK * 1e3:g} ms; "
        "gc: the server's garbage collections, their total and longest pause (ms); "
        "target: storm p99 (rounds pooled) "
        f"<= {STORM_P99_TARGET:g} x quiet p99 and every storm connect under "
        f"{STORM_CONNECT_TARGET:g} s"
    )
    if args.json:
        metadata = run.metadata(args, tls=_harness.transport_tls(args, TLS_VERSION))
        write_json(args.json, {"metadata": metadata, "results": results})
    failed = any("error" in r or not r.get("target_met") for r in results)
    return 1 if failed else 0


# -- orchestration --------------------------------------------------------------


def run_case(
    ctx: Any, case: Case, cpus: tuple[int | None, int | None], tls: TLSFiles | None
) -> dict[str, Any]:
    """Run one backend: the server, then the client's steps; return the rows."""
    steps = []
    with ProcessPair(ctx, "hostile", cpus) as pair:
        server, address = pair.start_server(server_main, case, tls)
        client = pair.start_client(client_main, case, tls, address)
        server.send("report")
        start = server.receive(time.monotonic() + STARTUP_TIMEOUT)  # before any peer
        run_step = _bomb_step_row if case.scenario == "bomb" else _step_row
        for peers in case.peers:
            steps.append(run_step(server, client, case, peers, start))
        client.send("stop")
        server.send("stop")
    return {
        **asdict(case),
        "start_rss": start["rss"],
        "steps": steps,
        "target_met": _target_met(case, steps),
    }


def _step_row(
    server: Child,
    client: Child,
    case: Case,  # noqa: ARG001 (the signature of every step)
    peers: int,
    start: dict[str, Any],
) -> dict[str, Any]:
    """One step: open ``peers`` peers in all, report, then the legitimate client."""
    client.send(peers)
    client.receive(time.monotonic() + STEP_TIMEOUT)
    server.send("report")
    report = server.receive(time.monotonic() + STARTUP_TIMEOUT)
    client.send("go")
    legit = client.receive(time.monotonic() + STEP_TIMEOUT)
    return {"peers": peers, **report, **legit, "growth": report["rss"] - start["rss"]}


def _bomb_step_row(
    server: Child, client: Child, case: Case, peers: int, start: dict[str, Any]
) -> dict[str, Any]:
    """One step of the bomb scenario (see the module); growth: the step's peak
    above the server's level before any peer."""
    server.send("reset peak")
    server.receive(time.monotonic() + STARTUP_TIMEOUT)
    client.send(peers)
    client.receive(time.monotonic() + STEP_TIMEOUT + case.attack)  # "left"
    reports = []
    for _ in range(3):  # when they left, 1 s later, 2 s later
        server.send("report")
        reports.append(server.receive(time.monotonic() + STARTUP_TIMEOUT))
        time.sleep(1.0)
    client.send("go")
    legit = client.receive(time.monotonic() + STEP_TIMEOUT)
    return {
        "peers": peers,
        **reports[-1],
        **legit,
        "growth": reports[-1]["hwm"] - start["rss"],
        "cpu_first_s": reports[1]["cpu"] - reports[0]["cpu"],
        "cpu_next_s": reports[2]["cpu"] - reports[1]["cpu"],
    }


def _target_met(case: Case, steps: list[dict[str, Any]]) -> bool | None:
    """Whether the step of TARGET_PEERS peers met the scenario's target (None: no
    target for this run)."""
    at_target = [s for s in steps if s["peers"] == TARGET_PEERS]
    if not at_target or case.declare < 2**30:
        return None
    step = at_target[0]
    if case.scenario == "declare":
        return bool(step["growth"] < GROWTH_TARGET and step["errors"] == 0)
    if case.scenario == "bomb":
        # the budget, one larger message, the pool's slab of the one before it
        bound = DEFAULT_RECEIVE_BUDGET + 2 * case.declare
        return bool(
            step["growth"] < bound
            and (step["attack"]["max_ms"] or math.inf) < 100
            and step["cpu_next_s"] < IDLE_CPU
            and step["errors"] == 0
        )
    return None


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per step and backend."""
    head = (
        f"{'peers':>6}{'RSS MiB':>10}{'growth MiB':>12}{'peak MiB':>10}{'budget MiB':>12}"
        f"{'waiting':>9}{'1 KB p50 ms':>13}{'1 MB ms':>9}{'errors':>8}"
    )

    def figures(r: dict[str, Any]) -> list[str]:
        rows = [
            f"{s['peers']:>6}{_mib(s['rss']):>10}{_mib(s['growth']):>12}{_mib(s['hwm']):>10}"
            f"{_mib(s['budget_in_use']):>12}{_harness_num(s['budget_waiting']):>9}"
            f"{_harness_num(s['small_p50_ms'], '.2f'):>13}{_harness_num(s['large_ms'], '.1f'):>9}"
            f"{s['errors']:>8}"
            for s in r["steps"]
        ]
        return rows[:1] + [" " * 19 + row for row in rows[1:]]  # under the first row

    return _harness.backend_table(head, results, figures)


def _harness_num(value: float | None, spec: str = "d") -> str:
    return "-" if value is None else format(value, spec)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.argument_parser("hostile_peers", __doc__)
    add = parser.add_argument
    add("--scenario", choices=SCENARIOS, default="declare", help="default: declare")
    add(
        "--peers",
        type=csv_list(None, int),
        default=None,
        help="cumulative peer counts to measure at (default: 0,16,64,256 for declare and "
        "frames, 0,1000 for idle, 0,2000 for silent, 0,1,64 for bomb, 0,2 for rpc-queue)",
    )
    add("--declare", type=byte_size(), default=2**30, help="frame declared (1GiB)")
    add(
        "--frames",
        type=whole_number(),
        default=anyio_comm.Limits().max_frames,
        help="frames of the frames and taken scenarios' messages (default: the limit, 16384)",
    )
    add(
        "--messages",
        type=whole_number(),
        default=4,
        help="whole messages each peer sends in the taken scenario (default: 4)",
    )
    add("--round-trips", type=whole_number(), default=50, help="1 KB ones (default: 50)")
    add("--unprotected", action="store_true", help="no budget, frames committed at their header")
    add(
        "--attack",
        type=float,
        default=5.0,
        help="seconds the bomb scenario's peers stay before they leave (default: 5)",
    )
    add(
        "--bombs",
        type=whole_number(),
        default=1,
        help="messages each peer of the bomb scenario sends, one after another (default: 1)",
    )
    storm = parser.add_argument_group("tls-storm")
    storm.add_argument(
        "--stalled", type=int, default=100, help="peers stalling after ClientHello (100)"
    )
    storm.add_argument(
        "--looping", type=int, default=100, help="peers doing full handshakes in a loop (100)"
    )
    storm.add_argument("--seconds", type=float, default=5.0, help="per phase (default: 5)")
    storm.add_argument("--rounds", type=whole_number(), default=2, help="quiet+storm rounds (2)")
    storm.add_argument(
        "--handshake-threads",
        type=whole_number(),
        default=None,
        help="the listener's handshake_threads (default: its default)",
    )
    storm.add_argument(
        "--client-nice",
        action="store_true",
        help="keep the legitimate client at niceness 0, not real-time (its figures then "
        "include its waits for the attackers' CPU)",
    )
    _harness.add_backend_options(parser, TRANSPORTS)
    _harness.add_output_options(parser)
    args = parser.parse_args(argv)
    _rpc_queue_arguments(parser, args)
    if args.peers is None:
        args.peers = {"idle": [0, 1000], "silent": [0, 2000], "bomb": [0, 1, 64]}.get(
            args.scenario, [0, 16, 64, 256]
        )
    if sorted(args.peers) != args.peers or not args.peers or args.peers[0] < 0:
        parser.error("--peers must be increasing counts from 0 up")
    if args.frames > anyio_comm.Limits().max_frames:
        parser.error(f"--frames: at most the default limit, {anyio_comm.Limits().max_frames}")
    if args.peers[-1] > 5000:
        parser.error("--peers: at most 5000")
    unprotected_total = args.peers[-1] * args.declare
    if (
        args.unprotected
        and args.scenario == "declare"
        and unprotected_total > UNPROTECTED_MAX * 2**30
    ):
        parser.error(f"--unprotected commits every declared frame: at most {UNPROTECTED_MAX} GiB")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run each backend and print the results; return the exit status."""
    args = parse_args(argv)
    if args.scenario == "tls-storm":
        return storm_main(args, argv)
    if (backends := _harness.backends_for(args)) is None:
        return 2
    run = _harness.start_run("hostile_peers", "hostile-peers memory benchmark", argv, args.no_pin)
    mode = "unprotected (no budget, eager frames)" if args.unprotected else "default options"
    what = {
        "declare": f"each declaring a {args.declare:,}-byte frame",
        "frames": f"each sending the header of a message of {args.frames:,} frames",
        "taken": f"each sending {args.messages} messages of {args.frames:,} empty frames, kept",
        "idle": "idle after the preamble",
        "bomb": f"each sending {args.bombs:,} {BOMB_CODEC} bombs of {args.declare:,} bytes, "
        f"leaving after {args.attack:g} s",
        "rpc-queue": f"each queueing {RPC_CALLS:,} RPC calls of {RPC_ARGUMENT:,} bytes",
        "silent": "connected, silent (no preamble, no TLS handshake)",
    }[args.scenario]
    print(f"{args.transport}, {mode}; peers {what}", flush=True)
    cases = [
        Case(
            backend,
            args.transport,
            args.scenario,
            tuple(args.peers),
            args.declare,
            args.frames,
            args.messages,
            args.round_trips,
            args.unprotected,
            args.attack,
            args.bombs,
        )
        for backend in backends
    ]
    results = _harness.run_backends(
        cases,
        run_case,
        run.cpus,
        "hostile-tls-" if args.transport == "tls" else None,
        lambda r: f"last step: growth {_mib(r['steps'][-1]['growth'])} MiB",
    )
    if args.scenario == "bomb":
        print(format_bomb_table(results))
        print(
            "\ngrowth: the server's peak RSS during the step above its RSS before any peer; "
            "attack, after: the legitimate round trips while the peers were there, and after; "
            "CPU: the server's CPU seconds in the first and the second second after they left"
        )
    else:
        print(format_table(results))
        print(
            "\ngrowth: the server's RSS above its level before any peer; budget: the listener's "
            "receive budget in use; waiting: connections waiting for it"
        )
    if args.json:
        metadata = run.metadata(args, tls=_harness.transport_tls(args, TLS_VERSION))
        write_json(args.json, {"metadata": metadata, "results": results})
    failed = any("error" in r or r.get("target_met") is False for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
