"""A real dask cluster on anyio-comm: a scheduler and two Nanny-spawned worker
processes, which find the ``anyio+tcp`` / ``anyio+tls`` backends through their entry
points alone. Loopback only (``host="127.0.0.1"``), no dashboard.
"""

from __future__ import annotations

import operator
import os
import time
from typing import TYPE_CHECKING

import pytest

pytest.importorskip("distributed")
np = pytest.importorskip("numpy")

import dask  # noqa: E402
import dask.array as da  # noqa: E402
from distributed import Client, LocalCluster, Security  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module", params=["anyio+tcp", "anyio+tls"])
def client(request: pytest.FixtureRequest) -> Iterator[Client]:
    scheme = request.param
    security = Security.temporary() if scheme == "anyio+tls" else None
    with (
        dask.config.set({"distributed.comm.timeouts.connect": "30s"}),
        LocalCluster(
            n_workers=2,
            threads_per_worker=1,
            processes=True,
            protocol=scheme,
            host="127.0.0.1",
            dashboard_address=None,
            security=security,
            memory_limit="2GiB",
        ) as cluster,
        Client(cluster, security=security) as client,
    ):
        yield client


def _worker_addresses(client: Client) -> list[str]:
    """The workers' addresses, asked of the workers themselves.

    (``client.scheduler_info()`` can return the client's periodic refresh, which
    carries no workers, when that refresh lands during the call.)
    """
    return sorted(client.run(os.getpid))


def test_every_address_uses_the_scheme(client: Client) -> None:
    scheme = client.scheduler.address.partition("://")[0]
    assert scheme in ("anyio+tcp", "anyio+tls")
    workers = _worker_addresses(client)
    assert len(workers) == 2
    for address in workers:
        assert address.startswith(f"{scheme}://127.0.0.1:")
    # each worker process runs on the backend too (its own comms to the scheduler)
    comms = client.run(
        lambda dask_worker: type(dask_worker.batched_stream.comm).__module__  # type: ignore[attr-defined]
    )
    assert set(comms.values()) == {"anyio_comm.dask"}


def test_array_computation_moves_data_between_workers(client: Client) -> None:
    array = da.random.default_rng(0).random((4000, 4000), chunks=(500, 500))
    total, plain = client.compute([(array + array.T).sum(), array.sum()], sync=True)
    assert np.isclose(total, 2 * plain)  # (x + x.T).sum() is twice x.sum()
    # data moved worker to worker (a chunk of x.T and its chunk of x are on either)
    moved = client.run(lambda dask_worker: dask_worker.transfer_outgoing_count_total)
    assert sum(moved.values()) > 0
    assert client.compute(array[:3, :3], sync=True).shape == (3, 3)


def test_many_tiny_tasks(client: Client) -> None:
    futures = client.map(operator.add, range(2000), range(2000))
    total = client.submit(sum, futures)
    assert total.result(timeout=120) == 2 * sum(range(2000))
    assert client.gather(futures[:5]) == [0, 2, 4, 6, 8]


def _pool_statistics() -> object:
    from anyio_comm.dask import buffer_pool

    return buffer_pool().statistics()


def _held_keys(dask_worker: object) -> int:
    return len(dask_worker.data)  # type: ignore[attr-defined]


def test_large_frames_reuse_memory_in_the_workers(client: Client) -> None:
    """An array sent to the same worker again and again lands in the memory of the
    one before (which that worker released), in the worker process's buffer pool."""
    a, b = _worker_addresses(client)
    for seed in range(4):
        x = client.submit(np.full, 2**20, seed, dtype="f8", workers=[a], pure=False)  # 8 MiB
        y = client.submit(np.sum, x, workers=[b], pure=False)
        assert y.result(timeout=60) == seed * 2**20
        del x, y
        deadline = time.monotonic() + 30
        while client.run(_held_keys, workers=[b])[b]:
            assert time.monotonic() < deadline, "worker B kept the array"
            time.sleep(0.05)
    stats = client.run(_pool_statistics, workers=[b])[b]
    assert stats.reused >= 3  # type: ignore[attr-defined]
