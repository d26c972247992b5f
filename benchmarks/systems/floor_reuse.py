"""The event-loop floors receiving every frame into the same buffer each time.

:mod:`benchmarks.systems.floor_asyncio` (asyncio, uvloop) and
:mod:`benchmarks.systems.floor_trio` (trio) with ``reuse``: a large frame is
read into the buffer of the frame of the same place and length in the previous
message, allocated (and faulted in) once per connection, as
:mod:`benchmarks.systems.floor_blocking_reuse` does with threads. What is left is
the kernel's copies and the event loop's wake-ups, with no frame buffer
allocated after the first message: the row to read a large-message target
against for a design built on an event loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from benchmarks.systems import floor_asyncio, floor_trio

if TYPE_CHECKING:
    import contextlib
    import ssl
    from collections.abc import Awaitable, Callable


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Serve with the floor of ``case.backend``, reusing frame buffers."""
    floor = floor_trio if case.backend == "trio" else floor_asyncio
    floor.run_server(case, ssl_context, counter, ready, reuse=True)


async def open_client(
    stack: contextlib.AsyncExitStack, address: str, case: Any, ssl_context: ssl.SSLContext | None
) -> Callable[[], Awaitable[None]]:
    """One connection of the floor of ``case.backend``, reusing frame buffers."""
    floor = floor_trio if case.backend == "trio" else floor_asyncio
    return await floor.open_client(stack, address, case, ssl_context, reuse=True)
