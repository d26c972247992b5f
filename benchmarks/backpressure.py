"""Backpressure soak: a fast producer against a slow consumer, with memory measured.

A consumer process listens and reads messages slowly (``--consumer-delay``
seconds of sleep after each one); a producer process connects and sends
``--message-size`` messages as fast as the connection takes them, each one
out-of-band frame viewing the same reused payload buffer, until ``--total``
bytes are sent or ``--seconds-max`` have passed, whichever comes first. Both
processes are fresh for each backend and pinned to two different CPUs
(``os.sched_setaffinity``, as in ``benchmarks.echo``).

Memory: each process reads its resident set size from ``/proc/self/status``
(``VmRSS``) once connected and before the transfer (start), samples it every
10 ms during the transfer, and resets then reads the kernel's high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs``), so "peak" is the largest
RSS during the transfer. With backpressure working, the growth of either side
is a few messages' worth, whatever ``--total`` is: the producer holds one
message and waits in ``send`` while the kernel's socket buffers are full; the
consumer holds the message it is reading.

Reported per backend: bytes moved, time, throughput, the fraction of the
producer's time spent blocked in ``send`` (high: the consumer sets the
pace), and the start, peak and growth of each side's RSS.

The default run is short (2 GB per backend, at most 120 s each, about 3 s per
backend at the default 1 ms consumer delay). Run from the repository root::

    python -m benchmarks.backpressure                                   # 2 GB, every backend
    python -m benchmarks.backpressure --total 10GB --message-size 1MB --backend uvloop \\
        --transport tls --seconds-max 120 --json backpressure.json
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio

import anyio_comm
from anyio_comm.bench import (
    TLSFiles,
    byte_size,
    client_context,
    run_backend,
    server_context,
    write_json,
)

from . import _harness
from ._harness import STARTUP_TIMEOUT, ProcessPair

if TYPE_CHECKING:
    import argparse
    import ssl
    from multiprocessing.connection import Connection

TRANSPORTS = ("tcp", "unix", "tls")
TLS_VERSION = "1.3"
ROLES = ("consumer", "producer")
SAMPLE_INTERVAL = 0.01  # seconds between RSS samples
DRAIN_TIMEOUT = 60.0  # seconds for the consumer to read what is in flight at the end
_MEMORY_FIELDS = re.compile(r"^(VmRSS|VmHWM):\s+(\d+) kB$", re.MULTILINE)


@dataclass(frozen=True)
class Case:
    """One backend's run."""

    backend: str
    transport: str
    total: int
    message_size: int
    seconds_max: float
    consumer_delay: float


# -- memory -------------------------------------------------------------------


def read_memory() -> dict[str, int | None]:
    """This process's resident set size and its high-water mark, in bytes
    (``None`` where ``/proc`` is not available).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            status = fh.read()
    except OSError:
        return {"rss": None, "hwm": None}
    found = {name: int(kb) * 1024 for name, kb in _MEMORY_FIELDS.findall(status)}
    return {"rss": found.get("VmRSS"), "hwm": found.get("VmHWM")}


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux 4.0+); return whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


class MemoryWatch:
    """Start RSS, then the peak RSS seen from :meth:`start` to :meth:`stop`."""

    def __init__(self) -> None:
        self.start_rss: int | None = None
        self.peak_sampled: int | None = None
        self.hwm_reset = False
        self._running = False

    async def start(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        """Run in a task group (``await tg.start(watch.start)``) until :meth:`stop`."""
        self.start_rss = self.peak_sampled = read_memory()["rss"]
        self.hwm_reset = reset_peak_rss()
        self._running = True
        task_status.started()
        while self._running:
            await anyio.sleep(SAMPLE_INTERVAL)
            rss = read_memory()["rss"]
            if rss is not None and (self.peak_sampled is None or rss > self.peak_sampled):
                self.peak_sampled = rss

    def stop(self) -> dict[str, Any]:
        """Stop sampling; return the start, peak and growth in bytes."""
        self._running = False
        now = read_memory()
        candidates = [v for v in (self.peak_sampled, now["rss"]) if v is not None]
        if self.hwm_reset and now["hwm"] is not None:
            candidates.append(now["hwm"])
        peak = max(candidates) if candidates else None
        start = self.start_rss
        return {
            "rss_start": start,
            "rss_peak": peak,
            "rss_growth": None if peak is None or start is None else peak - start,
            "peak_source": "VmHWM and samples" if self.hwm_reset else "samples",
        }


# -- consumer (server) --------------------------------------------------------


def _listen_address(case: Case, unix_dir: str | None) -> str:
    if case.transport == "unix":
        assert unix_dir is not None
        return f"unix://{unix_dir}/backpressure.sock"
    return f"{case.transport}://127.0.0.1:0"


async def _consumer(
    conn: Connection, case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> dict[str, Any]:
    async def handle(comm: anyio_comm.Comm, result: dict[str, Any]) -> None:
        watch = MemoryWatch()
        received = messages = 0
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            await tg.start(watch.start)
            try:
                async for message in comm:
                    data = message["data"]
                    seq = int.from_bytes(data[:8], "big")
                    if message["seq"] != messages or seq != messages:
                        raise RuntimeError(f"message {messages} arrived as {seq}")
                    received += data.nbytes
                    messages += 1
                    del message, data
                    if case.consumer_delay:
                        await anyio.sleep(case.consumer_delay)
            finally:
                result.update(watch.stop())
                tg.cancel_scope.cancel()
        result.update(bytes=received, messages=messages, seconds=time.perf_counter() - start)

    budget = STARTUP_TIMEOUT + case.seconds_max + DRAIN_TIMEOUT
    return await _harness.serve_one(
        conn, address, handle, role="consumer", budget=budget, ssl_context=ssl_context
    )


def consumer_main(
    conn: Connection, case: Case, tls: TLSFiles | None, unix_dir: str | None
) -> dict[str, Any]:
    """Entry point of the consumer process."""
    ssl_context = server_context(tls, TLS_VERSION)
    address = _listen_address(case, unix_dir)
    return run_backend(case.backend, _consumer, conn, case, address, ssl_context)


# -- producer (client) --------------------------------------------------------


async def _producer(
    case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> dict[str, Any]:
    options: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context is not None else {}
    comm = await anyio_comm.connect(address, timeout=STARTUP_TIMEOUT, **options)
    async with comm:
        payload = bytearray(case.message_size)
        view = memoryview(payload)
        watch = MemoryWatch()
        sent = messages = 0
        blocked = 0.0
        async with anyio.create_task_group() as tg:
            await tg.start(watch.start)
            start = time.perf_counter()
            deadline = start + case.seconds_max
            # a hang guard only: the deadline is checked between messages
            with anyio.fail_after(case.seconds_max + DRAIN_TIMEOUT):
                while sent < case.total and time.perf_counter() < deadline:
                    view[:8] = messages.to_bytes(8, "big")
                    t0 = time.perf_counter()
                    await comm.send({"seq": messages, "data": view})
                    blocked += time.perf_counter() - t0
                    sent += case.message_size
                    messages += 1
                sending = time.perf_counter() - start
                await comm.send_eof()
                # the consumer closes once it has read everything
                with contextlib.suppress(anyio.EndOfStream):
                    await comm.receive()
            elapsed = time.perf_counter() - start
            memory = watch.stop()
            tg.cancel_scope.cancel()
    return {
        "bytes": sent,
        "messages": messages,
        "send_seconds": sending,
        "seconds": elapsed,
        "blocked_fraction": blocked / sending if sending else 0.0,
        "stopped_by": "total" if sent >= case.total else "seconds-max",
        **memory,
    }


def producer_main(
    conn: Connection,  # noqa: ARG001 (the producer reports only its result)
    case: Case,
    tls: TLSFiles | None,
    address: str,
) -> dict[str, Any]:
    """Entry point of the producer process."""
    ssl_context = client_context(tls, TLS_VERSION)
    return run_backend(case.backend, _producer, case, address, ssl_context)


# -- orchestration ------------------------------------------------------------


def run_case(
    ctx: Any, case: Case, cpus: tuple[int | None, int | None], tls: TLSFiles | None
) -> dict[str, Any]:
    """Run one backend in a fresh consumer and producer process; return the measurements."""
    budget = STARTUP_TIMEOUT + case.seconds_max + DRAIN_TIMEOUT + STARTUP_TIMEOUT
    with (
        _harness.unix_directory(case.transport, "acomm-bp-") as unix_dir,
        ProcessPair(ctx, "backpressure", cpus, ROLES) as pair,
    ):
        consumer, address = pair.start_server(consumer_main, case, tls, unix_dir)
        producer = pair.start_client(producer_main, case, tls, address)
        deadline = time.monotonic() + budget
        _, produced = producer.receive(deadline)
        _, consumed = consumer.receive(deadline)
    if consumed["bytes"] != produced["bytes"]:
        raise RuntimeError(f"sent {produced['bytes']} bytes but {consumed['bytes']} arrived")
    seconds = consumed["seconds"]
    return {
        **asdict(case),
        "bytes": consumed["bytes"],
        "messages": consumed["messages"],
        "seconds": seconds,
        "mb_per_s": consumed["bytes"] / seconds / 1e6 if seconds else None,
        "producer": produced,
        "consumer": consumed,
    }


# -- reporting ----------------------------------------------------------------


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per backend: moved, time, throughput, blocked share, RSS of each side."""
    head = (
        f"{'moved GB':>9}{'s':>7}{'MB/s':>8}{'blocked':>8}"
        f"{'prod RSS MB start/peak/+':>26}{'cons RSS MB start/peak/+':>26}  stopped by"
    )

    def figures(r: dict[str, Any]) -> list[str]:
        p, c = r["producer"], r["consumer"]
        rss_p = f"{_mb(p['rss_start'])}/{_mb(p['rss_peak'])}/{_mb(p['rss_growth'])}"
        rss_c = f"{_mb(c['rss_start'])}/{_mb(c['rss_peak'])}/{_mb(c['rss_growth'])}"
        row = (
            f"{r['bytes'] / 1e9:>9.2f}{r['seconds']:>7.2f}{r['mb_per_s'] or 0:>8.0f}"
            f"{p['blocked_fraction']:>8.0%}{rss_p:>26}{rss_c:>26}  {p['stopped_by']}"
        )
        return [row]

    return _harness.backend_table(head, results, figures)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.argument_parser("backpressure", __doc__)
    add = parser.add_argument
    add("--total", type=byte_size(), default=2 * 10**9, help="bytes to send (default: 2GB)")
    add(
        "--message-size",
        type=byte_size(),
        default=10**6,
        help="bytes per message, at least 8 (default: 1MB)",
    )
    _harness.add_backend_options(parser, TRANSPORTS)
    add(
        "--seconds-max",
        type=float,
        default=120.0,
        help="stop sending after this many seconds per backend (default: 120)",
    )
    add(
        "--consumer-delay",
        type=float,
        default=0.001,
        help="seconds the consumer sleeps after each message (default: 0.001)",
    )
    _harness.add_output_options(parser, no_pin_help="do not pin the processes to CPUs")
    args = parser.parse_args(argv)
    if args.message_size < 8:
        parser.error("--message-size must be at least 8 bytes")
    if not 0 < args.seconds_max <= 3600 or not 0 <= args.consumer_delay <= 1:
        parser.error("--seconds-max must be in (0, 3600] and --consumer-delay in [0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak for each backend and print the results; return the exit status."""
    args = parse_args(argv)
    if (backends := _harness.backends_for(args)) is None:
        return 2
    run = _harness.start_run("backpressure", "backpressure soak", argv, args.no_pin, roles=ROLES)
    print(
        f"{args.transport}, {args.total / 1e9:g} GB in messages of {args.message_size:,} bytes "
        f"per backend, at most {args.seconds_max:g} s; the consumer sleeps "
        f"{args.consumer_delay * 1e3:g} ms after each message",
        flush=True,
    )
    print(flush=True)
    sizes = (args.total, args.message_size, args.seconds_max, args.consumer_delay)
    cases = [Case(backend, args.transport, *sizes) for backend in backends]
    tls_prefix = "bp-tls-" if args.transport == "tls" else None
    results = _harness.run_backends(
        cases,
        run_case,
        run.cpus,
        tls_prefix,
        lambda r: f"{r['bytes'] / 1e9:.2f} GB in {r['seconds']:.2f} s",
    )
    print(format_table(results))
    print(
        "\nblocked: share of the producer's sending time spent waiting in send(); "
        "RSS growth (+) is peak minus start, in MB."
    )
    if args.json:
        metadata = run.metadata(args, tls=_harness.transport_tls(args, TLS_VERSION))
        write_json(args.json, {"metadata": metadata, "results": results})
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
