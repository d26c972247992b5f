"""The systems compared by :mod:`benchmarks.compare`, one module each.

Every module implements the same small interface:

* ``run_server(case, ssl_context, counter, ready)``: bind ``127.0.0.1`` on a
  free port, call ``ready(address)`` once listening, then echo every message
  back, adding one to ``counter.n`` (or to a cell of ``counter``) per echoed
  message, until the process ends. It owns the event loop (or threads) of the
  server process.
* for the asynchronous systems, ``async open_client(stack, address, case,
  ssl_context) -> roundtrip``: open one connection (closed by ``stack``) and
  return a coroutine function doing one request/reply round trip; the caller
  runs it under ``anyio.run`` with the case's backend.
* for the blocking floor, ``open_blocking(stack, address, case, ssl_context) ->
  roundtrip``: the same with a plain function, run in one thread per
  connection.

Every round trip sends ``case.frames`` frames of ``case.size`` bytes and checks
the sizes of the reply periodically (:class:`benchmarks.systems.framing.Checker`).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType


@dataclass(frozen=True)
class System:
    """A system of the comparison and the backends it runs on."""

    name: str
    backends: tuple[str, ...]  # the backends of plain TCP cases
    tls_backends: tuple[str, ...]  # the backends of TLS cases (empty: no TLS)
    modules: tuple[tuple[str, str], ...]  # (backend, module under benchmarks.systems)
    requires: tuple[str, ...] = ()  # importable packages the system needs
    blocking: bool = False  # client is synchronous and runs in threads
    diagnostic: bool = False  # measured only when named in --systems, not by default
    description: str = ""

    def module(self, backend: str) -> ModuleType:
        """The module implementing this system on ``backend``."""
        name = dict(self.modules)[backend]
        return importlib.import_module(f"benchmarks.systems.{name}")

    def missing(self) -> list[str]:
        """The required packages that are not installed."""
        return [name for name in self.requires if importlib.util.find_spec(name) is None]


ASYNC_BACKENDS = ("asyncio", "uvloop", "trio")

SYSTEMS: dict[str, System] = {
    system.name: system
    for system in (
        System(
            "anyio-comm",
            ASYNC_BACKENDS,
            ASYNC_BACKENDS,
            tuple((backend, "comm") for backend in ASYNC_BACKENDS),
            description="anyio_comm.connect/listen, messages {'data': [frames]}",
        ),
        System(
            "anyio-comm-pull",
            ("asyncio", "uvloop"),
            ("asyncio", "uvloop"),
            tuple((backend, "comm_pull") for backend in ("asyncio", "uvloop")),
            diagnostic=True,
            description="anyio-comm with the pull receive engine (the receiving task reads), "
            "to compare with the default push engine on asyncio and uvloop",
        ),
        System(
            "anyio-comm-nopool",
            ASYNC_BACKENDS,
            ASYNC_BACKENDS,
            tuple((backend, "comm_nopool") for backend in ASYNC_BACKENDS),
            diagnostic=True,
            description="anyio-comm receiving every frame into fresh memory "
            "(allocator=default_allocator), to compare with the default buffer pool",
        ),
        System(
            "floor",
            ASYNC_BACKENDS,
            ("asyncio", "uvloop"),
            (("asyncio", "floor_asyncio"), ("uvloop", "floor_asyncio"), ("trio", "floor_trio")),
            description="no library: asyncio BufferedProtocol (asyncio, uvloop) or "
            "trio.socket recv_into/sendmsg (trio)",
        ),
        System(
            "floor-reuse",
            ASYNC_BACKENDS,
            (),
            tuple((backend, "floor_reuse") for backend in ASYNC_BACKENDS),
            diagnostic=True,
            description="the floor receiving each frame into the same buffer every message "
            "(allocated and faulted in once): the sockets' and the event loop's own cost",
        ),
        System(
            "floor-reader",
            ("asyncio", "uvloop"),
            (),
            tuple((backend, "floor_reader") for backend in ("asyncio", "uvloop")),
            diagnostic=True,
            description="the asyncio/uvloop floor's server on its own sockets: loop.add_reader "
            "callbacks recv_into the same buffers and answer with send/sendmsg (add_writer "
            "when the socket is full), to compare its server CPU with the BufferedProtocol "
            "floor's",
        ),
        System(
            "floor-task",
            ("asyncio", "uvloop"),
            ("asyncio", "uvloop"),
            tuple((backend, "floor_task") for backend in ("asyncio", "uvloop")),
            diagnostic=True,
            description="the asyncio/uvloop floor's server with a task per connection woken "
            "through a future for each message it waits for: the least a per-message API that "
            "hands messages to a task can cost, to tell which targets such an API can reach",
        ),
        System(
            "floor-blocking",
            ("threads",),
            ("threads",),
            (("threads", "floor_blocking"),),
            blocking=True,
            description="blocking sockets, a thread per connection, recv_into/sendmsg",
        ),
        System(
            "floor-blocking-reuse",
            ("threads",),
            ("threads",),
            (("threads", "floor_blocking_reuse"),),
            blocking=True,
            diagnostic=True,
            description="floor-blocking receiving each frame into the same buffer every "
            "message (allocated and faulted in once): the sockets' own cost",
        ),
        System(
            "anyio-streams",
            ASYNC_BACKENDS,
            ASYNC_BACKENDS,
            tuple((backend, "streams") for backend in ASYNC_BACKENDS),
            description="plain AnyIO TCP streams (TLSStream over TLS), "
            "BufferedByteReceiveStream.receive_exactly",
        ),
        System(
            "anyio-echo",
            ASYNC_BACKENDS,
            ASYNC_BACKENDS,
            tuple((backend, "streams_echo") for backend in ASYNC_BACKENDS),
            description="plain AnyIO TCP streams written the plainest way: an 8-byte length "
            "prefix, stream.receive() accumulated into a bytearray, one stream.send() per "
            "message",
        ),
        System(
            "dask",
            ("asyncio",),
            ("asyncio",),
            (("asyncio", "dask_tcp"),),
            requires=("distributed",),
            description="distributed.comm tcp:// and tls:// (tornado), to_serialize "
            "frames, deserialize=False",
        ),
        System(
            "zmq",
            ("asyncio",),
            (),
            (("asyncio", "zmq_echo"),),
            requires=("zmq",),
            description="pyzmq DEALER/ROUTER with zmq.asyncio, frames as message parts",
        ),
    )
}
