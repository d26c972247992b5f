"""Retries of idempotent calls: which calls, on which errors, how often, and how
long to wait between attempts (exponential backoff with full jitter, never past
the caller's deadline)."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import anyio

from .._compat import final
from ._errors import OverloadedError, RPCError, UnavailableError

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

    from ._interceptors import OutgoingCall, Proceed

__all__ = ["Retry"]


@final
class Retry:
    """Which calls may be sent again, and how: a call of one of ``methods``
    (the idempotent ones: running them twice does no harm) that fails with one
    of ``retry_on`` is sent again, up to ``attempts`` times in all, after a
    backoff of at most ``initial_backoff * multiplier ** n`` seconds (n from 0;
    at most ``max_backoff``), drawn at random (full jitter, so that callers
    do not come back together). When the caller's deadline would pass during
    the backoff, the last error is raised at once.

    Give it to :class:`Pool` (``retry=``), whose :meth:`Pool.call` sends each
    attempt to an address picked again (another one, when the first failed),
    or as an interceptor to a client (``interceptors=[retry]``), which sends the
    attempts over its one connection (useful for :exc:`OverloadedError`; a
    connection that ended stays ended).

    Args:
        methods: the names of the idempotent methods, or a function of the
            method's name that says whether it is one.
        attempts: sends of one call at most, the first included.
        initial_backoff: seconds, the bound of the first backoff.
        max_backoff: seconds, the bound of every backoff.
        multiplier: how much the bound grows from one backoff to the next.
        retry_on: the errors that are retried (by default
            :exc:`UnavailableError`: the connection ended before the reply, and
            :exc:`OverloadedError`: the server refused the call at its limit).

    Raises:
        ValueError: ``attempts`` is below 1, a backoff is negative or not
            finite, or ``multiplier`` is below 1.
        TypeError: ``retry_on`` holds something that is not a subclass of
            :exc:`RPCError`, or ``methods`` is one str.
    """

    __slots__ = (
        "_idempotent",
        "attempts",
        "initial_backoff",
        "max_backoff",
        "multiplier",
        "retry_on",
    )

    def __init__(
        self,
        methods: Collection[str] | Callable[[str], bool],
        *,
        attempts: int = 3,
        initial_backoff: float = 0.05,
        max_backoff: float = 1.0,
        multiplier: float = 2.0,
        retry_on: tuple[type[RPCError], ...] = (UnavailableError, OverloadedError),
    ) -> None:
        if isinstance(methods, str):
            raise TypeError("methods must be a collection of names, not one str")
        if attempts < 1:
            raise ValueError("attempts must be at least 1")
        if not (
            0 <= initial_backoff < math.inf and 0 <= max_backoff < math.inf and multiplier >= 1
        ):
            raise ValueError("backoffs must be finite and at least 0, multiplier at least 1")
        for error in retry_on:
            if not (isinstance(error, type) and issubclass(error, RPCError)):
                raise TypeError(f"retry_on takes subclasses of RPCError, not {error!r:.80}")
        self._idempotent: Callable[[str], bool] = (
            methods if callable(methods) else frozenset(methods).__contains__
        )
        self.attempts = attempts
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.multiplier = multiplier
        self.retry_on = tuple(retry_on)

    def idempotent(self, method: str) -> bool:
        """Whether calls of ``method`` may be sent again."""
        return bool(self._idempotent(method))

    def retries(self, method: str, error: BaseException, attempt: int) -> bool:
        """Whether a call of ``method`` that failed with ``error`` at its
        ``attempt``-th send (from 1) is sent again."""
        return (
            attempt < self.attempts
            and isinstance(error, self.retry_on)
            and self.idempotent(method)
        )

    async def back_off(self, attempt: int, error: BaseException) -> None:
        """Wait before the send after the ``attempt``-th (from 1).

        Raises:
            BaseException: ``error``, at once, when the caller's deadline would
                pass before the wait ends.
        """
        bound = min(self.max_backoff, self.initial_backoff * self.multiplier ** (attempt - 1))
        delay = random.uniform(0, bound)
        if anyio.current_time() + delay >= anyio.current_effective_deadline():
            raise error
        await anyio.sleep(delay)

    async def __call__(self, call: OutgoingCall, proceed: Proceed) -> Any:
        """As a client interceptor: retry calls (not streams, uploads, channels
        or notifications) over the client's connection.

        Raises:
            RPCError: the last attempt's error.
        """
        if call.kind != "call":
            return await proceed()
        attempt = 1
        while True:
            try:
                return await proceed()
            except RPCError as exc:
                if not self.retries(call.method, exc, attempt):
                    raise
                await self.back_off(attempt, exc)
                attempt += 1

    def __repr__(self) -> str:
        return (
            f"Retry(attempts={self.attempts}, initial_backoff={self.initial_backoff},"
            f" max_backoff={self.max_backoff}, multiplier={self.multiplier},"
            f" retry_on={tuple(e.__name__ for e in self.retry_on)})"
        )
