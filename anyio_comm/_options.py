"""Connection options shared by connect, listen and from_stream."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ._sansio.decoder import DEFAULT_READ_BUFFER_SIZE, check_read_buffer_size
from ._sansio.serialization import DEFAULT_OOB_THRESHOLD, Serializer
from ._sansio.wire import Limits

if TYPE_CHECKING:
    from ._sansio.buffers import Allocator


@dataclass(frozen=True, slots=True)
class CommOptions:
    """Validated per-connection options (see :func:`anyio_comm.connect`)."""

    limits: Limits = field(default_factory=Limits)
    read_buffer_size: int = DEFAULT_READ_BUFFER_SIZE
    allocator: Allocator | None = None
    oob_threshold: int = DEFAULT_OOB_THRESHOLD
    allow_pickle: bool = False
    idle_timeout: float | None = None

    def __post_init__(self) -> None:
        # Fail at the call site, not at the first connection (without
        # allocating a read-ahead buffer only to throw it away).
        check_read_buffer_size(self.read_buffer_size)
        self.serializer()
        check_seconds("idle_timeout", self.idle_timeout)

    def serializer(self) -> Serializer:
        return Serializer(oob_threshold=self.oob_threshold, allow_pickle=self.allow_pickle)


def check_seconds(name: str, value: float | None, minimum: float = 0.0) -> None:
    """Check an optional duration option: ``None`` or a number above ``minimum``.

    Raises:
        TypeError: ``value`` is not a number.
        ValueError: ``value`` is not above ``minimum`` (or is NaN).
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or None, not {value!r}")
    if not value > minimum:  # also rejects NaN
        raise ValueError(f"{name} must be greater than {minimum:g} seconds, not {value!r}")


def make_options(
    limits: Limits | None,
    read_buffer_size: int,
    allocator: Allocator | None,
    oob_threshold: int,
    allow_pickle: bool,
    idle_timeout: float | None = None,
) -> CommOptions:
    return CommOptions(
        limits=limits if limits is not None else Limits(),
        read_buffer_size=read_buffer_size,
        allocator=allocator,
        oob_threshold=oob_threshold,
        allow_pickle=allow_pickle,
        idle_timeout=idle_timeout,
    )
