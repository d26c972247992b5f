from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from .._connect import from_stream
from .._options import check_seconds, make_options
from .._sansio.decoder import DEFAULT_READ_BUFFER_SIZE
from .._sansio.serialization import DEFAULT_OOB_THRESHOLD
from .._transports.memory import memory_byte_stream_pair

if TYPE_CHECKING:
    from .._comm import Comm

_OPTIONS = frozenset(
    {
        "timeout",
        "idle_timeout",
        "limits",
        "read_buffer_size",
        "allocator",
        "oob_threshold",
        "allow_pickle",
    }
)


async def comm_pair(
    *, max_chunks: int = 16, chunk_size: int = 65536, **options: Any
) -> tuple[Comm, Comm]:
    """Return two comms connected through a :func:`memory_byte_stream_pair`.

    ``options`` are passed to :func:`anyio_comm.from_stream` for both ends.
    Close both comms when done.

    Raises:
        ValueError: invalid option.
        TypeError: unknown option, or a duration option is not a number.
    """
    # Validate here, so that a bad option raises itself, not an ExceptionGroup
    # of two copies from the task group below.
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(f"comm_pair() got unexpected options: {', '.join(sorted(unknown))}")
    check_seconds("timeout", options.get("timeout"))
    make_options(
        options.get("limits"),
        options.get("read_buffer_size", DEFAULT_READ_BUFFER_SIZE),
        options.get("allocator"),
        options.get("oob_threshold", DEFAULT_OOB_THRESHOLD),
        options.get("allow_pickle", False),
        options.get("idle_timeout"),
    )
    a, b = memory_byte_stream_pair(max_chunks=max_chunks, chunk_size=chunk_size)
    comms: list[Comm] = []

    async def open_one(stream: Any, local: str, peer: str) -> None:
        comms.append(await from_stream(stream, local_address=local, peer_address=peer, **options))

    async with anyio.create_task_group() as tg:
        tg.start_soon(open_one, a, "memory://a", "memory://b")
        tg.start_soon(open_one, b, "memory://b", "memory://a")
    first, second = sorted(comms, key=lambda c: c.local_address)
    return first, second
