"""A dask cluster across two Linux network namespaces joined by a veth pair, so that
every address dask advertises is a real interface's (as on a cluster of machines),
never ``127.0.0.1``: the scheduler in the first namespace (``198.18.0.1``), two worker
processes in the second (``198.18.0.2``), a client beside the scheduler. The client
puts an array of 4 MiB on one worker and has a task on the other consume it, so the
array goes worker to worker; every address must use the scheme and the workers'
address, and every comm must be anyio-comm's. Over ``anyio+tcp://`` and over
``anyio+tls://`` (trustme certificates for both addresses, encryption required).

Each process runs ``tests/netns_cluster.py`` with the repository's root on its path.
The namespaces hold addresses of the benchmarking range (198.18.0.0/15) only; the
machine's own interfaces and routes are left alone. Making namespaces needs root
(CAP_NET_ADMIN) and iproute2's ``ip``: without them the test is skipped, unless the
environment variable ``CI`` is set, and then it fails. The namespaces, and every
process left in them, are removed afterwards.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("distributed")
pytest.importorskip("numpy")

import trustme

if TYPE_CHECKING:
    from collections.abc import Iterator

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
SCHEDULER_IP = "198.18.0.1"
WORKERS_IP = "198.18.0.2"
#: free in a namespace of its own
SCHEDULER_PORT = 8786
#: the client's run (connect, two workers, the transfer) must end within this
CLIENT_TIMEOUT = 60
#: how long a process gets to stop once its standard input is closed, then once terminated
STOP_TIMEOUT = 10

_names = itertools.count()


@dataclass(frozen=True)
class Namespaces:
    scheduler: str
    workers: str


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)


def _remove_namespace(name: str) -> list[str]:
    """Kill every process in namespace ``name``, then delete it; return what failed."""
    problems = []
    pids = _ip("netns", "pids", name)
    for pid in pids.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
        problems.append(f"process {pid} was still running in {name}")
    deleted = _ip("netns", "delete", name)
    if deleted.returncode:
        problems.append(f"ip netns delete {name}: {deleted.stderr.strip()}")
    return problems


def _cannot(reason: str) -> None:
    """Skip, or fail where the environment variable ``CI`` is set (``1``, ``true``, ...)."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"network namespaces: {reason} (CI must run this test)")
    pytest.skip(f"network namespaces: {reason}")


@pytest.fixture
def namespaces() -> Iterator[Namespaces]:
    """Two namespaces joined by a veth pair: 198.18.0.1/24 in the first and 198.18.0.2/24
    in the second, each with its ``lo`` up; both (and the veth pair) removed afterwards."""
    if not sys.platform.startswith("linux"):
        _cannot(f"not on Linux ({sys.platform})")
    if shutil.which("ip") is None:
        _cannot("no ip command (iproute2)")
    tag = f"anyio-comm-{os.getpid()}-{next(_names)}"
    spaces = Namespaces(scheduler=f"{tag}-a", workers=f"{tag}-b")
    made: list[str] = []
    try:
        a, b = spaces.scheduler, spaces.workers
        steps = [
            f"netns add {a}",
            f"netns add {b}",
            # made inside the first namespace, its peer end moved to the second at once
            f"-n {a} link add veth-a type veth peer name veth-b netns {b}",
            f"-n {a} addr add {SCHEDULER_IP}/24 dev veth-a",
            f"-n {b} addr add {WORKERS_IP}/24 dev veth-b",
            f"-n {a} link set lo up",
            f"-n {a} link set veth-a up",
            f"-n {b} link set lo up",
            f"-n {b} link set veth-b up",
        ]
        for step in steps:
            result = _ip(*step.split())
            if result.returncode:
                _cannot(f"ip {step}: {result.stderr.strip()}")
            if step.startswith("netns add "):
                made.append(step.split()[-1])
        yield spaces
    finally:
        problems = [problem for name in made for problem in _remove_namespace(name)]
        assert not problems, problems


@pytest.fixture(params=["anyio+tcp", "anyio+tls"])
def scheme(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


def _tls_directory(directory: Path) -> Path:
    """``ca.pem`` and ``node.pem`` (a key and its certificate for both addresses and
    ``localhost``), as ``tests/netns_cluster.py`` reads them."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    node = ca.issue_cert(SCHEDULER_IP, WORKERS_IP, "localhost")
    node.private_key_and_cert_chain_pem.write_to_path(str(directory / "node.pem"))
    return directory


def _command(namespace: str, role: str, *args: str) -> list[str]:
    """``python -m tests.netns_cluster ROLE ARGS...`` in ``namespace``."""
    python = [sys.executable, "-m", "tests.netns_cluster", role, *args]
    return ["ip", "netns", "exec", namespace, *python]


def _environment() -> dict[str, str]:
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "PYTHONUNBUFFERED": "1"}


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    """Stop the processes, the last started first (the workers before the scheduler):
    the end of their input (a clean close) within STOP_TIMEOUT for all of them, then
    SIGTERM to those still running and as long again, then SIGKILL."""
    deadline = time.monotonic() + STOP_TIMEOUT
    for process in reversed(processes):
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return f"--- {path.name} ---\n" + "\n".join(text[-lines:])


def test_worker_to_worker_across_namespaces(
    namespaces: Namespaces, scheme: str, tmp_path: Path
) -> None:
    scheduler = f"{scheme}://{SCHEDULER_IP}:{SCHEDULER_PORT}"
    tls = ["--tls", str(_tls_directory(tmp_path))] if scheme == "anyio+tls" else []
    environment = _environment()
    processes: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []

    def start(namespace: str, name: str, *args: str) -> None:
        """Start ``name`` (``scheduler`` or ``worker-N``), its output in ``name.log``."""
        logs.append(tmp_path / f"{name}.log")
        with logs[-1].open("wb") as output:
            processes.append(
                subprocess.Popen(
                    _command(namespace, name.partition("-")[0], scheduler, *args, *tls),
                    cwd=ROOT,
                    env=environment,
                    stdin=subprocess.PIPE,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                )
            )

    failure = None
    try:
        start(namespaces.scheduler, "scheduler")
        for index in range(2):
            directory = tmp_path / f"worker-{index}"
            directory.mkdir()
            start(
                namespaces.workers,
                directory.name,
                "--host",
                WORKERS_IP,
                "--local-directory",
                str(directory),
            )
        logs.append(tmp_path / "client.log")
        with logs[-1].open("wb") as errors:
            client = subprocess.run(
                _command(namespaces.scheduler, "client", scheduler, *tls),
                cwd=ROOT,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=errors,
                timeout=CLIENT_TIMEOUT,
                check=False,
            )
        if client.returncode:
            failure = f"the client failed (exit status {client.returncode})"
    except subprocess.TimeoutExpired:
        failure = f"the client did not finish within {CLIENT_TIMEOUT} s"
    finally:
        _stop(processes)
    if failure is not None:
        pytest.fail("\n".join([failure, *map(_tail, logs)]))

    summary: dict[str, Any] = json.loads(client.stdout.splitlines()[-1])
    comm_class = "anyio_comm.dask." + ("AnyioTLS" if scheme == "anyio+tls" else "AnyioTCP")
    assert summary["scheduler"] == scheduler
    workers = summary["workers"]
    assert len(workers) == 2
    for address in workers:
        assert address.startswith(f"{scheme}://{WORKERS_IP}:")
    assert summary["worker_addresses"] == workers  # as each worker sees itself
    # every comm is anyio-comm's: the client's and each worker's to the scheduler
    assert summary["client_comm"] == comm_class
    assert summary["worker_comms"] == dict.fromkeys(workers, comm_class)
    # the array went from the first worker to the second, whole
    source, target = summary["source"], summary["target"]
    assert source in summary["holders"]
    assert summary["digest_seen"] == summary["digest_sent"]
    assert summary["sum_computed"] == summary["sum_expected"]
    assert summary["gathered_equal"]
    transfers = summary["transfers"]
    assert transfers[source]["sent"] >= 1
    assert [source, summary["nbytes"]] in transfers[target]["fetched"]
