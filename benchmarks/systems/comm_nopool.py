"""anyio-comm receiving every frame into fresh memory (no buffer pool).

Everything else is :mod:`benchmarks.systems.comm`; only the allocator differs
(``allocator=default_allocator``: a ``bytearray``, or a fresh memory mapping from
32 MiB), so that a comparison shows what the default buffer pool gains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from anyio_comm._sansio.buffers import default_allocator
from benchmarks.systems import comm

if TYPE_CHECKING:
    import contextlib
    import ssl
    from collections.abc import Awaitable, Callable


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Echo every message back, without the buffer pool, until the process ends."""
    comm.OPTIONS["allocator"] = default_allocator
    comm.run_server(case, ssl_context, counter, ready)


async def open_client(
    stack: contextlib.AsyncExitStack, address: str, case: Any, ssl_context: ssl.SSLContext | None
) -> Callable[[], Awaitable[None]]:
    """One comm without the buffer pool; round trips as in :mod:`benchmarks.systems.comm`."""
    comm.OPTIONS["allocator"] = default_allocator
    return await comm.open_client(stack, address, case, ssl_context)
