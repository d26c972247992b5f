"""Round-trip echo benchmark: anyio-comm messages versus plain AnyIO TCP streams.

A server process echoes every message back; a client process keeps
``--concurrency`` connections busy with request/reply round trips of one
payload size for ``--seconds`` (after a short warm-up). Each case runs in a
fresh pair of processes, by default pinned to two different CPUs. Systems:

* ``anyio-comm``: :func:`anyio_comm.listen` / :func:`anyio_comm.connect`,
  messages ``{"data": payload}`` (payloads of 4096 bytes or more travel
  out-of-band);
* ``anyio-streams``: :func:`anyio.create_tcp_listener` /
  :func:`anyio.connect_tcp` with an 8-byte big-endian length prefix, read back
  with :meth:`BufferedByteReceiveStream.receive_exactly`.

Run from the repository root::

    python -m benchmarks.echo --seconds 2 --repeat 2 --json results.json
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
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream

import anyio_comm

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from multiprocessing.connection import Connection

    from anyio.abc import SocketStream

SYSTEMS = ("anyio-comm", "anyio-streams")
BACKENDS = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}
STARTUP_TIMEOUT = 30.0  # seconds for a process to start, import and connect
SIZE_CHECK_EVERY = 256  # round trips between checks of the reply size

@dataclass(frozen=True)
class Case:
    """One cell of the benchmark matrix."""

    system: str
    backend: str
    size: int
    concurrency: int


@dataclass
class _Load:
    """Measurement window shared by the client's connection tasks."""

    start: float
    end: float
    max_count: int
    latencies: list[float] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)


class _Counter:
    """Requests echoed by the server, read at each measurement mark."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


def _run(backend: str, func: Any, *args: Any) -> Any:
    name, options = BACKENDS[backend]
    return anyio.run(func, *args, backend=name, backend_options=options)


def _pin(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


# -- server -------------------------------------------------------------------


async def _serve_comm(served: _Counter, *, task_status: Any) -> None:
    async def echo(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)
            served.n += 1

    async with anyio_comm.listen("tcp://127.0.0.1:0", echo) as listener:
        task_status.started(listener.address)
        await anyio.sleep_forever()


async def _serve_streams(served: _Counter, *, task_status: Any) -> None:
    async def echo(stream: SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        async with stream:
            with contextlib.suppress(
                anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError
            ):
                while True:
                    header = await reader.receive_exactly(8)
                    data = await reader.receive_exactly(int.from_bytes(header, "big"))
                    await stream.send(header + data)
                    served.n += 1

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    async with listener:
        host, port = listener.extra(SocketAttribute.local_address)[:2]
        task_status.started(f"tcp://{host}:{port}")
        await listener.serve(echo)


async def _server(conn: Connection, system: str, lifetime: float) -> None:
    """Serve until told ``"stop"``; snapshot CPU time and requests at each mark."""
    served = _Counter()
    marks: list[tuple[float, int]] = []
    with anyio.move_on_after(lifetime):
        async with anyio.create_task_group() as tg:
            serve = _serve_comm if system == "anyio-comm" else _serve_streams
            conn.send(("ready", await tg.start(serve, served)))
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


def server_main(conn: Connection, system: str, backend: str, cpu: int | None,
                lifetime: float) -> None:
    """Entry point of the server process."""
    try:
        _pin(cpu)
        _run(backend, _server, conn, system, lifetime)
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


# -- client -------------------------------------------------------------------


async def _open_comm(stack: contextlib.AsyncExitStack, address: str,
                     payload: bytes) -> Callable[[], Awaitable[None]]:
    comm = await anyio_comm.connect(address, timeout=STARTUP_TIMEOUT)
    stack.push_async_callback(comm.aclose)
    message = {"data": payload}
    size = len(payload)
    count = 0

    async def roundtrip() -> None:
        nonlocal count
        await comm.send(message)
        reply = await comm.receive()
        count += 1
        if count % SIZE_CHECK_EVERY == 1 and len(reply["data"]) != size:
            raise RuntimeError(f"echo of {size} bytes came back with {len(reply['data'])}")

    return roundtrip


async def _open_streams(stack: contextlib.AsyncExitStack, address: str,
                       payload: bytes) -> Callable[[], Awaitable[None]]:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    with anyio.fail_after(STARTUP_TIMEOUT):
        stream = await anyio.connect_tcp(host, int(port))
    stack.push_async_callback(stream.aclose)
    reader = BufferedByteReceiveStream(stream)
    header = len(payload).to_bytes(8, "big")
    size = len(payload)
    count = 0

    async def roundtrip() -> None:
        nonlocal count
        await stream.send(header + payload)
        data = await reader.receive_exactly(int.from_bytes(await reader.receive_exactly(8), "big"))
        count += 1
        if count % SIZE_CHECK_EVERY == 1 and len(data) != size:
            raise RuntimeError(f"echo of {size} bytes came back with {len(data)}")

    return roundtrip


async def _worker(roundtrip: Callable[[], Awaitable[None]], load: _Load) -> None:
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


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _client(conn: Connection, case: Case, address: str, seconds: float, warmup: float,
                  max_count: int) -> dict[str, Any]:
    """Run one case's load; return the client-side measurements."""
    opener = _open_comm if case.system == "anyio-comm" else _open_streams
    payload = bytes(range(256)) * (case.size // 256) + bytes(case.size % 256)
    with anyio.fail_after(STARTUP_TIMEOUT + warmup + seconds + STARTUP_TIMEOUT):
        async with contextlib.AsyncExitStack() as stack:
            roundtrips = [await opener(stack, address, payload) for _ in range(case.concurrency)]
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
    window = load.end - load.start
    rps = count / window
    ordered = sorted(load.latencies)
    return {
        "round_trips": count,
        "window_s": window,
        "rps": rps,
        "us_per_rt": 1e6 / rps,
        "mb_per_s": rps * case.size / 1e6,
        "p50_ms": _percentile(ordered, 0.50) * 1e3,
        "p99_ms": _percentile(ordered, 0.99) * 1e3,
        "max_ms": ordered[-1] * 1e3,
        "client_cpu_us_per_rt": (cpu1 - cpu0) / count * 1e6,
    }


def client_main(conn: Connection, case: Case, address: str, cpu: int | None, seconds: float,
                warmup: float, max_count: int) -> None:
    """Entry point of the client process."""
    try:
        _pin(cpu)
        result = _run(case.backend, _client, conn, case, address, seconds, warmup, max_count)
        conn.send(("result", result))
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


# -- orchestration ------------------------------------------------------------


def _receive(conn: Connection, proc: Any, deadline: float) -> Any:
    """Next message from ``proc``; raise if it failed, died or ran past ``deadline``."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{proc.name} did not answer in time")
        if conn.poll(min(remaining, 0.5)):
            try:
                message = conn.recv()
            except EOFError:
                raise RuntimeError(f"{proc.name} closed its pipe (exit code "
                                   f"{proc.exitcode})") from None
            if isinstance(message, tuple) and message[0] == "error":
                raise RuntimeError(f"{proc.name} failed:\n{message[1]}")
            return message
        if not proc.is_alive() and not conn.poll():
            raise RuntimeError(f"{proc.name} exited with code {proc.exitcode}")


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


def run_case(ctx: Any, case: Case, cpus: tuple[int | None, int | None],
             args: argparse.Namespace) -> dict[str, Any]:
    """Run one case in a fresh server and client process; return its measurements."""
    budget = STARTUP_TIMEOUT + args.warmup + args.seconds + STARTUP_TIMEOUT
    server_conn, server_child = ctx.Pipe()
    client_conn, client_child = ctx.Pipe()
    server = ctx.Process(target=server_main, name="echo-server", daemon=True,
                         args=(server_child, case.system, case.backend, cpus[0], budget))
    client = None
    try:
        server.start()
        server_child.close()
        _, address = _receive(server_conn, server, time.monotonic() + STARTUP_TIMEOUT)
        client = ctx.Process(target=client_main, name="echo-client", daemon=True,
                             args=(client_child, case, address, cpus[1], args.seconds,
                                   args.warmup, args.max_count))
        client.start()
        client_child.close()
        deadline = time.monotonic() + budget
        while (message := _receive(client_conn, client, deadline)) == "mark":
            server_conn.send("mark")
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
    if len(marks) >= 2 and marks[1][1] > marks[0][1]:
        (cpu0, n0), (cpu1, n1) = marks[:2]
        result["server_cpu_us_per_rt"] = (cpu1 - cpu0) / (n1 - n0) * 1e6
    else:
        result["server_cpu_us_per_rt"] = None
    return {**asdict(case), **result}


# -- reporting ----------------------------------------------------------------


def _fmt_size(n: int) -> str:
    for unit, scale in (("MB", 10**6), ("kB", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per case, then the anyio-comm / anyio-streams ratios."""
    head = (f"{'system':<14}{'backend':<9}{'size':>7}{'conc':>5}{'rt/s':>10}{'us/rt':>10}"
            f"{'MB/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'cli us/rt':>11}"
            f"{'srv us/rt':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['system']:<14}{r['backend']:<9}{_fmt_size(r['size']):>7}"
                         f"{r['concurrency']:>5}  FAILED: {r['error']}")
            continue
        srv = "-" if r["server_cpu_us_per_rt"] is None else f"{r['server_cpu_us_per_rt']:.1f}"
        lines.append(
            f"{r['system']:<14}{r['backend']:<9}{_fmt_size(r['size']):>7}{r['concurrency']:>5}"
            f"{r['rps']:>10,.0f}{r['us_per_rt']:>10.1f}{r['mb_per_s']:>9.1f}"
            f"{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['max_ms']:>9.3f}"
            f"{r['client_cpu_us_per_rt']:>11.1f}{srv:>11}"
        )
    by_case = {(r["system"], r["backend"], r["size"], r["concurrency"]): r
               for r in results if "error" not in r}
    ratios = []
    for (system, backend, size, conc), r in by_case.items():
        other = by_case.get(("anyio-streams", backend, size, conc))
        if system == "anyio-comm" and other:
            ratios.append(f"  {_fmt_size(size):>7} {backend:<8} conc {conc}: "
                          f"{r['rps'] / other['rps']:.2f}x")
    if ratios:
        lines += ["", "anyio-comm / anyio-streams, round trips per second:", *ratios]
    return "\n".join(lines)


def _choose_cpus(no_pin: bool) -> tuple[tuple[int | None, int | None], str]:
    if no_pin:
        return (None, None), "none (--no-pin)"
    if not hasattr(os, "sched_setaffinity"):
        return (None, None), "none (os.sched_setaffinity is not available)"
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        return (None, None), f"none (only CPU {allowed[0]} is available)"
    return (allowed[0], allowed[1]), f"server CPU {allowed[0]}, client CPU {allowed[1]}"


def _versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"anyio-comm": anyio_comm.__version__}
    for dist in ("anyio", "trio", "uvloop", "msgpack"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def _csv(choices: tuple[str, ...] | None, convert: Any = str) -> Any:
    def parse(text: str) -> list[Any]:
        items = [convert(item.strip()) for item in text.split(",") if item.strip()]
        bad = [item for item in items if choices is not None and item not in choices]
        if not items or bad:
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
    parser = argparse.ArgumentParser(prog="python -m benchmarks.echo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=_csv(None, _positive_int), default=[1000, 10_000_000],
                        help="payload sizes in bytes (default: 1000,10000000)")
    parser.add_argument("--backends", type=_csv(tuple(BACKENDS)), default=list(BACKENDS),
                        help="asyncio, uvloop and/or trio (default: all)")
    parser.add_argument("--systems", type=_csv(SYSTEMS), default=list(SYSTEMS),
                        help="anyio-comm and/or anyio-streams (default: both)")
    parser.add_argument("--concurrency", type=_positive_int, default=1,
                        help="concurrent connections in the client (default: 1)")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="measured seconds per case (default: 2)")
    parser.add_argument("--warmup", type=float, default=0.3,
                        help="warm-up seconds before measuring (default: 0.3)")
    parser.add_argument("--max-count", type=_positive_int, default=1_000_000,
                        help="most round trips measured per case (default: 1000000)")
    parser.add_argument("--repeat", type=_positive_int, default=1,
                        help="run the whole matrix N times, keep the best rt/s per case")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin the server and client to separate CPUs")
    parser.add_argument("--json", metavar="PATH", help="also write all results as JSON")
    args = parser.parse_args(argv)
    if not 0 < args.seconds <= 600 or not 0 <= args.warmup <= 60:
        parser.error("--seconds must be in (0, 600] and --warmup in [0, 60]")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark matrix and print the results; return the exit status."""
    args = parse_args(argv)
    backends = args.backends
    for missing in ("uvloop", "trio"):
        if missing in backends and importlib.util.find_spec(missing) is None:
            print(f"note: {missing} is not installed; skipping it", file=sys.stderr)
            backends = [b for b in backends if b != missing]
    cpus, pinning = _choose_cpus(args.no_pin)
    versions = _versions()
    print(f"anyio-comm echo benchmark: Python {platform.python_version()} on "
          f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs; "
          + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    print(f"pinning: {pinning}")
    print(f"{args.seconds:g} s per case after {args.warmup:g} s warm-up, at most "
          f"{args.max_count:,} round trips; concurrency {args.concurrency}; "
          f"repeat {args.repeat} (best rt/s kept)\n", flush=True)

    cases = [Case(system, backend, size, args.concurrency)
             for size in args.sizes for backend in backends for system in args.systems]
    ctx = multiprocessing.get_context("spawn")
    runs: list[dict[str, Any]] = []
    best: dict[Case, dict[str, Any]] = {}
    total = len(cases) * args.repeat
    for repeat in range(args.repeat):
        for case in cases:
            label = f"{case.system} {case.backend} {_fmt_size(case.size)}"
            try:
                result = run_case(ctx, case, cpus, args)
            except Exception as exc:
                lines = [line.strip(" |+-") for line in str(exc).splitlines()]
                summary = next((line for line in reversed(lines) if line), repr(exc))
                result = {**asdict(case), "error": summary, "details": str(exc)}
                print(f"[{len(runs) + 1}/{total}] {label}: FAILED\n{exc}", file=sys.stderr)
            else:
                print(f"[{len(runs) + 1}/{total}] {label}: {result['rps']:,.0f} rt/s",
                      file=sys.stderr, flush=True)
            runs.append({"repeat": repeat, **result})
            previous = best.get(case)
            if previous is None or "error" in previous or result.get("rps", 0) > previous["rps"]:
                best[case] = result
    results = [best[case] for case in cases]
    print(format_table(results))
    if args.json:
        metadata = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": [sys.executable, "-m", "benchmarks.echo", *sys.argv[1:]],
            "python": sys.version,
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "pinning": pinning,
            "server_cpu": cpus[0],
            "client_cpu": cpus[1],
            "versions": versions,
            "options": {k: v for k, v in vars(args).items() if k != "json"},
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"metadata": metadata, "results": results, "runs": runs}, fh, indent=2)
            fh.write("\n")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
