"""Command line: ``python -m anyio_comm demo|bench|serve`` (also installed as ``anyio-comm``).

* ``demo``: an echo listener and client in one process, with a short report;
* ``bench``: an echo benchmark with client processes against a local or remote server;
* ``serve``: the echo server for ``bench ADDRESS`` (between two hosts).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio

from . import Comm, connect, listen
from ._bench import OneLineParser, add_parsers, bench_main, serve_main

if TYPE_CHECKING:
    from collections.abc import Sequence

BACKENDS = ("asyncio", "uvloop", "trio")


def run(main: Any, backend: str) -> None:
    """Run ``main`` on ``backend`` (``asyncio``, ``uvloop`` or ``trio``)."""
    if backend == "uvloop":
        anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    else:
        anyio.run(main, backend=backend)


async def _echo(comm: Comm) -> None:
    async for message in comm:
        await comm.send(message)


async def demo(address: str, backend: str, rounds: int, megabytes: int) -> None:
    """Start an echo listener, connect to it, and report what travelled."""
    print(f"anyio-comm demo on {backend}")
    async with listen(address, _echo) as listener:
        print(f"  listening on {listener.address}")
        async with await connect(listener.address, timeout=10) as comm:
            print(f"  connected    {comm.local_address} -> {comm.peer_address}")
            message = {"op": "ping", "args": [1, 2.5, "three"], "blob": b"x" * 1000}
            await comm.send(message)
            reply = await comm.receive()
            print(f"  sent {message!r:.60} ...; echo equal: {reply == message}")

            start = time.perf_counter()
            for i in range(rounds):
                await comm.send({"i": i, "payload": b"p" * 1000})
                await comm.receive()
            elapsed = time.perf_counter() - start
            print(
                f"  {rounds} round trips of a 1 KB message: "
                f"{elapsed / rounds * 1e6:.1f} us each, {rounds / elapsed:,.0f} per second"
            )

            payload = bytes(range(256)) * (megabytes * 10**6 // 256)
            start = time.perf_counter()
            await comm.send({"op": "put", "data": memoryview(payload)})
            reply = await comm.receive()
            elapsed = time.perf_counter() - start
            data = reply["data"]
            print(
                f"  {len(payload) / 1e6:.0f} MB out-of-band payload echoed in "
                f"{elapsed * 1e3:.1f} ms ({2 * len(payload) / elapsed / 1e6:,.0f} MB/s "
                f"both ways); received as {type(data).__name__} of {data.nbytes:,} bytes, "
                f"intact: {data == payload}"
            )
    print("  listener closed; done")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m anyio_comm``."""
    parser = OneLineParser(
        prog="anyio-comm", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="run an echo server and client, report")
    demo_parser.add_argument("--backend", choices=(*BACKENDS, "all"), default="all")
    demo_parser.add_argument("--address", default="tcp://127.0.0.1:0")
    demo_parser.add_argument("--rounds", type=int, default=2000)
    demo_parser.add_argument("--megabytes", type=int, default=50)
    add_parsers(commands)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench_main(args, argv)
    if args.command == "serve":
        return serve_main(args)

    backends = BACKENDS if args.backend == "all" else (args.backend,)
    for backend in backends:
        try:
            run(lambda b=backend: demo(args.address, b, args.rounds, args.megabytes), backend)
        except ModuleNotFoundError as exc:
            print(f"skipping {backend}: {exc} (pip install 'anyio-comm[{backend}]')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
