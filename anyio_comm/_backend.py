"""Which event loop runs the calling task: decided here, and only here.

AnyIO hides the backend from most of the package, but the hot paths call the
event loop's own primitives (trio's checkpoints, asyncio's reader callbacks)
because AnyIO's wrappers look the backend up on every call. They ask
:func:`current_backend` once per connection.

The answer comes from sniffio, as AnyIO's own comes: it tells trio running in
*guest mode* on an asyncio host loop (where an asyncio loop is running too, and
``asyncio.get_running_loop()`` would mislead) from asyncio itself. Without
sniffio (it is a dependency of trio, so trio is not installed either) a running
asyncio loop is the only possibility.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio
from anyio.lowlevel import current_token

from ._cancellation import (
    asyncio_cancel_due,
    asyncio_check,
    asyncio_effective_deadline,
    trio_cancel_due,
)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from types import ModuleType, TracebackType

__all__ = ["Backend", "CancelScopeLike", "current_backend"]

try:
    import sniffio
except ImportError:  # pragma: no cover (trio, and with it sniffio, not installed)
    _sniffio: ModuleType | None = None
else:
    _sniffio = sniffio


class CancelScopeLike(Protocol):
    """What the package uses of a cancel scope: AnyIO's or trio's own."""

    def cancel(self) -> None: ...

    def __enter__(self) -> CancelScopeLike: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool: ...


@dataclass(frozen=True, slots=True)
class Backend:
    """The event loop of the calling task.

    Attributes:
        loop: the running asyncio event loop (uvloop's included), or ``None``
            on trio.
        trio: the ``trio.lowlevel`` module on trio, ``None`` on asyncio.
        checkpoint_if_cancelled: the backend's own
            ``checkpoint_if_cancelled()``: trio's, or on asyncio AnyIO's
            in effect (:func:`~anyio_comm._cancellation.asyncio_check`: it
            reads AnyIO's cancel scopes directly, at a third of the cost).
        cancel_due: a predicate telling whether ``checkpoint_if_cancelled()``
            would raise in the calling task now, for hot paths that await it
            only then (where the backend's layout is not the one it reads, it
            always answers True: await the check and let it answer).
        cancel_scope: the class of cancel scope to open per call on hot paths:
            trio's own on trio (AnyIO's wraps one), AnyIO's on asyncio. Takes
            ``deadline`` as :class:`anyio.CancelScope` does.
        current_time: the clock of :func:`anyio.current_time`, called directly.
        effective_deadline: :func:`anyio.current_effective_deadline` for the
            calling task: trio's own on trio; on asyncio, AnyIO's scopes read
            directly (:func:`~anyio_comm._cancellation.asyncio_effective_deadline`)
            where their layout is the one it reads, else AnyIO's function.
    """

    loop: asyncio.AbstractEventLoop | None
    trio: ModuleType | None
    checkpoint_if_cancelled: Callable[[], Awaitable[None]]
    cancel_due: Callable[[], bool]
    cancel_scope: Callable[..., CancelScopeLike]
    current_time: Callable[[], float]
    effective_deadline: Callable[[], float]

    @property
    def name(self) -> str:
        """``"asyncio"`` or ``"trio"``."""
        return "trio" if self.trio is not None else "asyncio"


def _always() -> bool:
    return True


def _library() -> str:
    if _sniffio is not None:
        try:
            library: str = _sniffio.current_async_library()
        except _sniffio.AsyncLibraryNotFoundError:
            raise RuntimeError("no async event loop is running in this thread") from None
        return library
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError("no async event loop is running in this thread") from None
    return "asyncio"  # pragma: no cover (only without trio installed)


def current_backend() -> Backend:
    """Return the backend of the calling task.

    Raises:
        RuntimeError: no event loop runs in this thread, or one that anyio-comm
            does not support (only asyncio, uvloop and trio are).
    """
    library = _library()
    if library == "asyncio":
        backend_class = current_token().backend_class
        loop = asyncio.get_running_loop()
        effective_deadline = asyncio_effective_deadline(loop) or anyio.current_effective_deadline
        return Backend(
            loop=loop,
            trio=None,
            checkpoint_if_cancelled=asyncio_check(loop, backend_class.checkpoint_if_cancelled),
            cancel_due=asyncio_cancel_due(loop) or _always,
            cancel_scope=anyio.CancelScope,
            current_time=loop.time,
            effective_deadline=effective_deadline,
        )
    if library == "trio":
        import trio  # only ever imported under trio

        return Backend(
            loop=None,
            trio=trio.lowlevel,
            checkpoint_if_cancelled=trio.lowlevel.checkpoint_if_cancelled,
            cancel_due=trio_cancel_due() or _always,
            cancel_scope=trio.CancelScope,
            current_time=trio.current_time,
            effective_deadline=trio.current_effective_deadline,
        )
    raise RuntimeError(f"anyio-comm runs on asyncio and trio, not on {library!r}")
