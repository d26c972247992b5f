"""Server memory against hostile peers, and against idle connections.

A server process runs :func:`anyio_comm.listen` with an echo handler (default
options, or ``--unprotected``: no receive budget and every frame buffer a
``bytearray``, committed whole when its header arrives, as anyio-comm did
before the budget). A client process opens raw TCP (or TLS) connections that
send a valid preamble and then, per ``--scenario``:

* ``declare``: one message header declaring a single frame of ``--declare``
  bytes (1 GiB by default) and 1,000 bytes of it, then nothing (they hold the
  connection open);
* ``frames``: the header of one message of ``--frames`` frames (16,384, the
  default limit), all empty but the last, which is declared 1,000 bytes long
  and never sent: 128 KiB each, which as frame objects would cost the server
  about 6 MB (it holds them as bytes until the message is taken);
* ``taken``: ``--messages`` (4) whole messages of ``--frames`` empty frames
  (128 KiB each), which the server's handler takes with ``receive_frames()``
  and keeps while the connection is open: what a taken message holds (as frame
  objects, 6.4 MB each);
* ``idle``: nothing after the preamble;
* ``silent``: nothing at all, not even a preamble (with ``--transport tls``
  not even a TLS ClientHello: a plain TCP connection to the TLS listener),
  until the server drops them at its ``handshake_timeout`` (10 s by default;
  each step is measured well before that).

They are opened in steps (``--peers``, cumulative counts); after each step
and a settling second the server reports its resident set size (``VmRSS``),
its peak (``VmHWM``) and its receive budget, and a legitimate client does
``--round-trips`` round trips of 1 KB and one of 1 MB, whose latencies are
reported. The server is pinned to the first CPU, the client to the second
(``os.sched_setaffinity``), as in ``benchmarks.echo``; the output says which.

Targets (default options): 64 peers declaring 1 GiB frames grow the server by
less than 512 MiB, and the legitimate client's round trips all succeed.

Run from the repository root::

    python -m benchmarks.hostile_peers                          # declare, 0-256 peers, tcp
    python -m benchmarks.hostile_peers --transport tls --backend uvloop
    python -m benchmarks.hostile_peers --scenario frames --peers 0,16,64
    python -m benchmarks.hostile_peers --scenario taken --peers 0,16,64
    python -m benchmarks.hostile_peers --scenario idle --peers 0,1000
    python -m benchmarks.hostile_peers --scenario silent --peers 0,2000 --transport tls
    python -m benchmarks.hostile_peers --unprotected --peers 0,1,4   # the old behaviour
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

import anyio_comm
from anyio_comm._sansio.wire import SMALL_COUNT, encode_header, encode_preamble

from . import _harness
from ._harness import (
    STARTUP_TIMEOUT,
    ProcessPair,
    TLSFiles,
    client_context,
    csv_list,
    run_backend,
    server_context,
)
from .backpressure import read_memory
from .many_connections import FD_MARGIN, raise_fd_limit

if TYPE_CHECKING:
    import argparse
    import ssl
    from multiprocessing.connection import Connection

TRANSPORTS = ("tcp", "tls")
SCENARIOS = ("declare", "frames", "taken", "idle", "silent")
TLS_VERSION = "1.3"
SETTLE = 1.0  # seconds between opening a step's peers and measuring
STEP_TIMEOUT = 120.0  # seconds for one step (opening peers and the round trips)
GROWTH_TARGET = 512 * 2**20  # bytes: 64 peers declaring 1 GiB must grow the server less
TARGET_PEERS = 64
UNPROTECTED_MAX = 8  # peers x 1 GiB committed: keep the machine alive


@dataclass(frozen=True)
class Case:
    """One backend's run."""

    backend: str
    transport: str
    scenario: str
    peers: tuple[int, ...]
    declare: int
    frames: int
    messages: int
    round_trips: int
    unprotected: bool


# -- server ---------------------------------------------------------------------


async def _server(
    conn: Connection, case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> None:
    async def echo(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)

    async def keep(comm: anyio_comm.Comm) -> None:
        """Keep the hostile peers' messages of many frames; echo the others."""
        kept = []
        while True:
            try:
                frames = await comm.receive_frames()
            except anyio.EndOfStream:
                return
            if len(frames) > SMALL_COUNT:
                kept.append(frames)
            else:
                await comm.send_frames(frames)

    options: dict[str, Any] = {"ssl_context": ssl_context}
    if case.unprotected:
        options.update(receive_budget=None, allocator=bytearray, message_timeout=None)
    lifetime = STARTUP_TIMEOUT + STEP_TIMEOUT * (len(case.peers) + 1)
    with anyio.move_on_after(lifetime):
        handler = keep if case.scenario == "taken" else echo
        async with anyio_comm.listen(address, handler, **options) as listener:
            conn.send(("ready", listener.address))
            while True:
                try:
                    command = await anyio.to_thread.run_sync(conn.recv, abandon_on_cancel=True)
                except EOFError:
                    return
                if command == "stop":
                    return
                budget = listener.receive_budget
                conn.send(
                    {
                        **read_memory(),
                        "budget_in_use": budget.in_use if budget else None,
                        "budget_waiting": budget.waiting if budget else None,
                        "connections": listener.active_connections,
                    }
                )


def server_main(conn: Connection, case: Case, tls: TLSFiles | None) -> None:
    """Entry point of the server process."""
    raise_fd_limit(max(case.peers) + FD_MARGIN)
    ssl_context = server_context(tls, TLS_VERSION if case.transport == "tls" else None)
    run_backend(case.backend, _server, conn, case, f"{case.transport}://127.0.0.1:0", ssl_context)


# -- client ---------------------------------------------------------------------


async def _open_silent_peer(host: str, port: int) -> anyio.abc.ByteStream:
    """The ``silent`` scenario's peer: a TCP connection that sends nothing (no TLS
    handshake either, whatever the transport)."""
    return await anyio.connect_tcp(host, port)


async def _open_peer(
    host: str, port: int, ssl_context: ssl.SSLContext | None, first_bytes: bytes
) -> anyio.abc.ByteStream:
    stream: anyio.abc.ByteStream
    if ssl_context is not None:
        stream = await anyio.connect_tcp(
            host, port, tls=True, ssl_context=ssl_context, tls_hostname="localhost"
        )
    else:
        stream = await anyio.connect_tcp(host, port)
    await stream.send(first_bytes)
    return stream


async def _client(
    conn: Connection, case: Case, address: str, ssl_context: ssl.SSLContext | None
) -> None:
    host, port = address.split("://")[1].rsplit(":", 1)
    first = encode_preamble(anyio_comm.Limits())
    if case.scenario == "declare":
        first += struct.pack("!IQ", 1, case.declare) + b"\0" * 1000
    elif case.scenario == "frames":
        first += encode_header([0] * (case.frames - 1) + [1000])
    elif case.scenario == "taken":
        first += encode_header([0] * case.frames) * case.messages
    options: dict[str, Any] = {"ssl_context": ssl_context} if ssl_context is not None else {}
    small, large = b"x" * 1000, os.urandom(2**20)
    limiter = anyio.CapacityLimiter(100)  # connects in flight, under the listen backlog
    async with contextlib.AsyncExitStack() as stack:
        opened = 0
        while True:
            command = await anyio.to_thread.run_sync(conn.recv)
            if command == "stop":
                return
            with anyio.fail_after(STEP_TIMEOUT):

                async def open_one() -> None:
                    async with limiter:
                        if case.scenario == "silent":
                            stream = await _open_silent_peer(host, int(port))
                        else:
                            stream = await _open_peer(host, int(port), ssl_context, first)
                    stack.push_async_callback(anyio.aclose_forcefully, stream)

                async with anyio.create_task_group() as tg:
                    for _ in range(command - opened):
                        tg.start_soon(open_one)
                opened = command
                await anyio.sleep(SETTLE)
                conn.send("opened")
                await anyio.to_thread.run_sync(conn.recv)  # the server has reported
                latencies = []
                errors = 0
                try:
                    async with await anyio_comm.connect(
                        address, timeout=STARTUP_TIMEOUT, **options
                    ) as comm:
                        for payload in [small] * case.round_trips + [large]:
                            t0 = time.perf_counter()
                            await comm.send(payload)
                            if bytes(await comm.receive()) != payload:
                                errors += 1
                            latencies.append(time.perf_counter() - t0)
                except Exception:
                    errors += 1
                ordered = sorted(latencies[:-1])
                conn.send(
                    {
                        "small_p50_ms": ordered[len(ordered) // 2] * 1e3 if ordered else None,
                        "large_ms": latencies[-1] * 1e3
                        if len(latencies) > case.round_trips
                        else None,
                        "errors": errors,
                    }
                )


def client_main(conn: Connection, case: Case, tls: TLSFiles | None, address: str) -> None:
    """Entry point of the client process."""
    raise_fd_limit(max(case.peers) + FD_MARGIN)
    ssl_context = client_context(tls, TLS_VERSION if case.transport == "tls" else None)
    run_backend(case.backend, _client, conn, case, address, ssl_context)


# -- orchestration --------------------------------------------------------------


def run_case(
    ctx: Any, case: Case, cpus: tuple[int | None, int | None], tls: TLSFiles | None
) -> dict[str, Any]:
    """Run one backend: the server, then the client's steps; return the rows."""
    steps = []
    with ProcessPair(ctx, "hostile", cpus) as pair:
        server, address = pair.start_server(server_main, case, tls)
        client = pair.start_client(client_main, case, tls, address)
        server.send("report")
        start = server.receive(time.monotonic() + STARTUP_TIMEOUT)
        for peers in case.peers:
            client.send(peers)
            client.receive(time.monotonic() + STEP_TIMEOUT)
            server.send("report")
            report = server.receive(time.monotonic() + STARTUP_TIMEOUT)
            client.send("go")
            legit = client.receive(time.monotonic() + STEP_TIMEOUT)
            steps.append(
                {"peers": peers, **report, **legit, "growth": report["rss"] - start["rss"]}
            )
        client.send("stop")
        server.send("stop")
    at_target = [s for s in steps if s["peers"] == TARGET_PEERS]
    met = None
    if case.scenario == "declare" and case.declare >= 2**30 and at_target:
        met = at_target[0]["growth"] < GROWTH_TARGET and at_target[0]["errors"] == 0
    return {**asdict(case), "start_rss": start["rss"], "steps": steps, "target_met": met}


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per step and backend."""
    head = (
        f"{'peers':>6}{'RSS MiB':>10}{'growth MiB':>12}{'peak MiB':>10}{'budget MiB':>12}"
        f"{'waiting':>9}{'1 KB p50 ms':>13}{'1 MB ms':>9}{'errors':>8}"
    )

    def figures(r: dict[str, Any]) -> list[str]:
        rows = [
            f"{s['peers']:>6}{_mib(s['rss']):>10}{_mib(s['growth']):>12}{_mib(s['hwm']):>10}"
            f"{_mib(s['budget_in_use']):>12}{_harness_num(s['budget_waiting']):>9}"
            f"{_harness_num(s['small_p50_ms'], '.2f'):>13}{_harness_num(s['large_ms'], '.1f'):>9}"
            f"{s['errors']:>8}"
            for s in r["steps"]
        ]
        return rows[:1] + [" " * 19 + row for row in rows[1:]]  # under the first row

    return _harness.backend_table(head, results, figures)


def _harness_num(value: float | None, spec: str = "d") -> str:
    return "-" if value is None else format(value, spec)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.argument_parser("hostile_peers", __doc__)
    add = parser.add_argument
    add("--scenario", choices=SCENARIOS, default="declare", help="default: declare")
    add(
        "--peers",
        type=csv_list(None, int),
        default=None,
        help="cumulative peer counts to measure at (default: 0,16,64,256 for declare and "
        "frames, 0,1000 for idle, 0,2000 for silent)",
    )
    add("--declare", type=_harness.parse_size, default=2**30, help="frame declared (1GiB)")
    add(
        "--frames",
        type=_harness.positive_int,
        default=anyio_comm.Limits().max_frames,
        help="frames of the frames and taken scenarios' messages (default: the limit, 16384)",
    )
    add(
        "--messages",
        type=_harness.positive_int,
        default=4,
        help="whole messages each peer sends in the taken scenario (default: 4)",
    )
    add("--round-trips", type=_harness.positive_int, default=50, help="1 KB ones (default: 50)")
    add("--unprotected", action="store_true", help="no budget, frames committed at their header")
    _harness.add_backend_options(parser, TRANSPORTS)
    _harness.add_output_options(parser)
    args = parser.parse_args(argv)
    if args.peers is None:
        args.peers = {"idle": [0, 1000], "silent": [0, 2000]}.get(args.scenario, [0, 16, 64, 256])
    if sorted(args.peers) != args.peers or not args.peers or args.peers[0] < 0:
        parser.error("--peers must be increasing counts from 0 up")
    if args.frames > anyio_comm.Limits().max_frames:
        parser.error(f"--frames: at most the default limit, {anyio_comm.Limits().max_frames}")
    if args.peers[-1] > 5000:
        parser.error("--peers: at most 5000")
    unprotected_total = args.peers[-1] * args.declare
    if (
        args.unprotected
        and args.scenario == "declare"
        and unprotected_total > UNPROTECTED_MAX * 2**30
    ):
        parser.error(f"--unprotected commits every declared frame: at most {UNPROTECTED_MAX} GiB")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run each backend and print the results; return the exit status."""
    args = parse_args(argv)
    if (backends := _harness.backends_for(args)) is None:
        return 2
    run = _harness.start_run("hostile_peers", "hostile-peers memory benchmark", argv, args.no_pin)
    mode = "unprotected (no budget, eager frames)" if args.unprotected else "default options"
    what = {
        "declare": f"each declaring a {args.declare:,}-byte frame",
        "frames": f"each sending the header of a message of {args.frames:,} frames",
        "taken": f"each sending {args.messages} messages of {args.frames:,} empty frames, kept",
        "idle": "idle after the preamble",
        "silent": "connected, silent (no preamble, no TLS handshake)",
    }[args.scenario]
    print(f"{args.transport}, {mode}; peers {what}", flush=True)
    cases = [
        Case(
            backend,
            args.transport,
            args.scenario,
            tuple(args.peers),
            args.declare,
            args.frames,
            args.messages,
            args.round_trips,
            args.unprotected,
        )
        for backend in backends
    ]
    results = _harness.run_backends(
        cases,
        run_case,
        run.cpus,
        "hostile-tls-" if args.transport == "tls" else None,
        lambda r: f"last step: growth {_mib(r['steps'][-1]['growth'])} MiB",
    )
    print(format_table(results))
    print(
        "\ngrowth: the server's RSS above its level before any peer; budget: the listener's "
        "receive budget in use; waiting: connections waiting for it"
    )
    if args.json:
        metadata = run.metadata(args, tls=_harness.transport_tls(args, TLS_VERSION))
        _harness.write_json(args.json, {"metadata": metadata, "results": results})
    failed = any("error" in r or r.get("target_met") is False for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
