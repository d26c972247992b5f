"""The processes of the dask cluster of ``tests/test_dask_netns.py``, one role per run::

    python -m tests.netns_cluster scheduler anyio+tcp://198.18.0.1:8786 [--tls DIR]
    python -m tests.netns_cluster worker anyio+tcp://198.18.0.1:8786 --host 198.18.0.2 \\
        --local-directory DIR [--tls DIR]
    python -m tests.netns_cluster client anyio+tcp://198.18.0.1:8786 [--tls DIR]

Run from the repository's root (the test runs each inside a network namespace with
``ip netns exec``). The scheduler and a worker run until their standard input ends
(the test closes it, or exits) or until SIGTERM / SIGINT; a worker also stops when
its scheduler goes away. The client waits for two workers, moves an array from one
worker to the other and prints what it saw as one line of JSON on standard output.

``--tls DIR``: ``DIR/ca.pem`` (the CA) and ``DIR/node.pem`` (a key and its
certificate, for every role), through dask's ``Security`` with encryption required.

Installed, the package declares the ``anyio+tcp`` / ``anyio+tls`` backends as entry
points and dask finds them there; from a source tree that is not installed nothing
declares them, so each role registers them first.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import sys
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import dask
import numpy as np
from distributed import Client, Scheduler, Security, Worker
from distributed.comm import parse_address
from distributed.comm.addressing import parse_host_port
from distributed.comm.registry import backends

if TYPE_CHECKING:
    from collections.abc import Sequence

    from distributed.core import Server

#: every connection attempt (and handshake) gives up after this long
CONNECT_TIMEOUT = "20s"
#: the client's bound on each wait: connecting, two workers to arrive, a result
WAIT = 30
#: the array the client moves: 4 MiB of int64
ARRAY_LENGTH = 2**19


def register_backends() -> None:
    """Register the anyio-comm backends with dask unless installed entry points declare them."""
    from anyio_comm.dask import AnyioTCPBackend, AnyioTLSBackend

    declared = {point.name for point in entry_points(group="distributed.comm.backends")}
    for scheme, backend in (("anyio+tcp", AnyioTCPBackend), ("anyio+tls", AnyioTLSBackend)):
        if scheme not in declared:
            backends[scheme] = backend()


def security(tls: str | None) -> Security | None:
    if tls is None:
        return None
    ca, node = os.path.join(tls, "ca.pem"), os.path.join(tls, "node.pem")
    return Security(  # type: ignore[no-untyped-call]
        tls_ca_file=ca,
        tls_client_cert=node,
        tls_scheduler_cert=node,
        tls_worker_cert=node,
        require_encryption=True,
    )


async def _until_stopped(server: Server) -> None:
    """Wait for the end of standard input, SIGTERM / SIGINT, or ``server`` to close."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    stdin = sys.stdin.fileno()

    def read_input() -> None:
        if not os.read(stdin, 4096):
            loop.remove_reader(stdin)
            stop.set()

    try:
        loop.add_reader(stdin, read_input)
    except PermissionError:  # not a pipe (/dev/null): signals only
        pass
    waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(server.finished())}
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()


async def run_scheduler(address: str, tls: str | None) -> None:
    scheme, location = parse_address(address)
    host, port = parse_host_port(location)
    async with Scheduler(
        host=host,
        port=port,
        protocol=scheme,
        dashboard=False,
        dashboard_address=None,
        security=security(tls),
    ) as scheduler:
        print(json.dumps({"scheduler": scheduler.address}), flush=True)
        await _until_stopped(scheduler)


async def run_worker(scheduler: str, host: str, local_directory: str, tls: str | None) -> None:
    async with Worker(
        scheduler,
        host=host,
        protocol=parse_address(scheduler)[0],
        nthreads=1,
        memory_limit="1GiB",
        local_directory=local_directory,
        death_timeout=CONNECT_TIMEOUT,
        dashboard=False,
        security=security(tls),
    ) as worker:
        print(json.dumps({"worker": worker.address}), flush=True)
        await _until_stopped(worker)


def digest(array: np.ndarray[Any, Any]) -> str:
    """The SHA-256 of an array's bytes (run by a worker on the array it received)."""
    return hashlib.sha256(array.tobytes()).hexdigest()


def comm_class(comm: object) -> str:
    """The module and name of a comm's class (``anyio_comm.dask.AnyioTCP``)."""
    return f"{type(comm).__module__}.{type(comm).__qualname__}"


def _worker_comm(dask_worker: Worker) -> str:
    """The class of the worker's comm to the scheduler."""
    return comm_class(dask_worker.batched_stream.comm)


def _transfers(dask_worker: Worker) -> dict[str, Any]:
    """How many times the worker sent data to another, and what it fetched from whom."""
    return {
        "sent": dask_worker.transfer_outgoing_count_total,
        "fetched": [[entry["who"], entry["total"]] for entry in dask_worker.transfer_incoming_log],
    }


def run_client(scheduler: str, tls: str | None) -> dict[str, Any]:
    """Put an array on one worker, have a task on the other consume it (the second
    worker fetches it from the first), and report what the cluster looks like."""
    with Client(scheduler, security=security(tls), timeout=WAIT) as client:
        client.wait_for_workers(2, timeout=WAIT)
        workers = sorted(client.run(os.getpid))  # not scheduler_info(): its refresh races
        source, target = workers
        data = np.random.default_rng(0).integers(0, 2**40, ARRAY_LENGTH, dtype=np.int64)
        (array,) = client.scatter([data], workers=[source])
        seen = client.submit(digest, array, workers=[target], pure=False)
        total = client.submit(np.sum, array, workers=[target], pure=False)
        summary = {
            "scheduler": client.scheduler.address,
            "workers": workers,
            "worker_addresses": sorted(
                client.run(lambda dask_worker: dask_worker.address).values()
            ),
            "client_comm": comm_class(client.scheduler_comm.comm),
            "worker_comms": client.run(_worker_comm),
            "holders": sorted(client.who_has(array)[array.key]),
            "digest_sent": digest(data),
            "digest_seen": seen.result(timeout=WAIT),
            "nbytes": data.nbytes,
            "sum_expected": int(data.sum()),
            "sum_computed": int(total.result(timeout=WAIT)),
            "gathered_equal": bool(np.array_equal(array.result(timeout=WAIT), data)),
            "transfers": client.run(_transfers),
            "source": source,
            "target": target,
        }
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.netns_cluster")
    parser.add_argument("role", choices=["scheduler", "worker", "client"])
    parser.add_argument("scheduler", help="the scheduler's address")
    parser.add_argument("--host", help="a worker's address to listen on and advertise")
    parser.add_argument("--local-directory", help="a worker's scratch directory")
    parser.add_argument("--tls", help="a directory with ca.pem and node.pem")
    args = parser.parse_args(argv)
    register_backends()
    with dask.config.set({"distributed.comm.timeouts.connect": CONNECT_TIMEOUT}):
        if args.role == "scheduler":
            asyncio.run(run_scheduler(args.scheduler, args.tls))
        elif args.role == "worker":
            if args.host is None or args.local_directory is None:
                parser.error("a worker needs --host and --local-directory")
            asyncio.run(run_worker(args.scheduler, args.host, args.local_directory, args.tls))
        else:
            print(json.dumps(run_client(args.scheduler, args.tls)), flush=True)


if __name__ == "__main__":
    main()
