"""Remote calls under load: many concurrent callers in one client process.

A server process serves one method, ``echo``, which returns its argument (a
small map: an integer and 100 bytes), in every system measured; a client
process runs ``--callers`` tasks (1000) that call it in a loop, each call timed
on its own. The systems:

* ``rpc``: ``anyio_comm.rpc``, every caller's calls multiplexed over one
  connection (``rpc.connect``);
* ``rpc-pool``: ``anyio_comm.rpc.Pool(max_per_address=4)``, the callers
  spread over its connections;
* ``rpc-channel``: ``anyio_comm.rpc`` bidirectional streams, one channel per
  caller over one connection (``client.channel``), each call a ``send`` of the
  argument to a handler that yields it back, then a ``receive``;
* ``comms``: plain anyio-comm comms, one per caller (1000 connections), each
  call a ``send`` then a ``receive``;
* ``dask`` (asyncio only): dask's ``ConnectionPool`` (its default limit, 512
  connections) against a ``distributed.core.Server`` over dask's ``tcp://``,
  as dask's scheduler and workers call one another;
* ``grpc`` (asyncio only, if grpcio is installed): a ``grpc.aio`` unary call
  over one channel, the request and reply msgpack-encoded by the caller;
* ``grpc-stream`` (asyncio only, as ``grpc``): a ``grpc.aio`` bidirectional
  stream per caller over one channel, each call a ``write`` then a ``read``.

Each round runs every system once, in an order that rotates from round to
round, for ``--warmup`` seconds then ``--seconds`` measured: the calls that
start and end in the measured part give the throughput and the latency
quantiles. The table gives the median over the rounds of each round's figures
and their range; p99/p50 is from the pooled latencies. Server pinned to the
first CPU, client to the second. Run from the repository root::

    python -m benchmarks.rpc_load                     # every backend, 5 rounds
    python -m benchmarks.rpc_load --backend asyncio --callers 1000 --rounds 7 --json rpc.json
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgpack

import anyio_comm
from anyio_comm import rpc
from anyio_comm.bench import run_backend, versions, whole_number, write_json

from . import _harness
from ._harness import STARTUP_TIMEOUT, ProcessPair
from .many_connections import FD_MARGIN, raise_fd_limit

if TYPE_CHECKING:
    import argparse
    from multiprocessing.connection import Connection

SYSTEMS = ("rpc", "rpc-pool", "rpc-channel", "comms", "dask", "grpc", "grpc-stream")
ASYNCIO_ONLY = ("dask", "grpc", "grpc-stream")
POOL_CONNECTIONS = 4
PAYLOAD = b"x" * 100
CALL_TIMEOUT = 60.0  # seconds a window may take to wind down, a hang guard


@dataclass(frozen=True)
class Case:
    """One backend's run."""

    backend: str
    transport: str
    systems: tuple[str, ...]
    callers: int
    rounds: int
    warmup: float
    seconds: float


def systems_for(backend: str, wanted: tuple[str, ...]) -> tuple[str, ...]:
    """The systems of ``wanted`` that run on ``backend`` (and are installed)."""
    systems = [s for s in wanted if backend == "asyncio" or s not in ASYNCIO_ONLY]
    if "grpc" in systems or "grpc-stream" in systems:
        try:
            import grpc  # noqa: F401
        except ImportError:
            systems = [s for s in systems if not s.startswith("grpc")]
    return tuple(systems)


# -- server -----------------------------------------------------------------------------


async def _echo(value: Any) -> Any:
    return value


async def _echo_channel(items: rpc.InputStream) -> Any:
    async for item in items:
        yield item


async def _serve_comm(comm: anyio_comm.Comm) -> None:
    async for message in comm:
        await comm.send(message)


async def _server(conn: Connection, case: Case) -> None:
    budget = STARTUP_TIMEOUT + case.rounds * len(case.systems) * (
        case.warmup + case.seconds + CALL_TIMEOUT
    )
    addresses: dict[str, Any] = {}
    with anyio.fail_after(budget):
        async with contextlib.AsyncExitStack() as stack:
            server = await stack.enter_async_context(
                rpc.serve(
                    "tcp://127.0.0.1:0",
                    {"echo": _echo, "echo_channel": _echo_channel},
                    max_calls_per_connection=case.callers + 1000,
                    max_calls=case.callers + 1000,
                )
            )
            addresses["rpc"] = addresses["rpc-pool"] = addresses["rpc-channel"] = server.address
            listener = await stack.enter_async_context(
                anyio_comm.listen("tcp://127.0.0.1:0", _serve_comm)
            )
            addresses["comms"] = listener.address
            if "dask" in case.systems:
                from distributed.core import Server

                async def dask_echo(comm: object = None, value: Any = None) -> Any:  # noqa: ARG001 (dask passes the comm)
                    return value

                dask_server = Server({"echo": dask_echo})
                await dask_server.listen("tcp://127.0.0.1:0")
                stack.push_async_callback(dask_server.close)
                addresses["dask"] = dask_server.address
            if "grpc" in case.systems or "grpc-stream" in case.systems:
                import grpc

                async def grpc_echo(request: bytes, context: object) -> bytes:  # noqa: ARG001
                    return request

                async def grpc_chat(requests: Any, context: object) -> Any:  # noqa: ARG001
                    async for request in requests:
                        yield request

                grpc_server = grpc.aio.server()
                handler = grpc.method_handlers_generic_handler(
                    "bench",
                    {
                        "echo": grpc.unary_unary_rpc_method_handler(grpc_echo),
                        "chat": grpc.stream_stream_rpc_method_handler(grpc_chat),
                    },
                )
                grpc_server.add_generic_rpc_handlers((handler,))
                port = grpc_server.add_insecure_port("127.0.0.1:0")
                await grpc_server.start()
                stack.push_async_callback(grpc_server.stop, None)
                addresses["grpc"] = addresses["grpc-stream"] = f"127.0.0.1:{port}"
            conn.send(("ready", addresses))
            await anyio.wait_readable(conn.fileno())


def server_main(conn: Connection, case: Case) -> None:
    """Entry point of the server process."""
    raise_fd_limit(case.callers + FD_MARGIN)
    run_backend(case.backend, _server, conn, case)


# -- client -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _callers(system: str, address: str, callers: int) -> Any:
    """Per caller, an async function making one call with the argument ``i``."""
    async with contextlib.AsyncExitStack() as stack:
        if system == "rpc":
            client = await stack.enter_async_context(rpc.connect(address, max_queued=callers))

            async def call(i: int) -> Any:
                return await client.call("echo", {"i": i, "data": PAYLOAD})

            yield [call] * callers
        elif system == "rpc-pool":
            pool = await stack.enter_async_context(
                rpc.Pool(
                    max_per_address=POOL_CONNECTIONS,
                    max_users_per_connection=-(-callers // POOL_CONNECTIONS),
                    max_queued=callers,
                )
            )

            async def pooled(i: int) -> Any:
                async with pool.client(address) as remote:
                    return await remote.call("echo", {"i": i, "data": PAYLOAD})

            yield [pooled] * callers
        elif system == "rpc-channel":
            client = await stack.enter_async_context(rpc.connect(address, max_queued=callers))

            async def open_channel() -> Any:
                channel = await stack.enter_async_context(client.channel("echo_channel"))

                async def exchange(i: int) -> Any:
                    await channel.send({"i": i, "data": PAYLOAD})
                    return await channel.receive()

                return exchange

            yield [await open_channel() for _ in range(callers)]
        elif system == "comms":
            comms = []
            for _ in range(callers):
                comms.append(await stack.enter_async_context(await anyio_comm.connect(address)))

            def caller(comm: anyio_comm.Comm) -> Any:
                async def call(i: int) -> Any:
                    await comm.send({"i": i, "data": PAYLOAD})
                    return await comm.receive()

                return call

            yield [caller(comm) for comm in comms]
        elif system == "dask":
            from distributed.core import ConnectionPool

            dask_pool = await ConnectionPool()
            stack.push_async_callback(dask_pool.close)

            async def dask_call(i: int) -> Any:
                return await dask_pool(address).echo(value={"i": i, "data": PAYLOAD})

            yield [dask_call] * callers
        elif system == "grpc":
            import grpc

            channel = grpc.aio.insecure_channel(address)
            stack.push_async_callback(channel.close)
            method = channel.unary_unary("/bench/echo")

            async def grpc_call(i: int) -> Any:
                reply = await method(msgpack.packb({"i": i, "data": PAYLOAD}))
                return msgpack.unpackb(reply)

            yield [grpc_call] * callers
        elif system == "grpc-stream":
            import grpc

            channel = grpc.aio.insecure_channel(address)
            stack.push_async_callback(channel.close)
            chat = channel.stream_stream("/bench/chat")

            def streaming_caller() -> Any:
                stream = chat()
                stack.callback(stream.cancel)

                async def exchange(i: int) -> Any:
                    await stream.write(msgpack.packb({"i": i, "data": PAYLOAD}))
                    return msgpack.unpackb(await stream.read())

                return exchange

            yield [streaming_caller() for _ in range(callers)]
        else:
            raise ValueError(system)


async def _window(system: str, address: str, case: Case) -> dict[str, Any]:
    """One system's window: warm up, measure, wind down."""
    latencies: list[float] = []
    measuring = False
    stopping = False
    errors = 0
    async with _callers(system, address, case.callers) as calls:

        async def run(call: Any, base: int) -> None:
            nonlocal errors
            i = base
            perf_counter = time.perf_counter
            while not stopping:
                started_measuring = measuring
                t0 = perf_counter()
                reply = await call(i)
                t1 = perf_counter()
                if reply != {"i": i, "data": PAYLOAD}:
                    errors += 1
                if started_measuring and measuring:
                    latencies.append(t1 - t0)
                i += 1

        with anyio.fail_after(case.warmup + case.seconds + CALL_TIMEOUT):
            async with anyio.create_task_group() as tg:
                for n, call in enumerate(calls):
                    tg.start_soon(run, call, n * 1_000_000)
                await anyio.sleep(case.warmup)
                measuring = True
                start = time.perf_counter()
                await anyio.sleep(case.seconds)
                measuring = False
                elapsed = time.perf_counter() - start
                stopping = True
    return {"latencies": latencies, "seconds": elapsed, "errors": errors}


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    if len(ordered) < 2:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan")}
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {"p50": cuts[49], "p99": cuts[98], "max": ordered[-1]}


async def _client(case: Case, addresses: dict[str, Any]) -> dict[str, Any]:
    rounds: dict[str, list[dict[str, Any]]] = {s: [] for s in case.systems}
    pooled: dict[str, list[float]] = {s: [] for s in case.systems}
    for index in range(case.rounds):
        shift = index % len(case.systems)
        for system in case.systems[shift:] + case.systems[:shift]:
            window = await _window(system, addresses[system], case)
            lat = window["latencies"]
            rounds[system].append(
                {
                    "calls_per_second": len(lat) / window["seconds"],
                    **_quantiles(lat),
                    "errors": window["errors"],
                }
            )
            pooled[system].extend(lat)
    return {
        "rounds": rounds,
        "pooled": {s: {**_quantiles(v), "calls": len(v)} for s, v in pooled.items()},
    }


def client_main(conn: Connection, case: Case, addresses: dict[str, Any]) -> dict[str, Any]:  # noqa: ARG001
    """Entry point of the client process."""
    raise_fd_limit(case.callers * 2 + FD_MARGIN)
    return run_backend(case.backend, _client, case, addresses)


# -- orchestration ----------------------------------------------------------------------


def run_case(
    ctx: Any,
    case: Case,
    cpus: tuple[int | None, int | None],
    tls: object,  # noqa: ARG001 (plain TCP only)
) -> dict[str, Any]:
    """Run one backend: a server process, a client process; return the figures."""
    with ProcessPair(ctx, "rpc-load", cpus) as pair:
        server, addresses = pair.start_server(server_main, case)
        client = pair.start_client(client_main, case, addresses)
        per_window = case.warmup + case.seconds + CALL_TIMEOUT
        deadline = (
            time.monotonic() + STARTUP_TIMEOUT + case.rounds * len(case.systems) * per_window
        )
        _, measured = client.receive(deadline)
        server.send("stop")
    summary = {}
    for system, rounds in measured["rounds"].items():
        rates = [r["calls_per_second"] for r in rounds]
        summary[system] = {
            "calls_per_second": statistics.median(rates),
            "calls_per_second_range": [min(rates), max(rates)],
            "p50_ms": statistics.median(r["p50"] for r in rounds) * 1e3,
            "p99_ms": statistics.median(r["p99"] for r in rounds) * 1e3,
            "max_ms": max(r["max"] for r in rounds) * 1e3,
            "pooled_p99_over_p50": measured["pooled"][system]["p99"]
            / measured["pooled"][system]["p50"],
            "errors": sum(r["errors"] for r in rounds),
        }
    return {**asdict(case), "summary": summary, "measured": measured}


def format_table(results: list[dict[str, Any]]) -> str:
    """Per backend and system: throughput, latency quantiles, and ratios to the others."""
    head = (
        f"{'system':<12}{'calls/s':>10}{'range':>18}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'max ms':>9}{'p99/p50':>9}{'errors':>8}"
    )

    def figures(r: dict[str, Any]) -> list[str]:
        rows = []
        for system, s in r["summary"].items():
            low, high = s["calls_per_second_range"]
            rows.append(
                f"{system:<12}{s['calls_per_second']:>10,.0f}{f'{low:,.0f}-{high:,.0f}':>18}"
                f"{s['p50_ms']:>9.2f}{s['p99_ms']:>9.2f}{s['max_ms']:>9.1f}"
                f"{s['pooled_p99_over_p50']:>9.2f}{s['errors']:>8}"
            )
        summary = r["summary"]
        if "rpc" in summary:
            base = summary["rpc"]["calls_per_second"]
            ratios = ", ".join(
                f"{base / s['calls_per_second']:.2f}x {name}"
                for name, s in summary.items()
                if name != "rpc" and s["calls_per_second"]
            )
            rows.append(f"rpc calls/s against the others: {ratios}")
        return [rows[0], *(" " * 19 + row for row in rows[1:])]

    return _harness.backend_table(head, results, figures)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the command line."""
    parser = _harness.argument_parser("rpc_load", __doc__)
    add = parser.add_argument
    _harness.add_backend_options(parser, ("tcp",))
    add("--systems", type=_harness.csv_list(SYSTEMS), default=list(SYSTEMS), help="all")
    add("--callers", type=whole_number(), default=1000, help="concurrent callers (1000)")
    add("--rounds", type=whole_number(), default=5, help="windows per system (5)")
    add("--warmup", type=float, default=1.0, help="seconds before each measurement (1)")
    add("--seconds", type=float, default=3.0, help="seconds measured per window (3)")
    _harness.add_output_options(parser)
    args = parser.parse_args(argv)
    if args.callers > 5000:
        parser.error("--callers: at most 5000")
    if not 0 < args.seconds <= 60 or not 0 <= args.warmup <= 60:
        parser.error("--seconds and --warmup: from 0 (warmup) or more than 0 to 60")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run each backend and print the table; return the exit status."""
    args = parse_args(argv)
    if (backends := _harness.backends_for(args)) is None:
        return 2
    dists = {
        **_harness.comm_versions(),
        **versions("grpcio"),
    }
    run = _harness.start_run("rpc_load", "RPC load", argv, args.no_pin, versions=dists)
    print(
        f"{args.callers} callers calling echo({{'i': i, 'data': 100 bytes}}) in a loop; "
        f"{args.rounds} rounds of {args.warmup:g} s warm-up + {args.seconds:g} s measured "
        "per system, interleaved",
        flush=True,
    )
    cases = [
        Case(
            backend,
            "tcp",
            systems_for(backend, tuple(args.systems)),
            args.callers,
            args.rounds,
            args.warmup,
            args.seconds,
        )
        for backend in backends
    ]
    results = _harness.run_backends(
        cases,
        run_case,
        run.cpus,
        None,
        lambda r: ", ".join(
            f"{name} {s['calls_per_second']:,.0f}/s" for name, s in r["summary"].items()
        ),
    )
    print(format_table(results))
    if args.json:
        for r in results:
            r.pop("measured", None)
        write_json(args.json, {"metadata": run.metadata(args), "results": results})
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
