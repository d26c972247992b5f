"""Throughput of large messages with frame compression, against none.

A server process echoes messages of one frame (``receive_frames`` then
``send_frames``); its listener accepts LZ4 and Zstandard (``compression=("lz4",
"zstd")``). A client process opens three connections to it: one without
compression, one with ``compression="lz4"`` and one with ``compression="zstd"``
(each reply is compressed with the codec of its request). For each payload
size (``--sizes``, default 1 MB, 10 MB and 100 MB) and kind of data, it runs
round trips for ``--seconds`` on each connection in turn, the order alternating,
``--repeat`` times: the modes see the same state of the machine.

Kinds of data:

* ``compressible``: words of a small vocabulary (LZ4 makes it about a quarter
  of its size, Zstandard about an eighth), as text, logs and many serialized
  tables are;
* ``incompressible``: random bytes (the sender's sample shows it does not
  compress, and the frame goes as it is).

Reported: the payload moved each way per second (MB/s, the median over the
repeats, with their range as the noise), and each codec's ratio to no
compression. Server on the first CPU, client on the second. Run from the
repository root::

    python -m benchmarks.compression                          # tcp, asyncio
    python -m benchmarks.compression --transport tls --backend uvloop --json compression.json
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio

import anyio_comm
from anyio_comm.bench import (
    BACKENDS,
    TLSFiles,
    byte_size,
    client_context,
    format_size,
    run_backend,
    server_context,
    whole_number,
    write_json,
)

from . import _harness
from ._harness import STARTUP_TIMEOUT, ProcessPair

if TYPE_CHECKING:
    import argparse
    import ssl
    from multiprocessing.connection import Connection

TRANSPORTS = ("tcp", "tls")
TLS_VERSION = "1.3"
MODES = ("none", "lz4", "zstd")
KINDS = ("compressible", "incompressible")
CLIENT_BUDGET = 1800.0  # seconds the client may take, a hang guard


@dataclass(frozen=True)
class Case:
    """One backend's run."""

    backend: str
    transport: str
    sizes: tuple[int, ...]
    seconds: float
    repeat: int


def payload(kind: str, size: int) -> bytes:
    """``size`` bytes of ``kind`` data (the same for every mode)."""
    if kind == "incompressible":
        return os.urandom(size)
    rng = random.Random(size)
    words = [rng.randbytes(rng.randrange(3, 9)).hex().encode() for _ in range(512)]
    chunk = b" ".join(rng.choice(words) for _ in range(200_000))
    return (chunk * (size // len(chunk) + 1))[:size]


# -- server -----------------------------------------------------------------------------


async def _server(conn: Connection, address: str, ssl_context: ssl.SSLContext | None) -> dict:
    async def echo(comm: anyio_comm.Comm) -> None:
        try:
            while True:
                await comm.send_frames(await comm.receive_frames())
        except anyio.EndOfStream:
            pass

    await _harness.serve_until_stopped(
        conn,
        address,
        echo,
        budget=STARTUP_TIMEOUT + CLIENT_BUDGET,
        ssl_context=ssl_context,
        compression=("lz4", "zstd"),
    )
    return {}


def server_main(conn: Connection, case: Case, tls: TLSFiles | None) -> dict[str, Any]:
    """Entry point of the server process."""
    address = f"{case.transport}://127.0.0.1:0"
    return run_backend(case.backend, _server, conn, address, server_context(tls, TLS_VERSION))


# -- client -----------------------------------------------------------------------------


async def _round_trips(comm: anyio_comm.Comm, data: bytes, seconds: float) -> float:
    """Round trips of ``data`` for about ``seconds`` (at least two); MB/s each way."""
    view = memoryview(data)
    count = 0
    start = time.perf_counter()
    while True:
        await comm.send_frames([view])
        (frame,) = await comm.receive_frames()
        if frame.nbytes != len(data):
            raise RuntimeError(f"a reply of {frame.nbytes} bytes, not {len(data)}")
        count += 1
        elapsed = time.perf_counter() - start
        if count >= 2 and elapsed >= seconds:
            return count * len(data) / elapsed / 1e6


async def _client(case: Case, address: str, ssl_context: ssl.SSLContext | None) -> dict:
    options: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context is not None else {}
    comms = {}
    for mode in MODES:
        compression = () if mode == "none" else mode
        comms[mode] = await anyio_comm.connect(address, compression=compression, **options)
    results = []
    with anyio.fail_after(CLIENT_BUDGET):
        for size in case.sizes:
            for kind in KINDS:
                data = payload(kind, size)
                for comm in comms.values():  # warm-up: buffers faulted in, pools filled
                    await _round_trips(comm, data, 0.0)
                runs: dict[str, list[float]] = {mode: [] for mode in MODES}
                for index in range(case.repeat):
                    order = MODES if index % 2 == 0 else MODES[::-1]
                    for mode in order:
                        runs[mode].append(await _round_trips(comms[mode], data, case.seconds))
                results.append({"size": size, "kind": kind, "mb_per_s": runs})
    for comm in comms.values():
        await comm.aclose()
    return {"results": results}


def client_main(
    conn: Connection,  # noqa: ARG001 (the client reports only its result)
    case: Case,
    tls: TLSFiles | None,
    address: str,
) -> dict[str, Any]:
    """Entry point of the client process."""
    return run_backend(case.backend, _client, case, address, client_context(tls, TLS_VERSION))


# -- orchestration ----------------------------------------------------------------------


def run_case(
    ctx: Any, case: Case, cpus: tuple[int | None, int | None], tls: TLSFiles | None
) -> dict[str, Any]:
    """Run one backend in a fresh server and client process; return the measurements."""
    with ProcessPair(ctx, "compression", cpus) as pair:
        server, address = pair.start_server(server_main, case, tls)
        client = pair.start_client(client_main, case, tls, address)
        _, measured = client.receive(time.monotonic() + STARTUP_TIMEOUT + CLIENT_BUDGET)
        server.send("stop")
        server.receive(time.monotonic() + STARTUP_TIMEOUT)
    rows = []
    for row in measured["results"]:
        runs = row["mb_per_s"]
        medians = {mode: statistics.median(values) for mode, values in runs.items()}
        rows.append(
            {
                **row,
                "median": medians,
                "range": {mode: [min(v), max(v)] for mode, v in runs.items()},
                "ratio": {mode: medians[mode] / medians["none"] for mode in MODES},
            }
        )
    return {**asdict(case), "rows": rows}


def _cell(row: dict[str, Any], mode: str) -> str:
    low, high = row["range"][mode]
    return f"{row['median'][mode]:.0f} ({low:.0f}-{high:.0f})".rjust(20)


def format_table(results: list[dict[str, Any]]) -> str:
    """Per backend: one row per size and kind of data, MB/s each way per mode."""
    head = f"{'size':>7} {'data':<15}" + "".join(f"{mode + ' MB/s':>20}" for mode in MODES)
    head += f"{'lz4/none':>10}{'zstd/none':>10}"

    def figures(r: dict[str, Any]) -> list[str]:
        lines = []
        for row in r["rows"]:
            cells = "".join(_cell(row, mode) for mode in MODES)
            lines.append(
                f"{format_size(row['size']):>7} {row['kind']:<15}{cells}"
                f"{row['ratio']['lz4']:>9.2f}x{row['ratio']['zstd']:>9.2f}x"
            )
        return [lines[0], *(" " * 19 + line for line in lines[1:])]

    return _harness.backend_table(head, results, figures)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.argument_parser("compression", __doc__)
    add = parser.add_argument
    parser.add_argument(
        "--backend",
        choices=(*BACKENDS, "all"),
        default="asyncio",
        help="asyncio, uvloop, trio or all (default: asyncio)",
    )
    parser.add_argument("--transport", choices=TRANSPORTS, default="tcp", help="default: tcp")
    add(
        "--sizes",
        type=_harness.csv_list(None, byte_size()),
        default=[10**6, 10**7, 10**8],
        help="payload sizes (default: 1MB,10MB,100MB)",
    )
    add("--seconds", type=float, default=1.5, help="seconds per mode and repeat (1.5)")
    add("--repeat", type=whole_number(), default=3, help="repeats (3)")
    _harness.add_output_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run each backend and print the table; return the exit status."""
    args = parse_args(argv)
    if (backends := _harness.backends_for(args)) is None:
        return 2
    run = _harness.start_run("compression", "compression", argv, args.no_pin)
    print(
        f"{args.transport}: one connection per mode, {args.repeat} repeats of "
        f"{args.seconds:g} s per mode, size and kind of data; MB/s of payload each way "
        "(median, range over the repeats)",
        flush=True,
    )
    print(flush=True)
    cases = [
        Case(backend, args.transport, tuple(args.sizes), args.seconds, args.repeat)
        for backend in backends
    ]
    results = _harness.run_backends(
        cases,
        run_case,
        run.cpus,
        "cmp-tls-" if args.transport == "tls" else None,
        lambda r: f"{len(r['rows'])} rows",
    )
    print(format_table(results))
    if args.json:
        metadata = run.metadata(args, tls=_harness.transport_tls(args, TLS_VERSION))
        write_json(args.json, {"metadata": metadata, "results": results})
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
