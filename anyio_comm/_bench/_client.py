"""A bench client process: C comms doing request/reply round trips in a shared window."""

from __future__ import annotations

import contextlib
import random
import time
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from .. import connect
from ._common import HELLO_KEY, PROTOCOL, run_backend

if TYPE_CHECKING:
    import ctypes
    from collections.abc import Sequence
    from multiprocessing.connection import Connection

    from .. import Comm
    from ._tls import ClientTLS

MAX_SAMPLES = 1_000_000  # latency samples kept per process (reservoir sampling beyond)
CHECK_EVERY = 256  # round trips between full checks of the reply's frames
MAX_REQUESTS = 100_000_000  # per comm: a bound on the loop besides the window's end
PUBLISH_EVERY = 0.25  # seconds between updates of the live count the parent shows


@dataclass(frozen=True)
class ClientSpec:
    """Everything a client process needs (picklable)."""

    index: int
    address: str
    backend: str
    concurrency: int
    frames: int
    size: int
    raw: bool
    tls: ClientTLS | None
    connect_timeout: float
    control: bool  # this process also takes the server's stats at the window's edges
    budget: float  # seconds this process may live


@dataclass
class Window:
    """The measurement window, in this process's ``perf_counter`` time."""

    start: float
    end: float
    count: int = 0
    max_latency: float = 0.0
    samples: array[float] = field(default_factory=lambda: array("d"))
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def record(self, latency: float) -> None:
        """Count one round trip; keep its latency (a uniform sample beyond MAX_SAMPLES)."""
        self.count += 1
        self.max_latency = max(self.max_latency, latency)
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(latency)
        else:
            slot = self.rng.randrange(self.count)
            if slot < MAX_SAMPLES:
                self.samples[slot] = latency


async def open_comm(
    address: str, tls: ClientTLS | None, timeout: float, role: str, raw: bool = False
) -> tuple[Comm, dict[str, Any]]:
    """Connect, say hello with ``role``, return the comm and the server's description."""
    kwargs: dict[str, Any] = {}
    if tls is not None:
        kwargs["ssl_context"] = tls.context()
        kwargs["server_hostname"] = tls.server_hostname
    comm = await connect(address, timeout=timeout, **kwargs)
    try:
        with anyio.fail_after(timeout):
            await comm.send({HELLO_KEY: PROTOCOL, "role": role, "raw": raw})
            info = await comm.receive()
        if not isinstance(info, dict) or info.get(HELLO_KEY) != PROTOCOL:
            raise RuntimeError(f"{address} is not an anyio-comm bench server")
    except BaseException:
        await comm.aclose()
        raise
    return comm, info


def _check(spec: ClientSpec, frames: Sequence[Any]) -> None:
    if len(frames) != spec.frames or any(len(memoryview(f)) != spec.size for f in frames):
        sizes = [len(memoryview(f)) for f in frames]
        raise RuntimeError(f"the echo came back with frames of {sizes} bytes")


async def round_trips(comm: Comm, spec: ClientSpec, window: Window) -> None:
    """Round trips until the window ends; record those that complete inside it."""
    payload = [bytes(range(256)) * (spec.size // 256) + bytes(spec.size % 256)] * spec.frames
    perf_counter = time.perf_counter
    for i in range(MAX_REQUESTS):
        t0 = perf_counter()
        if spec.raw:
            await comm.send_frames(payload)
            frames: Sequence[Any] = await comm.receive_frames()
        else:
            await comm.send({"i": i, "data": payload})
            reply = await comm.receive()
            if reply["i"] != i:
                raise RuntimeError(f"reply {reply['i']} to request {i}")
            frames = reply["data"]
        t1 = perf_counter()
        if i % CHECK_EVERY == 0:
            _check(spec, frames)
        if t1 >= window.end:
            return
        if t1 >= window.start:
            window.record(t1 - t0)


async def _sleep_until(when: float) -> None:
    await anyio.sleep(max(0.0, when - time.perf_counter()))


async def _publish_until_end(
    window: Window, live: ctypes.Array[ctypes.c_double], index: int
) -> None:
    """Sleep until the window ends; meanwhile, every PUBLISH_EVERY seconds, put the round
    trips counted so far and the seconds of window they took in ``live[2 * index]`` and
    ``live[2 * index + 1]``, memory shared with the parent, which shows the progress from
    them. The round-trip loop itself does nothing more than count."""
    while True:
        now = time.perf_counter()
        live[2 * index] = window.count
        live[2 * index + 1] = min(now, window.end) - window.start
        if now >= window.end:
            return
        await anyio.sleep(min(PUBLISH_EVERY, window.end - now))


async def _server_stats(control: Comm) -> dict[str, Any]:
    await control.send({"op": "stats"})
    stats: dict[str, Any] = await control.receive()
    return stats


async def client(
    conn: Connection, spec: ClientSpec, live: ctypes.Array[ctypes.c_double]
) -> dict[str, Any]:
    """Connect, report ready, wait for the start time, run the load (publishing its count
    in ``live`` as it goes), return the counts."""
    with anyio.fail_after(spec.budget):
        async with contextlib.AsyncExitStack() as stack:
            comms = []
            for _ in range(spec.concurrency):
                comm, info = await open_comm(
                    spec.address, spec.tls, spec.connect_timeout, "echo", spec.raw
                )
                stack.push_async_callback(comm.aclose)
                comms.append(comm)
            control = None
            if spec.control:
                control, _ = await open_comm(
                    spec.address, spec.tls, spec.connect_timeout, "control"
                )
                stack.push_async_callback(control.aclose)
            conn.send(("ready", info))
            while not await anyio.to_thread.run_sync(conn.poll, 0.2, abandon_on_cancel=True):
                pass
            _, start_wall, seconds = conn.recv()
            start = time.perf_counter() + (start_wall - time.time())
            window = Window(start, start + seconds)
            marks: list[dict[str, Any]] = []
            async with anyio.create_task_group() as tg:
                for comm in comms:
                    tg.start_soon(round_trips, comm, spec, window)
                await _sleep_until(window.start)
                cpu0 = time.process_time()
                if control is not None:
                    marks.append(await _server_stats(control))
                await _publish_until_end(window, live, spec.index)
                cpu1 = time.process_time()
                if control is not None:
                    marks.append(await _server_stats(control))
    return {
        "index": spec.index,
        "requests": window.count,
        "cpu_s": cpu1 - cpu0,
        "max_latency_s": window.max_latency,
        "samples": window.samples,
        "server_marks": marks,
    }


def client_process(
    conn: Connection, spec: ClientSpec, live: ctypes.Array[ctypes.c_double]
) -> dict[str, Any]:
    """Entry point of a client process (a :class:`~._processes.Child`): sends ``("ready",
    server_info)``, waits for ``("start", wall_time, seconds)``, then returns the counts;
    during the window it keeps its count so far in ``live`` (see :func:`_publish_until_end`)."""
    return run_backend(spec.backend, client, conn, spec, live)
