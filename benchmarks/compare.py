"""Echo comparison: anyio-comm against raw floors, AnyIO streams, dask and pyzmq.

One invocation runs the same request/reply echo workload through every system,
interleaved (for each repeat, for each workload, for each system and backend)
so that drift in the machine hits all of them alike, and keeps the best run
of each case. Systems (``benchmarks/systems/``, one module each):

* ``anyio-comm`` on asyncio, uvloop and trio: ``{"data": [frames...]}`` through
  ``Comm.send`` / ``Comm.receive`` (msgpack body, out-of-band frames);
* ``floor``: the same bytes with no library: an asyncio ``BufferedProtocol``
  (asyncio, uvloop) or ``trio.socket`` ``recv_into``/``sendmsg`` (trio);
* ``floor-task`` (diagnostic): the asyncio/uvloop floor's server answering from a
  task per connection woken through a future per message it waits for, the least a
  per-message API that hands messages to a task can cost;
* ``floor-blocking``: blocking sockets, a server thread per connection,
  ``recv_into``/``sendmsg`` (backend ``threads``);
* ``floor-reader`` (diagnostic, only when named in ``--systems``): the asyncio
  floor's server with its own sockets, read in ``loop.add_reader`` callbacks;
* ``floor-blocking-reuse`` and ``floor-reuse`` (diagnostic): the blocking
  floor and the event-loop floors receiving each frame into the same buffer
  every message (no frame buffer allocated, nor faulted in, after the first
  message);
* ``anyio-comm-pull`` and ``anyio-comm-nopool`` (diagnostic): anyio-comm with
  its pull receive engine, and with fresh memory per frame instead of its pool;
* ``anyio-streams``: plain AnyIO TCP streams (``TLSStream`` over TLS);
* ``anyio-echo``: plain AnyIO streams written the plainest way (an 8-byte length
  prefix, ``stream.receive()`` accumulated into a ``bytearray``);
* ``dask``: ``distributed.comm`` over ``tcp://`` / ``tls://`` on asyncio;
* ``zmq``: pyzmq DEALER/ROUTER with ``zmq.asyncio`` (plain TCP only).

The floors and anyio-streams frame a message as an 8-byte frame count, 8-byte
lengths, then the frames. A workload is a frame size (``--sizes``), a number of
concurrent connections in the client process (``--concurrency``), a number of
frames per message (``--frames``) and TLS on or off (``--tls``), plus the
many-connections workload (``--many``, default 8 KB frames over 200 connections,
one frame per message, plain and TLS); with ``--gil-hold`` every server process
also runs a thread that holds the GIL in a busy loop, and the report compares
the systems under that load. Each case runs in a fresh server process pinned
to one CPU and a fresh client process pinned to another (see
:mod:`benchmarks._harness`). A system whose package is missing is skipped with
a note.

Run from the repository root::

    python -m benchmarks.compare --quick
    python -m benchmarks.compare --repeat 2 --seconds 1 --json benchmarks/results/compare.json \\
        --markdown benchmarks/results/compare.md \\
        --plot 'benchmarks/results/compare-{backend}.png'
    python -m benchmarks.compare --gil-hold --sizes 1e3,1e6 --frames 1 --tls off \\
        --systems anyio-comm,floor,dask,zmq --json benchmarks/results/compare-gil.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import multiprocessing
import os
import ssl
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anyio_comm.bench import (
    GilHolder,
    TLSFiles,
    byte_size,
    certificates,
    client_context,
    format_size,
    parse_size,
    run_backend,
    server_context,
    versions,
    whole_number,
    write_json,
)
from benchmarks import _harness
from benchmarks._harness import (
    ROUND_TRIP_HEAD,
    STARTUP_TIMEOUT,
    Timing,
    csv_list,
    round_trip_columns,
)
from benchmarks.systems import SYSTEMS

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

SIZES = (1_000, 10_000, 100_000, 1_000_000, 10_000_000)
QUICK_SIZES = (1_000, 1_000_000)
TLS_SIZES = (1_000, 1_000_000, 10_000_000)
QUICK_TLS = ((1_000, 4), (1_000_000, 1))  # (size, concurrency) of the --quick TLS workloads
MANY = (8_000, 200)  # (frame size, connections) of the many-connections workload
TLS_VERSION = "1.3"
STRETCH = 20.0  # most seconds a window waits past its end for its first round trip
# The warm-up also lasts until the connections made this many round trips per
# connection, counted together (the first large messages fault their buffers in:
# 5 x 10 MB over four connections ran at half its rate when measured right after
# 0.3 s), up to WARMUP_EXTRA more seconds.
WARMUP_ROUND_TRIPS = 8
WARMUP_EXTRA = 5.0


@dataclass(frozen=True)
class Case:
    """One cell of the comparison matrix."""

    system: str
    backend: str
    size: int  # bytes per frame
    concurrency: int
    frames: int = 1
    tls: str | None = None  # TLS version, None for plain TCP
    gil_hold: bool = False  # the server process runs a GIL-holding thread

    @property
    def label(self) -> str:
        """System and backend, with ``+tls`` for a TLS case."""
        return f"{self.system}{'+tls' if self.tls else ''}/{self.backend}"

    @property
    def workload(self) -> str:
        """Size, frames, concurrency and TLS mode, as text."""
        frames = f"{self.frames}x" if self.frames > 1 else ""
        return (
            f"{frames}{format_size(self.size)} c{self.concurrency} {'tls' if self.tls else 'tcp'}"
        )


@dataclass
class Counter:
    """Messages echoed by the server: ``n`` plus one cell per server thread."""

    n: int = 0
    cells: list[list[int]] = field(default_factory=list)

    def total(self) -> int:
        """All messages echoed so far."""
        return self.n + sum(cell[0] for cell in self.cells)


# -- server process -----------------------------------------------------------


def _control(conn: Connection, counter: Counter, address: str, lifetime: float) -> None:
    """Report the address, snapshot (CPU time, messages) at each command, then exit."""
    conn.send(("ready", address))
    marks: list[tuple[float, int]] = []
    deadline = time.monotonic() + lifetime
    with contextlib.suppress(EOFError, OSError):
        while len(marks) < 16 and (remaining := deadline - time.monotonic()) > 0:
            if not conn.poll(min(remaining, 1.0)):
                continue
            command = conn.recv()
            marks.append((time.process_time(), counter.total()))
            if command == "stop":
                break
        conn.send(("marks", marks))
        conn.close()
    os._exit(0)  # the server's loop never returns on its own


def server_main(conn: Connection, case: Case, tls: TLSFiles | None, lifetime: float) -> None:
    """Entry point of the server process: the system's server plus a control thread."""
    ssl_context = server_context(tls, case.tls)
    counter = Counter()

    def ready(address: str) -> None:
        args = (conn, counter, address, lifetime)
        threading.Thread(target=_control, args=args, daemon=True).start()

    if case.gil_hold:
        GilHolder().start()  # a daemon thread: it ends with the process
    SYSTEMS[case.system].module(case.backend).run_server(case, ssl_context, counter, ready)


# -- client process -----------------------------------------------------------


@dataclass
class _Window:
    """Measurement window shared by the client's connections.

    ``start`` and ``end`` are relative until :meth:`begin`; the warm-up then
    lasts until ``start`` and until ``warm_round_trips`` round trips were made
    (:meth:`warmed`), when :meth:`restart` moves the window to begin there.
    """

    start: float
    end: float
    max_count: int
    warm_round_trips: int = 0
    latencies: list[float] = field(default_factory=list)
    round_trips: int = 0  # made so far, warm-up included
    measuring: bool = False  # restart() was called: the warm-up is over

    def record(self, t0: float, t1: float) -> bool:
        """Record a round trip from t0 to t1; False once the window is over.

        Before :meth:`restart` it only counts the round trip (and returns True).
        A window in which no round trip completed (very large messages on a busy
        machine) is stretched to the end of the first one, up to ``STRETCH`` seconds.
        """
        self.round_trips += 1
        if not self.measuring:
            return True
        if t1 >= self.end and (self.latencies or t1 >= self.end + STRETCH):
            return False
        if t1 >= self.start:
            self.latencies.append(t1 - t0)
            if len(self.latencies) >= self.max_count or t1 >= self.end:
                self.end = t1
                return False
        return True

    def begin(self) -> None:
        """Make ``start`` and ``end``, so far relative, count from now."""
        self.start += time.perf_counter()
        self.end += self.start

    def warmed(self) -> bool:
        """Whether the warm-up is over: its time passed, and its round trips were
        made or it ran ``WARMUP_EXTRA`` seconds longer."""
        now = time.perf_counter()
        if now < self.start:
            return False
        return self.round_trips >= self.warm_round_trips or now >= self.start + WARMUP_EXTRA

    def restart(self) -> None:
        """Begin the window now (the warm-up outlasted ``start``), as long as before."""
        now = time.perf_counter()
        if now > self.start:
            self.end += now - self.start
            self.start = now
        self.measuring = True

    def open(self) -> bool:
        """Whether the window is still open (or stretched, waiting for a first round trip)."""
        now = time.perf_counter()
        return now < self.end or (not self.latencies and now < self.end + STRETCH)


async def _async_load(
    conn: Connection, case: Case, address: str, ssl_context: Any, window: _Window
) -> tuple[float, float]:
    import anyio

    module = SYSTEMS[case.system].module(case.backend)
    async with contextlib.AsyncExitStack() as stack:
        with anyio.fail_after(STARTUP_TIMEOUT):
            roundtrips = [
                await module.open_client(stack, address, case, ssl_context)
                for _ in range(case.concurrency)
            ]
        window.begin()

        async def worker(roundtrip: Any) -> None:
            while True:
                t0 = time.perf_counter()
                await roundtrip()
                if not window.record(t0, time.perf_counter()):
                    return

        limit = window.end - time.perf_counter() + WARMUP_EXTRA + STRETCH + STARTUP_TIMEOUT
        with anyio.fail_after(limit):
            async with anyio.create_task_group() as tg:
                for roundtrip in roundtrips:
                    tg.start_soon(worker, roundtrip)
                while not window.warmed():  # noqa: ASYNC110 (a count or a deadline)
                    await anyio.sleep(max(0.005, min(0.02, window.start - time.perf_counter())))
                window.restart()
                cpu0 = time.process_time()
                conn.send("mark")
                while window.open():  # noqa: ASYNC110 (a deadline that may be stretched)
                    await anyio.sleep(0.02)
                cpu1 = time.process_time()
                conn.send("mark")
    return cpu0, cpu1


def _blocking_load(
    conn: Connection, case: Case, address: str, ssl_context: Any, window: _Window
) -> tuple[float, float]:
    module = SYSTEMS[case.system].module(case.backend)
    errors: list[BaseException] = []
    with contextlib.ExitStack() as stack:
        roundtrips = [
            module.open_blocking(stack, address, case, ssl_context)
            for _ in range(case.concurrency)
        ]
        go = threading.Event()

        def worker(roundtrip: Any) -> None:
            go.wait()
            try:
                while True:
                    t0 = time.perf_counter()
                    roundtrip()
                    if not window.record(t0, time.perf_counter()):
                        return
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(rt,), daemon=True) for rt in roundtrips]
        for thread in threads:
            thread.start()
        window.begin()  # once every thread runs: starting 200 of them takes a while
        go.set()
        while not window.warmed() and not errors:
            time.sleep(max(0.005, min(0.02, window.start - time.perf_counter())))
        window.restart()
        cpu0 = time.process_time()
        conn.send("mark")
        while window.open() and not errors:
            time.sleep(0.02)
        cpu1 = time.process_time()
        conn.send("mark")
        for thread in threads:
            thread.join(STARTUP_TIMEOUT)
    if errors:
        raise errors[0]
    return cpu0, cpu1


def client_main(
    conn: Connection,
    case: Case,
    tls: TLSFiles | None,
    address: str,
    timing: Timing,
) -> dict[str, Any]:
    """Entry point of the client process: run the load, return the measurements."""
    ssl_context = client_context(tls, case.tls)
    # made absolute (begin) when the connections are open
    window = _Window(
        start=timing.warmup,
        end=timing.seconds,
        max_count=timing.max_count,
        warm_round_trips=WARMUP_ROUND_TRIPS * case.concurrency,
    )
    if SYSTEMS[case.system].blocking:
        cpu0, cpu1 = _blocking_load(conn, case, address, ssl_context, window)
    else:
        cpu0, cpu1 = run_backend(
            case.backend, _async_load, conn, case, address, ssl_context, window
        )
    return _harness.round_trip_results(
        window.latencies, window.end - window.start, case.size * case.frames, cpu1 - cpu0
    )


# -- orchestration ------------------------------------------------------------


def run_case(
    ctx: Any,
    case: Case,
    cpus: tuple[int | None, int | None],
    args: argparse.Namespace,
    tls: TLSFiles | None,
) -> dict[str, Any]:
    """Run one case in a fresh server process and a fresh client process."""
    timing = Timing(args.seconds, args.warmup, args.max_count, STRETCH + WARMUP_EXTRA)
    entry_points = (server_main, client_main)
    return _harness.run_round_trips(ctx, case.system, cpus, entry_points, case, tls, timing)


class Progress:
    """A one-line counter with an ETA on stderr."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()

    def update(self, text: str) -> None:
        """Count one finished case and show ``text`` about it."""
        self.done += 1
        elapsed = time.monotonic() - self.started
        eta = elapsed / self.done * (self.total - self.done)
        line = (
            f"[{self.done}/{self.total} {100 * self.done / self.total:3.0f}% "
            f"{elapsed / 60:.1f} min, ETA {eta / 60:.1f} min] {text}"
        )
        if self.tty:
            sys.stderr.write(f"\r\x1b[K{line}")
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(f"{line}\n")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        """Print ``text`` on a line of its own."""
        sys.stderr.write(("\n" if self.tty and self.done else "") + text + "\n")
        sys.stderr.flush()


def run_matrix(
    cases: list[Case],
    cpus: tuple[int | None, int | None],
    args: argparse.Namespace,
    tls: TLSFiles | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every case ``args.repeat`` times, interleaved; return (best per case, all runs)."""
    ctx = multiprocessing.get_context("spawn")
    progress = Progress(len(cases) * args.repeat)

    def report(case: Case, result: dict[str, Any]) -> None:
        if "error" in result:
            progress.note(f"{case.workload} {case.label} FAILED: {result['details']}")
            progress.update(f"{case.workload} {case.label}: failed")
        else:
            progress.update(f"{case.workload} {case.label}: {result['rps']:,.0f} rt/s")

    def run(case: Case) -> dict[str, Any]:
        return run_case(ctx, case, cpus, args, tls)

    return _harness.run_matrix(cases, args.repeat, run, report)


def build_cases(args: argparse.Namespace) -> list[Case]:
    """The matrix: for each workload (size, concurrency, frames, TLS), every system and backend.

    The workloads are the cross product of sizes, concurrencies and frames (TLS ones limited
    to ``--tls-sizes`` and ``--tls-frames``, or to ``QUICK_TLS`` with ``--quick``), then the
    many-connections workload (``--many``: one frame per message) in every TLS mode.
    """
    workloads: list[tuple[int, int, int, str | None]] = []
    for size in args.sizes:
        for concurrency in args.concurrency:
            for frames in args.frames:
                for tls in args.tls_modes:
                    if tls is not None and args.quick and (size, concurrency) not in QUICK_TLS:
                        continue
                    if tls is not None and (
                        frames not in args.tls_frames or size not in args.tls_sizes
                    ):
                        continue
                    workloads.append((size, concurrency, frames, tls))
    if args.many is not None:
        size, connections = args.many
        for tls in args.tls_modes:
            if (size, connections, 1, tls) not in workloads:
                workloads.append((size, connections, 1, tls))
    cases = []
    for size, concurrency, frames, tls in workloads:
        for name in args.systems:
            system = SYSTEMS[name]
            for backend in system.tls_backends if tls else system.backends:
                if backend in args.backends or backend == "threads":
                    cases.append(
                        Case(name, backend, size, concurrency, frames, tls, args.gil_hold)
                    )
    return cases


def _versions() -> dict[str, str | None]:
    found = versions(
        "anyio-comm", "anyio", "trio", "uvloop", "msgpack", "distributed", "tornado", "pyzmq"
    )
    with contextlib.suppress(ImportError):
        import zmq

        found["libzmq"] = zmq.zmq_version()
    found["openssl"] = ssl.OPENSSL_VERSION
    return found


def format_table(results: list[dict[str, Any]]) -> str:
    """One line per case."""
    head = f"{'workload':<18}{'system/backend':<27}{ROUND_TRIP_HEAD}"
    lines = [head, "-" * len(head)]
    for r in results:
        case = Case(
            r["system"],
            r["backend"],
            r["size"],
            r["concurrency"],
            r["frames"],
            r["tls"],
            r.get("gil_hold", False),
        )
        row = f"{case.workload:<18}{case.label:<27}"
        if "error" in r:
            lines.append(f"{row}FAILED: {r['error']}")
        else:
            lines.append(row + round_trip_columns(r))
    return "\n".join(lines)


# -- command line -------------------------------------------------------------


def _many(text: str) -> list[int]:
    """``SIZE,CONNECTIONS`` (``8e3,200``) as ``[8000, 200]``."""
    items = text.split(",")
    try:
        if len(items) != 2:
            raise ValueError(text)
        return [parse_size(items[0]), whole_number()(items[1])]
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(
            f"expected SIZE,CONNECTIONS such as 8e3,200, got {text!r}"
        ) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line; fill in the defaults of the full or the --quick matrix."""
    parser = _harness.argument_parser("compare", __doc__)
    add = parser.add_argument
    add(
        "--quick",
        action="store_true",
        help="short matrix: sizes 1e3,1e6, c=1,4, 1 frame, TLS only for 1e3 c=4 and 1e6 c=1, "
        "plus the many-connections workload, 0.5 s per case",
    )
    add(
        "--sizes",
        type=csv_list(None, byte_size()),
        help="frame sizes in bytes (default: 1e3,...,1e7)",
    )
    add("--concurrency", type=csv_list(None, int), help="connections per client (default: 1,4)")
    add("--frames", type=csv_list(None, int), help="frames per message (default: 1,5)")
    add(
        "--tls-sizes",
        type=csv_list(None, byte_size()),
        help="frame sizes of the TLS workloads, among --sizes (default: 1e3,1e6,1e7)",
    )
    add(
        "--tls-frames",
        type=csv_list(None, int),
        default=[1],
        help="frames per message of the TLS workloads (default: 1)",
    )
    add(
        "--many",
        type=_many,
        default=list(MANY),
        metavar="SIZE,CONNECTIONS",
        help="the many-connections workload, one frame per message, plain and TLS, added to "
        "the matrix (default: 8e3,200)",
    )
    add("--no-many", action="store_true", help="leave the many-connections workload out")
    add(
        "--systems",
        type=csv_list(tuple(SYSTEMS)),
        default=[name for name, system in SYSTEMS.items() if not system.diagnostic],
        help="systems to run (default: all but the diagnostic ones: "
        + ", ".join(name for name, system in SYSTEMS.items() if system.diagnostic)
        + ")",
    )
    add(
        "--backends",
        type=csv_list(("asyncio", "uvloop", "trio")),
        default=["asyncio", "uvloop", "trio"],
        help="async backends (the blocking floor always runs on threads)",
    )
    add("--tls", choices=("off", "on", "both"), default="both", help="TLS cases (default: both)")
    add("--seconds", type=float, help="measured seconds per case (default 1, --quick 0.5)")
    add(
        "--warmup",
        type=float,
        help="warm-up seconds per case (default 0.3, --quick 0.2); the warm-up also lasts "
        f"{WARMUP_ROUND_TRIPS} round trips per connection, counted together "
        f"(up to {WARMUP_EXTRA:g} s more)",
    )
    add(
        "--gil-hold",
        action="store_true",
        help="every server process also runs a thread holding the GIL in a busy loop",
    )
    add("--max-count", type=int, default=1_000_000, help="most round trips measured per case")
    add("--repeat", type=int, help="repeats of the whole matrix, best kept (default 2, quick 1)")
    _harness.add_output_options(parser, json_help="write all runs, the best per case and metadata")
    add("--markdown", metavar="PATH", help="write the markdown report (render_compare)")
    add(
        "--plot",
        metavar="PATH",
        help="write the PNG plots, one per backend, to PATH with {backend} replaced by its name "
        "(without {backend}: -asyncio, -uvloop, -trio added before the suffix; needs matplotlib)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    args.sizes = args.sizes or list(QUICK_SIZES if quick else SIZES)
    args.concurrency = args.concurrency or [1, 4]
    args.frames = args.frames or ([1] if quick else [1, 5])
    args.tls_sizes = args.tls_sizes or list(TLS_SIZES)
    args.seconds = args.seconds or (0.5 if quick else 1.0)
    args.warmup = args.warmup if args.warmup is not None else (0.2 if quick else 0.3)
    args.warmup_round_trips = WARMUP_ROUND_TRIPS  # (recorded with the options)
    args.repeat = args.repeat or (1 if quick else 2)
    args.tls_modes = {"off": [None], "on": [TLS_VERSION], "both": [None, TLS_VERSION]}[args.tls]
    if args.no_many:
        args.many = None
    if not 0 < args.seconds <= 60 or not 0 <= args.warmup <= 10 or not 0 < args.repeat <= 20:
        parser.error("--seconds must be in (0, 60], --warmup in [0, 10], --repeat in 1..20")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the comparison, print the table and write the requested files."""
    args = parse_args(argv)
    for name in list(args.systems):
        if missing := SYSTEMS[name].missing():
            print(f"note: skipping {name}: {', '.join(missing)} not installed", file=sys.stderr)
            args.systems.remove(name)
    _harness.drop_missing_backends(args.backends)
    if args.tls != "off" and importlib.util.find_spec("trustme") is None:
        print("note: trustme is not installed; skipping the TLS cases", file=sys.stderr)
        args.tls_modes = [None]
    cases = build_cases(args)
    run = _harness.start_run("compare", "comparison", argv, args.no_pin, versions=_versions())
    print(
        f"{len(cases)} cases x {args.repeat} repeats (interleaved, best rt/s kept), "
        f"{args.seconds:g} s per case after a warm-up of {args.warmup:g} s and "
        f"{WARMUP_ROUND_TRIPS} round trips per connection",
        flush=True,
    )
    with certificates("compare-tls-" if any(c.tls for c in cases) else None) as tls_files:
        results, runs = run_matrix(cases, run.cpus, args, tls_files)
    print()
    print(format_table(results))
    metadata = run.metadata(
        args,
        outputs=("json", "markdown", "plot"),
        tls={
            "version": TLS_VERSION,
            "openssl": ssl.OPENSSL_VERSION,
            "certificates": "trustme CA, server certificate for 127.0.0.1 and localhost",
        },
        systems={name: SYSTEMS[name].description for name in args.systems},
    )
    data = {"metadata": metadata, "results": results, "runs": runs}
    from benchmarks import render_compare

    print()
    print(render_compare.summary(data))
    if args.json:
        write_json(args.json, data)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(render_compare.render(data))
    if args.plot:
        try:
            render_compare.plot(data, args.plot)
        except ImportError:
            print("note: matplotlib is not installed; no plot", file=sys.stderr)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
