"""What the benchmark scripts share beyond :mod:`anyio_comm.bench`: the pair of processes of a
case, the round-trip measurement, the run of the cases, the header, the tables and the
command line.

The event loops, the sizes, TLS, pinning, child processes and the metadata of a run come
from :mod:`anyio_comm.bench`, which ``anyio-comm bench`` uses too. Every case runs in a
fresh server process and a fresh client process (a :class:`ProcessPair`), each pinned to a
CPU of its own where the machine allows it. A child talks to the parent over a pipe: the
server first reports its address as ``("ready", address)``, a child's entry point returns
its result, and a failure is raised in the parent by :meth:`anyio_comm.bench.Child.receive`.
A script builds its cases, runs each one with :func:`attempt` (a failed case becomes a
result with an ``error``), begins its output with :func:`start_run` and writes
:meth:`Run.metadata` into its JSON file.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import multiprocessing
import os
import platform
import shutil
import ssl
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from anyio_comm.bench import (
    BACKENDS,
    Child,
    RunError,
    TLSFiles,
    backend_installed,
    certificates,
    choose_cpus,
    load_average,
    run_metadata,
    versions,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator
    from multiprocessing.connection import Connection

STARTUP_TIMEOUT = 30.0  # seconds for a process to start, import and connect


def drop_missing_backends(backends: list[str]) -> None:
    """Remove uvloop and trio from ``backends`` where they are not installed, with a note."""
    for name in BACKENDS:
        if name in backends and not backend_installed(name):
            print(f"note: {name} is not installed; skipping that backend", file=sys.stderr)
            backends.remove(name)


# -- processes ----------------------------------------------------------------


@contextlib.contextmanager
def unix_directory(transport: str, prefix: str) -> Iterator[str | None]:
    """A temporary directory for a ``unix`` transport's socket (None for other transports),
    removed afterwards."""
    if transport != "unix":
        yield None
        return
    directory = tempfile.mkdtemp(prefix=prefix)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


class ProcessPair:
    """The two processes of a case: a server on the first CPU, a client on the second.

    On leaving the ``with`` block the pipes are closed and both processes
    stopped, the client first (at once with ``terminate``, else after a few
    seconds if they have not exited by themselves).
    """

    def __init__(
        self,
        ctx: Any,
        name: str,
        cpus: tuple[int | None, int | None],
        roles: tuple[str, str] = ("server", "client"),
        *,
        terminate: bool = False,
    ) -> None:
        self._terminate = terminate
        self._ctx = ctx
        self._names = (f"{name}-{roles[0]}", f"{name}-{roles[1]}")
        self._cpus = cpus
        self._children: list[Child] = []

    def start_server(self, target: Callable[..., Any], *args: Any) -> tuple[Child, str]:
        """Start ``target(conn, *args)`` as the server; return it and the address it listens on."""
        server = self._start(0, target, args)
        _, address = server.receive(time.monotonic() + STARTUP_TIMEOUT)
        return server, address

    def start_client(self, target: Callable[..., Any], *args: Any) -> Child:
        """Start ``target(conn, *args)`` as the client."""
        return self._start(1, target, args)

    def _start(self, role: int, target: Callable[..., Any], args: tuple[Any, ...]) -> Child:
        child = Child(self._ctx, self._names[role], target, args, cpu=self._cpus[role])
        self._children.append(child)
        return child

    def __enter__(self) -> ProcessPair:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for child in self._children:
            child.conn.close()
        for child in reversed(self._children):
            child.stop(terminate=self._terminate)


async def serve_one(
    conn: Connection,
    address: str,
    handle: Callable[[Any, dict[str, Any]], Awaitable[None]],
    *,
    role: str,
    budget: float,
    **listen_options: Any,
) -> dict[str, Any]:
    """Listen on ``address``, report ``("ready", address)`` on ``conn``, run ``handle(comm,
    result)`` for the first connection, then return ``result``; raise if ``handle`` failed
    (``role`` names this process in the error) or ``budget`` seconds passed."""
    import anyio

    import anyio_comm

    result: dict[str, Any] = {}
    finished = anyio.Event()

    async def handler(comm: anyio_comm.Comm) -> None:
        try:
            await handle(comm, result)
        except Exception as exc:
            result["error"] = repr(exc)
        finally:
            finished.set()

    with anyio.fail_after(budget):
        async with anyio_comm.listen(address, handler, **listen_options) as listener:
            conn.send(("ready", listener.address))
            await finished.wait()
    if "error" in result:
        raise RuntimeError(f"the {role} failed: {result['error']}")
    return result


async def serve_until_stopped(
    conn: Connection,
    address: str,
    handler: Callable[[Any], Awaitable[None]],
    *,
    budget: float,
    **listen_options: Any,
) -> None:
    """Listen on ``address`` with ``handler``, report ``("ready", address)`` on ``conn``,
    and serve until the parent sends anything on ``conn`` (or ``budget`` seconds pass)."""
    import anyio

    import anyio_comm

    with anyio.fail_after(budget):
        async with anyio_comm.listen(address, handler, **listen_options) as listener:
            conn.send(("ready", listener.address))
            await anyio.wait_readable(conn.fileno())


@dataclass(frozen=True)
class Timing:
    """The measurement of a round-trip case: ``warmup`` seconds, then ``seconds`` or
    ``max_count`` round trips, whichever comes first (``stretch``: seconds a case may run
    past ``warmup + seconds``: a longer warm-up, a window waiting for its first round trip)."""

    seconds: float
    warmup: float
    max_count: int
    stretch: float = 0.0

    @property
    def budget(self) -> float:
        """Seconds a client may take to start, connect, measure and wind down."""
        return STARTUP_TIMEOUT + self.warmup + self.seconds + self.stretch + STARTUP_TIMEOUT


def run_round_trips(
    ctx: Any,
    name: str,
    cpus: tuple[int | None, int | None],
    entry_points: tuple[Callable[..., Any], Callable[..., Any]],
    case: Any,
    tls: TLSFiles | None,
    timing: Timing,
) -> dict[str, Any]:
    """Run a round-trip case in a fresh pair of processes; return its fields and measurements.

    ``entry_points`` are ``server_main(conn, case, tls, lifetime)``, which reports its address
    and answers each ``"mark"`` and the final ``"stop"`` as :func:`_relay_marks` expects, and
    ``client_main(conn, case, tls, address, timing)``, which sends ``"mark"`` as its window
    starts and ends and returns the figures of :func:`round_trip_results`.
    """
    server_main, client_main = entry_points
    with ProcessPair(ctx, name, cpus) as pair:
        server, address = pair.start_server(server_main, case, tls, timing.budget + 10)
        client = pair.start_client(client_main, case, tls, address, timing)
        result = _relay_marks(server, client, time.monotonic() + timing.budget)
    return {**asdict(case), **result}


def _relay_marks(server: Child, client: Child, deadline: float) -> dict[str, Any]:
    """Pass the client's ``"mark"`` messages on to the server until the client's result comes;
    add the server's CPU time per round trip between the first two marks to that result.

    The server answers ``"stop"`` with its marks, (CPU seconds, messages echoed) at each
    command it received.
    """
    while (message := client.receive(deadline)) == "mark":
        server.send("mark")  # the client's window starts or ends now
    result: dict[str, Any]
    kind, result = message
    if kind != "result":
        raise RuntimeError(f"unexpected message from the client: {message!r}")
    server.send("stop")
    _, marks = server.receive(time.monotonic() + 10)
    result["server_cpu_us_per_rt"] = None
    if len(marks) >= 2 and marks[1][1] > marks[0][1]:
        (cpu0, n0), (cpu1, n1) = marks[:2]
        result["server_cpu_us_per_rt"] = (cpu1 - cpu0) / (n1 - n0) * 1e6
    return result


def round_trip_results(
    latencies: list[float], window: float, message_bytes: int, cpu_seconds: float
) -> dict[str, Any]:
    """The client's figures from the ``latencies`` of the round trips completed in a window of
    ``window`` seconds, over which the client used ``cpu_seconds`` of CPU time."""
    count = len(latencies)
    if not count:
        raise RuntimeError("no round trip completed inside the measurement window")
    rps = count / window
    ordered = sorted(latencies)

    def percentile_ms(q: float) -> float:
        return ordered[round(q * (count - 1))] * 1e3

    return {
        "round_trips": count,
        "window_s": window,
        "rps": rps,
        "us_per_rt": 1e6 / rps,
        "mb_per_s": rps * message_bytes / 1e6,
        "p50_ms": percentile_ms(0.50),
        "p99_ms": percentile_ms(0.99),
        "max_ms": percentile_ms(1),
        "client_cpu_us_per_rt": cpu_seconds / count * 1e6,
    }


#: the column heads of :func:`round_trip_columns`
ROUND_TRIP_HEAD = (
    f"{'rt/s':>10}{'us/rt':>10}{'MB/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
    f"{'cli us/rt':>11}{'srv us/rt':>11}"
)


def round_trip_columns(r: dict[str, Any]) -> str:
    """The figures of a round-trip case as the columns of a table row (``-``: no server CPU)."""
    srv = r["server_cpu_us_per_rt"]
    return (
        f"{r['rps']:>10,.0f}{r['us_per_rt']:>10.1f}{r['mb_per_s']:>9.1f}"
        f"{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['max_ms']:>9.3f}"
        f"{r['client_cpu_us_per_rt']:>11.1f}{'-' if srv is None else f'{srv:.1f}':>11}"
    )


# -- running cases ------------------------------------------------------------


def attempt(case: Any, run: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """``run(*args)``; if that raises, the fields of ``case`` with ``error`` (the last line of
    the message, or of the traceback of a child that failed) and ``details`` (all of it)."""
    try:
        return run(*args)
    except Exception as exc:
        details = (
            f"{exc}\n{exc.details}" if isinstance(exc, RunError) and exc.details else str(exc)
        )
        lines = [line.strip(" |+-") for line in details.splitlines()]
        summary = next((line for line in reversed(lines) if line), repr(exc))
        return {**asdict(case), "error": summary, "details": details}


def run_matrix(
    cases: list[Any],
    repeat: int,
    run: Callable[[Any], dict[str, Any]],
    report: Callable[[Any, dict[str, Any]], None],
    figure: str = "rps",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every case ``repeat`` times, interleaved, each result shown by ``report``; return
    (the best run of each case by ``figure``, round trips per second by default; all
    runs)."""
    runs: list[dict[str, Any]] = []
    best: dict[Any, dict[str, Any]] = {}
    for index in range(repeat):
        for case in cases:
            result = attempt(case, run, case)
            report(case, result)
            runs.append({"repeat": index, **result})
            previous = best.get(case)
            if previous is None or "error" in previous or result.get(figure, 0) > previous[figure]:
                best[case] = result
    return [best[case] for case in cases], runs


def run_backends(
    cases: list[Any],
    run_case: Callable[[Any, Any, tuple[int | None, int | None], TLSFiles | None], dict[str, Any]],
    cpus: tuple[int | None, int | None],
    tls_prefix: str | None,
    describe: Callable[[dict[str, Any]], str],
) -> list[dict[str, Any]]:
    """Run each case (one per backend) as ``run_case(ctx, case, cpus, tls_files)``, with test
    certificates unless ``tls_prefix`` is None; show ``describe(result)`` or the failure of
    each on stderr; return the results."""
    ctx = multiprocessing.get_context("spawn")
    results = []
    with certificates(tls_prefix) as tls_files:
        for case in cases:
            result = attempt(case, run_case, ctx, case, cpus, tls_files)
            if "error" in result:
                print(f"{case.backend}: FAILED", result["details"], sep="\n", file=sys.stderr)
            else:
                print(f"{case.backend}: {describe(result)}", file=sys.stderr)
            sys.stderr.flush()
            results.append(result)
    return results


# -- reporting ----------------------------------------------------------------


def backend_table(
    head: str, results: list[dict[str, Any]], figures: Callable[[dict[str, Any]], list[str]]
) -> str:
    """A table of :func:`run_backends` results: per case its backend and transport, then the
    columns ``head`` names, filled by ``figures(result)`` (the rest of the row, then any lines
    below it), or the error of a failed case."""
    head = f"{'backend':<9}{'transport':<10}{head}"
    lines = [head, "-" * len(head)]
    for r in results:
        row = f"{r['backend']:<9}{r['transport']:<10}"
        if "error" in r:
            lines.append(f"{row}FAILED: {r['error']}")
        else:
            first, *below = figures(r)
            lines += [row + first, *below]
    return "\n".join(lines)


def comm_versions() -> dict[str, str | None]:
    """anyio-comm's version and those of the packages it runs on."""
    import anyio_comm

    return {"anyio-comm": anyio_comm.__version__, **versions("anyio", "trio", "uvloop", "msgpack")}


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages, as text."""
    loads = load_average()
    return "unknown" if loads is None else " ".join(f"{load:.2f}" for load in loads)


@dataclass(frozen=True)
class Run:
    """One invocation of a script: its command line, where its processes run, what it runs on."""

    script: str  # module under benchmarks
    command: list[str]  # the arguments after ``python -m benchmarks.<script>``
    cpus: tuple[int | None, int | None]
    pinning: str
    roles: tuple[str, str]
    versions: dict[str, str | None]
    load_before: str

    def metadata(
        self,
        args: argparse.Namespace,
        *,
        executable: bool = False,
        outputs: tuple[str, ...] = ("json",),
        **fields: Any,
    ) -> dict[str, Any]:
        """The metadata of the JSON file: date, command, platform, pinning, load and versions,
        then ``fields``, then the options (``args`` without the ``outputs`` paths)."""
        metadata = run_metadata(
            ["python", "-m", f"benchmarks.{self.script}", *self.command],
            pinning=self.pinning,
            cpus={f"{role}_cpu": cpu for role, cpu in zip(self.roles, self.cpus, strict=True)},
            load=(self.load_before, loadavg()),
            versions=self.versions,
            executable=executable,
        )
        return {
            **metadata,
            **fields,
            "options": {k: v for k, v in vars(args).items() if k not in outputs},
        }


def start_run(
    script: str,
    title: str,
    argv: list[str] | None,
    no_pin: bool,
    *,
    versions: dict[str, str | None] | None = None,
    roles: tuple[str, str] = ("server", "client"),
) -> Run:
    """Choose the CPUs; print the platform and ``versions`` (default: :func:`comm_versions`),
    then what is pinned where and the load average: the first two lines of every script."""
    cpus, pinning = choose_cpus(no_pin, roles)
    if versions is None:
        versions = comm_versions()
    print(
        f"anyio-comm {title}: Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs; "
        + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    )
    load_before = loadavg()
    print(f"pinning: {pinning}; load average before: {load_before}")
    command = sys.argv[1:] if argv is None else argv
    return Run(script, command, cpus, pinning, roles, versions, load_before)


# -- command line -------------------------------------------------------------


def argument_parser(script: str, description: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m benchmarks.<script>``, its help text the module docstring."""
    return argparse.ArgumentParser(
        prog=f"python -m benchmarks.{script}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_backend_options(parser: argparse.ArgumentParser, transports: tuple[str, ...]) -> None:
    """``--backend`` (asyncio, uvloop, trio or all) and ``--transport`` (default: tcp)."""
    parser.add_argument(
        "--backend",
        choices=(*BACKENDS, "all"),
        default="all",
        help="asyncio, uvloop, trio or all (default: all)",
    )
    parser.add_argument("--transport", choices=transports, default="tcp", help="default: tcp")


def add_output_options(
    parser: argparse.ArgumentParser,
    *,
    no_pin_help: str = "do not pin server and client to CPUs",
    json_help: str = "also write the results and metadata as JSON",
) -> None:
    """``--no-pin`` and ``--json PATH``."""
    parser.add_argument("--no-pin", action="store_true", help=no_pin_help)
    parser.add_argument("--json", metavar="PATH", help=json_help)


def backends_for(args: argparse.Namespace) -> list[str] | None:
    """The installed backends that ``--backend`` names (``all``: every one); None, after an
    error message, when ``--transport tls`` cannot run for want of trustme.

    The options are those of :func:`add_backend_options`.
    """
    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    drop_missing_backends(backends)
    if args.transport == "tls" and importlib.util.find_spec("trustme") is None:
        print("error: --transport tls needs the trustme package", file=sys.stderr)
        return None
    return backends


def transport_tls(args: argparse.Namespace, version: str) -> dict[str, str] | None:
    """The ``tls`` metadata of a run with ``--transport``: None unless it is ``tls``."""
    if args.transport != "tls":
        return None
    return {"version": version, "openssl": ssl.OPENSSL_VERSION}


def csv_list(choices: tuple[str, ...] | None, convert: Any = str) -> Any:
    """An argparse type: a comma-separated list of ``convert``-ed items, among ``choices``."""

    def parse(text: str) -> list[Any]:
        items = [convert(item.strip()) for item in text.split(",") if item.strip()]
        if not items or (choices is not None and not set(items) <= set(choices)):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {choices}")
        return items

    return parse
