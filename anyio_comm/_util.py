"""Small helpers shared by the I/O layer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from anyio import BusyResourceError

from ._compat import final

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["ConflictDetector"]


@final
class ConflictDetector:
    """Detects two tasks using one direction of a resource at once (trio's pattern).

    ``with detector:`` around an operation raises :exc:`anyio.BusyResourceError`
    when another task is inside it already. A plain flag: no lock, nothing to
    wait for, so it costs a couple of attribute writes per operation.

    Args:
        action: what the operation does to the resource, for the error message
            ("receiving from", "sending to").
    """

    __slots__ = ("_action", "_held")

    def __init__(self, action: str) -> None:
        self._action = action
        self._held = False

    def __enter__(self) -> None:
        if self._held:
            raise BusyResourceError(self._action)
        self._held = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc_value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._held = False
