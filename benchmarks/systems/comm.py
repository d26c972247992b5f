"""anyio-comm through its message layer: ``{"data": [frames...]}`` via send/receive.

The msgpack body carries the list; frames of 16384 bytes or more travel
out-of-band and come back as memoryviews. Runs on asyncio, uvloop and trio;
TLS through ``tls://`` addresses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

import anyio_comm
from anyio_comm.bench import run_backend
from benchmarks.systems.framing import Checker, make_frames

if TYPE_CHECKING:
    import contextlib
    import ssl
    from collections.abc import Awaitable, Callable

CONNECT_TIMEOUT = 30.0
#: options of every comm this module opens (systems built on it set them)
OPTIONS: dict[str, Any] = {}


async def connect(address: str, ssl_context: ssl.SSLContext | None) -> anyio_comm.Comm:
    """A comm to ``address`` (a ``tls://`` one with ``ssl_context``)."""
    if ssl_context is None:
        return await anyio_comm.connect(address, timeout=CONNECT_TIMEOUT, **OPTIONS)
    return await anyio_comm.connect(
        address, timeout=CONNECT_TIMEOUT, ssl_context=ssl_context, **OPTIONS
    )


async def serve(counter: Any, ssl_context: ssl.SSLContext | None, ready: Any) -> None:
    """Listen on a free port of 127.0.0.1 (``tls://`` with ``ssl_context``), report the address
    to ``ready``, then echo every message back, adding one to ``counter.n`` for each."""

    async def echo(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)
            counter.n += 1

    if ssl_context is None:
        listening = anyio_comm.listen("tcp://127.0.0.1:0", echo, **OPTIONS)
    else:
        listening = anyio_comm.listen(
            "tls://127.0.0.1:0", echo, ssl_context=ssl_context, **OPTIONS
        )
    async with listening as listener:
        ready(listener.address)
        await anyio.sleep_forever()


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Echo every message back until the process ends."""
    run_backend(case.backend, serve, counter, ssl_context, ready)


async def open_client(
    stack: contextlib.AsyncExitStack, address: str, case: Any, ssl_context: ssl.SSLContext | None
) -> Callable[[], Awaitable[None]]:
    """One comm; round trips send ``{"data": frames}`` and receive the echo."""
    comm = await connect(address, ssl_context)
    stack.push_async_callback(comm.aclose)
    message = {"data": make_frames(case.size, case.frames)}
    checker = Checker(case.size, case.frames)

    async def roundtrip() -> None:
        await comm.send(message)
        reply = await comm.receive()
        if checker.due():
            checker.check([len(f) for f in reply["data"]])

    return roundtrip
