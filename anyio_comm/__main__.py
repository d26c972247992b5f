"""Command line: ``python -m anyio_comm demo|bench|serve`` (also installed as ``anyio-comm``).

* ``demo``: an echo listener and client in one process, with a short report;
* ``bench``: an echo benchmark with client processes against a local or remote server;
* ``serve``: the echo server for ``bench ADDRESS`` (between two hosts).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from . import Comm, __version__, connect, listen
from ._bench import OneLineParser, add_parsers, bench_main, serve_main, whole_number
from ._bench._common import BACKENDS, backend_installed, install_hint, run_backend
from ._build import describe

if TYPE_CHECKING:
    from collections.abc import Sequence


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


DESCRIPTION = """\
Fast, structured-concurrency message transport on asyncio, uvloop and trio.

  demo   an echo listener and client in one process, with a short report
  bench  an echo benchmark: client processes against a local or remote server
  serve  the echo server for 'anyio-comm bench ADDRESS', between two hosts

'anyio-comm COMMAND --help' describes each command's options."""


def missing_backends() -> list[str]:
    """The optional backends whose package is not installed."""
    return [b for b in BACKENDS if not backend_installed(b)]


def parser() -> argparse.ArgumentParser:
    """The parser of ``anyio-comm`` and its commands."""
    top = OneLineParser(
        prog="anyio-comm",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument(
        "--version", action="version", version=f"anyio-comm {__version__} ({describe()})"
    )
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo_parser = commands.add_parser(
        "demo",
        help="run an echo server and client, report",
        description="Run an echo listener and a client in one process on each backend "
        "and report what travelled: a message, 1 KB round trips, a large out-of-band "
        "payload. Backends that are not installed are skipped.",
    )
    add = demo_parser.add_argument
    add(
        "--backend",
        choices=(*BACKENDS, "all"),
        default="all",
        help="event loop to run on (default: all, those installed)",
    )
    add("--address", default="tcp://127.0.0.1:0", help="listen address (tcp://127.0.0.1:0)")
    add("--rounds", type=whole_number(10**7), default=2000, help="1 KB round trips (2000)")
    add("--megabytes", type=whole_number(4096), default=50, help="out-of-band payload size (50)")
    add_parsers(commands)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m anyio_comm``."""
    args = parser().parse_args(argv)
    if args.command == "bench":
        return bench_main(args, argv)
    if args.command == "serve":
        return serve_main(args)

    missing = missing_backends()
    if args.backend in missing:
        print(
            f"anyio-comm demo: error: --backend {args.backend} needs the {args.backend} "
            f"package: {install_hint(args.backend)}",
            file=sys.stderr,
        )
        return 2
    if args.backend == "all":
        backends = tuple(b for b in BACKENDS if b not in missing)
        if missing:
            print(
                f"anyio-comm demo: skipping {' and '.join(missing)} (not installed; "
                f"{install_hint(*missing)})",
                flush=True,
            )
    else:
        backends = (args.backend,)
    for backend in backends:
        run_backend(backend, demo, args.address, backend, args.rounds, args.megabytes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
