"""Memory of one large message: what sending and receiving it allocate.

A receiver process listens; a sender process connects and sends one message
``{"data": [frame, ...]}`` of ``--frames`` out-of-band frames that together
hold ``--size`` bytes (default: one frame of 200 MB), viewing a payload the
sender allocated beforehand. Each side starts ``tracemalloc`` once connected,
then measures the peak of traced memory above what was traced just before its
``send`` or ``receive``: everything the operation allocated while it ran, the
received message included. Each side also measures the peak of its resident
memory (RSS) above its level before the operation (Linux: the high-water mark
is reset first), which also counts memory that is not Python's: the receiver's
large frames are anonymous mappings (see ``anyio_comm._sansio.buffers``), whose
pages tracemalloc does not see. "allocated" is the larger of the two. The
receiver checks every byte against the pattern the sender wrote. Both
processes are fresh for each backend and pinned to two different CPUs.

Targets: receiving allocates less than 1.1x the payload (the frame buffers
themselves are the payload: anything else must be small), and sending
allocates less than 16 MB (the payload is sent from the caller's buffer).
tracemalloc sees the allocations of Python's allocators, which is where
bytearray frame buffers, msgpack bodies, TLS buffers and every Python object
live; the kernel's socket buffers are not in it.

Run from the repository root::

    python -m benchmarks.memory                                  # 200 MB, every backend, tcp
    python -m benchmarks.memory --transport tls --frames 4 --json memory.json \\
        --markdown memory.md
"""

from __future__ import annotations

import hashlib
import sys
import time
import tracemalloc
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
    whole_number,
    write_json,
)

from . import _harness
from ._harness import STARTUP_TIMEOUT, ProcessPair
from .backpressure import read_memory, reset_peak_rss

if TYPE_CHECKING:
    import argparse
    import ssl
    from multiprocessing.connection import Connection

TRANSPORTS = ("tcp", "unix", "tls")
TLS_VERSION = "1.3"
ROLES = ("receiver", "sender")
TRANSFER_TIMEOUT = 120.0  # seconds for the message to go through
RECEIVE_TARGET = 1.1  # receive allocations / payload
SEND_TARGET = 16 * 10**6  # bytes allocated by send


@dataclass(frozen=True)
class Case:
    """One backend's run."""

    backend: str
    transport: str
    size: int  # payload bytes, all frames together
    frames: int


def frame_sizes(case: Case) -> list[int]:
    """The sizes of the message's frames: ``size`` split as evenly as possible."""
    base, extra = divmod(case.size, case.frames)
    return [base + (1 if i < extra else 0) for i in range(case.frames)]


def pattern(size: int) -> bytearray:
    """``size`` bytes that differ from frame to frame and position to position."""
    block = hashlib.sha256(str(size).encode()).digest() * 2048  # 64 KiB
    data = bytearray(size)
    view = memoryview(data)
    for start in range(0, size, len(block)):
        chunk = view[start : start + len(block)]
        chunk[:] = block[: chunk.nbytes]
    return data


class Traced:
    """The peak of traced memory, and of resident memory, above their levels
    before the ``with`` block; ``peak`` is the larger of the two."""

    def __enter__(self) -> Traced:
        if not tracemalloc.is_tracing():
            tracemalloc.start()
        tracemalloc.reset_peak()
        self.baseline = tracemalloc.get_traced_memory()[0]
        reset_peak_rss()
        self.rss_baseline = read_memory()["rss"] or 0
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.seconds = time.perf_counter() - self.start
        self.traced_peak = tracemalloc.get_traced_memory()[1] - self.baseline
        self.rss_peak = max(0, (read_memory()["hwm"] or 0) - self.rss_baseline)
        self.peak = max(self.traced_peak, self.rss_peak)


# -- receiver (server) ----------------------------------------------------------


async def _receiver(
    conn: Connection, case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> dict[str, Any]:
    async def handle(comm: anyio_comm.Comm, result: dict[str, Any]) -> None:
        with Traced() as traced:
            message = await comm.receive()
        frames = message["data"]
        sizes = [frame.nbytes for frame in frames]
        if sizes != frame_sizes(case):
            raise RuntimeError(f"frames of {sizes} bytes arrived")
        for frame in frames:
            if frame != pattern(frame.nbytes):
                raise RuntimeError("a frame arrived corrupted")
        result.update(allocated=traced.peak, seconds=traced.seconds)
        await comm.send("done")

    limits = anyio_comm.Limits(max_frame_size=case.size, max_message_size=case.size + 2**20)
    return await _harness.serve_one(
        conn,
        address,
        handle,
        role="receiver",
        budget=STARTUP_TIMEOUT + TRANSFER_TIMEOUT,
        ssl_context=ssl_context,
        limits=limits,
    )


def receiver_main(
    conn: Connection, case: Case, tls: TLSFiles | None, unix_path: str | None
) -> dict[str, Any]:
    """Entry point of the receiver process."""
    ssl_context = server_context(tls, TLS_VERSION if case.transport == "tls" else None)
    address = unix_path or f"{case.transport}://127.0.0.1:0"
    return run_backend(case.backend, _receiver, conn, case, address, ssl_context)


# -- sender (client) ------------------------------------------------------------


async def _sender(case: Case, address: str, ssl_context: ssl.SSLContext | None) -> dict[str, Any]:
    frames = [memoryview(pattern(size)) for size in frame_sizes(case)]
    options: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context is not None else {}
    with anyio.fail_after(STARTUP_TIMEOUT + TRANSFER_TIMEOUT):
        comm = await anyio_comm.connect(address, timeout=STARTUP_TIMEOUT, **options)
        async with comm:
            with Traced() as traced:
                await comm.send({"data": frames})
            if await comm.receive() != "done":
                raise RuntimeError("the receiver did not confirm")
    return {"allocated": traced.peak, "seconds": traced.seconds}


def sender_main(
    conn: Connection,  # noqa: ARG001 (the sender reports only its result)
    case: Case,
    tls: TLSFiles | None,
    address: str,
) -> dict[str, Any]:
    """Entry point of the sender process."""
    ssl_context = client_context(tls, TLS_VERSION if case.transport == "tls" else None)
    return run_backend(case.backend, _sender, case, address, ssl_context)


# -- orchestration --------------------------------------------------------------


def run_case(
    ctx: Any, case: Case, cpus: tuple[int | None, int | None], tls: TLSFiles | None
) -> dict[str, Any]:
    """Run one backend in a fresh receiver and sender process; return the measurements."""
    with _harness.unix_directory(case.transport, "acomm-mem-") as unix_dir:
        unix_path = f"unix://{unix_dir}/memory.sock" if unix_dir else None
        with ProcessPair(ctx, "memory", cpus, ROLES) as pair:
            receiver, address = pair.start_server(receiver_main, case, tls, unix_path)
            sender = pair.start_client(sender_main, case, tls, address)
            deadline = time.monotonic() + STARTUP_TIMEOUT + TRANSFER_TIMEOUT
            _, sent = sender.receive(deadline)
            _, received = receiver.receive(deadline)
    receive_ratio = received["allocated"] / case.size
    return {
        **asdict(case),
        "receive_allocated": received["allocated"],
        "receive_ratio": receive_ratio,
        "receive_seconds": received["seconds"],
        "receive_met": receive_ratio < RECEIVE_TARGET,
        "send_allocated": sent["allocated"],
        "send_seconds": sent["seconds"],
        "send_met": sent["allocated"] < SEND_TARGET,
    }


# -- reporting ------------------------------------------------------------------


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per backend: allocations of receive and send against their targets."""
    head = f"{'receive MB':>11}{'x payload':>11}{'':>3}{'s':>7}{'send MB':>10}{'':>3}{'s':>7}"

    def figures(r: dict[str, Any]) -> list[str]:
        row = (
            f"{r['receive_allocated'] / 1e6:>11.2f}{r['receive_ratio']:>11.4f}"
            f"{'✓' if r['receive_met'] else '✗':>3}{r['receive_seconds']:>7.2f}"
            f"{r['send_allocated'] / 1e6:>10.3f}{'✓' if r['send_met'] else '✗':>3}"
            f"{r['send_seconds']:>7.2f}"
        )
        return [row]

    return _harness.backend_table(head, results, figures)


def render(data: dict[str, Any]) -> str:
    """The markdown table of a JSON file written with ``--json``."""
    meta = data["metadata"]
    opts = meta["options"]
    command = " ".join(meta["command"])
    run = f"({meta['date']}, {meta['pinning']})"
    what = f"{opts['size']:,} bytes in {opts['frames']} frame(s) over {opts['transport']}"
    receive_head = f"x payload (target < {RECEIVE_TARGET:g})"
    send_head = f"send allocated (target < {SEND_TARGET / 1e6:g} MB)"
    lines = [
        f"`{command}` {run}: one message of {what}.",
        "",
        f"| backend | receive allocated | {receive_head} | {send_head} |",
        "|---|---:|---:|---:|",
    ]
    for r in data["results"]:
        if "error" in r:
            lines.append(f"| {r['backend']} | failed: {r['error']} | | |")
            continue
        lines.append(
            f"| {r['backend']} | {r['receive_allocated'] / 1e6:.2f} MB | "
            f"{r['receive_ratio']:.4f} {'✓' if r['receive_met'] else '✗'} | "
            f"{r['send_allocated'] / 1e6:.3f} MB {'✓' if r['send_met'] else '✗'} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.argument_parser("memory", __doc__)
    add = parser.add_argument
    add("--size", type=byte_size(), default=200 * 10**6, help="payload (default: 200MB)")
    add("--frames", type=whole_number(), default=1, help="frames (default: 1)")
    _harness.add_backend_options(parser, TRANSPORTS)
    _harness.add_output_options(parser, no_pin_help="do not pin the processes to CPUs")
    add("--markdown", metavar="PATH", help="also write the table as markdown (needs --json)")
    args = parser.parse_args(argv)
    if args.markdown and not args.json:
        parser.error("--markdown needs --json")
    if not args.frames <= args.size <= 2 * 10**9:
        parser.error("--size must be at least --frames and at most 2GB")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure each backend and print the results; return the exit status (1: a target missed
    or a run failed)."""
    args = parse_args(argv)
    if (backends := _harness.backends_for(args)) is None:
        return 2
    run = _harness.start_run("memory", "large-message memory", argv, args.no_pin, roles=ROLES)
    print(
        f"{args.transport}, one message of {args.size:,} bytes in {args.frames} frame(s); "
        f"targets: receive < {RECEIVE_TARGET:g}x the payload, send < {SEND_TARGET / 1e6:g} MB",
        flush=True,
    )
    print(flush=True)
    cases = [Case(backend, args.transport, args.size, args.frames) for backend in backends]
    results = _harness.run_backends(
        cases,
        run_case,
        run.cpus,
        "mem-tls-" if args.transport == "tls" else None,
        lambda r: f"receive {r['receive_ratio']:.4f}x, send {r['send_allocated'] / 1e6:.3f} MB",
    )
    print(format_table(results))
    print(
        "\nallocated: the larger of the peaks of tracemalloc's traced memory and of the "
        "resident memory during the operation, above their levels before it."
    )
    if args.json:
        metadata = run.metadata(args, tls=_harness.transport_tls(args, TLS_VERSION))
        data = {"metadata": metadata, "results": results}
        write_json(args.json, data)
        if args.markdown:
            with open(args.markdown, "w", encoding="utf-8") as fh:
                fh.write(render(data))
    failed = any("error" in r or not (r["receive_met"] and r["send_met"]) for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
