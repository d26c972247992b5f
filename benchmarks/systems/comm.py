"""anyio-comm through its message layer: ``{"data": [frames...]}`` via send/receive.

The msgpack body carries the list; frames of 4096 bytes or more travel
out-of-band and come back as memoryviews. Runs on asyncio, uvloop and trio;
TLS through ``tls://`` addresses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

import anyio_comm
from benchmarks.systems.framing import Checker, make_frames, run_backend

if TYPE_CHECKING:
    import contextlib
    import ssl
    from collections.abc import Awaitable, Callable

CONNECT_TIMEOUT = 30.0


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Echo every message back until the process ends."""

    async def echo(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)
            counter.n += 1

    async def main() -> None:
        if ssl_context is None:
            listening = anyio_comm.listen("tcp://127.0.0.1:0", echo)
        else:
            listening = anyio_comm.listen("tls://127.0.0.1:0", echo, ssl_context=ssl_context)
        async with listening as listener:
            ready(listener.address)
            await anyio.sleep_forever()

    run_backend(case.backend, main)


async def open_client(
    stack: contextlib.AsyncExitStack, address: str, case: Any, ssl_context: ssl.SSLContext | None
) -> Callable[[], Awaitable[None]]:
    """One comm; round trips send ``{"data": frames}`` and receive the echo."""
    if ssl_context is None:
        comm = await anyio_comm.connect(address, timeout=CONNECT_TIMEOUT)
    else:
        comm = await anyio_comm.connect(address, timeout=CONNECT_TIMEOUT, ssl_context=ssl_context)
    stack.push_async_callback(comm.aclose)
    message = {"data": make_frames(case.size, case.frames)}
    checker = Checker(case.size, case.frames)

    async def roundtrip() -> None:
        await comm.send(message)
        reply = await comm.receive()
        if checker.due():
            checker.check([len(f) for f in reply["data"]])

    return roundtrip
