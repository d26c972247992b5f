"""Round-trip echo benchmark: anyio-comm messages versus plain AnyIO TCP streams.

A server process echoes every message back; a client process keeps
``--concurrency`` connections busy with request/reply round trips of one
payload size for ``--seconds`` (after a short warm-up). Every case runs in a
fresh pair of processes, by default pinned to two different CPUs. Systems:

* ``anyio-comm``: :func:`anyio_comm.listen` / :func:`anyio_comm.connect`,
  messages ``{"data": payload}`` (payloads of 16384 bytes or more travel
  out-of-band);
* ``anyio-streams``: :func:`anyio.create_tcp_listener` /
  :func:`anyio.connect_tcp` with an 8-byte big-endian length prefix, read back
  with ``BufferedByteReceiveStream.receive_exactly``.

``--tls`` runs the same workload over TLS (``--tls-version``, default 1.3) with
certificates made by ``trustme`` at startup: ``tls://`` addresses for
anyio-comm, :class:`anyio.streams.tls.TLSListener` and
``anyio.connect_tcp(..., ssl_context=...)`` for anyio-streams. ``--tls both``
interleaves plain and TLS cases in one run and adds a TLS-versus-plain summary.

Run from the repository root::

    python -m benchmarks.echo --seconds 2 --repeat 2 --json results.json
    python -m benchmarks.echo --sizes 1000,1000000,10000000 --tls both
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import multiprocessing
import ssl
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from anyio.streams.buffered import BufferedByteReceiveStream

from anyio_comm.bench import (
    BACKENDS,
    TLS_VERSIONS,
    TLSFiles,
    certificates,
    client_context,
    format_size,
    run_backend,
    server_context,
    whole_number,
    write_json,
)
from benchmarks import _harness
from benchmarks._harness import ROUND_TRIP_HEAD, Timing, csv_list, round_trip_columns
from benchmarks.systems import comm as comm_system
from benchmarks.systems import streams as streams_system

if TYPE_CHECKING:
    import argparse
    from collections.abc import Awaitable, Callable
    from multiprocessing.connection import Connection

    from anyio.abc import ByteStream, TaskStatus

    RoundTrip = Callable[[], Awaitable[None]]

SYSTEMS = ("anyio-comm", "anyio-streams")
SIZE_CHECK_EVERY = 256  # round trips between checks of the reply size


@dataclass(frozen=True)
class Case:
    """One cell of the benchmark matrix."""

    system: str
    backend: str
    size: int
    concurrency: int
    tls: str | None = None  # TLS version ("1.2" or "1.3"); None for plain TCP

    @property
    def label(self) -> str:
        """The system, with ``+tls`` for a TLS case."""
        return self.system if self.tls is None else f"{self.system}+tls"


@dataclass
class _Load:
    """Measurement window shared by the client's connection tasks."""

    start: float
    end: float
    max_count: int
    latencies: list[float] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)


@dataclass
class _Counter:
    """Messages echoed by the server so far."""

    n: int = 0


# -- server -------------------------------------------------------------------


async def _serve_comm(
    served: _Counter, ssl_context: ssl.SSLContext | None, *, task_status: TaskStatus[str]
) -> None:
    await comm_system.serve(served, ssl_context, task_status.started)


async def _serve_streams(
    served: _Counter, ssl_context: ssl.SSLContext | None, *, task_status: TaskStatus[str]
) -> None:
    async def echo(reader: BufferedByteReceiveStream, stream: ByteStream) -> None:
        while True:
            header = await reader.receive_exactly(8)
            data = await reader.receive_exactly(int.from_bytes(header, "big"))
            await stream.send(header + data)
            served.n += 1

    await streams_system.serve(echo, ssl_context, task_status.started)


async def _server(
    conn: Connection, system: str, ssl_context: ssl.SSLContext | None, lifetime: float
) -> list[tuple[float, int]]:
    """Serve until told ``"stop"``; return the CPU time and messages at each command."""
    served = _Counter()
    marks: list[tuple[float, int]] = []
    with anyio.move_on_after(lifetime):
        async with anyio.create_task_group() as tg:
            serve = _serve_comm if system == "anyio-comm" else _serve_streams
            conn.send(("ready", await tg.start(serve, served, ssl_context)))
            while len(marks) < 16:
                try:
                    command = await anyio.to_thread.run_sync(conn.recv, abandon_on_cancel=True)
                except EOFError:
                    break
                marks.append((time.process_time(), served.n))
                if command == "stop":
                    break
            tg.cancel_scope.cancel()
    return marks


def server_main(
    conn: Connection, case: Case, tls: TLSFiles | None, lifetime: float
) -> list[tuple[float, int]]:
    """Entry point of the server process."""
    ssl_context = server_context(tls, case.tls)
    return run_backend(case.backend, _server, conn, case.system, ssl_context, lifetime)


# -- client -------------------------------------------------------------------


def _check_size(count: int, size: int, received: int) -> None:
    if count % SIZE_CHECK_EVERY == 1 and received != size:
        raise RuntimeError(f"the echo of {size} bytes came back with {received}")


async def _open_comm(
    stack: contextlib.AsyncExitStack,
    address: str,
    payload: bytes,
    ssl_context: ssl.SSLContext | None,
) -> RoundTrip:
    comm = await comm_system.connect(address, ssl_context)
    stack.push_async_callback(comm.aclose)
    message = {"data": payload}
    count = 0

    async def roundtrip() -> None:
        nonlocal count
        await comm.send(message)
        reply = await comm.receive()
        count += 1
        _check_size(count, len(payload), len(reply["data"]))

    return roundtrip


async def _open_streams(
    stack: contextlib.AsyncExitStack,
    address: str,
    payload: bytes,
    ssl_context: ssl.SSLContext | None,
) -> RoundTrip:
    stream = await streams_system.connect(address, ssl_context)
    stack.push_async_callback(stream.aclose)
    reader = BufferedByteReceiveStream(stream)
    header = len(payload).to_bytes(8, "big")
    count = 0

    async def roundtrip() -> None:
        nonlocal count
        await stream.send(header + payload)
        data = await reader.receive_exactly(int.from_bytes(await reader.receive_exactly(8), "big"))
        count += 1
        _check_size(count, len(payload), len(data))

    return roundtrip


async def _worker(roundtrip: RoundTrip, load: _Load) -> None:
    """Do round trips until the window ends; record those completed inside it."""
    latencies = load.latencies
    while True:
        t0 = time.perf_counter()
        await roundtrip()
        t1 = time.perf_counter()
        if t1 >= load.end:
            return
        if t1 >= load.start:
            latencies.append(t1 - t0)
            if len(latencies) >= load.max_count:
                load.end = t1
                load.done.set()
                return


async def _client(
    conn: Connection,
    case: Case,
    ssl_context: ssl.SSLContext | None,
    address: str,
    timing: Timing,
) -> dict[str, Any]:
    """Run one case's load; return the client-side measurements."""
    opener = _open_comm if case.system == "anyio-comm" else _open_streams
    payload = bytes(range(256)) * (case.size // 256) + bytes(case.size % 256)
    with anyio.fail_after(timing.budget):
        async with contextlib.AsyncExitStack() as stack:
            roundtrips = [
                await opener(stack, address, payload, ssl_context) for _ in range(case.concurrency)
            ]
            start = time.perf_counter() + timing.warmup
            load = _Load(start=start, end=start + timing.seconds, max_count=timing.max_count)
            async with anyio.create_task_group() as tg:
                for roundtrip in roundtrips:
                    tg.start_soon(_worker, roundtrip, load)
                await anyio.sleep(max(0.0, load.start - time.perf_counter()))
                cpu0 = time.process_time()
                conn.send("mark")
                with anyio.move_on_after(max(0.0, load.end - time.perf_counter())):
                    await load.done.wait()
                cpu1 = time.process_time()
                conn.send("mark")
    window = load.end - load.start
    return _harness.round_trip_results(load.latencies, window, case.size, cpu1 - cpu0)


def client_main(
    conn: Connection, case: Case, tls: TLSFiles | None, address: str, timing: Timing
) -> dict[str, Any]:
    """Entry point of the client process."""
    ssl_context = client_context(tls, case.tls)
    return run_backend(case.backend, _client, conn, case, ssl_context, address, timing)


# -- orchestration ------------------------------------------------------------


def run_case(
    ctx: Any,
    case: Case,
    cpus: tuple[int | None, int | None],
    args: argparse.Namespace,
    tls: TLSFiles | None = None,
) -> dict[str, Any]:
    """Run one case in a fresh server and client process; return its measurements."""
    timing = Timing(args.seconds, args.warmup, args.max_count)
    entry_points = (server_main, client_main)
    return _harness.run_round_trips(ctx, "echo", cpus, entry_points, case, tls, timing)


def run_matrix(
    cases: list[Case],
    cpus: tuple[int | None, int | None],
    args: argparse.Namespace,
    tls: TLSFiles | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run every case ``args.repeat`` times, interleaved; return (best per case, all runs)."""
    ctx = multiprocessing.get_context("spawn")
    total = len(cases) * args.repeat
    done = itertools.count(1)

    def report(case: Case, result: dict[str, Any]) -> None:
        progress = f"[{next(done)}/{total}] {case.label} {case.backend} {format_size(case.size)}:"
        if "error" in result:
            print(progress, "FAILED", result["details"], sep="\n", file=sys.stderr, flush=True)
        else:
            print(progress, f"{result['rps']:,.0f} rt/s", file=sys.stderr, flush=True)

    def run(case: Case) -> dict[str, Any]:
        return run_case(ctx, case, cpus, args, tls)

    return _harness.run_matrix(cases, args.repeat, run, report)


# -- reporting ----------------------------------------------------------------


def _label(r: dict[str, Any]) -> str:
    return r["system"] if r.get("tls") is None else f"{r['system']}+tls"


def _key(r: dict[str, Any]) -> tuple[str, str, int, int, str | None]:
    return (r["system"], r["backend"], r["size"], r["concurrency"], r.get("tls"))


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per case, then the anyio-comm / anyio-streams ratios (like with like)."""
    width = max([14, *(len(_label(r)) + 1 for r in results)])
    any_tls = any(r.get("tls") is not None for r in results)
    head = f"{'system':<{width}}{'backend':<9}{'size':>7}{'conc':>5}{ROUND_TRIP_HEAD}"
    lines = [head, "-" * len(head)]
    for r in results:
        shown = format_size(r["size"])
        row = f"{_label(r):<{width}}{r['backend']:<9}{shown:>7}{r['concurrency']:>5}"
        if "error" in r:
            lines.append(f"{row}  FAILED: {r['error']}")
        else:
            lines.append(row + round_trip_columns(r))
    ok = {_key(r): r for r in results if "error" not in r}
    ratios = []
    for (system, backend, size, conc, tls), r in ok.items():
        other = ok.get(("anyio-streams", backend, size, conc, tls))
        if system != "anyio-comm" or other is None:
            continue
        mode = f" {'plain' if tls is None else f'TLS {tls}':<8}" if any_tls else ""
        ratios.append(
            f"  {format_size(size):>7} {backend:<8}{mode} conc {conc}: "
            f"{r['rps'] / other['rps']:.2f}x"
        )
    if ratios:
        lines += ["", "anyio-comm / anyio-streams, round trips per second:", *ratios]
    return "\n".join(lines)


def format_tls_summary(results: list[dict[str, Any]]) -> str:
    """TLS versus plain for each backend and size, anyio-comm beside anyio-streams.

    Values are MB/s for payloads of 1 MB or more and the median round-trip
    latency in microseconds below; ratios are of round trips per second (above
    1 means the first is faster), "-" where a case is missing or failed. Empty
    unless some system has both a plain and a TLS result for the same case.
    """
    ok = {_key(r): r for r in results if "error" not in r}

    def value(r: dict[str, Any] | None, size: int) -> str:
        if r is None:
            return "-"
        return f"{r['mb_per_s']:.1f}" if size >= 10**6 else f"{r['p50_ms'] * 1e3:.1f}"

    def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
        return "-" if a is None or b is None else f"{a['rps'] / b['rps']:.2f}x"

    head = (
        f"{'size':>7} {'backend':<9}{'metric':<8}{'comm':>10}{'comm+tls':>10}"
        f"{'streams':>10}{'streams+tls':>13}{'comm tls/plain':>16}"
        f"{'streams tls/plain':>19}{'tls comm/streams':>18}"
    )
    lines: list[str] = []
    versions: set[str] = set()
    seen: set[tuple[str, int, int, str]] = set()
    for _, backend, size, conc, tls in ok:
        if tls is None or (backend, size, conc, tls) in seen:
            continue
        seen.add((backend, size, conc, tls))
        comm, comm_tls, streams, streams_tls = (
            ok.get((system, backend, size, conc, mode))
            for system in SYSTEMS
            for mode in (None, tls)
        )
        if (comm is None or comm_tls is None) and (streams is None or streams_tls is None):
            continue
        versions.add(tls)
        lines.append(
            f"{format_size(size):>7} {backend:<9}{'MB/s' if size >= 10**6 else 'p50 us':<8}"
            f"{value(comm, size):>10}{value(comm_tls, size):>10}{value(streams, size):>10}"
            f"{value(streams_tls, size):>13}{ratio(comm_tls, comm):>16}"
            f"{ratio(streams_tls, streams):>19}{ratio(comm_tls, streams_tls):>18}"
        )
    if not lines:
        return ""
    title = (
        f"TLS {'/'.join(sorted(versions))} vs plain TCP, anyio-comm beside anyio-streams: "
        "MB/s or p50 us; ratios of round trips per second (above 1: the first is faster)"
    )
    return "\n".join([title, head, "-" * len(head), *lines])


# -- command line -------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.argument_parser("echo", __doc__)
    add = parser.add_argument
    add(
        "--sizes",
        type=csv_list(None, whole_number()),
        default=[1000, 10_000_000],
        help="payload sizes in bytes (default: 1000,10000000)",
    )
    add(
        "--backends",
        type=csv_list(tuple(BACKENDS)),
        default=list(BACKENDS),
        help="asyncio, uvloop and/or trio (default: all three)",
    )
    add(
        "--systems",
        type=csv_list(SYSTEMS),
        default=list(SYSTEMS),
        help="anyio-comm and/or anyio-streams (default: both)",
    )
    add(
        "--concurrency",
        type=whole_number(),
        default=1,
        help="concurrent connections in the client (default: 1)",
    )
    add("--seconds", type=float, default=2.0, help="measured seconds per case (default: 2)")
    add("--warmup", type=float, default=0.3, help="warm-up seconds per case (default: 0.3)")
    add(
        "--max-count",
        type=whole_number(),
        default=1_000_000,
        help="most round trips measured per case (default: 1000000)",
    )
    add(
        "--repeat",
        type=whole_number(),
        default=1,
        help="run the whole matrix N times and keep the best rt/s per case (default: 1)",
    )
    add(
        "--tls",
        nargs="?",
        const="on",
        default="off",
        choices=("off", "on", "both"),
        help="run over TLS: --tls (or --tls on) runs only TLS cases, --tls both runs plain "
        "and TLS cases interleaved and adds a TLS-vs-plain summary (default: off)",
    )
    add(
        "--tls-version",
        choices=tuple(TLS_VERSIONS),
        default="1.3",
        help="TLS version, pinned as both minimum and maximum on both ends (default: 1.3)",
    )
    _harness.add_output_options(parser)
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 600 or not 0 <= args.warmup <= 60:
        parser.error("--seconds must be in (0, 600] and --warmup in [0, 60]")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark matrix and print the results; return the exit status."""
    args = parse_args(argv)
    _harness.drop_missing_backends(args.backends)
    if args.tls != "off" and importlib.util.find_spec("trustme") is None:
        print("error: --tls needs the trustme package (pip install trustme)", file=sys.stderr)
        return 2
    run = _harness.start_run("echo", "echo benchmark", argv, args.no_pin)
    print(
        f"{args.seconds:g} s per case after {args.warmup:g} s warm-up (at most "
        f"{args.max_count:,} round trips), concurrency {args.concurrency}, "
        f"repeat {args.repeat} (best rt/s kept)",
        flush=True,
    )
    modes: list[str | None] = {
        "off": [None],
        "on": [args.tls_version],
        "both": [None, args.tls_version],
    }[args.tls]
    if args.tls != "off":
        print(
            f"TLS {args.tls_version} ({ssl.OPENSSL_VERSION}), trustme certificates for "
            "127.0.0.1" + ("; plain and TLS cases interleaved" if args.tls == "both" else ""),
            flush=True,
        )
    print(flush=True)
    cases = [
        Case(system, backend, size, args.concurrency, tls)
        for size in args.sizes
        for backend in args.backends
        for tls in modes
        for system in args.systems
    ]
    with certificates(None if args.tls == "off" else "echo-tls-") as tls_files:
        results, runs = run_matrix(cases, run.cpus, args, tls_files)
    print(format_table(results))
    if summary := format_tls_summary(results):
        print(f"\n{summary}")
    if args.json:
        tls = None
        if args.tls != "off":
            tls = {
                "mode": args.tls,
                "version": args.tls_version,
                "openssl": ssl.OPENSSL_VERSION,
                "certificates": "trustme CA, server certificate for 127.0.0.1 and localhost",
            }
        metadata = run.metadata(args, executable=True, tls=tls)
        write_json(args.json, {"metadata": metadata, "results": results, "runs": runs})
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
