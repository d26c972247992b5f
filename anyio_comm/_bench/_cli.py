"""``anyio-comm bench`` and ``anyio-comm serve``: parsing, orchestration and the report."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import multiprocessing
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from .. import __version__
from .._addressing import parse_address
from .._sansio.serialization import DEFAULT_OOB_THRESHOLD
from ._arguments import byte_size, format_size, whole_number
from ._client import ClientSpec, client_process, open_comm
from ._common import (
    BACKENDS,
    MAX_FRAMES,
    MAX_MESSAGE,
    MAX_SIZE,
    RunError,
    UsageError,
    check_backend,
    install_hint,
    one_line,
    run_backend,
)
from ._metadata import load_average, run_metadata, versions, write_json
from ._processes import Child, allowed_cpus, choose_cpus, gather
from ._server import serve_command, server_process
from ._tls import ClientTLS, ServerTLS, certificates

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

STARTUP_TIMEOUT = 60.0  # seconds for the processes to start, import and connect
STOP_TIMEOUT = 10.0  # seconds for a process to exit once told to
PROGRESS_TTY_EVERY = 0.5  # seconds between rewrites of the progress line on a terminal
PROGRESS_LOG_EVERY = 5.0  # seconds between progress lines when the output is not a terminal


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line on stderr (exit status 2)."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _seconds(low: float, high: float, *, open_low: bool = False) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
        if not (low < value if open_low else low <= value) or not value <= high:
            raise argparse.ArgumentTypeError(f"expected {low:g} to {high:g} seconds, got {text}")
        return value

    return parse


def add_parsers(commands: Any) -> None:
    """Add the ``bench`` and ``serve`` subcommands to ``commands`` (from add_subparsers)."""
    bench = commands.add_parser(
        "bench",
        help="measure echo round trips against a local or remote bench server",
        description="Echo benchmark: P client processes x C comms send messages of F frames "
        "of B bytes and wait for each echo. Without ADDRESS, a local server process is "
        "started on 127.0.0.1. Needs the 'bench' extra for uvloop, trio and --tls.",
    )
    add = bench.add_argument
    add("address", nargs="?", help="server started with 'anyio-comm serve' (default: local)")
    add("-p", "--processes", type=whole_number(64), default=1, help="client processes (default 1)")
    add("-c", "--concurrency", type=whole_number(1000), default=1, help="comms per process (1)")
    add("-f", "--frames", type=whole_number(MAX_FRAMES), default=1, help="frames per message (1)")
    add(
        "-s",
        "--size",
        type=byte_size(MAX_SIZE),
        default=1000,
        help="bytes per frame: 1000, 1e6, 1MB, 1KiB",
    )
    add("--seconds", type=_seconds(0, 600, open_low=True), default=3.0, help="window (3)")
    add("--warmup", type=_seconds(0, 60), default=0.5, help="warm-up seconds (0.5)")
    add("--backend", choices=BACKENDS, default="asyncio", help="event loop (asyncio)")
    add("--raw-frames", action="store_true", help="send_frames/receive_frames, no msgpack")
    add("--tls", action="store_true", help="local run over TLS with trustme certificates")
    add("--cafile", help="remote tls:// server: CA certificates to verify it with")
    add("--certfile", help="remote tls:// server: client certificate (mutual TLS)")
    add("--keyfile", help="private key of --certfile, if not in that file")
    add("--server-hostname", help="remote tls:// server: name to verify instead of the host")
    add("--gil-hold", action="store_true", help="local server runs a GIL-holding thread")
    add("--no-pin", action="store_true", help="do not pin processes to CPUs")
    add(
        "--connect-timeout",
        type=_seconds(0, 300, open_low=True),
        default=10.0,
        help="seconds each connection and its hello may take (10)",
    )
    add("--json", metavar="PATH", help="also write the results and metadata as JSON")

    serve = commands.add_parser(
        "serve",
        help="run a bench echo server until Ctrl-C or SIGTERM",
        description="Echo server for 'anyio-comm bench ADDRESS'; prints its address.",
    )
    add = serve.add_argument
    add("address", help="tcp://host:port (port 0: any), tls://host:port or unix:///path")
    add("--backend", choices=BACKENDS, default="asyncio", help="event loop (asyncio)")
    add("--tls", action="store_true", help="serve TLS (tcp:// becomes tls://)")
    add("--certfile", help="server certificate chain (PEM), required for TLS")
    add("--keyfile", help="private key of --certfile, if not in that file")
    add("--cafile", help="require client certificates signed by these CAs")
    add("--gil-hold", action="store_true", help="run a thread that holds the GIL")
    add("--grace", type=_seconds(0, 600), default=5.0, help="shutdown grace seconds (5)")
    add("--cpu", type=int, help="pin the server to this CPU")
    add(
        "--stats",
        type=_seconds(0, 3600, open_low=True),
        metavar="SECONDS",
        help="print the listener's and the connections' statistics every SECONDS",
    )


# -- serve ----------------------------------------------------------------------------------


def serve_main(args: argparse.Namespace) -> int:
    """``anyio-comm serve``; returns the exit status."""
    try:
        check_backend(args.backend)
        address = args.address
        scheme = _scheme(address)
        if args.tls and scheme == "tcp":
            address = "tls" + address[3:]
        elif args.tls and scheme != "tls":
            raise UsageError(f"--tls needs a tcp:// or tls:// address, not {address}")
        tls = None
        if _scheme(address) == "tls":
            if args.certfile is None:
                raise UsageError("TLS needs --certfile (and --keyfile unless it holds the key)")
            tls = ServerTLS(args.certfile, args.keyfile, args.cafile)
        elif args.certfile or args.keyfile or args.cafile:
            raise UsageError("--certfile, --keyfile and --cafile need --tls or a tls:// address")
        if args.cpu is not None and args.cpu not in allowed_cpus():
            raise UsageError(f"--cpu {args.cpu} is not one of the CPUs {allowed_cpus()}")
        serve_command(address, args.backend, tls, args.gil_hold, args.grace, args.cpu, args.stats)
    except UsageError as exc:
        print(f"anyio-comm serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        print(f"anyio-comm serve: error: {one_line(exc)}", file=sys.stderr)
        return 1
    return 0


def _scheme(address: str) -> str:
    try:
        return parse_address(address).scheme
    except ValueError as exc:
        raise UsageError(str(exc)) from None


# -- bench: configuration -------------------------------------------------------------------


@dataclass
class Config:
    """A validated bench run."""

    args: argparse.Namespace
    address: str | None  # None: a local server
    client_tls: ClientTLS | None
    server_cpu: int | None
    client_cpu: int | None
    pinning: str


def configure(args: argparse.Namespace) -> Config:
    """Check the options together; raise :exc:`UsageError` on a bad combination."""
    check_backend(args.backend)
    if args.frames * args.size > MAX_MESSAGE:
        raise UsageError("--frames x --size must stay below 2 GiB per message")
    remote_only = [
        o for o in ("cafile", "certfile", "keyfile", "server_hostname") if vars(args)[o]
    ]
    client_tls = None
    if args.address is None:
        if remote_only:
            raise UsageError(
                f"--{remote_only[0].replace('_', '-')} is for a remote tls:// ADDRESS"
            )
        if args.tls and importlib.util.find_spec("trustme") is None:
            raise UsageError(
                f"--tls without ADDRESS makes certificates with trustme: {install_hint('bench')}"
            )
    else:
        scheme = _scheme(args.address)
        if scheme == "inproc":
            raise UsageError("inproc:// addresses do not cross processes; use tcp:// or unix://")
        if args.gil_hold:
            raise UsageError(
                "--gil-hold applies to the local server; "
                "start the remote one with 'anyio-comm serve --gil-hold'"
            )
        if args.tls and scheme != "tls":
            raise UsageError("with ADDRESS, TLS is chosen by a tls:// address, not --tls")
        if scheme == "tls":
            client_tls = ClientTLS(
                cafile=args.cafile,
                certfile=args.certfile,
                keyfile=args.keyfile,
                server_hostname=args.server_hostname,
            )
        elif remote_only:
            raise UsageError(f"{remote_only[0]} needs a tls:// ADDRESS")
    (server_cpu, client_cpu), pinning = choose_cpus(args.no_pin, ("server", "client processes"))
    if args.address is not None:
        server_cpu = None
        if client_cpu is not None:
            pinning = f"client processes CPU {client_cpu} (server: remote)"
    return Config(args, args.address, client_tls, server_cpu, client_cpu, pinning)


# -- bench: processes -----------------------------------------------------------------------


class Progress:
    """The progress of a run, on ``out``: the seconds since the load started and, once the
    window is open, the round trips so far with their rate, read from what the client
    processes publish in ``live`` (per process: the count, then the seconds of window it
    took). On a terminal one line is rewritten in place every half second; otherwise a
    line is written every 5 s."""

    def __init__(
        self,
        out: TextIO,
        live: ctypes.Array[ctypes.c_double] | Sequence[float],
        start: float,
        window: tuple[float, float],
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.out = out
        self.live = live
        self.start = start  # wall time at which the load starts (warm-up first)
        self.window = window  # wall times at which the measured window opens and closes
        self.tty = out.isatty() if tty is None else tty
        self.every = PROGRESS_TTY_EVERY if self.tty else PROGRESS_LOG_EVERY
        self.clock = clock
        self._next = start if self.tty else start + self.every
        self._width = 0  # of the line on the terminal

    def line(self, now: float) -> str:
        """The progress at wall time ``now``, in words."""
        total = self.window[1] - self.start
        head = f"anyio-comm bench: {max(0.0, min(now - self.start, total)):5.1f} of {total:.1f} s"
        if now < self.window[0]:
            return f"{head}, warming up"
        counts, spans = self.live[0::2], self.live[1::2]
        rate = sum(count / span for count, span in zip(counts, spans, strict=True) if span > 0)
        return f"{head}, {int(sum(counts)):,} requests, {rate:,.0f} requests/s so far"

    def update(self) -> None:
        """Show the progress, if it is time to."""
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.every
        text = self.line(now)
        if self.tty:
            self.out.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def close(self) -> None:
        """Clear the line on a terminal, so that what follows starts on a clean line."""
        if self._width:
            self.out.write("\r" + " " * self._width + "\r")
            self.out.flush()
            self._width = 0


async def probe(address: str, tls: ClientTLS | None, timeout: float) -> dict[str, Any]:
    """Connect once as a control client: check the server, return its description."""
    comm, info = await open_comm(address, tls, timeout, "control")
    await comm.aclose()
    return info


def run(config: Config, out: TextIO | None = None) -> dict[str, Any]:
    """Run the processes, showing the server's address and the progress on ``out``
    (standard output by default); return the aggregated result."""
    out = sys.stdout if out is None else out
    args = config.args
    ctx = multiprocessing.get_context("spawn")
    lifetime = 2 * STARTUP_TIMEOUT + args.warmup + args.seconds + 30
    server: Child | None = None
    clients: list[Child] = []
    address, client_tls = config.address, config.client_tls
    with contextlib.ExitStack() as stack:

        def stop_all() -> None:
            for child in clients:
                child.stop(terminate=True, timeout=STOP_TIMEOUT)
            if server is not None:
                server.stop(terminate=True, timeout=STOP_TIMEOUT)

        stack.callback(stop_all)
        if address is None:
            server_tls = None
            local = "tcp://127.0.0.1:0"
            if args.tls:
                files = stack.enter_context(certificates("bench-tls-"))
                assert files is not None
                server_tls, client_tls = files.server(), files.client()
                local = "tls://127.0.0.1:0"
            server = Child(
                ctx,
                "server process",
                server_process,
                (local, args.backend, server_tls, args.gil_hold, lifetime),
                cpu=config.server_cpu,
                ignore_interrupt=True,
            )
            _, address = server.receive(time.monotonic() + STARTUP_TIMEOUT)
        try:
            info = run_backend("asyncio", probe, address, client_tls, args.connect_timeout)
        except Exception as exc:
            raise RunError(f"cannot reach a bench server at {address}: {one_line(exc)}") from None
        where = "remote" if server is None else "local process"
        print(f"anyio-comm bench: server {address} ({where}, {info.get('backend')})", file=out)
        out.flush()
        live = ctx.RawArray(ctypes.c_double, 2 * args.processes)
        watch = [] if server is None else [server]
        for index in range(args.processes):
            spec = ClientSpec(
                index=index,
                address=address,
                backend=args.backend,
                concurrency=args.concurrency,
                frames=args.frames,
                size=args.size,
                raw=args.raw_frames,
                tls=client_tls,
                connect_timeout=args.connect_timeout,
                control=index == 0,
                budget=lifetime,
            )
            clients.append(
                Child(
                    ctx,
                    f"client process {index}",
                    client_process,
                    (spec, live),
                    cpu=config.client_cpu,
                    ignore_interrupt=True,
                )
            )
        gather(clients, time.monotonic() + STARTUP_TIMEOUT, watch)
        load_at = time.time()
        start_at = load_at + args.warmup + 0.05
        for child in clients:
            child.send(("start", start_at, args.seconds))
        progress = Progress(out, live, load_at, (start_at, start_at + args.seconds))
        stack.callback(progress.close)
        deadline = time.monotonic() + args.warmup + args.seconds + STARTUP_TIMEOUT
        results = [result for _, result in gather(clients, deadline, watch, progress.update)]
        progress.close()
        for child in clients:
            child.stop(timeout=STOP_TIMEOUT)
        server_exit = None if server is None else server.stop(terminate=True, timeout=STOP_TIMEOUT)
        clients.clear()
        server = None
    summary = aggregate(config, results)
    summary["server"] = {**info, "address": address, "local": config.address is None}
    if server_exit is not None:
        summary["server"]["exit_code"] = server_exit
    return summary


# -- bench: results -------------------------------------------------------------------------


def aggregate(config: Config, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum the processes' counts over the shared window; latency percentiles over all."""
    args = config.args
    requests = sum(r["requests"] for r in results)
    if requests == 0:
        raise RunError(f"no request completed inside the {args.seconds:g} s window")
    samples: list[float] = sorted(s for r in results for s in r["samples"])
    max_latency: float = max(r["max_latency_s"] for r in results)

    def percentile_us(q: float) -> float:
        return min(samples[round(q * (len(samples) - 1))], max_latency) * 1e6

    rps = requests / args.seconds
    marks = results[0]["server_marks"]
    server_cpu = server_loop_cpu = served = None
    if len(marks) == 2 and marks[1]["served"] > marks[0]["served"]:
        served = marks[1]["served"] - marks[0]["served"]
        server_cpu = (marks[1]["cpu"] - marks[0]["cpu"]) / served * 1e6
        server_loop_cpu = (marks[1]["loop_cpu"] - marks[0]["loop_cpu"]) / served * 1e6
    return {
        "requests": requests,
        "window_s": args.seconds,
        "rps": rps,
        "us_per_request": 1e6 / rps,
        "mb_per_s": rps * args.frames * args.size / 1e6,
        "p50_us": percentile_us(0.50),
        "p99_us": percentile_us(0.99),
        "max_us": max_latency * 1e6,
        "latency_samples": len(samples),
        "client_cpu_us_per_request": sum(r["cpu_s"] for r in results) / requests * 1e6,
        "server_cpu_us_per_request": server_cpu,
        "server_loop_cpu_us_per_request": server_loop_cpu,
        "server_requests": served,
        "per_process": [
            {"index": r["index"], "requests": r["requests"], "cpu_s": r["cpu_s"]} for r in results
        ],
    }


def describe(config: Config) -> str:
    """The workload, in words."""
    args = config.args
    frames = f"{args.frames} x {format_size(args.size)}"
    if args.raw_frames:
        shape = f"send_frames([{frames}])"
        note = "raw frames, no msgpack"
    else:
        shape = f'{{"i": n, "data": [{frames}]}}'
        note = (
            "frames travel out-of-band"
            if args.size >= DEFAULT_OOB_THRESHOLD
            else (
                "frames inline in the msgpack body: out-of-band only from "
                f"{DEFAULT_OOB_THRESHOLD} bytes"
            )
        )
    return (
        f"{args.processes} process{'es' if args.processes > 1 else ''} x "
        f"{args.concurrency} comm{'s' if args.concurrency > 1 else ''} on {args.backend}, "
        f"echo of {shape} ({note})"
    )


def report(config: Config, summary: dict[str, Any]) -> str:
    """The human-readable report."""
    args = config.args
    server = summary["server"]
    where = "local process" if server["local"] else "remote"
    flags = " + GIL-holding thread" if server.get("gil_hold") else ""

    def us(value: float | None) -> str:
        return "-" if value is None else f"{value:,.1f} us"

    loop = summary["server_loop_cpu_us_per_request"]
    lines = [
        f"server:   {server['address']} ({where}, {server['backend']}{flags})",
        f"clients:  {describe(config)}",
        f"pinning:  {config.pinning}",
        f"window:   {args.seconds:g} s after {args.warmup:g} s warm-up",
        "",
        f"requests               {summary['requests']:,}",
        f"requests/s             {summary['rps']:,.0f}",
        f"us per request         {summary['us_per_request']:,.2f}  (window / requests)",
        f"MB/s each way          {summary['mb_per_s']:,.2f}  (requests/s x frames x size)",
        f"latency p50            {us(summary['p50_us'])}",
        f"latency p99            {us(summary['p99_us'])}",
        f"latency max            {us(summary['max_us'])}",
        f"client CPU / request   {us(summary['client_cpu_us_per_request'])}  (all processes)",
        f"server CPU / request   {us(summary['server_cpu_us_per_request'])}"
        + ("" if loop is None else f"  (event-loop thread: {loop:,.1f} us)"),
    ]
    return "\n".join(lines)


def bench_main(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``anyio-comm bench``; returns the exit status."""
    try:
        config = configure(args)
        load_before = load_average()
        print(
            f"anyio-comm bench: starting, about {args.warmup + args.seconds:g} s of load",
            flush=True,
        )
        summary = run(config)
    except UsageError as exc:
        print(f"anyio-comm bench: error: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"anyio-comm bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("anyio-comm bench: interrupted", file=sys.stderr)
        return 130
    print(report(config, summary), flush=True)
    if args.json:
        metadata = run_metadata(
            ["anyio-comm", *(sys.argv[1:] if argv is None else argv)],
            pinning=config.pinning,
            cpus={"server_cpu": config.server_cpu, "client_cpu": config.client_cpu},
            load=(load_before, load_average()),
            versions={
                "anyio-comm": __version__,
                **versions("anyio", "msgpack", "trio", "uvloop", "trustme"),
            },
        )
        options = {k: v for k, v in vars(args).items() if k not in ("json", "command")}
        document = {"metadata": metadata, "options": options, "result": summary}
        try:
            write_json(args.json, document)
        except OSError as exc:
            print(f"anyio-comm bench: error: cannot write {args.json}: {exc}", file=sys.stderr)
            return 1
    return 0
