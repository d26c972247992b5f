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
* ``idle``: nothing after the preamble.

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
round trips' p50/p99/max, the new connects' times and the server's event-loop
lag (how much later than asked a task sleeping 5 ms wakes up). Target: in every
round, the storm's p99 is at most 3 times the quiet phase's, and every new
connect during the storm completes within 1 s. The attackers and the
legitimate client share the second CPU, the attackers at niceness 10 so that
the legitimate client's figures are the server's, not the waits of a client
that shares its CPU with a busy process.

They are opened in steps (``--peers``, cumulative counts); after each step
and a settling second the server reports its resident set size (``VmRSS``),
its peak (``VmHWM``) and its receive budget, and a legitimate client does
``--round-trips`` round trips of 1 KB and one of 1 MB, whose latencies are
reported. The server is pinned to the first CPU, the client to the second
(``os.sched_setaffinity``), as in ``benchmarks.echo``; the output says which.

Targets (default options): 64 peers declaring 1 GiB frames grow the server by
less than 512 MiB, and the legitimate client's round trips all succeed.

Run from the repository root::

    python -m benchmarks.hostile_peers                          # declare, 0-256 peers, tcp
    python -m benchmarks.hostile_peers --transport tls --backend uvloop
    python -m benchmarks.hostile_peers --scenario frames --peers 0,16,64
    python -m benchmarks.hostile_peers --scenario taken --peers 0,16,64
    python -m benchmarks.hostile_peers --scenario idle --peers 0,1000
    python -m benchmarks.hostile_peers --unprotected --peers 0,1,4   # the old behaviour
    python -m benchmarks.hostile_peers --scenario tls-storm --backend uvloop --rounds 3
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import struct
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

import anyio_comm
from anyio_comm._sansio.wire import SMALL_COUNT, encode_header, encode_preamble

from . import _harness
from ._harness import (
    STARTUP_TIMEOUT,
    ProcessPair,
    TLSFiles,
    client_context,
    csv_list,
    run_backend,
    server_context,
)
from .backpressure import read_memory
from .many_connections import FD_MARGIN, raise_fd_limit

if TYPE_CHECKING:
    import argparse
    import ssl
    from multiprocessing.connection import Connection

TRANSPORTS = ("tcp", "tls")
SCENARIOS = ("declare", "frames", "taken", "idle", "tls-storm")
TLS_VERSION = "1.3"
SETTLE = 1.0  # seconds between opening a step's peers and measuring
STEP_TIMEOUT = 120.0  # seconds for one step (opening peers and the round trips)
GROWTH_TARGET = 512 * 2**20  # bytes: 64 peers declaring 1 GiB must grow the server less
TARGET_PEERS = 64
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
                budget = listener.receive_budget
                conn.send(
                    {
                        **read_memory(),
                        "budget_in_use": budget.in_use if budget else None,
                        "budget_waiting": budget.waiting if budget else None,
                        "connections": listener.active_connections,
                    }
                )


def server_main(conn: Connection, case: Case, tls: TLSFiles | None) -> None:
    """Entry point of the server process."""
    raise_fd_limit(max(case.peers) + FD_MARGIN)
    ssl_context = server_context(tls, TLS_VERSION if case.transport == "tls" else None)
    run_backend(case.backend, _server, conn, case, f"{case.transport}://127.0.0.1:0", ssl_context)


# -- client ---------------------------------------------------------------------


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


def client_main(conn: Connection, case: Case, tls: TLSFiles | None, address: str) -> None:
    """Entry point of the client process."""
    raise_fd_limit(max(case.peers) + FD_MARGIN)
    ssl_context = client_context(tls, TLS_VERSION if case.transport == "tls" else None)
    run_backend(case.backend, _client, conn, case, address, ssl_context)


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


async def _storm_server(
    conn: Connection, case: StormCase, address: str, ssl_context: ssl.SSLContext | None
) -> None:
    async def echo(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)

    lags: list[float] = []

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
                }
            )


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
    conn: Connection, address: str, ssl_context: ssl.SSLContext | None
) -> None:
    async with await anyio_comm.connect(
        address, ssl_context=ssl_context, timeout=STARTUP_TIMEOUT
    ) as comm:
        conn.send("connected")
        while (command := await anyio.to_thread.run_sync(conn.recv)) != "stop":
            conn.send(await _storm_phase(comm, address, ssl_context, command))


def _storm_client_main(
    conn: Connection, case: StormCase, tls: TLSFiles | None, address: str
) -> None:
    ssl_context = client_context(tls, TLS_VERSION)
    run_backend(case.backend, _storm_client, conn, address, ssl_context)


def _quantile_ms(ordered: list[float], q: float) -> float | None:
    return ordered[round(q * (len(ordered) - 1))] * 1e3 if ordered else None


def run_storm_case(
    ctx: Any, case: StormCase, cpus: tuple[int | None, int | None], tls: TLSFiles | None
) -> dict[str, Any]:
    """Run one backend: quiet and storm phases, alternately; return the phases."""
    phases = []
    with ProcessPair(ctx, "storm", cpus) as pair, contextlib.ExitStack() as stack:
        server, address = pair.start_server(_storm_server_main, case, tls)
        client = pair.start_client(_storm_client_main, case, tls, address)
        attackers = _harness.Child(
            ctx, "storm-attackers", cpus[1], _storm_attackers_main, (case, tls, address)
        )
        stack.callback(attackers.stop)
        stack.callback(attackers.conn.close)
        client.receive(time.monotonic() + STARTUP_TIMEOUT)  # connected
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
    return {**asdict(case), "phases": phases, **_storm_verdict(phases)}


def _storm_verdict(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's storm p99 over its quiet p99, the slowest connect in a storm, and
    whether both targets were met in every round."""
    ratios = []
    for quiet, storm in zip(phases[::2], phases[1::2], strict=True):
        if quiet["p99_ms"] and storm["p99_ms"] is not None:
            ratios.append(storm["p99_ms"] / quiet["p99_ms"])
    slowest = max((max(p["connects"], default=0.0) for p in phases if p["storm"]), default=None)
    failed = sum(p["failed"] for p in phases)
    met = (
        bool(ratios)
        and max(ratios) <= STORM_P99_TARGET
        and slowest is not None
        and slowest < STORM_CONNECT_TARGET
        and not failed
    )
    return {"p99_ratios": ratios, "slowest_storm_connect_s": slowest, "target_met": met}


def format_storm_table(results: list[dict[str, Any]]) -> str:
    """One row per phase and backend."""
    head = (
        f"{'phase':>7}{'srv cores':>10}{'RSS MiB':>9}{'hs/s':>6}{'rt p50 ms':>10}"
        f"{'p99 ms':>8}{'max ms':>8}{'conn p50 s':>11}{'conn max s':>11}{'fail':>5}"
        f"{'lag p99':>8}{'lag max':>8}"
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
            )
        ratios = ", ".join(f"{x:.1f}" for x in r["p99_ratios"])
        rows.append(
            f"{'':>7}storm p99 / quiet p99: {ratios}; slowest storm connect "
            f"{_harness_num(r['slowest_storm_connect_s'], '.3f')} s; target met: "
            f"{r['target_met']}"
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
        )
        for backend in backends
    ]
    results = _harness.run_backends(
        cases,
        run_storm_case,
        run.cpus,
        "hostile-tls-",
        lambda r: f"p99 ratios {', '.join(f'{x:.1f}' for x in r['p99_ratios'])}",
    )
    print(format_storm_table(results))
    print(
        "\nsrv cores: the server's CPU time over the phase's time; hs/s: the looping peers' "
        "full handshakes per second; rt: the legitimate client's 1 KB round trips on its "
        f"established connection (one every {STORM_INTERVAL * 1e3:g} ms); conn: its new "
        f"connects (TLS and preamble, one every {STORM_CONNECT_INTERVAL:g} s); lag: how late "
        f"(ms) the server's event loop wakes a task sleeping {STORM_LAG_TICK * 1e3:g} ms; "
        "target: storm "
        f"p99 <= {STORM_P99_TARGET:g} x quiet p99 and every storm connect under "
        f"{STORM_CONNECT_TARGET:g} s"
    )
    if args.json:
        metadata = run.metadata(args, tls=_harness.transport_tls(args, TLS_VERSION))
        _harness.write_json(args.json, {"metadata": metadata, "results": results})
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
        start = server.receive(time.monotonic() + STARTUP_TIMEOUT)
        for peers in case.peers:
            client.send(peers)
            client.receive(time.monotonic() + STEP_TIMEOUT)
            server.send("report")
            report = server.receive(time.monotonic() + STARTUP_TIMEOUT)
            client.send("go")
            legit = client.receive(time.monotonic() + STEP_TIMEOUT)
            steps.append(
                {"peers": peers, **report, **legit, "growth": report["rss"] - start["rss"]}
            )
        client.send("stop")
        server.send("stop")
    at_target = [s for s in steps if s["peers"] == TARGET_PEERS]
    met = None
    if case.scenario == "declare" and case.declare >= 2**30 and at_target:
        met = at_target[0]["growth"] < GROWTH_TARGET and at_target[0]["errors"] == 0
    return {**asdict(case), "start_rss": start["rss"], "steps": steps, "target_met": met}


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
        "frames, 0,1000 for idle)",
    )
    add("--declare", type=_harness.parse_size, default=2**30, help="frame declared (1GiB)")
    add(
        "--frames",
        type=_harness.positive_int,
        default=anyio_comm.Limits().max_frames,
        help="frames of the frames and taken scenarios' messages (default: the limit, 16384)",
    )
    add(
        "--messages",
        type=_harness.positive_int,
        default=4,
        help="whole messages each peer sends in the taken scenario (default: 4)",
    )
    add("--round-trips", type=_harness.positive_int, default=50, help="1 KB ones (default: 50)")
    add("--unprotected", action="store_true", help="no budget, frames committed at their header")
    storm = parser.add_argument_group("tls-storm")
    storm.add_argument(
        "--stalled", type=int, default=100, help="peers stalling after ClientHello (100)"
    )
    storm.add_argument(
        "--looping", type=int, default=100, help="peers doing full handshakes in a loop (100)"
    )
    storm.add_argument("--seconds", type=float, default=5.0, help="per phase (default: 5)")
    storm.add_argument(
        "--rounds", type=_harness.positive_int, default=2, help="quiet+storm rounds (2)"
    )
    storm.add_argument(
        "--handshake-threads",
        type=_harness.positive_int,
        default=None,
        help="the listener's handshake_threads (default: its default)",
    )
    _harness.add_backend_options(parser, TRANSPORTS)
    _harness.add_output_options(parser)
    args = parser.parse_args(argv)
    if args.peers is None:
        args.peers = [0, 1000] if args.scenario == "idle" else [0, 16, 64, 256]
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
    print(format_table(results))
    print(
        "\ngrowth: the server's RSS above its level before any peer; budget: the listener's "
        "receive budget in use; waiting: connections waiting for it"
    )
    if args.json:
        metadata = run.metadata(args, tls=_harness.transport_tls(args, TLS_VERSION))
        _harness.write_json(args.json, {"metadata": metadata, "results": results})
    failed = any("error" in r or r.get("target_met") is False for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
