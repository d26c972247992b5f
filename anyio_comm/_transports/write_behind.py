"""Writing behind: small sends queued during a burst and written together.

A stream of small messages costs a system call per message when every send
writes at once (on loopback about 5 us of kernel time each, more than the rest
of the send). A transport that supports it
(:meth:`~anyio_comm._transports.base.Transport.send_later`) instead queues a
send the comm makes while a stream flows (its previous operation did not wait
for the peer), and writes the queue in one gather write: with the next send
that writes, or else within the event loop's next pass (which the comm's yield
every ``YIELD_EVERY`` operations provides). Only
bytes the transport owns are queued (never a caller's out-of-band buffer),
at most :data:`BEHIND_LIMIT` of them.

The write in the next pass is an event-loop callback on asyncio and uvloop
(``loop.call_soon``). trio has no callbacks: there :class:`TrioFlusher`, one
system task per run, writes the queues of every transport that asked, and a
queue the socket did not take whole is written on, as the socket takes more,
by a task of its nursery. The flusher runs while a transport that may queue is
open (attached), and ends when the last one closes: no task outlives the
connections.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, Protocol

from anyio.lowlevel import RunVar

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import ModuleType

__all__ = ["BEHIND_LIMIT", "TrioFlusher", "trio_flusher"]

#: the most bytes a transport queues to write behind; a send that would queue
#: more writes at once (with the queue before it)
BEHIND_LIMIT: Final = 65536


class Flushable(Protocol):
    """A transport whose queue :class:`TrioFlusher` writes."""

    def flush_behind(self) -> Callable[[], Awaitable[None]] | None:
        """Write the queue without waiting; return the coroutine function that
        writes the rest as the socket takes it, if the socket did not take it all."""


class TrioFlusher:
    """The task that writes queued sends on trio (see the module docstring).

    Parked while no transport waits; :meth:`schedule` wakes it, and it runs in
    the run loop's next batch, after the task that queued.
    """

    __slots__ = ("_attached", "_dead", "_parked", "_queue", "_task", "_trio")

    def __init__(self, trio_lowlevel: ModuleType) -> None:
        self._trio = trio_lowlevel
        self._queue: list[Flushable] = []
        self._task: Any = None
        self._parked = False
        self._dead = False
        self._attached = 0

    @property
    def dead(self) -> bool:
        """The flusher ended (no transport was attached, or the run is ending)."""
        return self._dead

    def attach(self) -> None:
        """A transport that may :meth:`schedule` opened: run until it detaches."""
        self._attached += 1

    def detach(self) -> None:
        """A transport that attached closed; the last one ends the flusher."""
        self._attached -= 1
        if not self._attached and self._parked:
            self._parked = False
            self._trio.reschedule(self._task)

    def schedule(self, transport: Flushable) -> bool:
        """Have ``transport.flush_behind()`` called in the run loop's next batch.

        Returns:
            False when the flusher is gone (the run is ending): nothing was
            scheduled.
        """
        if self._dead:
            return False
        self._queue.append(transport)
        if self._parked:
            self._parked = False
            self._trio.reschedule(self._task)
        return True

    def _abort(self, _: object) -> Any:
        self._parked = False
        self._dead = True
        return self._trio.Abort.SUCCEEDED

    async def run(self) -> None:
        import trio  # only ever imported under trio

        trio_lowlevel = self._trio
        self._task = trio_lowlevel.current_task()
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    if not self._queue:
                        if not self._attached:
                            # Ended from here on (the nursery's exit may yield, and
                            # a transport opened meanwhile must start another).
                            self._dead = True
                            break
                        self._parked = True
                        await trio_lowlevel.wait_task_rescheduled(self._abort)
                    queue, self._queue = self._queue, []
                    for transport in queue:
                        rest = transport.flush_behind()
                        if rest is not None:
                            nursery.start_soon(rest)
        finally:
            self._dead = True


_FLUSHER: RunVar[TrioFlusher] = RunVar("anyio_comm.trio_flusher")


def trio_flusher(trio_lowlevel: ModuleType) -> TrioFlusher | None:
    """Return this trio run's flusher, started if there is none (or it ended),
    and attached: call its :meth:`~TrioFlusher.detach` once done with it.
    ``None`` when none can start (the run is ending)."""
    flusher = _FLUSHER.get(None)
    if flusher is None or flusher.dead:
        flusher = TrioFlusher(trio_lowlevel)
        try:
            trio_lowlevel.spawn_system_task(flusher.run, name="anyio_comm write-behind")
        except RuntimeError:  # (the system nursery is closed)
            return None
        _FLUSHER.set(flusher)
    flusher.attach()
    return flusher
