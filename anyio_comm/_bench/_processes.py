"""The processes of a benchmark run: where they run, and the parent's hold on each.

A benchmark runs its server and its clients in child processes of its own, each pinned
to a CPU where the machine allows it (:func:`choose_cpus`). A :class:`Child` runs
``target(conn, *args)`` in a fresh process, ``conn`` being the child's end of a pipe
to the parent. Whatever ``target`` returns (unless None) reaches the parent as
``("result", value)``; a failure as ``("error", one_line, traceback)``, after which
the child exits with status 1. The parent reads the children's messages with
:meth:`Child.receive` or, for several at once, :func:`gather`: both raise
:exc:`RunError` when a child reports a failure, dies, or says nothing in time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import wait as wait_for
from typing import TYPE_CHECKING, Any

from ._common import RunError, one_line

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from multiprocessing.connection import Connection


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, or ``[]`` where affinity is not available."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


def pin(cpu: int | None) -> None:
    """Run this process on ``cpu`` only (no-op for ``None``)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def choose_cpus(
    no_pin: bool, roles: tuple[str, str] = ("server", "client")
) -> tuple[tuple[int | None, int | None], str]:
    """The CPUs of the two processes of a run (the first two this process may use), and
    what is pinned where, as text (``roles`` names the two processes)."""
    if no_pin:
        return (None, None), "none (--no-pin)"
    allowed = allowed_cpus()
    if not allowed:
        return (None, None), "none (os.sched_setaffinity is not available)"
    if len(allowed) < 2:
        return (None, None), f"none (only CPU {allowed[0]} is available)"
    first, second = allowed[:2]
    return (first, second), f"{roles[0]} CPU {first}, {roles[1]} CPU {second}"


def _child_main(
    conn: Connection,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    cpu: int | None,
    ignore_interrupt: bool,
) -> None:
    """Entry point of a child process (see the module)."""
    if ignore_interrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pin(cpu)
        result = target(conn, *args)
        if result is not None:
            conn.send(("result", result))
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", one_line(exc), traceback.format_exc()))
        sys.exit(1)
    finally:
        conn.close()


class Child:
    """A child process running ``target(conn, *args)``, and the parent's end of its pipe.

    The child runs on ``cpu`` only (None: anywhere). With ``ignore_interrupt`` it ignores
    Ctrl-C, for a parent that stops its children itself, in order; otherwise Ctrl-C
    interrupts it along with the parent.
    """

    def __init__(
        self,
        ctx: Any,
        name: str,
        target: Callable[..., Any],
        args: tuple[Any, ...] = (),
        *,
        cpu: int | None = None,
        ignore_interrupt: bool = False,
    ) -> None:
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_child_main,
            name=name,
            daemon=True,
            args=(child_conn, target, args, cpu, ignore_interrupt),
        )
        try:
            self.process.start()
        except BaseException:
            self.conn.close()
            raise
        finally:
            child_conn.close()

    def send(self, message: Any) -> None:
        """Send ``message`` to the child."""
        self.conn.send(message)

    def receive(self, deadline: float) -> Any:
        """The child's next message; raise :exc:`RunError` if the child reports a failure,
        dies, or sends nothing by ``deadline`` (``time.monotonic``)."""
        return gather([self], deadline)[0]

    def died(self) -> RunError:
        """The error for a process that exited without reporting."""
        self.process.join(1)
        return RunError(
            f"{self.name} (pid {self.process.pid}) exited with code {self.process.exitcode} "
            "before reporting"
        )

    def stop(self, *, terminate: bool = False, timeout: float = 5.0) -> int | None:
        """Stop the child and close the pipe; return its exit code.

        The child is sent SIGTERM at once with ``terminate``, otherwise after ``timeout``
        seconds if it has not exited by then; SIGKILL follows if it is still alive.
        """
        process = self.process
        if terminate and process.is_alive():
            process.terminate()
        process.join(timeout)
        if not terminate and process.is_alive():
            process.terminate()
            process.join(2)
        if process.is_alive():
            process.kill()
            process.join(2)
        self.conn.close()
        code: int | None = process.exitcode
        return code

    def _take(self) -> Any:
        """The message waiting on the pipe (see :meth:`receive`)."""
        try:
            message = self.conn.recv()
        except EOFError:
            raise self.died() from None
        if isinstance(message, tuple) and message[:1] == ("error",):
            _, summary, details = message
            raise RunError(f"{self.name}: {summary}", details)
        return message


def gather(
    children: Sequence[Child],
    deadline: float,
    watch: Sequence[Child] = (),
    tick: Callable[[], None] | None = None,
) -> list[Any]:
    """The next message of each child, in order; raise :exc:`RunError` if one reports a
    failure, if one (or a watched child) dies, or at ``deadline`` (``time.monotonic``).
    ``tick`` is called at least every 0.25 s meanwhile (it shows the progress)."""
    poll = 1.0 if tick is None else 0.25
    pending = {id(c): c for c in children}
    got: dict[int, Any] = {}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            names = ", ".join(c.name for c in pending.values())
            raise RunError(f"no answer in time from the {names}")
        handles: list[Any] = [c.conn for c in pending.values()]
        handles += [c.process.sentinel for c in (*pending.values(), *watch)]
        wait_for(handles, timeout=min(remaining, poll))
        if tick is not None:
            tick()
        for key, child in list(pending.items()):
            if child.conn.poll():
                got[key] = child._take()
                del pending[key]
            elif not child.process.is_alive():
                raise child.died()
        for child in watch:
            if not child.process.is_alive():
                raise child.died()
    return [got[id(c)] for c in children]
