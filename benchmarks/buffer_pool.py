"""The buffer pool's bound: what a receiver keeps beyond the frames it holds.

A sender process sends ``--messages`` messages (default 400) of 1 to 8 frames,
each frame between 64 KiB and ``--max-frame`` (default 32 MiB) bytes, sizes drawn
log-uniformly from a seeded generator: about 9 GB of frames in some 70
size classes. The receiver holds the last ``--hold`` messages (default 8) it
received, as an application working on recent data would, and drops older
ones; after each message it samples the event loop's
:func:`anyio_comm.current_buffer_pool` (:meth:`~anyio_comm.BufferPool.statistics`)
and its resident memory. At the end it drops everything, reads the pool and
its resident memory again, then calls :meth:`~anyio_comm.BufferPool.trim`.

Reported: the peak of the pool's free bytes against its bound
(``max_free_bytes``, 256 MiB by default), the peak of resident memory above the
frames held (the pool's kept slabs, what the kernel did not take back, and the
process's own churn), how much of the traffic went into reused memory, and the
resident memory above the start before and after ``trim()``. Targets: free
bytes never above ``max_free_bytes``; resident memory above the frames held
under ``max_free_bytes`` plus 64 MiB; after ``trim()``, under 64 MiB above the
start. Both processes are fresh for each backend and pinned to two CPUs.

Run from the repository root::

    python -m benchmarks.buffer_pool
    python -m benchmarks.buffer_pool --backend uvloop --messages 1000 --json pool.json
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio

import anyio_comm
from anyio_comm._sansio.pool import DEFAULT_MAX_FREE_BYTES
from anyio_comm.bench import byte_size, run_backend, whole_number, write_json

from . import _harness
from ._harness import STARTUP_TIMEOUT, ProcessPair
from .backpressure import read_memory

if TYPE_CHECKING:
    import argparse
    from multiprocessing.connection import Connection

ROLES = ("receiver", "sender")
TRANSFER_TIMEOUT = 300.0  # seconds for every message to go through
MIN_FRAME = 64 * 1024 + 1
SLACK = 64 * 2**20  # resident memory allowed beyond the pool's bound (and after trim)
SEED = 20261125


@dataclass(frozen=True)
class Case:
    """One backend's run."""

    backend: str
    messages: int
    max_frame: int
    hold: int


def message_sizes(case: Case) -> list[list[int]]:
    """The frame sizes of every message (the same for sender and receiver)."""
    rng = random.Random(SEED)
    low, high = math.log(MIN_FRAME), math.log(case.max_frame)
    return [
        [int(math.exp(rng.uniform(low, high))) for _ in range(rng.randint(1, 8))]
        for _ in range(case.messages)
    ]


def _rss() -> int:
    return read_memory()["rss"] or 0


async def _receiver(conn: Connection, case: Case, address: str) -> dict[str, Any]:
    async def handle(comm: anyio_comm.Comm, result: dict[str, Any]) -> None:
        pool = anyio_comm.current_buffer_pool()
        expected = message_sizes(case)
        held: list[list[memoryview]] = []
        start = _rss()
        peak_free = peak_above_held = 0
        for sizes in expected:
            frames = (await comm.receive())["data"]
            if [frame.nbytes for frame in frames] != sizes:
                raise RuntimeError("a message arrived with other frames than were sent")
            held.append(frames)
            del held[: -case.hold]
            stats = pool.statistics()
            held_bytes = sum(frame.nbytes for message in held for frame in message)
            peak_free = max(peak_free, stats.free_bytes)
            peak_above_held = max(peak_above_held, _rss() - start - held_bytes)
        await comm.send("done")
        del frames
        held.clear()
        stats = pool.statistics()
        before_trim = _rss() - start
        trimmed = pool.trim()
        result.update(
            max_free_bytes=pool.max_free_bytes,
            peak_free=peak_free,
            peak_above_held=peak_above_held,
            reused=stats.reused,
            created=stats.created,
            released=stats.released,
            kept=stats.free_bytes,
            above_start=before_trim,
            trimmed=trimmed,
            above_start_trimmed=_rss() - start,
        )

    limits = anyio_comm.Limits(max_frame_size=case.max_frame)
    return await _harness.serve_one(
        conn,
        address,
        handle,
        role="receiver",
        budget=STARTUP_TIMEOUT + TRANSFER_TIMEOUT,
        limits=limits,
    )


def receiver_main(conn: Connection, case: Case) -> dict[str, Any]:
    """Entry point of the receiver process."""
    return run_backend(case.backend, _receiver, conn, case, "tcp://127.0.0.1:0")


async def _sender(case: Case, address: str) -> dict[str, Any]:
    payload = memoryview(bytes(range(256)) * (case.max_frame // 256 + 1))
    total = 0
    with anyio.fail_after(STARTUP_TIMEOUT + TRANSFER_TIMEOUT):
        async with await anyio_comm.connect(address, timeout=STARTUP_TIMEOUT) as comm:
            started = time.perf_counter()
            for sizes in message_sizes(case):
                await comm.send({"data": [payload[:n] for n in sizes]})
                total += sum(sizes)
            if await comm.receive() != "done":
                raise RuntimeError("the receiver did not confirm")
            seconds = time.perf_counter() - started
    return {"bytes": total, "seconds": seconds}


def sender_main(conn: Connection, case: Case, address: str) -> dict[str, Any]:  # noqa: ARG001
    """Entry point of the sender process."""
    return run_backend(case.backend, _sender, case, address)


def run_case(
    ctx: Any,
    case: Case,
    cpus: tuple[int | None, int | None],
    tls: Any,  # noqa: ARG001 (plain TCP only)
) -> dict[str, Any]:
    """Run one backend in a fresh receiver and sender process; return the measurements."""
    with ProcessPair(ctx, "buffer-pool", cpus, ROLES) as pair:
        receiver, address = pair.start_server(receiver_main, case)
        sender = pair.start_client(sender_main, case, address)
        deadline = time.monotonic() + STARTUP_TIMEOUT + TRANSFER_TIMEOUT
        _, sent = sender.receive(deadline)
        _, got = receiver.receive(deadline)
    bound = got["max_free_bytes"]
    return {
        **asdict(case),
        "transport": "tcp",
        **got,
        "bytes": sent["bytes"],
        "seconds": sent["seconds"],
        "free_met": got["peak_free"] <= bound,
        "held_met": got["peak_above_held"] < bound + SLACK,
        "trim_met": got["above_start_trimmed"] < SLACK,
    }


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per backend (MiB, except the traffic in GB)."""
    head = (
        f"{'GB':>6}{'reused':>8}{'peak free':>11}{'':>2}{'RSS-held':>10}{'':>2}"
        f"{'kept':>7}{'RSS+':>7}{'trimmed':>9}{'RSS+':>7}{'':>2}"
    )

    def mib(n: int) -> float:
        return n / 2**20

    def mark(met: bool) -> str:
        return "✓" if met else "✗"

    def figures(r: dict[str, Any]) -> list[str]:
        frames = r["reused"] + r["created"]
        row = (
            f"{r['bytes'] / 1e9:>6.2f}{r['reused'] / frames:>8.0%}{mib(r['peak_free']):>11.0f}"
            f"{mark(r['free_met']):>2}{mib(r['peak_above_held']):>10.0f}{mark(r['held_met']):>2}"
            f"{mib(r['kept']):>7.0f}{mib(r['above_start']):>7.0f}{mib(r['trimmed']):>9.0f}"
            f"{mib(r['above_start_trimmed']):>7.0f}{mark(r['trim_met']):>2}"
        )
        return [row]

    return _harness.backend_table(head, results, figures)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.argument_parser("buffer_pool", __doc__)
    add = parser.add_argument
    add("--messages", type=whole_number(), default=400, help="messages (default: 400)")
    add(
        "--max-frame",
        type=byte_size(),
        default=32 * 2**20,
        help="largest frame (default: 32MiB)",
    )
    add("--hold", type=whole_number(), default=8, help="messages held (default: 8)")
    _harness.add_backend_options(parser, ("tcp",))
    _harness.add_output_options(parser, no_pin_help="do not pin the processes to CPUs")
    args = parser.parse_args(argv)
    if args.max_frame <= MIN_FRAME:
        parser.error(f"--max-frame must be more than {MIN_FRAME} bytes")
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure each backend and print the results; return the exit status (1: a target missed
    or a run failed)."""
    args = parse_args(argv)
    if (backends := _harness.backends_for(args)) is None:
        return 2
    run = _harness.start_run("buffer_pool", "buffer pool bound", argv, args.no_pin, roles=ROLES)
    print(
        f"{args.messages} messages of 1-8 frames of 64 KiB-{args.max_frame / 2**20:g} MiB, the "
        f"last {args.hold} held; bound: max_free_bytes {DEFAULT_MAX_FREE_BYTES / 2**20:g} MiB",
        flush=True,
    )
    print(flush=True)
    cases = [Case(backend, args.messages, args.max_frame, args.hold) for backend in backends]
    results = _harness.run_backends(
        cases,
        run_case,
        run.cpus,
        None,
        lambda r: (
            f"peak free {r['peak_free'] / 2**20:.0f} MiB, "
            f"after trim {r['above_start_trimmed'] / 2**20:.0f} MiB above the start"
        ),
    )
    print(format_table(results))
    print(
        "\nGB: frames received; reused: frames received into kept memory; peak free: the "
        "pool's free bytes at most (MiB; bound max_free_bytes); RSS-held: resident memory "
        "above the start and the frames held, at most; kept / RSS+: the pool's free bytes and "
        "resident memory above the start once every frame was dropped; trimmed / RSS+: what "
        "trim() unmapped, and resident memory above the start after it. Targets: peak free "
        f"<= the bound; RSS-held < the bound + {SLACK / 2**20:g} MiB; RSS+ after trim < "
        f"{SLACK / 2**20:g} MiB."
    )
    if args.json:
        write_json(args.json, {"metadata": run.metadata(args), "results": results})
    failed = any(
        "error" in r or not (r["free_met"] and r["held_met"] and r["trim_met"]) for r in results
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
