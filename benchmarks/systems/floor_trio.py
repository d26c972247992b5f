"""Floor on trio: ``trio.socket`` with ``recv_into`` and ``sendmsg``, nothing else.

Receives into the buffers :class:`FrameReader` hands out; sends a reply with one
``sendmsg`` of the header and frames (looping on partial sends).
"""

# ruff: noqa: ARG001  (every system takes the same arguments; some need fewer)

from __future__ import annotations

import contextlib
import socket
from typing import TYPE_CHECKING, Any

from benchmarks.systems.framing import Checker, FrameReader, advance, host_port, outgoing, request

if TYPE_CHECKING:
    import ssl
    from collections.abc import Awaitable, Callable

    import trio


async def _send(sock: trio.socket.SocketType, buffers: list[Any], total: int) -> None:
    sent = await sock.sendmsg(buffers)
    while sent < total:
        total -= sent
        buffers = advance(buffers, sent)
        sent = await sock.sendmsg(buffers)


async def _receive(sock: trio.socket.SocketType, reader: FrameReader) -> list[Any]:
    while True:
        nbytes = await sock.recv_into(reader.get_buffer())
        if not nbytes:
            raise EOFError
        if done := reader.buffer_updated(nbytes):
            return done[0][1]


def run_server(
    case: Any,
    ssl_context: ssl.SSLContext | None,
    counter: Any,
    ready: Any,
    *,
    reuse: bool = False,
) -> None:
    """Serve on trio until the process ends (no TLS: this floor is plain TCP only;
    ``reuse``: see :class:`FrameReader`)."""
    import trio

    if ssl_context is not None:
        raise ValueError("the trio floor has no TLS variant")

    async def echo(sock: trio.socket.SocketType) -> None:
        reader = FrameReader(reuse=reuse)
        with sock, contextlib.suppress(EOFError, OSError):
            while True:
                nbytes = await sock.recv_into(reader.get_buffer())
                if not nbytes:
                    return
                for header, frames in reader.buffer_updated(nbytes):
                    buffers = outgoing(header, frames)
                    await _send(sock, buffers, sum(len(b) for b in buffers))
                    counter.n += 1

    async def main() -> None:
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        host, port = listener.getsockname()[:2]
        ready(f"tcp://{host}:{port}")
        async with trio.open_nursery() as nursery:
            while True:
                sock, _ = await listener.accept()
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nursery.start_soon(echo, sock)

    trio.run(main)


async def open_client(
    stack: contextlib.AsyncExitStack,
    address: str,
    case: Any,
    ssl_context: ssl.SSLContext | None,
    *,
    reuse: bool = False,
) -> Callable[[], Awaitable[None]]:
    """One connection; runs under the trio loop of the calling (AnyIO trio) task."""
    import trio

    sock = trio.socket.socket()
    stack.callback(sock.close)
    await sock.connect(host_port(address))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffers, total = request(case)
    reader = FrameReader(reuse=reuse)
    checker = Checker(case.size, case.frames)

    async def roundtrip() -> None:
        await _send(sock, buffers, total)
        reply = await _receive(sock, reader)
        if checker.due():
            checker.check([len(f) for f in reply])

    return roundtrip
