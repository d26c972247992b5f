"""Task floor on asyncio and uvloop: the floor's server with a task woken per message.

The same ``BufferedProtocol`` as :mod:`benchmarks.systems.floor_asyncio` parses the
messages in the event loop's callback, but instead of answering there it hands each
message to one task per connection, which writes the reply. A task is woken through a
future only when it waits for a message (one per message when one request is in flight
per connection); messages that arrived together are answered in one wake-up.

This is the least any API that hands messages to a task per connection can do: no
library, no cancellation checks, no serialization, only the future, the task step and
the coroutine resumption. It measures how far such an API can get from the callback
floor on a workload, and so whether a target for a per-message API is reachable at all.
The client is the floor's.
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING, Any

from benchmarks.systems.floor_asyncio import _Sender, open_client, serve_protocol
from benchmarks.systems.framing import FrameReader, outgoing

if TYPE_CHECKING:
    import ssl

__all__ = ["open_client", "run_server"]


class _TaskEchoProtocol(_Sender, asyncio.BufferedProtocol):
    def __init__(self, counter: Any) -> None:
        super().__init__()
        self.counter = counter
        self.reader = FrameReader()
        self.messages: collections.deque[tuple[bytes, list[Any]]] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def get_buffer(self, sizehint: int) -> memoryview:  # noqa: ARG002
        return self.reader.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        messages = self.reader.buffer_updated(nbytes)
        if messages:
            self.messages.extend(messages)
            waiter = self.waiter
            if waiter is not None:
                self.waiter = None
                waiter.set_result(None)

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002
        if self.task is not None:
            self.task.cancel()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        messages = self.messages
        counter = self.counter
        while True:
            while messages:
                header, frames = messages.popleft()
                self.send(outgoing(header, frames))
                counter.n += 1
            self.waiter = waiter = loop.create_future()
            await waiter


def run_server(case: Any, ssl_context: ssl.SSLContext | None, counter: Any, ready: Any) -> None:
    """Serve on asyncio (or uvloop for the ``uvloop`` backend) until the process ends."""
    serve_protocol(case, ssl_context, ready, lambda: _TaskEchoProtocol(counter))
