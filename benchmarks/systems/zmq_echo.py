"""pyzmq: DEALER clients and a ROUTER server with ``zmq.asyncio``.

Frames travel as the parts of a multipart message; from 64 KB up they are
sent and received with ``copy=False`` (zero-copy ``zmq.Frame`` objects), below
that with copies, as pyzmq recommends. One ROUTER socket serves every client
connection. Asyncio only; no TLS.
"""

# ruff: noqa: ARG001  (every system takes the same arguments; some need fewer)

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from benchmarks.systems.framing import Checker, make_frames

if TYPE_CHECKING:
    import contextlib
    import ssl
    from collections.abc import Awaitable, Callable

ZERO_COPY_FROM = 65536


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Echo every multipart message back (identity part included) until the process ends."""
    import asyncio

    import zmq
    import zmq.asyncio

    if ssl_context is not None:
        raise ValueError("the zmq system has no TLS variant")
    copy = case.size < ZERO_COPY_FROM

    async def main() -> None:
        context = zmq.asyncio.Context()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        ready(f"tcp://127.0.0.1:{port}")
        while True:
            parts = await sock.recv_multipart(copy=copy)
            await sock.send_multipart(parts, copy=copy)
            counter.n += 1

    asyncio.run(main())


async def open_client(
    stack: contextlib.AsyncExitStack, address: str, case: Any, ssl_context: ssl.SSLContext | None
) -> Callable[[], Awaitable[None]]:
    """One DEALER socket (its own connection); round trips send the parts and await the echo."""
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    stack.callback(sock.close)
    frames = make_frames(case.size, case.frames)
    copy = case.size < ZERO_COPY_FROM
    checker = Checker(case.size, case.frames)

    async def roundtrip() -> None:
        await sock.send_multipart(frames, copy=copy)
        reply = await sock.recv_multipart(copy=copy)
        if checker.due():
            checker.check([len(part) for part in reply])

    return roundtrip
