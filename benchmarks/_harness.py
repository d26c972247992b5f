"""What the benchmark scripts share: the processes of a case, TLS, the header and the metadata.

Every case runs in a fresh server process and a fresh client process, each
pinned to a CPU of its own where the machine allows it. A child talks to the
parent over a pipe: the server first reports its address as ``("ready",
address)``, a child's entry point returns its result, sent as ``("result",
value)``, and any failure comes back as ``("error", traceback)``, which
:meth:`Child.receive` raises in the parent. A script builds its cases, runs
each one with :func:`attempt` (a failed case becomes a result with an
``error``), begins its output with :func:`start_run` and writes
:meth:`Run.metadata` into its JSON file.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import re
import shutil
import ssl
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator
    from multiprocessing.connection import Connection

T = TypeVar("T")

STARTUP_TIMEOUT = 30.0  # seconds for a process to start, import and connect
BACKENDS = {  # name: (AnyIO backend, backend options)
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}
TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


def run_backend(backend: str, func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run(func, *args)`` on ``asyncio``, ``uvloop`` (asyncio with uvloop) or ``trio``."""
    import anyio

    name, options = BACKENDS[backend]
    return anyio.run(func, *args, backend=name, backend_options=options)


def drop_missing_backends(backends: list[str]) -> None:
    """Remove uvloop and trio from ``backends`` where they are not installed, with a note."""
    for name in ("uvloop", "trio"):
        if name in backends and importlib.util.find_spec(name) is None:
            print(f"note: {name} is not installed; skipping that backend", file=sys.stderr)
            backends.remove(name)


# -- TLS ----------------------------------------------------------------------


@dataclass(frozen=True)
class TLSFiles:
    """Test certificates made with trustme by the parent process."""

    ca_pem: bytes  # the CA certificate the client trusts
    server_pem: str  # path of the server's private key and certificate chain


def make_certificates(directory: str) -> TLSFiles:
    """A CA and a server certificate for 127.0.0.1 and localhost, in ``directory``."""
    import trustme  # only needed for TLS cases

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    server_pem = os.path.join(directory, "server.pem")
    with open(server_pem, "wb") as fh:
        fh.write(cert.private_key_and_cert_chain_pem.bytes())
    return TLSFiles(ca_pem=ca.cert_pem.bytes(), server_pem=server_pem)


@contextlib.contextmanager
def certificates(prefix: str | None) -> Iterator[TLSFiles | None]:
    """Test certificates in a temporary directory named ``prefix...`` (None: no certificates)."""
    if prefix is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as directory:
        yield make_certificates(directory)


def _pin_version(context: ssl.SSLContext, version: str) -> ssl.SSLContext:
    context.minimum_version = context.maximum_version = TLS_VERSIONS[version]
    return context


def server_context(files: TLSFiles | None, version: str | None) -> ssl.SSLContext | None:
    """The server's SSL context: our certificate, exactly TLS ``version``; None for plain TCP
    (no files or no version)."""
    if files is None or version is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.server_pem)
    return _pin_version(context, version)


def client_context(files: TLSFiles | None, version: str | None) -> ssl.SSLContext | None:
    """The client's SSL context: trusts only our CA, exactly TLS ``version``; None for plain
    TCP (no files or no version)."""
    if files is None or version is None:
        return None
    context = ssl.create_default_context(cadata=files.ca_pem.decode("ascii"))
    return _pin_version(context, version)


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


def choose_cpus(
    no_pin: bool, roles: tuple[str, str] = ("server", "client")
) -> tuple[tuple[int | None, int | None], str]:
    """The CPUs of the two processes of a case, and what is pinned where, as text."""
    if no_pin:
        return (None, None), "none (--no-pin)"
    if not hasattr(os, "sched_setaffinity"):
        return (None, None), "none (os.sched_setaffinity is not available)"
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return (None, None), f"none (only CPU {allowed[0]} is available)"
    first, second = allowed[:2]
    return (first, second), f"{roles[0]} CPU {first}, {roles[1]} CPU {second}"


def _child_main(
    conn: Connection, cpu: int | None, target: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    """Entry point of a child: pinned to ``cpu``, runs ``target(conn, *args)``, sends its result
    (unless None) or its failure, then closes ``conn``."""
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        result = target(conn, *args)
        if result is not None:
            conn.send(("result", result))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


class Child:
    """A child process of a case and the parent's end of its pipe."""

    def __init__(
        self,
        ctx: Any,
        name: str,
        cpu: int | None,
        target: Callable[..., Any],
        args: tuple[Any, ...],
    ) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main, name=name, daemon=True, args=(child_conn, cpu, target, args)
        )
        try:
            self.process.start()
        except BaseException:
            self.conn.close()
            raise
        finally:
            child_conn.close()

    def send(self, message: Any) -> None:
        """Send ``message`` to the child."""
        self.conn.send(message)

    def receive(self, deadline: float) -> Any:
        """The child's next message; raise if it failed, died or ran past ``deadline``."""
        conn, proc = self.conn, self.process
        while (remaining := deadline - time.monotonic()) > 0:
            if conn.poll(min(remaining, 0.5)):
                try:
                    message = conn.recv()
                except EOFError:
                    raise RuntimeError(f"{proc.name} exited (code {proc.exitcode})") from None
                if isinstance(message, tuple) and message[0] == "error":
                    raise RuntimeError(f"{proc.name} failed:\n{message[1]}")
                return message
            if not proc.is_alive() and not conn.poll():
                raise RuntimeError(f"{proc.name} exited (code {proc.exitcode})")
        raise TimeoutError(f"{proc.name} did not answer in time")

    def stop(self) -> None:
        """Wait a little for the process to end, then terminate it, then kill it."""
        proc = self.process
        proc.join(5)
        if proc.is_alive():
            proc.terminate()
            proc.join(2)
        if proc.is_alive():
            proc.kill()
            proc.join(2)


class ProcessPair:
    """The two processes of a case: a server on the first CPU, a client on the second.

    On leaving the ``with`` block the pipes are closed and both processes
    stopped, the client first.
    """

    def __init__(
        self,
        ctx: Any,
        name: str,
        cpus: tuple[int | None, int | None],
        roles: tuple[str, str] = ("server", "client"),
    ) -> None:
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
        child = Child(self._ctx, self._names[role], self._cpus[role], target, args)
        self._children.append(child)
        return child

    def __enter__(self) -> ProcessPair:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for child in self._children:
            child.conn.close()
        for child in reversed(self._children):
            child.stop()


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
    the message) and ``details`` (all of it)."""
    try:
        return run(*args)
    except Exception as exc:
        lines = [line.strip(" |+-") for line in str(exc).splitlines()]
        summary = next((line for line in reversed(lines) if line), repr(exc))
        return {**asdict(case), "error": summary, "details": str(exc)}


def run_matrix(
    cases: list[Any],
    repeat: int,
    run: Callable[[Any], dict[str, Any]],
    report: Callable[[Any, dict[str, Any]], None],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every case ``repeat`` times, interleaved, each result shown by ``report``; return
    (the best run of each case by round trips per second, all runs)."""
    runs: list[dict[str, Any]] = []
    best: dict[Any, dict[str, Any]] = {}
    for index in range(repeat):
        for case in cases:
            result = attempt(case, run, case)
            report(case, result)
            runs.append({"repeat": index, **result})
            previous = best.get(case)
            if previous is None or "error" in previous or result.get("rps", 0) > previous["rps"]:
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


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """``"10GB"`` -> 10**10; decimal (kB, MB, GB) and binary (KiB, MiB, GiB) units.

    Raises:
        argparse.ArgumentTypeError: not a positive size.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 2GB, 1MB, 512KiB)")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def format_size(n: int) -> str:
    """``1000`` -> ``1 kB``, ``10000000`` -> ``10 MB``, ``1500`` -> ``1500 B``."""
    for unit, scale in (("MB", 10**6), ("kB", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def versions(*dists: str) -> dict[str, str | None]:
    """The installed version of each distribution (None: not installed)."""
    found: dict[str, str | None] = {}
    for dist in dists:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def comm_versions() -> dict[str, str | None]:
    """anyio-comm's version and those of the packages it runs on."""
    import anyio_comm

    return {"anyio-comm": anyio_comm.__version__, **versions("anyio", "trio", "uvloop", "msgpack")}


def loadavg() -> str:
    """The 1-, 5- and 15-minute load averages, as text."""
    if not hasattr(os, "getloadavg"):
        return "unknown"
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


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
        metadata: dict[str, Any] = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": ["python", "-m", f"benchmarks.{self.script}", *self.command],
            "python": sys.version,
        }
        if executable:
            metadata["executable"] = sys.executable
        return {
            **metadata,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "pinning": self.pinning,
            f"{self.roles[0]}_cpu": self.cpus[0],
            f"{self.roles[1]}_cpu": self.cpus[1],
            "load_average_before": self.load_before,
            "load_average_after": loadavg(),
            "versions": self.versions,
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


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` as indented JSON."""
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


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


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value
