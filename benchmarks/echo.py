"""Round-trip echo benchmark: anyio-comm messages versus plain AnyIO TCP streams.

A server process echoes every message back; a client process keeps
``--concurrency`` connections busy with request/reply round trips of one
payload size for ``--seconds`` (after a short warm-up). Every case runs in a
fresh pair of processes, by default pinned to two different CPUs. Systems:

* ``anyio-comm``: :func:`anyio_comm.listen` / :func:`anyio_comm.connect`,
  messages ``{"data": payload}`` (payloads of 4096 bytes or more travel
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

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import platform
import ssl
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.tls import TLSListener

import anyio_comm

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Iterator
    from multiprocessing.connection import Connection

    from anyio.abc import ByteStream, TaskStatus

    RoundTrip = Callable[[], Awaitable[None]]

SYSTEMS = ("anyio-comm", "anyio-streams")
BACKENDS = {  # name: (AnyIO backend, backend options)
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}
TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
STARTUP_TIMEOUT = 30.0  # seconds for a process to start, import and connect
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


@dataclass(frozen=True)
class TLSFiles:
    """Test certificates made with trustme by the parent process."""

    ca_pem: bytes  # the CA certificate the client trusts
    server_pem: str  # path of the server's private key and certificate chain


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


def _run(backend: str, func: Any, *args: Any) -> Any:
    name, options = BACKENDS[backend]
    return anyio.run(func, *args, backend=name, backend_options=options)


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def make_certificates(directory: str) -> TLSFiles:
    """A CA and a server certificate for 127.0.0.1 and localhost, in ``directory``."""
    import trustme  # only needed with --tls

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    server_pem = os.path.join(directory, "server.pem")
    with open(server_pem, "wb") as fh:
        fh.write(cert.private_key_and_cert_chain_pem.bytes())
    return TLSFiles(ca_pem=ca.cert_pem.bytes(), server_pem=server_pem)


def _pin_version(context: ssl.SSLContext, version: str) -> ssl.SSLContext:
    context.minimum_version = context.maximum_version = TLS_VERSIONS[version]
    return context


def server_context(files: TLSFiles, version: str) -> ssl.SSLContext:
    """The server's SSL context: our certificate, exactly TLS ``version``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.server_pem)
    return _pin_version(context, version)


def client_context(files: TLSFiles, version: str) -> ssl.SSLContext:
    """The client's SSL context: trusts only our CA, exactly TLS ``version``."""
    context = ssl.create_default_context(cadata=files.ca_pem.decode("ascii"))
    return _pin_version(context, version)


# -- server -------------------------------------------------------------------


async def _serve_comm(
    served: _Counter, ssl_context: ssl.SSLContext | None, *, task_status: TaskStatus[str]
) -> None:
    async def echo(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)
            served.n += 1

    if ssl_context is None:
        listening = anyio_comm.listen("tcp://127.0.0.1:0", echo)
    else:
        listening = anyio_comm.listen("tls://127.0.0.1:0", echo, ssl_context=ssl_context)
    async with listening as listener:
        task_status.started(listener.address)
        await anyio.sleep_forever()


async def _serve_streams(
    served: _Counter, ssl_context: ssl.SSLContext | None, *, task_status: TaskStatus[str]
) -> None:
    async def echo(stream: ByteStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        errors = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError)
        async with stream:
            with contextlib.suppress(*errors):
                while True:
                    header = await reader.receive_exactly(8)
                    data = await reader.receive_exactly(int.from_bytes(header, "big"))
                    await stream.send(header + data)
                    served.n += 1

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        host, port = listener.extra(SocketAttribute.local_address)[:2]
        task_status.started(f"tcp://{host}:{port}")
        if ssl_context is None:
            await listener.serve(echo)
        else:
            await TLSListener(listener, ssl_context, standard_compatible=False).serve(echo)


async def _server(
    conn: Connection, system: str, ssl_context: ssl.SSLContext | None, lifetime: float
) -> None:
    """Serve until told ``"stop"``; snapshot CPU time and messages at each command."""
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
    conn.send(("marks", marks))


@contextlib.contextmanager
def _reporting_to(conn: Connection) -> Iterator[None]:
    """Send any failure of the block to the parent as ``("error", traceback)``; close ``conn``."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def server_main(
    conn: Connection, case: Case, tls: TLSFiles | None, cpu: int | None, lifetime: float
) -> None:
    """Entry point of the server process."""
    with _reporting_to(conn):
        _pin(cpu)
        ssl_context = None
        if case.tls is not None:
            assert tls is not None
            ssl_context = server_context(tls, case.tls)
        _run(case.backend, _server, conn, case.system, ssl_context, lifetime)


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
    if ssl_context is None:
        comm = await anyio_comm.connect(address, timeout=STARTUP_TIMEOUT)
    else:
        comm = await anyio_comm.connect(address, timeout=STARTUP_TIMEOUT, ssl_context=ssl_context)
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
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    stream: ByteStream
    with anyio.fail_after(STARTUP_TIMEOUT):
        if ssl_context is None:
            stream = await anyio.connect_tcp(host, int(port))
        else:
            stream = await anyio.connect_tcp(
                host, int(port), ssl_context=ssl_context, tls_standard_compatible=False
            )
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
    seconds: float,
    warmup: float,
    max_count: int,
) -> dict[str, Any]:
    """Run one case's load; return the client-side measurements."""
    opener = _open_comm if case.system == "anyio-comm" else _open_streams
    payload = bytes(range(256)) * (case.size // 256) + bytes(case.size % 256)
    with anyio.fail_after(STARTUP_TIMEOUT + warmup + seconds + STARTUP_TIMEOUT):
        async with contextlib.AsyncExitStack() as stack:
            roundtrips = [
                await opener(stack, address, payload, ssl_context) for _ in range(case.concurrency)
            ]
            start = time.perf_counter() + warmup
            load = _Load(start=start, end=start + seconds, max_count=max_count)
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
    count = len(load.latencies)
    if not count:
        raise RuntimeError("no round trip completed inside the measurement window")
    rps = count / (load.end - load.start)
    ordered = sorted(load.latencies)

    def percentile_ms(q: float) -> float:
        return ordered[round(q * (count - 1))] * 1e3

    return {
        "round_trips": count,
        "window_s": load.end - load.start,
        "rps": rps,
        "us_per_rt": 1e6 / rps,
        "mb_per_s": rps * case.size / 1e6,
        "p50_ms": percentile_ms(0.50),
        "p99_ms": percentile_ms(0.99),
        "max_ms": percentile_ms(1),
        "client_cpu_us_per_rt": (cpu1 - cpu0) / count * 1e6,
    }


def client_main(
    conn: Connection,
    case: Case,
    tls: TLSFiles | None,
    address: str,
    cpu: int | None,
    seconds: float,
    warmup: float,
    max_count: int,
) -> None:
    """Entry point of the client process."""
    with _reporting_to(conn):
        _pin(cpu)
        ssl_context = None
        if case.tls is not None:
            assert tls is not None
            ssl_context = client_context(tls, case.tls)
        result = _run(
            case.backend, _client, conn, case, ssl_context, address, seconds, warmup, max_count
        )
        conn.send(("result", result))


# -- orchestration ------------------------------------------------------------


def _receive(conn: Connection, proc: Any, deadline: float) -> Any:
    """Next message from ``proc``; raise if it failed, died or ran past ``deadline``."""
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


def _stop(proc: Any) -> None:
    if proc is None or proc.pid is None:
        return
    proc.join(5)
    if proc.is_alive():
        proc.terminate()
        proc.join(2)
    if proc.is_alive():
        proc.kill()
        proc.join(2)


def run_case(
    ctx: Any,
    case: Case,
    cpus: tuple[int | None, int | None],
    args: argparse.Namespace,
    tls: TLSFiles | None = None,
) -> dict[str, Any]:
    """Run one case in a fresh server and client process; return its measurements."""
    budget = STARTUP_TIMEOUT + args.warmup + args.seconds + STARTUP_TIMEOUT
    server_conn, server_child = ctx.Pipe()
    client_conn, client_child = ctx.Pipe()
    server = ctx.Process(
        target=server_main,
        name="echo-server",
        daemon=True,
        args=(server_child, case, tls, cpus[0], budget),
    )
    client = None
    try:
        server.start()
        server_child.close()
        _, address = _receive(server_conn, server, time.monotonic() + STARTUP_TIMEOUT)
        client = ctx.Process(
            target=client_main,
            name="echo-client",
            daemon=True,
            args=(
                client_child,
                case,
                tls,
                address,
                cpus[1],
                args.seconds,
                args.warmup,
                args.max_count,
            ),
        )
        client.start()
        client_child.close()
        deadline = time.monotonic() + budget
        while (message := _receive(client_conn, client, deadline)) == "mark":
            server_conn.send("mark")  # the client's window starts or ends now
        kind, result = message
        if kind != "result":
            raise RuntimeError(f"unexpected message from the client: {message!r}")
        server_conn.send("stop")
        _, marks = _receive(server_conn, server, time.monotonic() + 10)
    finally:
        for conn in (server_conn, server_child, client_conn, client_child):
            conn.close()
        for proc in (client, server):
            _stop(proc)
    result["server_cpu_us_per_rt"] = None
    if len(marks) >= 2 and marks[1][1] > marks[0][1]:
        (cpu0, n0), (cpu1, n1) = marks[:2]
        result["server_cpu_us_per_rt"] = (cpu1 - cpu0) / (n1 - n0) * 1e6
    return {**asdict(case), **result}


def _choose_cpus(no_pin: bool) -> tuple[tuple[int | None, int | None], str]:
    if no_pin:
        return (None, None), "none (--no-pin)"
    if not hasattr(os, "sched_setaffinity"):
        return (None, None), "none (os.sched_setaffinity is not available)"
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return (None, None), f"none (only CPU {allowed[0]} is available)"
    return (allowed[0], allowed[1]), f"server CPU {allowed[0]}, client CPU {allowed[1]}"


def run_matrix(
    cases: list[Case],
    cpus: tuple[int | None, int | None],
    args: argparse.Namespace,
    tls: TLSFiles | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run every case ``args.repeat`` times, interleaved; return (best per case, all runs)."""
    ctx = multiprocessing.get_context("spawn")
    runs: list[dict[str, Any]] = []
    best: dict[Case, dict[str, Any]] = {}
    for repeat in range(args.repeat):
        for case in cases:
            progress = (
                f"[{len(runs) + 1}/{len(cases) * args.repeat}] {case.label} "
                f"{case.backend} {_fmt_size(case.size)}:"
            )
            try:
                result = run_case(ctx, case, cpus, args, tls)
            except Exception as exc:
                lines = [line.strip(" |+-") for line in str(exc).splitlines()]
                summary = next((line for line in reversed(lines) if line), repr(exc))
                result = {**asdict(case), "error": summary, "details": str(exc)}
                print(progress, "FAILED", exc, sep="\n", file=sys.stderr, flush=True)
            else:
                print(progress, f"{result['rps']:,.0f} rt/s", file=sys.stderr, flush=True)
            runs.append({"repeat": repeat, **result})
            previous = best.get(case)
            if previous is None or "error" in previous or result.get("rps", 0) > previous["rps"]:
                best[case] = result
    return [best[case] for case in cases], runs


# -- reporting ----------------------------------------------------------------


def _fmt_size(n: int) -> str:
    for unit, scale in (("MB", 10**6), ("kB", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def _label(r: dict[str, Any]) -> str:
    return r["system"] if r.get("tls") is None else f"{r['system']}+tls"


def _key(r: dict[str, Any]) -> tuple[str, str, int, int, str | None]:
    return (r["system"], r["backend"], r["size"], r["concurrency"], r.get("tls"))


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per case, then the anyio-comm / anyio-streams ratios (like with like)."""
    width = max([14, *(len(_label(r)) + 1 for r in results)])
    any_tls = any(r.get("tls") is not None for r in results)
    head = (
        f"{'system':<{width}}{'backend':<9}{'size':>7}{'conc':>5}{'rt/s':>10}{'us/rt':>10}"
        f"{'MB/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'cli us/rt':>11}"
        f"{'srv us/rt':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        row = (
            f"{_label(r):<{width}}{r['backend']:<9}{_fmt_size(r['size']):>7}{r['concurrency']:>5}"
        )
        if "error" in r:
            lines.append(f"{row}  FAILED: {r['error']}")
            continue
        srv = r["server_cpu_us_per_rt"]
        lines.append(
            f"{row}{r['rps']:>10,.0f}{r['us_per_rt']:>10.1f}{r['mb_per_s']:>9.1f}"
            f"{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['max_ms']:>9.3f}"
            f"{r['client_cpu_us_per_rt']:>11.1f}{'-' if srv is None else f'{srv:.1f}':>11}"
        )
    ok = {_key(r): r for r in results if "error" not in r}
    ratios = []
    for (system, backend, size, conc, tls), r in ok.items():
        other = ok.get(("anyio-streams", backend, size, conc, tls))
        if system != "anyio-comm" or other is None:
            continue
        mode = f" {'plain' if tls is None else f'TLS {tls}':<8}" if any_tls else ""
        ratios.append(
            f"  {_fmt_size(size):>7} {backend:<8}{mode} conc {conc}: "
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
            f"{_fmt_size(size):>7} {backend:<9}{'MB/s' if size >= 10**6 else 'p50 us':<8}"
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


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"anyio-comm": anyio_comm.__version__}
    for dist in ("anyio", "trio", "uvloop", "msgpack"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def _loadavg() -> str:
    """The 1-, 5- and 15-minute load averages, as text."""
    if not hasattr(os, "getloadavg"):
        return "unknown"
    return " ".join(f"{load:.2f}" for load in os.getloadavg())


# -- command line -------------------------------------------------------------


def _csv(choices: tuple[str, ...] | None, convert: Any = str) -> Any:
    def parse(text: str) -> list[Any]:
        items = [convert(item.strip()) for item in text.split(",") if item.strip()]
        if not items or (choices is not None and not set(items) <= set(choices)):
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {choices}")
        return items

    return parse


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.echo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add(
        "--sizes",
        type=_csv(None, _positive_int),
        default=[1000, 10_000_000],
        help="payload sizes in bytes (default: 1000,10000000)",
    )
    add(
        "--backends",
        type=_csv(tuple(BACKENDS)),
        default=list(BACKENDS),
        help="asyncio, uvloop and/or trio (default: all three)",
    )
    add(
        "--systems",
        type=_csv(SYSTEMS),
        default=list(SYSTEMS),
        help="anyio-comm and/or anyio-streams (default: both)",
    )
    add(
        "--concurrency",
        type=_positive_int,
        default=1,
        help="concurrent connections in the client (default: 1)",
    )
    add("--seconds", type=float, default=2.0, help="measured seconds per case (default: 2)")
    add("--warmup", type=float, default=0.3, help="warm-up seconds per case (default: 0.3)")
    add(
        "--max-count",
        type=_positive_int,
        default=1_000_000,
        help="most round trips measured per case (default: 1000000)",
    )
    add(
        "--repeat",
        type=_positive_int,
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
    add("--no-pin", action="store_true", help="do not pin server and client to CPUs")
    add("--json", metavar="PATH", help="also write the results and metadata as JSON")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 600 or not 0 <= args.warmup <= 60:
        parser.error("--seconds must be in (0, 600] and --warmup in [0, 60]")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark matrix and print the results; return the exit status."""
    args = parse_args(argv)
    for name in ("uvloop", "trio"):
        if name in args.backends and importlib.util.find_spec(name) is None:
            print(f"note: {name} is not installed; skipping that backend", file=sys.stderr)
            args.backends.remove(name)
    if args.tls != "off" and importlib.util.find_spec("trustme") is None:
        print("error: --tls needs the trustme package (pip install trustme)", file=sys.stderr)
        return 2
    cpus, pinning = _choose_cpus(args.no_pin)
    versions = _versions()
    print(
        f"anyio-comm echo benchmark: Python {platform.python_version()}, "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs; "
        + ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    )
    load_before = _loadavg()
    print(f"pinning: {pinning}; load average before: {load_before}")
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
    with contextlib.ExitStack() as stack:
        tls_files = None
        if args.tls != "off":
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="echo-tls-"))
            tls_files = make_certificates(directory)
        results, runs = run_matrix(cases, cpus, args, tls_files)
    print(format_table(results))
    if summary := format_tls_summary(results):
        print(f"\n{summary}")
    if args.json:
        command = sys.argv[1:] if argv is None else argv
        metadata = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": ["python", "-m", "benchmarks.echo", *command],
            "python": sys.version,
            "executable": sys.executable,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "pinning": pinning,
            "server_cpu": cpus[0],
            "client_cpu": cpus[1],
            "load_average_before": load_before,
            "load_average_after": _loadavg(),
            "versions": versions,
            "tls": None
            if args.tls == "off"
            else {
                "mode": args.tls,
                "version": args.tls_version,
                "openssl": ssl.OPENSSL_VERSION,
                "certificates": "trustme CA, server certificate for 127.0.0.1 and localhost",
            },
            "options": {k: v for k, v in vars(args).items() if k != "json"},
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"metadata": metadata, "results": results, "runs": runs}, fh, indent=2)
            fh.write("\n")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
