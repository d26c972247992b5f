"""Floor on asyncio and uvloop with the server's own sockets, read in ``add_reader`` callbacks.

A diagnostic variant of :mod:`benchmarks.systems.floor_asyncio`: no transport and
no protocol. The server owns its non-blocking sockets and registers
``loop.add_reader(fd, callback)`` for each; the callback calls ``recv_into``
on the buffer :class:`FrameReader` hands out (the scratch buffer, or the rest
of a large frame) and answers every completed message from inside the callback
with ``send`` (one joined buffer) or ``sendmsg`` (the header, then each frame).
When the socket does not take the whole reply (large messages), the rest waits
for ``loop.add_writer`` and the connection stops reading until it went out.

It shows what receiving into our own buffers from a readiness callback costs in
server CPU per message, next to the loop's transport driving a
``BufferedProtocol`` (uvloop's is written in C). Plain TCP only; the client is
the floor's (same wire format).
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Any

from benchmarks.systems import floor_asyncio
from benchmarks.systems.framing import FrameReader, advance, outgoing

if TYPE_CHECKING:
    import ssl

#: the client: the floor's ``BufferedProtocol`` client, which speaks the same wire format
open_client = floor_asyncio.open_client


class _Connection:
    """One accepted socket, echoed from the loop's readiness callbacks."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, counter: Any) -> None:
        self.loop = loop
        self.sock = sock
        self.fd = sock.fileno()
        self.counter = counter
        self.reader = FrameReader()
        self.pending: list[Any] = []  # buffers of replies not sent yet
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        loop.add_reader(self.fd, self.on_readable)

    def on_readable(self) -> None:
        """Receive what arrived, answer every completed message; wait to write if need be."""
        try:
            nbytes = self.sock.recv_into(self.reader.get_buffer())
            if not nbytes:
                raise EOFError
            for header, frames in self.reader.buffer_updated(nbytes):
                self.pending += outgoing(header, frames)
                self.counter.n += 1
            if self.pending and not self.flush():
                self.loop.remove_reader(self.fd)  # the replies go out before reading on
                self.loop.add_writer(self.fd, self.on_writable)
        except (BlockingIOError, InterruptedError):
            return
        except (EOFError, OSError):
            self.close()

    def on_writable(self) -> None:
        """Send more of the pending replies; read again once they all went out."""
        try:
            if self.flush():
                self.loop.remove_writer(self.fd)
                self.loop.add_reader(self.fd, self.on_readable)
        except OSError:
            self.close()

    def flush(self) -> bool:
        """Send as much of the pending buffers as the socket takes; True once all went out."""
        pending = self.pending
        try:
            sent = self.sock.send(pending[0]) if len(pending) == 1 else self.sock.sendmsg(pending)
        except (BlockingIOError, InterruptedError):
            return False
        self.pending = advance(pending, sent)
        return not self.pending

    def close(self) -> None:
        """Stop watching the socket and close it."""
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)
        self.sock.close()


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Serve on asyncio (or uvloop) until the process ends (plain TCP only)."""
    if ssl_context is not None:
        raise ValueError("the floor-reader system has no TLS variant")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        listener.setblocking(False)

        def accept() -> None:
            while True:
                try:
                    sock, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    return
                _Connection(loop, sock, counter)  # kept alive by its reader callback

        loop.add_reader(listener.fileno(), accept)
        host, port = listener.getsockname()[:2]
        ready(f"tcp://{host}:{port}")
        await loop.create_future()  # forever

    floor_asyncio.run_loop(case, main)
