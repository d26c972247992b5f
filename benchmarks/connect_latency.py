"""Latency of a new connection's first request: connect, send, receive the reply.

A server process listens (``anyio_comm.listen``, an echo handler) and a client
process opens connection after connection; on each it sends one small request
(``{"op": "ping", "n": i}``), waits for the echo and closes. The client measures
each connection from the call to ``connect()`` to the reply, and the part of it
spent in ``connect()``, with and without ``early_data`` (where ``connect()``
returns once the client's preamble is written, and the request follows at once
instead of after the server's preamble). The two modes alternate in blocks of
``--block`` connections, ``--rounds`` times, after a warm-up of one block of
each, so that both see the same state of the machine; each round gives the
ratio of the two modes' medians, and the table gives the range of those ratios
as the noise.

Both processes are fresh for each backend and pinned to two different CPUs
(the server on the first, the client on the second), as in ``benchmarks.echo``.
Run from the repository root::

    python -m benchmarks.connect_latency                      # tcp, every backend
    python -m benchmarks.connect_latency --transport tls --rounds 20 --json latency.json
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio

import anyio_comm
from anyio_comm.bench import (
    TLSFiles,
    client_context,
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

TRANSPORTS = ("tcp", "unix", "tls")
TLS_VERSION = "1.3"
MODES = ("waits", "early")  # early_data False, True
CLIENT_BUDGET = 600.0  # seconds the client may take, a hang guard


@dataclass(frozen=True)
class Case:
    """One backend's run."""

    backend: str
    transport: str
    block: int
    rounds: int


# -- server -----------------------------------------------------------------------------


async def _server(conn: Connection, address: str, ssl_context: ssl.SSLContext | None) -> dict:
    connections = 0

    async def echo(comm: anyio_comm.Comm) -> None:
        nonlocal connections
        connections += 1
        async for message in comm:
            await comm.send(message)

    await _harness.serve_until_stopped(
        conn, address, echo, budget=STARTUP_TIMEOUT + CLIENT_BUDGET, ssl_context=ssl_context
    )
    return {"connections": connections}


def server_main(
    conn: Connection, case: Case, tls: TLSFiles | None, unix_dir: str | None
) -> dict[str, Any]:
    """Entry point of the server process."""
    if case.transport == "unix":
        address = f"unix://{unix_dir}/latency.sock"
    else:
        address = f"{case.transport}://127.0.0.1:0"
    return run_backend(case.backend, _server, conn, address, server_context(tls, TLS_VERSION))


# -- client -----------------------------------------------------------------------------


async def _one(address: str, early: bool, n: int, options: dict[str, Any]) -> tuple[float, float]:
    """One connection: (seconds in connect(), seconds from connect() to the reply)."""
    start = time.perf_counter()
    comm = await anyio_comm.connect(address, early_data=early, **options)
    connected = time.perf_counter()
    async with comm:
        await comm.send({"op": "ping", "n": n})
        reply = await comm.receive()
        done = time.perf_counter()
    if reply != {"op": "ping", "n": n}:
        raise RuntimeError(f"wrong reply {reply!r}")
    return connected - start, done - start


async def _client(case: Case, address: str, ssl_context: ssl.SSLContext | None) -> dict:
    options: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context is not None else {}
    samples: dict[str, dict[str, list[float]]] = {m: {"connect": [], "total": []} for m in MODES}
    ratios: list[float] = []
    n = 0
    with anyio.fail_after(CLIENT_BUDGET):
        for round_ in range(-1, case.rounds):  # round -1: the warm-up
            medians = {}
            order = MODES if round_ % 2 else MODES[::-1]
            for mode in order:
                totals = []
                for _ in range(case.block):
                    connect, total = await _one(address, mode == "early", n, options)
                    n += 1
                    totals.append(total)
                    if round_ >= 0:
                        samples[mode]["connect"].append(connect)
                        samples[mode]["total"].append(total)
                medians[mode] = statistics.median(totals)
            if round_ >= 0:
                ratios.append(medians["waits"] / medians["early"])
    return {"samples": samples, "round_ratios": ratios, "connections": n}


def client_main(
    conn: Connection,  # noqa: ARG001 (the client reports only its result)
    case: Case,
    tls: TLSFiles | None,
    address: str,
) -> dict[str, Any]:
    """Entry point of the client process."""
    return run_backend(case.backend, _client, case, address, client_context(tls, TLS_VERSION))


# -- orchestration ----------------------------------------------------------------------


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98], "max": ordered[-1]}


def run_case(
    ctx: Any, case: Case, cpus: tuple[int | None, int | None], tls: TLSFiles | None
) -> dict[str, Any]:
    """Run one backend in a fresh server and client process; return the measurements."""
    with (
        _harness.unix_directory(case.transport, "acomm-lat-") as unix_dir,
        ProcessPair(ctx, "latency", cpus) as pair,
    ):
        server, address = pair.start_server(server_main, case, tls, unix_dir)
        client = pair.start_client(client_main, case, tls, address)
        deadline = time.monotonic() + STARTUP_TIMEOUT + CLIENT_BUDGET
        _, measured = client.receive(deadline)
        server.send("stop")
        _, served = server.receive(deadline)
    if served["connections"] != measured["connections"]:
        count, served_count = measured["connections"], served["connections"]
        raise RuntimeError(f"{count} connections made, {served_count} served")
    figures = {
        mode: {part: _quantiles(values) for part, values in parts.items()}
        for mode, parts in measured["samples"].items()
    }
    ratios = measured["round_ratios"]
    return {
        **asdict(case),
        "connections": measured["connections"],
        "figures": figures,
        "median_ratio": figures["waits"]["total"]["p50"] / figures["early"]["total"]["p50"],
        "round_ratio_min": min(ratios),
        "round_ratio_max": max(ratios),
    }


def format_table(results: list[dict[str, Any]]) -> str:
    """Per backend, per mode: connect() and connect-to-reply quantiles in microseconds."""
    head = f"{'mode':<7}{'connect p50':>12}{'first reply p50':>16}{'p90':>8}{'p99':>8}{'max':>9}"

    def figures(r: dict[str, Any]) -> list[str]:
        rows = []
        for mode in MODES:
            c, t = r["figures"][mode]["connect"], r["figures"][mode]["total"]
            rows.append(
                f"{mode:<7}{c['p50'] * 1e6:>12.0f}{t['p50'] * 1e6:>16.0f}"
                f"{t['p90'] * 1e6:>8.0f}{t['p99'] * 1e6:>8.0f}{t['max'] * 1e6:>9.0f}"
            )
        rows.append(
            f"{'':<19}waits/early, medians: {r['median_ratio']:.2f}x "
            f"(per round {r['round_ratio_min']:.2f}-{r['round_ratio_max']:.2f}x)"
        )
        return [rows[0], " " * 19 + rows[1], rows[2]]

    return _harness.backend_table(head, results, figures)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.argument_parser("connect_latency", __doc__)
    add = parser.add_argument
    _harness.add_backend_options(parser, TRANSPORTS)
    add("--block", type=whole_number(), default=50, help="connections per block (50)")
    add("--rounds", type=whole_number(), default=10, help="blocks of each mode (10)")
    _harness.add_output_options(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run each backend and print the table; return the exit status."""
    args = parse_args(argv)
    if (backends := _harness.backends_for(args)) is None:
        return 2
    run = _harness.start_run("connect_latency", "connect latency", argv, args.no_pin)
    print(
        f"{args.transport}: {args.rounds} rounds of {args.block} connections per mode and "
        "backend, each connect + one request of about 20 bytes + its echo + close; "
        "microseconds",
        flush=True,
    )
    print(flush=True)
    cases = [Case(backend, args.transport, args.block, args.rounds) for backend in backends]
    results = _harness.run_backends(
        cases,
        run_case,
        run.cpus,
        "lat-tls-" if args.transport == "tls" else None,
        lambda r: f"waits/early {r['median_ratio']:.2f}x",
    )
    print(format_table(results))
    print(
        "\nwaits: connect() returns once the server's preamble arrived; early: "
        "connect(early_data=True). first reply: from calling connect() to the echo."
    )
    if args.json:
        metadata = run.metadata(args, tls=_harness.transport_tls(args, TLS_VERSION))
        write_json(args.json, {"metadata": metadata, "results": results})
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
