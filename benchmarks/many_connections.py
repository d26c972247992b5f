"""Many connections at once: connect time, request latency and server memory.

A server process runs one :func:`anyio_comm.listen` with an echo handler; a
client process opens ``--connections`` comms (``--connect-concurrency`` connect
calls at a time, under the listen backlog of 1024), and once every one is
open, all of them do ``--round-trips`` request/reply round trips of
``--size``-byte payloads at once, each request tagged with its connection and
sequence number and checked on return. The connections are closed only after
the last round trip, so all of them are open together for the whole
measurement. Both processes raise their ``RLIMIT_NOFILE`` soft limit to the
hard limit when needed, and are pinned to two different CPUs (server on the
first, client on the second, ``os.sched_setaffinity``, as in
``benchmarks.echo``); the output says which.

Reported per backend: the time to open every connection, round-trip latency
(p50, p99, max), round trips per second over the exchange phase, errors
(failed connects, failed or mismatched round trips), the most connections the
listener counted at once, and the server's resident set size before any
connection, at its peak (``VmHWM``, reset once the listener is up, and 10 ms
samples) and the growth per connection.

Run from the repository root::

    python -m benchmarks.many_connections                     # 1000 connections, every backend
    python -m benchmarks.many_connections --connections 1000 --round-trips 20 --size 1000 \\
        --backend uvloop --transport tls --json many.json
"""

from __future__ import annotations

import contextlib
import resource
import struct
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

import anyio_comm
from anyio_comm.bench import (
    TLSFiles,
    client_context,
    run_backend,
    server_context,
    whole_number,
    write_json,
)

from . import _harness
from ._harness import STARTUP_TIMEOUT, ProcessPair
from .backpressure import MemoryWatch, read_memory

if TYPE_CHECKING:
    import argparse
    import ssl
    from multiprocessing.connection import Connection

TRANSPORTS = ("tcp", "unix", "tls")
TLS_VERSION = "1.3"
TAG = struct.Struct("!II")  # connection id, sequence number
FD_MARGIN = 256  # file descriptors beyond one per connection


@dataclass(frozen=True)
class Case:
    """One backend's run."""

    backend: str
    transport: str
    connections: int
    round_trips: int
    size: int
    connect_concurrency: int
    seconds_max: float


def raise_fd_limit(needed: int) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit if it is below ``needed``.

    Returns:
        The soft limit now in force.

    Raises:
        RuntimeError: even the hard limit is below ``needed``.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise RuntimeError(
            f"RLIMIT_NOFILE hard limit is {hard}; {needed} file descriptors are needed "
            "(raise it with `ulimit -Hn` or use fewer --connections)"
        )
    raised = hard if hard != resource.RLIM_INFINITY else needed
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    return raised


# -- server -------------------------------------------------------------------


async def _server(
    conn: Connection, case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> dict[str, Any]:
    """Echo until told ``"stop"``; return memory and connection counts."""
    echoed = 0
    most_active = 0
    watch = MemoryWatch()
    listener: anyio_comm.Listener | None = None

    async def echo(comm: anyio_comm.Comm) -> None:
        nonlocal echoed, most_active
        if listener is not None:
            most_active = max(most_active, listener.active_connections)
        async for message in comm:
            await comm.send(message)
            echoed += 1

    lifetime = 2 * STARTUP_TIMEOUT + case.seconds_max
    cpu0 = time.process_time()
    listening = anyio_comm.listen(address, echo, ssl_context=ssl_context)
    with anyio.move_on_after(lifetime):
        async with listening as listener, anyio.create_task_group() as tg:
            await tg.start(watch.start)
            conn.send(("ready", listener.address))
            command = None
            with contextlib.suppress(EOFError):
                while command != "stop":
                    command = await anyio.to_thread.run_sync(conn.recv, abandon_on_cancel=True)
            tg.cancel_scope.cancel()
    memory = watch.stop()
    return {
        "most_active": most_active,
        "echoed": echoed,
        "cpu_seconds": time.process_time() - cpu0,
        **memory,
    }


def server_main(
    conn: Connection, case: Case, tls: TLSFiles | None, unix_dir: str | None
) -> dict[str, Any]:
    """Entry point of the server process."""
    raise_fd_limit(case.connections + FD_MARGIN)
    ssl_context = server_context(tls, TLS_VERSION)
    if case.transport == "unix":
        assert unix_dir is not None
        address = f"unix://{unix_dir}/many.sock"
    else:
        address = f"{case.transport}://127.0.0.1:0"
    return run_backend(case.backend, _server, conn, case, address, ssl_context)


# -- client -------------------------------------------------------------------


async def _client(case: Case, address: str, ssl_context: ssl.SSLContext | None) -> dict[str, Any]:
    options: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context is not None else {}
    filler = bytes(range(256)) * (case.size // 256 + 1)
    errors: Counter[str] = Counter()
    latencies: list[float] = []
    comms: dict[int, anyio_comm.Comm] = {}
    limiter = anyio.CapacityLimiter(case.connect_concurrency)

    async def open_one(stack: contextlib.AsyncExitStack, cid: int) -> None:
        try:
            async with limiter:
                comm = await anyio_comm.connect(address, timeout=STARTUP_TIMEOUT, **options)
        except Exception as exc:
            errors[f"connect: {type(exc).__name__}: {exc}"] += 1
            return
        stack.push_async_callback(comm.aclose)
        comms[cid] = comm

    async def exchange(cid: int, comm: anyio_comm.Comm) -> None:
        done = 0
        try:
            for seq in range(case.round_trips):
                data = (TAG.pack(cid, seq) + filler)[: max(case.size, TAG.size)]
                t0 = time.perf_counter()
                await comm.send({"data": data})
                reply = await comm.receive()
                latencies.append(time.perf_counter() - t0)
                done += 1
                if reply["data"] != data:
                    errors["reply did not match its request"] += 1
        except Exception as exc:
            errors[f"round trip: {type(exc).__name__}: {exc}"] += case.round_trips - done

    with anyio.fail_after(case.seconds_max):
        async with contextlib.AsyncExitStack() as stack:
            t0 = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for cid in range(case.connections):
                    tg.start_soon(open_one, stack, cid)
            connect_seconds = time.perf_counter() - t0
            t1 = time.perf_counter()
            cpu1 = time.process_time()
            async with anyio.create_task_group() as tg:
                for cid, comm in comms.items():
                    tg.start_soon(exchange, cid, comm)
            exchange_seconds = time.perf_counter() - t1
            exchange_cpu = time.process_time() - cpu1
            client_memory = read_memory()
    ordered = sorted(latencies)

    def percentile_ms(q: float) -> float | None:
        return ordered[round(q * (len(ordered) - 1))] * 1e3 if ordered else None

    return {
        "opened": len(comms),
        "connect_seconds": connect_seconds,
        "exchange_seconds": exchange_seconds,
        "round_trips_ok": len(latencies),
        "rps": len(latencies) / exchange_seconds if exchange_seconds else None,
        "p50_ms": percentile_ms(0.50),
        "p99_ms": percentile_ms(0.99),
        "max_ms": percentile_ms(1),
        "client_cpu_us_per_rt": exchange_cpu / len(latencies) * 1e6 if latencies else None,
        "errors": sum(errors.values()),
        "error_kinds": dict(errors.most_common(5)),
        "client_rss": client_memory["rss"],
    }


def client_main(
    conn: Connection,  # noqa: ARG001 (the client reports only its result)
    case: Case,
    tls: TLSFiles | None,
    address: str,
) -> dict[str, Any]:
    """Entry point of the client process."""
    raise_fd_limit(case.connections + FD_MARGIN)
    ssl_context = client_context(tls, TLS_VERSION)
    return run_backend(case.backend, _client, case, address, ssl_context)


# -- orchestration ------------------------------------------------------------


def run_case(
    ctx: Any, case: Case, cpus: tuple[int | None, int | None], tls: TLSFiles | None
) -> dict[str, Any]:
    """Run one backend in a fresh server and client process; return the measurements."""
    with (
        _harness.unix_directory(case.transport, "acomm-many-") as unix_dir,
        ProcessPair(ctx, "many", cpus) as pair,
    ):
        server, address = pair.start_server(server_main, case, tls, unix_dir)
        client = pair.start_client(client_main, case, tls, address)
        _, result = client.receive(time.monotonic() + STARTUP_TIMEOUT + case.seconds_max)
        server.send("stop")
        _, served = server.receive(time.monotonic() + STARTUP_TIMEOUT)
    growth = served["rss_growth"]
    per_connection = growth / case.connections if growth is not None else None
    return {**asdict(case), **result, "server": served, "server_bytes_per_conn": per_connection}


# -- reporting ----------------------------------------------------------------


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per backend."""
    head = (
        f"{'conns':>6}{'open s':>8}{'rt/s':>9}{'p50 ms':>8}"
        f"{'p99 ms':>8}{'max ms':>8}{'cli us/rt':>10}{'errors':>7}{'srv max':>8}"
        f"{'srv RSS MB start/peak':>23}{'KB/conn':>9}"
    )

    def figures(r: dict[str, Any]) -> list[str]:
        s = r["server"]
        rss = f"{_num(s['rss_start'] and s['rss_start'] / 1e6, '.1f')}/" + _num(
            s["rss_peak"] and s["rss_peak"] / 1e6, ".1f"
        )
        per_conn = r["server_bytes_per_conn"]
        row = (
            f"{r['opened']:>6}{r['connect_seconds']:>8.2f}{_num(r['rps'], ',.0f'):>9}"
            f"{_num(r['p50_ms'], '.2f'):>8}{_num(r['p99_ms'], '.2f'):>8}"
            f"{_num(r['max_ms'], '.2f'):>8}{_num(r['client_cpu_us_per_rt'], '.1f'):>10}"
            f"{r['errors']:>7}{s['most_active']:>8}{rss:>23}"
            f"{_num(per_conn and per_conn / 1e3, '.1f'):>9}"
        )
        return [row, *(f"    {count} x {kind}" for kind, count in r["error_kinds"].items())]

    return _harness.backend_table(head, results, figures)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.argument_parser("many_connections", __doc__)
    add = parser.add_argument
    add("--connections", type=whole_number(), default=1000, help="default: 1000")
    add("--round-trips", type=whole_number(), default=20, help="per connection (default: 20)")
    add("--size", type=whole_number(), default=1000, help="payload bytes (default: 1000)")
    _harness.add_backend_options(parser, TRANSPORTS)
    add(
        "--connect-concurrency",
        type=whole_number(),
        default=100,
        help="connect calls in flight at once, at most 1000 (default: 100)",
    )
    add(
        "--seconds-max",
        type=float,
        default=120.0,
        help="bound on each backend's client run (default: 120)",
    )
    _harness.add_output_options(parser)
    args = parser.parse_args(argv)
    if args.connect_concurrency > 1000:
        parser.error("--connect-concurrency must stay under the listen backlog (1024)")
    if not 0 < args.seconds_max <= 3600:
        parser.error("--seconds-max must be in (0, 3600]")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run each backend and print the results; return the exit status."""
    args = parse_args(argv)
    if (backends := _harness.backends_for(args)) is None:
        return 2
    title = "many-connections benchmark"
    run = _harness.start_run("many_connections", title, argv, args.no_pin)
    print(
        f"{args.transport}: {args.connections} connections open at once "
        f"({args.connect_concurrency} connecting at a time), then {args.round_trips} round "
        f"trips of {args.size} bytes on each, all concurrently; at most {args.seconds_max:g} s",
        flush=True,
    )
    print(flush=True)
    load = (args.connections, args.round_trips, args.size, args.connect_concurrency)
    cases = [Case(backend, args.transport, *load, args.seconds_max) for backend in backends]
    tls_prefix = "many-tls-" if args.transport == "tls" else None
    results = _harness.run_backends(
        cases,
        run_case,
        run.cpus,
        tls_prefix,
        lambda r: f"{r['opened']} open in {r['connect_seconds']:.2f} s, {r['errors']} errors",
    )
    print(format_table(results))
    print(
        "\nopen s: time to open every connection; rt/s: round trips per second, all "
        "connections together; cli us/rt: client CPU time per round trip;\nsrv max: most "
        "connections the listener counted at once; KB/conn: server RSS growth (peak - start) "
        "per connection."
    )
    if args.json:
        metadata = run.metadata(args, tls=_harness.transport_tls(args, TLS_VERSION))
        write_json(args.json, {"metadata": metadata, "results": results})
    failed = any("error" in r or r["errors"] or r["opened"] < r["connections"] for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
