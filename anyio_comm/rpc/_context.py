"""Each call in a context of its own.

A connection's calls run one after another on its worker tasks, so they would
share the worker's :mod:`contextvars` context: a variable one call sets (a
user, a trace id) would be seen by the calls that follow, from other callers.
As a task of their own would, calls run in a copy of the context the worker
started with: a plain function through ``Context.run``, a coroutine (and each
step of an async generator) through :class:`InContext`, which resumes it inside
the context at every step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Coroutine, Generator
    from contextvars import Context

__all__ = ["InContext"]


class InContext:
    """An awaitable that runs ``coroutine`` with every step inside ``context``."""

    __slots__ = ("_context", "_coroutine")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], context: Context) -> None:
        self._coroutine = coroutine
        self._context = context

    def __await__(self) -> Generator[Any, Any, Any]:
        run = self._context.run
        send = self._coroutine.send
        throw = self._coroutine.throw
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = run(send, value) if error is None else run(throw, error)
            except StopIteration as stop:
                return stop.value
            error = None
            try:
                value = yield yielded
            except BaseException as exc:  # a cancellation, thrown in at the await
                value = None
                error = exc
