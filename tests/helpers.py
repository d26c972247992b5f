"""Shared helpers: connected comm pairs over every transport, leak counters."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import tempfile
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio.abc import SocketAttribute

import anyio_comm
from anyio_comm import Comm, _cancellation, rpc
from anyio_comm._backend import current_backend
from anyio_comm.testing import comm_pair

from .certs import client_context, server_context
from .conftest import HAVE_IPV6, HAVE_UNIX

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

#: every way to get a connected pair of comms
TRANSPORTS = [
    "tcp",
    pytest.param("tcp6", marks=pytest.mark.skipif(not HAVE_IPV6, reason="no IPv6 loopback")),
    pytest.param("unix", marks=pytest.mark.skipif(not HAVE_UNIX, reason="no Unix sockets")),
    "inproc",
    "memory",
    "anyio-tcp-stream",
    "tls1.2",
    "tls1.3",
]
#: the subset that goes through connect()/listen() with a plain address
ADDRESS_TRANSPORTS = TRANSPORTS[:4]
TLS_VERSIONS = {"tls1.2": ssl.TLSVersion.TLSv1_2, "tls1.3": ssl.TLSVersion.TLSv1_3}


@asynccontextmanager
async def temp_unix_address() -> AsyncIterator[str]:
    directory = tempfile.mkdtemp(prefix="acomm-")  # short: AF_UNIX paths are < 108 bytes
    try:
        yield f"unix://{directory}/s.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@asynccontextmanager
async def listen_address(kind: str) -> AsyncIterator[str]:
    if kind == "unix":
        async with temp_unix_address() as address:
            yield address
        return
    yield {
        "tcp": "tcp://127.0.0.1:0",
        "tcp6": "tcp://[::1]:0",
        "inproc": "inproc://",
        "tls1.2": "tls://127.0.0.1:0",
        "tls1.3": "tls://127.0.0.1:0",
    }[kind]


@asynccontextmanager
async def listen_arguments(
    kind: str,
) -> AsyncIterator[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Yield where to listen for ``kind`` (a transport of ``listen_address``, or
    ``"tls"``: TCP with the test certificates), with the keyword arguments of
    the listening side and of the connecting side."""
    async with listen_address("tcp" if kind == "tls" else kind) as address:
        if kind != "tls":
            yield address, {}, {}
            return
        yield (
            address.replace("tcp://", "tls://"),
            {"ssl_context": server_context()},
            {"ssl_context": client_context()},
        )


@asynccontextmanager
async def rpc_server_and_client(
    kind: str,
    methods: Any,
    *,
    connect_arguments: dict[str, Any] | None = None,
    **serve_arguments: Any,
) -> AsyncIterator[tuple[rpc.Server, rpc.Client]]:
    """An RPC server of ``methods`` listening over ``kind`` (as
    :func:`listen_arguments`), and a client connected to it (with
    ``connect_arguments`` besides)."""
    async with listen_arguments(kind) as (address, server_kwargs, client_kwargs):
        async with (
            rpc.serve(address, methods, **server_kwargs, **serve_arguments) as server,
            rpc.connect(
                server.address, timeout=10, **client_kwargs, **(connect_arguments or {})
            ) as client,
        ):
            yield server, client


@asynccontextmanager
async def connected_pair(kind: str, **options: Any) -> AsyncIterator[tuple[Comm, Comm]]:
    """Yield ``(client, server)`` comms connected over ``kind``; closes both."""
    if kind == "memory":
        client, server = await comm_pair(**options)
        async with client, server:
            yield client, server
        return
    if kind == "anyio-tcp-stream":
        multi = await anyio.create_tcp_listener(local_host="127.0.0.1")
        async with multi:
            (tcp_listener,) = multi.listeners
            port = tcp_listener.extra(anyio.abc.SocketAttribute.local_port)
            comms: list[Comm] = []

            async def accept() -> None:
                stream = await tcp_listener.accept()
                comms.append(await anyio_comm.from_stream(stream, **options))

            async def dial() -> None:
                stream = await anyio.connect_tcp("127.0.0.1", port)
                comms.insert(0, await anyio_comm.from_stream(stream, **options))

            async with anyio.create_task_group() as tg:
                tg.start_soon(accept)
                await dial()
        client, server = comms
        async with client, server:
            yield client, server
        return

    send, receive = anyio.create_memory_object_stream[Comm](1)
    done = anyio.Event()

    async def handler(comm: Comm) -> None:
        await send.send(comm)
        await done.wait()

    server_options = dict(options)
    client_options = dict(options)
    if kind in TLS_VERSIONS:
        server_options["ssl_context"] = server_context(TLS_VERSIONS[kind])
        client_options["ssl_context"] = client_context(TLS_VERSIONS[kind])
    async with send, receive, listen_address(kind) as address:
        async with anyio_comm.listen(address, handler, **server_options) as listener:
            client = await anyio_comm.connect(listener.address, timeout=10, **client_options)
            with anyio.fail_after(10):
                server = await receive.receive()
            try:
                async with client:
                    yield client, server
            finally:
                done.set()


def call_soon_outside_any_task(callback: Callable[[], object]) -> None:
    """Schedule ``callback`` as an event loop callback (no task is current there)."""
    backend = current_backend()
    if backend.trio is not None:
        backend.trio.current_trio_token().run_sync_soon(callback)
    else:
        assert backend.loop is not None
        backend.loop.call_soon(callback)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def running_tasks() -> int:
    return len(anyio.get_running_tasks())


#: cancel scope arrangements for :func:`in_scopes`
SCOPE_ARRANGEMENTS = ["", "p", "c", "pc", "cp", "cs", "sc", "csp", "cps", "pcsp", "scp", "ppp"]


async def in_scopes(arrange: str, body: Callable[[], Awaitable[None]]) -> None:
    """Await ``body()`` inside the cancel scopes ``arrange`` names, innermost
    last: ``c`` a cancelled scope, ``s`` a shielded one, ``p`` a plain one."""
    if not arrange:
        await body()
        return
    with anyio.CancelScope(shield=arrange[0] == "s") as scope:
        if arrange[0] == "c":
            scope.cancel()
        await in_scopes(arrange[1:], body)


def shrink_socket_buffers(
    client: anyio_comm.Comm, server: anyio_comm.Comm, size: int = 32768
) -> None:
    """Small kernel buffers between ``client`` and ``server`` (``size`` bytes
    each way), so that a producer blocks after a few hundred KB at most instead
    of megabytes."""
    client.extra(SocketAttribute.raw_socket).setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
    server.extra(SocketAttribute.raw_socket).setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


@contextmanager
def unknown_task_layout(monkeypatch: pytest.MonkeyPatch, *, trio: bool) -> Iterator[None]:
    """Make the layout of trio's runner (``trio``) or of AnyIO's asyncio task
    states one the comm's fast readers do not know, for the duration."""
    if trio:
        from trio._core import _run

        monkeypatch.delattr(_run.Runner, "ki_pending")
    else:
        from anyio._backends import _asyncio as backend

        monkeypatch.setattr(backend, "_task_states", object())
    _cancellation._trio_layout.cache_clear()
    _cancellation._anyio_layout.cache_clear()
    try:
        yield
    finally:
        monkeypatch.undo()
        _cancellation._trio_layout.cache_clear()
        _cancellation._anyio_layout.cache_clear()
