"""AnyIO's ``checkpoint_if_cancelled()`` on asyncio, at a third of its cost.

Every ``send`` and ``receive`` is a cancellation point (see :mod:`._comm`), so a
stream of small messages checks for a cancellation once per message at each
end, and a request/reply round trip four times. AnyIO's check costs 0.8-1.2 us
on asyncio: ``asyncio.current_task()``, which before Python 3.12 makes a
``getpid()`` system call on every call, a ``WeakKeyDictionary`` lookup, and
two property reads per cancel scope up the task's chain.

:func:`asyncio_check` returns a check that reads the same state directly: the
loop's current task from asyncio's table of current tasks (before 3.12; the
C ``current_task()`` of 3.12 and later needs no system call), the task's
AnyIO state from the dictionary behind the ``WeakKeyDictionary``, and the
scopes' attributes behind their properties. Its answer is AnyIO's: a cancelled
scope between the task and the first shielded one makes it yield, and AnyIO
delivers the cancellation there. Where AnyIO's layout is not the one this
reads (a release that renamed it), it returns AnyIO's own check instead.

The comm's hot paths go one step further and ask a plain predicate first
(:func:`asyncio_cancel_due`, and :func:`trio_cancel_due` for trio's own check,
which reads the task's cancel status as ``checkpoint_if_cancelled()`` does):
only when it answers yes do they await the check, which then yields and raises.
That spares a coroutine per message at each end (0.15 us of 0.23 on trio).
"""

from __future__ import annotations

import asyncio
import importlib
import math
import sys
from functools import cache, partial
from typing import TYPE_CHECKING, Any
from weakref import ref

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["asyncio_cancel_due", "asyncio_check", "asyncio_effective_deadline", "trio_cancel_due"]


@cache
def _anyio_layout() -> Any | None:
    """AnyIO's asyncio backend module, if its task states and cancel scopes are
    laid out as :func:`asyncio_check` reads them; else None."""
    try:
        backend: Any = importlib.import_module("anyio._backends._asyncio")
        data = backend._task_states.data
        scope = backend.CancelScope()
        (scope._cancel_called, scope._shield, scope._parent_scope, scope._deadline)  # noqa: B018
        state = backend.TaskState(None, scope)
        state.cancel_scope  # noqa: B018
        ref(state)  # (asyncio_cancel_due remembers a task's state by weak reference)
    except (ImportError, AttributeError, TypeError):
        return None
    if not isinstance(data, dict):
        return None
    return backend


def _current_task_of(loop: asyncio.AbstractEventLoop) -> Callable[[], Any]:
    """A function returning the task ``loop`` runs now."""
    if sys.version_info < (3, 12):
        current_tasks = getattr(asyncio.tasks, "_current_tasks", None)
        if isinstance(current_tasks, dict):
            return partial(current_tasks.get, loop)
    return partial(asyncio.current_task, loop)


def _anyio_task_states(
    loop: asyncio.AbstractEventLoop,
) -> tuple[dict[Any, Any], Callable[[], Any]] | None:
    """AnyIO's task states (by weak reference to the task) and a function
    returning the task ``loop`` runs now; None where AnyIO's layout is not the
    one :func:`_anyio_layout` checks."""
    backend = _anyio_layout()
    if backend is None:
        return None
    return backend._task_states.data, _current_task_of(loop)


def _nothing() -> None:
    return None


def _forget(_state: object) -> Callable[[], None]:
    return _nothing


# What ``cancel_due`` remembers of the last task's AnyIO state: a weak reference,
# which dies with the state when AnyIO drops or replaces it (at once, where
# reference counting frees objects); elsewhere nothing, and it looks the state
# up on every call.
_remember: Callable[[Any], Callable[[], Any]] = (
    ref if sys.implementation.name == "cpython" else _forget
)


def asyncio_cancel_due(loop: asyncio.AbstractEventLoop) -> Callable[[], bool] | None:
    """A predicate telling whether AnyIO would deliver a cancellation to the
    calling task of ``loop`` at a checkpoint now (a cancelled scope between the
    task and the first shielded one); None where AnyIO's layout is not the one
    it reads.

    A comm is mostly used by one task, so the predicate remembers the last task
    it was asked about and that task's AnyIO state, both by weak reference:
    it keeps neither alive, and a state AnyIO let go of is looked up again.
    The scopes themselves are read on every call."""
    reader = _anyio_task_states(loop)
    if reader is None:
        return None
    states, current_task = reader

    last_task: Callable[[], Any] = _nothing  # the last task asked about, by weak reference
    last_state: Callable[[], Any] = _nothing  # its AnyIO state, by weak reference

    def cancel_due() -> bool:
        nonlocal last_task, last_state
        task = current_task()
        if task is None:
            return False
        state = last_state() if last_task() is task else None
        if state is None:
            task_ref = ref(task)
            state = states.get(task_ref)
            if state is None:
                return False  # a task AnyIO does not know: no scope of AnyIO's holds it
            last_task = task_ref
            last_state = _remember(state)
        scope = state.cancel_scope
        while scope is not None:
            if scope._cancel_called:
                return True
            if scope._shield:
                return False
            scope = scope._parent_scope
        return False

    return cancel_due


def asyncio_effective_deadline(loop: asyncio.AbstractEventLoop) -> Callable[[], float] | None:
    """AnyIO's ``current_effective_deadline()`` for the calling task of ``loop``,
    read as :func:`asyncio_cancel_due` reads the scopes (at a third of its
    cost: an RPC call asks it once); None where AnyIO's layout is not the one
    it reads."""
    reader = _anyio_task_states(loop)
    if reader is None:
        return None
    states, current_task = reader
    inf = math.inf

    def effective_deadline() -> float:
        task = current_task()
        if task is None:
            return inf
        state = states.get(ref(task))
        if state is None:
            return inf
        scope = state.cancel_scope
        deadline = inf
        while scope is not None:
            if scope._cancel_called:
                return -inf
            if scope._deadline < deadline:
                deadline = scope._deadline
            if scope._shield:
                break
            scope = scope._parent_scope
        return deadline

    return effective_deadline


def asyncio_check(
    loop: asyncio.AbstractEventLoop, anyio_check: Callable[[], Awaitable[None]]
) -> Callable[[], Awaitable[None]]:
    """The cancellation check for tasks of ``loop``: ``anyio_check`` (AnyIO's
    ``checkpoint_if_cancelled``) in effect, at a third of its cost."""
    cancel_due = asyncio_cancel_due(loop)
    if cancel_due is None:
        return anyio_check
    sleep = asyncio.sleep

    async def checkpoint_if_cancelled() -> None:
        if cancel_due():
            await sleep(0)  # AnyIO delivers the cancellation here

    return checkpoint_if_cancelled


@cache
def _trio_layout() -> Any | None:
    """trio's ``lowlevel`` module, if its tasks are laid out as
    :func:`trio_cancel_due` reads them; else None."""
    try:
        import trio.lowlevel
        from trio._core import _run
    except ImportError:
        return None
    layout = (
        (trio.lowlevel.Task, ("_cancel_status", "_runner")),
        (_run.CancelStatus, ("effectively_cancelled",)),
        (_run.Runner, ("ki_pending", "main_task")),
    )
    if all(hasattr(cls, name) for cls, names in layout for name in names):
        return trio.lowlevel
    return None


def trio_cancel_due() -> Callable[[], bool] | None:
    """A predicate telling whether trio's ``checkpoint_if_cancelled()`` would
    raise in the calling task now (its cancel status, or a KeyboardInterrupt
    pending for the main task), without the coroutine; None where trio's
    layout is not the one it reads. Call it from a trio task."""
    lowlevel = _trio_layout()
    if lowlevel is None:
        return None
    current_task = lowlevel.current_task

    def cancel_due() -> bool:
        task: Any = current_task()
        if task._cancel_status.effectively_cancelled:
            return True
        runner = task._runner
        return bool(runner.ki_pending) and task is runner.main_task

    return cancel_due
