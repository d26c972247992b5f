"""dask.distributed on anyio-comm: dask's own ``tcp://`` / ``tls://`` against
``anyio+tcp://`` / ``anyio+tls://``, the same workloads on one cluster per scheme,
interleaved.

    python -m benchmarks.dask_cluster                           # all four schemes, 3 repeats
    python -m benchmarks.dask_cluster --schemes tcp,anyio+tcp --repeat 5 --json dask.json
    python -m benchmarks.dask_cluster --workloads tiny --tiny-tasks 2000 --repeat 1

Each scheme gets a ``LocalCluster`` of two worker processes (one thread each, no
memory limit, no dashboard, ``host="127.0.0.1"``); the TLS schemes share one
``Security.temporary()``. Every cluster is started first; then, workload by
workload, each repeat runs on each cluster in turn (the order of the schemes
alternates between repeats), so slow drifts of the machine hit every scheme alike.
A workload's repeats follow each other, as a steady stream of such work would: the
first repeat of each workload finds the memory its predecessor left (for the
transfer, the first of all, anyio-comm's buffer pool holds nothing yet, so it
measures fresh memory), the others the memory the repeat before left (reused by
anyio-comm's pool, which keeps freed frame memory for
``anyio-comm.buffer-pool.free-for``, 30 s). ``--no-pool``
(``anyio-comm.buffer-pool.max-free: 0``) makes anyio-comm receive every frame into
fresh memory, as ``tcp://`` does.

Workloads:

* ``transfer``: worker B computes on ``--transfer-arrays`` arrays (of
  ``--transfer-mb`` MB in all) that worker A holds, so they travel worker to worker
  (each in a message of its own: dask's ``transfer.message-bytes-limit`` is below
  their size); the figure is the bytes moved per second, from the submit to the
  result. The arrays are made on A (not timed) and released after each repeat.
* ``array``: ``(x + x.T).sum()`` of ``da.random.random((--array-n, --array-n),
  chunks=--array-chunk)``, its chunks generated on both workers, so the transposed
  chunks travel between them; seconds per computation.
* ``tiny``: ``client.map`` of ``--tiny-tasks`` tasks that add two ints, then
  ``gather``: the scheduler's message rate; tasks per second.
* ``rpc``: ``--rpc-calls`` requests for worker B's ``identity`` from this process, one
  after the other over one of dask's comms (``distributed.core.rpc``): the round trip
  of a small message through dask's serialization and the comm; round trips per second.

Pinning (``--no-pin`` turns it off): this process (the client and the scheduler) and
worker A on the first CPU, worker B on the second; every thread of each process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import sys
import time
from typing import Any

from anyio_comm.bench import versions, whole_number, write_json

from ._harness import argument_parser, csv_list, start_run

SCHEMES = ("tcp", "anyio+tcp", "tls", "anyio+tls")
WORKLOADS = ("transfer", "array", "tiny", "rpc")
#: each anyio-comm scheme against dask's own
BASELINE = {"anyio+tcp": "tcp", "anyio+tls": "tls"}


def pin_process(cpu: int) -> None:
    """Pin every thread of the calling process (and the threads they start) to ``cpu``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # (a thread that just ended)
            pass


def make_array(seed: int, nbytes: int) -> Any:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 255, nbytes, dtype="u1")


def total_nbytes(*arrays: Any) -> int:
    return sum(a.nbytes for a in arrays)


def add(a: int, b: int) -> int:
    return a + b


def worker_pool_statistics() -> Any:
    from anyio_comm.dask import buffer_pool

    return buffer_pool().statistics()


async def identity_calls(address: str, calls: int, connection_args: dict[str, Any]) -> float:
    """Round trips per second of ``calls`` ``identity`` requests to ``address``."""
    from distributed.core import rpc

    async with rpc(address, connection_args=connection_args) as remote:
        await remote.identity()  # (connects)
        started = time.perf_counter()
        for _ in range(calls):
            await remote.identity()
        return calls / (time.perf_counter() - started)


class Cluster:
    """A LocalCluster on one scheme, its client, and its two workers (A, B)."""

    def __init__(self, scheme: str, security: Any, cpus: tuple[int, int] | None) -> None:
        from distributed import Client, LocalCluster

        self.scheme = scheme
        tls = scheme.endswith("tls")
        self.cluster = LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            protocol=scheme,
            host="127.0.0.1",
            dashboard_address=None,
            security=security if tls else None,
            memory_limit=0,
            silence_logs=logging.ERROR,
        )
        self.client = Client(self.cluster, security=security if tls else None)
        self.connection_args = security.get_connection_args("client") if tls else {}
        self.client.wait_for_workers(2, timeout=60)
        self.a, self.b = sorted(self.client.run(os.getpid))  # scheduler_info() races its refresh
        if cpus is not None:
            self.client.run(pin_process, cpus[0], workers=[self.a])
            self.client.run(pin_process, cpus[1], workers=[self.b])

    def pool_statistics(self) -> dict[str, Any]:
        """Each worker's anyio-comm buffer pool statistics (anyio-comm schemes)."""
        if not self.scheme.startswith("anyio"):
            return {}
        return {
            name: dataclasses.asdict(stats)
            for name, stats in self.client.run(worker_pool_statistics).items()
        }

    def close(self) -> None:
        self.client.close()
        self.cluster.close()

    def transfer(self, total_mb: int, arrays: int, seed: int) -> float:
        """Bytes per second moved from worker A to worker B."""
        from distributed import wait

        client = self.client
        each = total_mb * 1_000_000 // arrays
        held = [
            client.submit(make_array, seed + i, each, workers=[self.a], pure=False)
            for i in range(arrays)
        ]
        wait(held, timeout=120)
        started = time.perf_counter()
        result = client.submit(total_nbytes, *held, workers=[self.b], pure=False)
        moved = result.result(timeout=300)
        elapsed = time.perf_counter() - started
        assert moved == each * arrays, moved
        del held, result
        return moved / elapsed

    def array(self, n: int, chunk: int, seed: int) -> float:
        """Seconds for (x + x.T).sum()."""
        import dask.array as da

        x = da.random.default_rng(seed).random((n, n), chunks=(chunk, chunk))
        started = time.perf_counter()
        total = self.client.compute((x + x.T).sum(), sync=True)
        elapsed = time.perf_counter() - started
        assert 0.9 * n * n < total < 1.1 * n * n, total  # the mean of x + x.T is 1
        return elapsed

    def rpc(self, calls: int) -> float:
        """Round trips per second of small requests (worker B's ``identity``) from
        this process over one of dask's comms."""
        return float(self.client.sync(identity_calls, self.b, calls, self.connection_args))

    def tiny(self, tasks: int) -> float:
        """Tasks per second."""
        client = self.client
        started = time.perf_counter()
        futures = client.map(add, range(tasks), range(tasks), pure=False)
        results = client.gather(futures)
        elapsed = time.perf_counter() - started
        assert results[-1] == 2 * (tasks - 1)
        del futures
        return tasks / elapsed


def number(value: float) -> str:
    """Three significant digits, without an exponent."""
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def summary(values: list[float]) -> str:
    if len(values) == 1:
        return number(values[0])
    return f"{number(statistics.median(values))} ({number(min(values))}-{number(max(values))})"


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser("dask_cluster", __doc__)
    add = parser.add_argument
    add("--schemes", type=csv_list(SCHEMES), default=list(SCHEMES), help="default: all four")
    add("--workloads", type=csv_list(WORKLOADS), default=list(WORKLOADS), help="default: all")
    add("--repeat", type=whole_number(), default=3, help="repeats of every workload (default 3)")
    add("--transfer-mb", type=whole_number(), default=1000, help="MB moved per transfer (1000)")
    add("--transfer-arrays", type=whole_number(), default=4, help="arrays they are in (4)")
    add("--array-n", type=whole_number(), default=20000, help="x is n x n (20000)")
    add("--array-chunk", type=whole_number(), default=2000, help="chunks of chunk x chunk (2000)")
    add("--tiny-tasks", type=whole_number(), default=10000, help="tiny tasks (10000)")
    add("--rpc-calls", type=whole_number(), default=5000, help="rpc round trips (5000)")
    add("--no-pin", action="store_true", help="do not pin the processes to CPUs")
    add("--no-pool", action="store_true", help="anyio-comm: no buffer pool (fresh memory)")
    add("--json", metavar="PATH", help="also write the results and metadata as JSON")
    args = parser.parse_args(argv)

    import dask
    from distributed import Security

    run = start_run(
        "dask_cluster",
        "dask cluster benchmark",
        argv,
        args.no_pin,
        versions=versions("anyio-comm", "anyio", "distributed", "numpy"),
        roles=("scheduler, client and worker A", "worker B"),
    )
    cpus = None if None in run.cpus else (run.cpus[0], run.cpus[1])
    if cpus is not None:
        pin_process(cpus[0])
    # one message per array in the transfer (the default limit is 50 MB)
    dask.config.set({"distributed.worker.transfer.message-bytes-limit": "1MB"})
    if args.no_pool:
        dask.config.set({"anyio-comm.buffer-pool.max-free": 0})
    security = Security.temporary() if any(s.endswith("tls") for s in args.schemes) else None
    clusters: dict[str, Cluster] = {}
    results: dict[str, dict[str, list[float]]] = {w: {} for w in args.workloads}
    pools: dict[str, dict[str, Any]] = {}
    try:
        for scheme in args.schemes:
            print(f"starting a cluster on {scheme}://", file=sys.stderr)
            clusters[scheme] = Cluster(scheme, security, cpus)
        for workload in args.workloads:
            for repeat in range(args.repeat):
                order = args.schemes if repeat % 2 == 0 else args.schemes[::-1]
                for scheme in order:
                    cluster = clusters[scheme]
                    if workload == "transfer":
                        value = cluster.transfer(
                            args.transfer_mb, args.transfer_arrays, seed=repeat * 100
                        )
                    elif workload == "array":
                        value = cluster.array(args.array_n, args.array_chunk, seed=repeat)
                    elif workload == "tiny":
                        value = cluster.tiny(args.tiny_tasks)
                    else:
                        value = cluster.rpc(args.rpc_calls)
                    results[workload].setdefault(scheme, []).append(value)
                    print(f"repeat {repeat + 1} {workload} {scheme}: {value:.4g}", file=sys.stderr)
        for scheme, cluster in clusters.items():
            pools[scheme] = cluster.pool_statistics()
            for worker, stats in pools[scheme].items():
                print(f"{scheme} {worker} buffer pool: {stats}", file=sys.stderr)
    finally:
        for cluster in clusters.values():
            cluster.close()

    units = {"transfer": "GB/s", "array": "s", "tiny": "tasks/s", "rpc": "round trips/s"}
    scale = {"transfer": 1e-9, "array": 1.0, "tiny": 1.0, "rpc": 1.0}
    higher_is_better = {"transfer": True, "array": False, "tiny": True, "rpc": True}
    print()
    print("| workload | scheme | median (min-max) | vs dask's own: median (min-max) |")
    print("|---|---|---|---|")
    ratios: dict[str, dict[str, list[float]]] = {}
    for workload, per_scheme in results.items():
        for scheme, values in per_scheme.items():
            shown = [v * scale[workload] for v in values]
            ratio_text = ""
            baseline = per_scheme.get(BASELINE.get(scheme, ""))
            if baseline:
                # paired by repeat, as "better" (above 1: anyio-comm is ahead)
                paired = [
                    v / b if higher_is_better[workload] else b / v
                    for v, b in zip(values, baseline, strict=True)
                ]
                ratios.setdefault(workload, {})[scheme] = paired
                ratio_text = summary(paired) + "x"
            print(
                f"| {workload} ({units[workload]}) | {scheme}:// | {summary(shown)} | "
                f"{ratio_text} |"
            )
    print(
        "\n(ratios: anyio-comm's figure over dask's own, per repeat; for `array`, "
        "dask's seconds over anyio-comm's: above 1, anyio-comm is ahead)"
    )
    if args.json:
        write_json(
            args.json,
            {
                "metadata": run.metadata(args),
                "results": results,
                "ratios": ratios,
                "buffer_pools": pools,
                "units": units,
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
