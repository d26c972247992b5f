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
"""

from __future__ import annotations

import asyncio
import importlib
import sys
from functools import cache, partial
from typing import TYPE_CHECKING, Any
from weakref import ref

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

__all__ = ["asyncio_check"]


@cache
def _anyio_layout() -> Any | None:
    """AnyIO's asyncio backend module, if its task states and cancel scopes are
    laid out as :func:`asyncio_check` reads them; else None."""
    try:
        backend: Any = importlib.import_module("anyio._backends._asyncio")
        data = backend._task_states.data
        scope = backend.CancelScope()
        (scope._cancel_called, scope._shield, scope._parent_scope)  # noqa: B018
        state = backend.TaskState(None, scope)
        state.cancel_scope  # noqa: B018
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


def asyncio_check(
    loop: asyncio.AbstractEventLoop, anyio_check: Callable[[], Awaitable[None]]
) -> Callable[[], Awaitable[None]]:
    """The cancellation check for tasks of ``loop``: ``anyio_check`` (AnyIO's
    ``checkpoint_if_cancelled``) in effect, at a third of its cost."""
    backend = _anyio_layout()
    if backend is None:
        return anyio_check
    states = backend._task_states.data
    current_task = _current_task_of(loop)
    sleep = asyncio.sleep

    async def checkpoint_if_cancelled() -> None:
        task = current_task()
        if task is None:
            return
        state = states.get(ref(task))
        if state is None:
            return
        scope = state.cancel_scope
        while scope is not None:
            if scope._cancel_called:
                await sleep(0)  # AnyIO delivers the cancellation here
            elif scope._shield:
                return
            else:
                scope = scope._parent_scope

    return checkpoint_if_cancelled
