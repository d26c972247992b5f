from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from .._connect import from_stream
from .._options import resolve_options
from .._transports.memory import memory_byte_stream_pair

if TYPE_CHECKING:
    from .._comm import Comm
    from .._compat import Unpack
    from .._options import Options, OptionsKeywords


async def comm_pair(
    *,
    options: Options | None = None,
    max_chunks: int = 16,
    chunk_size: int = 65536,
    **keywords: Unpack[OptionsKeywords],
) -> tuple[Comm, Comm]:
    """Return two comms connected through a :func:`memory_byte_stream_pair`.

    Both ends get the same options (:class:`~anyio_comm.Options`, or any of its
    fields as keywords), as :func:`anyio_comm.from_stream` takes them. Close
    both comms when done.

    Raises:
        ValueError: invalid option.
        TypeError: an unknown keyword, or an option of the wrong type.
    """
    # Resolved here, so that a bad option raises itself, not an ExceptionGroup
    # of two copies from the task group below.
    resolved = resolve_options("comm_pair", options, keywords)
    a, b = memory_byte_stream_pair(max_chunks=max_chunks, chunk_size=chunk_size)
    comms: list[Comm] = []

    async def open_one(stream: Any, local: str, peer: str) -> None:
        comms.append(
            await from_stream(stream, options=resolved, local_address=local, peer_address=peer)
        )

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(open_one, a, "memory://a", "memory://b")
            tg.start_soon(open_one, b, "memory://b", "memory://a")
    except BaseException:
        for comm in comms:  # the end that did come up, if the other failed
            await anyio.aclose_forcefully(comm)
        raise
    first, second = sorted(comms, key=lambda c: c.local_address)
    return first, second
