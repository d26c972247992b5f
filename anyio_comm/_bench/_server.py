"""The bench echo server: ``anyio-comm serve`` and the server process of a local run.

Every connection starts with a hello message ``{"anyio-comm-bench": 1, "role": ...}``
naming its role, answered with the server's description:

* ``"echo"``: every later message (or, with ``"raw": true``, every list of frames) is
  sent back unchanged and counted;
* ``"control"``: each ``{"op": "stats"}`` is answered with the process CPU time, the
  CPU time of the event-loop thread and the number of messages echoed so far, so a
  client can compute the server's CPU time per request over its own window.

The role is fixed by the first message only, so payloads can never collide with
control requests.
"""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

import anyio

from .. import __version__, listen
from ._common import HELLO_KEY, HELLO_TIMEOUT, PROTOCOL, run_backend
from ._processes import pin

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from multiprocessing.connection import Connection

    from .. import Comm, CommStatistics, ListenerStatistics
    from ._tls import ServerTLS


class GilHolder:
    """A thread that holds the GIL in a busy pure-Python loop until stopped.

    The event loop then has to win the GIL back from it (every switch interval, 5 ms by
    default) whenever it wakes up: that is the GIL convoy effect ``--gil-hold`` measures.
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, name="gil-hold", daemon=True)
        self.loops = 0

    def _spin(self) -> None:
        stopped = self._stop.is_set
        while not stopped():
            sum(range(1000))
            self.loops += 1

    def start(self) -> None:
        """Start spinning."""
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and join the thread (it ends within one iteration)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)


@contextlib.contextmanager
def gil_held(enabled: bool) -> Iterator[GilHolder | None]:
    """Run a :class:`GilHolder` for the duration of the block when ``enabled``."""
    if not enabled:
        yield None
        return
    holder = GilHolder()
    holder.start()
    try:
        yield holder
    finally:
        holder.stop()


class Traffic:
    """What comms moved, summed from their statistics."""

    __slots__ = ("bytes_in", "bytes_out", "messages_in", "messages_out", "wait_seconds", "waits")

    def __init__(self) -> None:
        self.messages_in = self.messages_out = self.bytes_in = self.bytes_out = 0
        self.waits = 0
        self.wait_seconds = 0.0

    def add(self, stats: CommStatistics) -> None:
        """Add one comm's figures."""
        self.messages_in += stats.messages_received
        self.messages_out += stats.messages_sent
        self.bytes_in += stats.bytes_received
        self.bytes_out += stats.bytes_sent
        self.waits += stats.send_waits
        self.wait_seconds += stats.send_wait_seconds


def _bytes(n: int) -> str:
    """``1234567`` -> ``1.2 MB``."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def statistics_line(listener: ListenerStatistics, traffic: Traffic) -> str:
    """One line of a listener's statistics and of its connections' traffic."""
    parts = [
        (
            f"connections {listener.active} open, {listener.accepted} accepted,"
            f" {listener.handshaking} handshaking"
        ),
        f"messages {traffic.messages_in} in, {traffic.messages_out} out",
        f"bytes {_bytes(traffic.bytes_in)} in, {_bytes(traffic.bytes_out)} out",
        f"send waits {traffic.waits} ({traffic.wait_seconds:.2f} s)",
    ]
    budget = listener.budget
    if budget is not None:
        parts.append(
            f"budget {_bytes(budget.in_use)} in use, {budget.waiting} waiting,"
            f" {budget.waits} waits, {budget.stalls_closed} stalls closed"
        )
    for name, counts in (
        ("refused", listener.refused),
        ("failed handshakes", listener.handshake_failures),
    ):
        if counts:
            parts.append(name + " " + ", ".join(f"{n} {why}" for why, n in sorted(counts.items())))
    return "stats: " + "; ".join(parts)


class EchoServer:
    """The connection handler and its counters."""

    def __init__(self, backend: str, gil_hold: bool) -> None:
        self.served = 0
        #: the comms being served, and the traffic of those that ended
        self.comms: set[Comm] = set()
        self.ended = Traffic()
        self.info = {
            HELLO_KEY: PROTOCOL,
            "backend": backend,
            "gil_hold": gil_hold,
            "pid": os.getpid(),
            "version": __version__,
            "python": platform.python_version(),
            "host": platform.node(),
        }

    def stats(self) -> dict[str, Any]:
        """CPU times and messages echoed so far (taken on the event-loop thread)."""
        return {
            "cpu": time.process_time(),
            "loop_cpu": time.thread_time(),
            "served": self.served,
            "time": time.time(),
        }

    def traffic(self) -> Traffic:
        """The traffic of every comm served, ended or not."""
        traffic = Traffic()
        for name in Traffic.__slots__:
            setattr(traffic, name, getattr(self.ended, name))
        for comm in self.comms:
            traffic.add(comm.statistics())
        return traffic

    async def handle(self, comm: Comm) -> None:
        """Serve one connection, its traffic counted."""
        self.comms.add(comm)
        try:
            await self._serve(comm)
        finally:
            self.comms.discard(comm)
            self.ended.add(comm.statistics())

    async def _serve(self, comm: Comm) -> None:
        """Read the hello, then echo or answer control requests until the peer closes."""
        with anyio.move_on_after(HELLO_TIMEOUT):
            hello = await comm.receive()
        if not isinstance(hello, dict) or hello.get(HELLO_KEY) != PROTOCOL:
            return  # not a bench client (or another protocol version): drop it
        role = hello.get("role")
        await comm.send(self.info)
        if role == "control":
            async for request in comm:
                if request != {"op": "stats"}:
                    return
                await comm.send(self.stats())
        elif role == "echo" and hello.get("raw"):
            while True:
                try:
                    frames = await comm.receive_frames()
                except anyio.EndOfStream:
                    return
                await comm.send_frames(frames)
                self.served += 1
        elif role == "echo":
            async for message in comm:
                await comm.send(message)
                self.served += 1


async def run_server(
    address: str,
    backend: str,
    tls: ServerTLS | None,
    gil_hold: bool,
    grace: float,
    lifetime: float | None,
    on_ready: Callable[[str], None],
    stop_signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM),
    stats_every: float | None = None,
) -> None:
    """Serve ``address`` until one of ``stop_signals`` (or ``lifetime`` seconds), then shut
    down gracefully, waiting at most ``grace`` seconds for the connections to end. With
    ``stats_every``, print a line of statistics every that many seconds, and once more
    after the shutdown."""
    server = EchoServer(backend, gil_hold)
    ssl_context = None if tls is None else tls.context()
    with (
        anyio.open_signal_receiver(*stop_signals) as signals,
        gil_held(gil_hold),
    ):
        async with listen(address, server.handle, ssl_context=ssl_context) as listener:
            on_ready(listener.address)

            def print_stats() -> None:
                print(statistics_line(listener.statistics(), server.traffic()), flush=True)

            async def print_stats_every(seconds: float) -> None:
                while True:
                    await anyio.sleep(seconds)
                    print_stats()

            async with anyio.create_task_group() as task_group:
                if stats_every is not None:
                    task_group.start_soon(print_stats_every, stats_every)
                with anyio.move_on_after(lifetime if lifetime is not None else float("inf")):
                    async for _ in signals:
                        break
                task_group.cancel_scope.cancel()
            await listener.shutdown(grace)
            if stats_every is not None:
                print_stats()


def serve_command(
    address: str,
    backend: str,
    tls: ServerTLS | None,
    gil_hold: bool,
    grace: float,
    cpu: int | None,
    stats_every: float | None = None,
) -> None:
    """``anyio-comm serve``: print the address, serve until Ctrl-C or SIGTERM (printing
    statistics every ``stats_every`` seconds)."""
    pin(cpu)

    def ready(real: str) -> None:
        extras = [f"backend {backend}", f"pid {os.getpid()}"]
        if cpu is not None:
            extras.append(f"CPU {cpu}")
        if gil_hold:
            extras.append("GIL-holding thread running")
        print(f"anyio-comm bench server listening on {real} ({', '.join(extras)})", flush=True)
        print("stop with Ctrl-C or SIGTERM", flush=True)

    run_backend(
        backend,
        run_server,
        address,
        backend,
        tls,
        gil_hold,
        grace,
        None,
        ready,
        (signal.SIGINT, signal.SIGTERM),
        stats_every,
    )
    print("server stopped", flush=True)


def server_process(
    conn: Connection,
    address: str,
    backend: str,
    tls: ServerTLS | None,
    gil_hold: bool,
    lifetime: float,
) -> None:
    """Entry point of the server process of a local run (a :class:`~._processes.Child`):
    reports ``("ready", address)`` on ``conn``; stops on SIGTERM (sent by the parent) or
    after ``lifetime`` seconds."""
    run_backend(
        backend,
        run_server,
        address,
        backend,
        tls,
        gil_hold,
        2.0,
        lifetime,
        lambda real: conn.send(("ready", real)),
        (signal.SIGTERM,),
    )
