"""One-way streams of small messages: messages per second at the receiver.

The workload of telemetry, logs, pub/sub and dask's batched stream of tasks: a
sender streams small messages as fast as the system lets it, with no reply per
message, and the receiver counts them. Every message carries its connection's
sequence number, and the receiver checks each one (a message lost, repeated or
out of order fails the case). The systems are in
:mod:`benchmarks.oneway_systems`: anyio-comm's per-message, frames and batch APIs
(and its per-message API over TLS 1.3, with certificates made for the run), the
raw asyncio floor, plain AnyIO streams, and pyzmq PUSH/PULL with blocking
sockets and with ``zmq.asyncio``.

Each case runs in a fresh receiver process pinned to one CPU and a fresh sender
process pinned to another. The receiver waits for the first message, lets
``--warmup`` seconds pass, then counts the messages (and its own CPU time) over
``--seconds``. The cases are interleaved (for each repeat, for each workload,
for each system and backend) so that drift in the machine hits all of them
alike, and the best run of each case is kept. The report gives messages per
second, the receiver's CPU per message, and the ratios the targets are stated
in: anyio-comm against the raw asyncio floor, against pyzmq's blocking sockets
and against ``zmq.asyncio``; with ``floor-task`` named, against the least a
per-message async API can cost on the same backend, and that floor against the
references.

Run from the repository root::

    python -m benchmarks.oneway                       # 100 B and 1 KB, 1 and 4 connections
    python -m benchmarks.oneway --sizes 100 --connections 1 --systems anyio-comm,floor
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import multiprocessing
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from anyio_comm.bench import (
    TLSFiles,
    certificates,
    client_context,
    format_size,
    parse_size,
    run_backend,
    server_context,
)
from benchmarks._harness import (
    ProcessPair,
    add_output_options,
    argument_parser,
    csv_list,
    drop_missing_backends,
    run_matrix,
    start_run,
)
from benchmarks.oneway_systems import SYSTEMS, Tally

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

#: seconds a process may take to start and the sender to connect
STARTUP_TIMEOUT = 30.0
#: seconds the receiver waits for the first message
FIRST_MESSAGE_TIMEOUT = 30.0
#: the TLS version of the systems over TLS
TLS_VERSION = "1.3"


@dataclass(frozen=True)
class Case:
    """One measurement: a system on a backend, a message size, a number of connections."""

    system: str
    backend: str
    size: int
    connections: int


@dataclass(frozen=True)
class Timing:
    warmup: float
    seconds: float

    @property
    def budget(self) -> float:
        """Seconds a case may take in all."""
        return STARTUP_TIMEOUT + FIRST_MESSAGE_TIMEOUT + self.warmup + self.seconds + 10


def _measure(conn: Connection, tally: Tally, timing: Timing) -> None:
    """The receiver's measuring thread: wait for the first message, warm up, count
    over the window, send the result, and end the process (its loop runs forever)."""
    try:
        deadline = time.monotonic() + FIRST_MESSAGE_TIMEOUT
        while tally.n == 0:
            if time.monotonic() > deadline:
                raise TimeoutError("no message arrived")
            time.sleep(0.005)
        time.sleep(timing.warmup)
        n0, t0, cpu0 = tally.n, time.perf_counter(), time.process_time()
        time.sleep(timing.seconds)
        n1, t1, cpu1 = tally.n, time.perf_counter(), time.process_time()
        if tally.error is not None:
            raise RuntimeError(tally.error)
        messages = n1 - n0
        if messages <= 0:
            raise RuntimeError("no message arrived during the window")
        conn.send(
            (
                "result",
                {
                    "messages": messages,
                    "window_s": t1 - t0,
                    "mps": messages / (t1 - t0),
                    "receiver_cpu_us_per_message": (cpu1 - cpu0) / messages * 1e6,
                },
            )
        )
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(exc).__name__}: {exc}", ""))
    finally:
        with contextlib.suppress(OSError):
            conn.close()
        os._exit(0)


def receiver_main(conn: Connection, case: Case, timing: Timing, tls: TLSFiles | None) -> None:
    """The receiving process: report ``("ready", address)``, then the result (see
    :func:`_measure`); the process ends when the measurement does, or at its budget."""
    tally = Tally()
    system = SYSTEMS[case.system]

    def ready(address: str) -> None:
        conn.send(("ready", address))
        threading.Thread(target=_measure, args=(conn, tally, timing), daemon=True).start()

    def give_up() -> None:
        time.sleep(timing.budget)
        os._exit(1)

    threading.Thread(target=give_up, daemon=True).start()
    extra = (server_context(tls, TLS_VERSION),) if system.tls else ()
    if system.blocking:
        system.receive(case, tally, ready)
    else:
        run_backend(case.backend, system.receive, case, tally, ready, *extra)


def sender_main(
    _conn: Connection, case: Case, address: str, timing: Timing, tls: TLSFiles | None
) -> None:
    """The sending process: stream until the budget's end (the runner stops it sooner)."""
    deadline = time.monotonic() + timing.budget
    system = SYSTEMS[case.system]
    extra = (client_context(tls, TLS_VERSION),) if system.tls else ()
    if system.blocking:
        system.send(case, address, deadline)
    else:
        run_backend(case.backend, system.send, case, address, deadline, *extra)


def run_case(
    ctx: Any,
    cpus: tuple[int | None, int | None],
    timing: Timing,
    case: Case,
    tls: TLSFiles | None = None,
) -> dict[str, Any]:
    """Run ``case`` in a fresh receiver and sender; return its fields and figures
    (``tls``: the certificates of the systems over TLS)."""
    name = f"oneway-{case.system}-{case.backend}"
    with ProcessPair(ctx, name, cpus, roles=("receiver", "sender"), terminate=True) as pair:
        receiver, address = pair.start_server(receiver_main, case, timing, tls)
        pair.start_client(sender_main, case, address, timing, tls)
        kind, result = receiver.receive(time.monotonic() + timing.budget)
    if kind != "result":
        raise RuntimeError(f"unexpected message from the receiver: {kind!r}")
    return {**asdict(case), **result}


def cases_for(args: Any) -> list[Case]:
    """The cases of the command line, grouped by workload (size, connections)."""
    backends = [*args.backends, "threads"]
    drop_missing_backends(backends)
    cases = []
    for size in args.sizes:
        for connections in args.connections:
            for name in args.systems:
                system = SYSTEMS[name]
                if any(importlib.util.find_spec(p) is None for p in system.requires):
                    continue
                cases += [
                    Case(name, backend, size, connections)
                    for backend in system.backends
                    if backend in backends
                ]
    return cases


def _label(r: dict[str, Any]) -> str:
    return f"{format_size(r['size'])} x{r['connections']}"


def report(results: list[dict[str, Any]]) -> str:
    """The table of the best runs, then the ratios of the targets."""
    head = f"{'workload':<12}{'system/backend':<30}{'msgs/s':>10}{'rx CPU us/msg':>15}"
    lines = [head, "-" * len(head)]
    ok: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in results:
        name = f"{r['system']}/{r['backend']}"
        if "error" in r:
            lines.append(f"{_label(r):<12}{name:<30}FAILED: {r['error']}")
            continue
        ok[r["system"], r["backend"], r["size"], r["connections"]] = r
        lines.append(
            f"{_label(r):<12}{name:<30}{r['mps']:>10,.0f}{r['receiver_cpu_us_per_message']:>15.2f}"
        )
    references = (
        ("floor/asyncio", ("floor", "asyncio")),
        ("zmq-blocking", ("zmq-blocking", "threads")),
        ("zmq-asyncio", ("zmq-asyncio", "asyncio")),
    )
    rows = []
    for (system, backend, size, connections), r in ok.items():
        if not system.startswith("anyio-comm") and system != "floor-task":
            continue
        cells = []
        for label, key in (*references, ("floor-task", ("floor-task", backend))):
            if key[0] == system:
                continue
            other = ok.get((*key, size, connections))
            if other is not None:
                cells.append(f"/ {label} {r['mps'] / other['mps']:.2f}")
        if cells:
            rows.append(f"{_label(r):<12}{system + '/' + backend:<30}" + "  ".join(cells))
    if rows:
        lines += [
            "",
            "anyio-comm (and the task floor) against the references, messages per second:",
            *rows,
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser("oneway", __doc__)
    parser.add_argument(
        "--sizes",
        type=csv_list(None, parse_size),
        default=[100, 1000],
        help="message sizes, at least 8 bytes (default: 100,1000)",
    )
    parser.add_argument(
        "--connections",
        type=csv_list(None, int),
        default=[1, 4],
        help="connections from the sender (default: 1,4)",
    )
    parser.add_argument(
        "--systems",
        type=csv_list(tuple(SYSTEMS)),
        default=[name for name, system in SYSTEMS.items() if not system.diagnostic],
        help="default: all but the diagnostic ones ("
        + ",".join(name for name, system in SYSTEMS.items() if not system.diagnostic)
        + "); diagnostic: "
        + ",".join(name for name, system in SYSTEMS.items() if system.diagnostic),
    )
    parser.add_argument(
        "--backends",
        type=csv_list(("asyncio", "uvloop", "trio")),
        default=["asyncio", "uvloop", "trio"],
        help="event loops of the asynchronous systems (default: all three)",
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="window (default: 2)")
    parser.add_argument("--warmup", type=float, default=0.5, help="default: 0.5")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each case (default: 2)")
    add_output_options(parser, no_pin_help="do not pin receiver and sender to CPUs")
    args = parser.parse_args(argv)
    if min(args.sizes) < 8 or min(args.connections) < 1 or max(args.connections) > 1000:
        parser.error("sizes must be at least 8 bytes, connections between 1 and 1000")
    if not (0 < args.seconds <= 600 and 0 <= args.warmup <= 60 and 1 <= args.repeat <= 100):
        parser.error("--seconds in (0, 600], --warmup in [0, 60], --repeat in [1, 100]")
    run = start_run("oneway", "one-way streams", argv, args.no_pin, roles=("receiver", "sender"))
    timing = Timing(args.warmup, args.seconds)
    ctx = multiprocessing.get_context("spawn")
    cases = cases_for(args)

    def show(case: Case, result: dict[str, Any]) -> None:
        name = f"{case.system}/{case.backend}"
        figure = result.get("error") or f"{result['mps']:,.0f} msgs/s"
        print(f"  {format_size(case.size)} x{case.connections} {name}: {figure}", file=sys.stderr)

    needs_tls = any(SYSTEMS[case.system].tls for case in cases)
    with certificates("oneway-tls-" if needs_tls else None) as tls:
        best, runs = run_matrix(
            cases,
            args.repeat,
            lambda c: run_case(ctx, run.cpus, timing, c, tls),
            show,
            figure="mps",
        )
    print(report(best))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"metadata": run.metadata(args), "results": best, "runs": runs}, f, indent=1)
    return 1 if any("error" in r for r in best) else 0


if __name__ == "__main__":
    sys.exit(main())
