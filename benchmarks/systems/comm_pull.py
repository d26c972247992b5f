"""anyio-comm with the pull receive engine on asyncio and uvloop (the receiving task reads).

Everything else is :mod:`benchmarks.systems.comm`; only the engine differs, so that a
comparison shows what the push engine (the event loop's callback reads and decodes,
the default there) gains. trio always pulls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from benchmarks.systems import comm

if TYPE_CHECKING:
    import contextlib
    import ssl
    from collections.abc import Awaitable, Callable


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Echo every message back, with the pull engine, until the process ends."""
    comm.OPTIONS["receive_engine"] = "pull"
    comm.run_server(case, ssl_context, counter, ready)


async def open_client(
    stack: contextlib.AsyncExitStack, address: str, case: Any, ssl_context: ssl.SSLContext | None
) -> Callable[[], Awaitable[None]]:
    """One comm with the pull engine; round trips as in :mod:`benchmarks.systems.comm`."""
    comm.OPTIONS["receive_engine"] = "pull"
    return await comm.open_client(stack, address, case, ssl_context)
