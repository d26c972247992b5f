"""Floor with blocking sockets: a thread per connection, ``recv_into`` and ``sendmsg``.

The server accepts in its main thread and echoes each connection in a thread
of its own; the client is a plain blocking socket (the caller runs one per
thread). Over TLS the sockets are ``ssl.SSLSocket`` objects, which have no
``sendmsg``: a small message goes out as one joined ``sendall``, a large one as
``sendall`` of the header then of each frame.
"""

# ruff: noqa: ARG001  (every system takes the same arguments; some need fewer)

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
from typing import TYPE_CHECKING, Any

from benchmarks.systems.framing import Checker, FrameReader, advance, host_port, outgoing, request

if TYPE_CHECKING:
    from collections.abc import Callable


def _send(sock: socket.socket, buffers: list[Any], total: int) -> None:
    if isinstance(sock, ssl.SSLSocket):
        for buf in buffers:
            sock.sendall(buf)
        return
    sent = sock.sendmsg(buffers)
    while sent < total:
        total -= sent
        buffers = advance(buffers, sent)
        sent = sock.sendmsg(buffers)


def _receive(sock: socket.socket, reader: FrameReader) -> list[Any]:
    while True:
        nbytes = sock.recv_into(reader.get_buffer())
        if not nbytes:
            raise EOFError
        if done := reader.buffer_updated(nbytes):
            return done[0][1]


def _echo(sock: socket.socket, cell: list[int], reuse: bool) -> None:
    reader = FrameReader(reuse=reuse)
    with sock, contextlib.suppress(EOFError, OSError):
        while True:
            nbytes = sock.recv_into(reader.get_buffer())
            if not nbytes:
                return
            for header, frames in reader.buffer_updated(nbytes):
                buffers = outgoing(header, frames)
                _send(sock, buffers, sum(len(b) for b in buffers))
                cell[0] += 1


def run_server(
    case: Any,
    ssl_context: ssl.SSLContext | None,
    counter: Any,
    ready: Any,
    *,
    reuse: bool = False,
) -> None:
    """Accept forever; echo each connection in its own daemon thread (``reuse``:
    see :class:`FrameReader`)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    host, port = listener.getsockname()[:2]
    ready(f"tcp://{host}:{port}")
    while True:
        sock, _ = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl_context is not None:
            sock = ssl_context.wrap_socket(sock, server_side=True)
        cell = [0]  # one counter per thread: no lost updates between threads
        counter.cells.append(cell)
        threading.Thread(target=_echo, args=(sock, cell, reuse), daemon=True).start()


def open_blocking(
    stack: contextlib.ExitStack,
    address: str,
    case: Any,
    ssl_context: ssl.SSLContext | None,
    *,
    reuse: bool = False,
) -> Callable[[], None]:
    """One blocking connection; the returned function does one round trip."""
    host, port = host_port(address)
    sock = socket.create_connection((host, port), timeout=30)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ssl_context is not None:
        sock = ssl_context.wrap_socket(sock, server_hostname=host)
    stack.callback(sock.close)
    buffers, total = request(case)
    reader = FrameReader(reuse=reuse)
    checker = Checker(case.size, case.frames)

    def roundtrip() -> None:
        _send(sock, buffers, total)
        reply = _receive(sock, reader)
        if checker.due():
            checker.check([len(f) for f in reply])

    return roundtrip
