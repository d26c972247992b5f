"""A closed connection leaves no reference cycle behind (every backend, every transport).

What a connection allocates is freed by reference counting as it closes, not by
the cyclic garbage collector later: the buffers it held go back at once, and a
server under a storm of short connections does not pay for collections that
pause its event loop (the tls-storm scenario of ``benchmarks/hostile_peers.py``).

Each test disables the collector, runs connections that end one way, collects
with ``gc.DEBUG_SAVEALL`` and looks for objects of anyio_comm in the garbage.
"""

from __future__ import annotations

import contextlib
import gc
import ssl
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import anyio_comm

from .certs import client_context, server_context
from .helpers import TLS_VERSIONS, TRANSPORTS, connected_pair, listen_address

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
    from contextlib import AbstractAsyncContextManager as AsyncContextManager

    Pair = tuple[anyio_comm.Comm, anyio_comm.Comm]

pytestmark = pytest.mark.anyio

ROUNDS = 3  # connections per test, after one that warms up the code paths


def _ours(obj: object) -> str | None:
    """A description of ``obj`` if anyio_comm made it (an instance of one of its
    classes, or a frame of its code), else None."""
    frame_code = getattr(obj, "f_code", None)
    if frame_code is not None and "anyio_comm" in frame_code.co_filename:
        return f"frame of {frame_code.co_qualname}"
    module = getattr(type(obj), "__module__", "") or ""
    if module.startswith("anyio_comm"):
        return f"{module}.{type(obj).__qualname__}"
    return None


@contextlib.contextmanager
def no_cycles() -> Iterator[None]:
    """Fail if what runs inside leaves garbage with anyio_comm objects in it."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            found = sorted({d for obj in gc.garbage if (d := _ours(obj)) is not None})
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    finally:
        if enabled:
            gc.enable()
    assert not found, f"reference cycles hold: {found}"


async def leaves_no_cycles(one: Callable[[], Awaitable[None]]) -> None:
    """Run ``one()`` once (which warms up the code paths), then ``ROUNDS`` times
    under :func:`no_cycles`."""
    await one()
    with no_cycles():
        for _ in range(ROUNDS):
            await one()


async def _round_trip(client: anyio_comm.Comm, server: anyio_comm.Comm) -> None:
    with anyio.fail_after(10):
        await client.send({"x": b"y" * 100})
        await server.send(await server.receive())
        await client.receive()


@contextlib.asynccontextmanager
async def pair_factory(kind: str) -> AsyncIterator[Callable[[], AsyncContextManager[Pair]]]:
    """Yield a function that opens a connected ``(client, server)`` pair over
    ``kind``; the listener behind them (if any) outlives the pairs."""
    if kind in ("memory", "anyio-tcp-stream"):
        yield lambda: connected_pair(kind)
        return
    send, receive = anyio.create_memory_object_stream[tuple[anyio_comm.Comm, anyio.Event]](1)

    async def handler(comm: anyio_comm.Comm) -> None:
        done = anyio.Event()
        await send.send((comm, done))
        await done.wait()

    server_options: dict[str, Any] = {}
    client_options: dict[str, Any] = {}
    if kind in TLS_VERSIONS:
        server_options["ssl_context"] = server_context(TLS_VERSIONS[kind])
        client_options["ssl_context"] = client_context(TLS_VERSIONS[kind])

    @contextlib.asynccontextmanager
    async def new_pair() -> AsyncIterator[Pair]:
        with anyio.fail_after(10):
            client = await anyio_comm.connect(listener.address, **client_options)
            server, done = await receive.receive()
        try:
            async with client:
                yield client, server
        finally:
            done.set()
            with anyio.fail_after(10):
                while listener.active_connections:
                    await anyio.sleep(0.005)

    async with send, receive, listen_address(kind) as address:
        async with anyio_comm.listen(address, handler, **server_options) as listener:
            yield new_pair


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_closed_comms(kind: str) -> None:
    async with pair_factory(kind) as new_pair:

        async def one() -> None:
            async with new_pair() as (client, server):
                await _round_trip(client, server)
                await server.aclose()

        await leaves_no_cycles(one)


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_comm_whose_peer_aborted(kind: str) -> None:
    # The survivor's receive raises (a reset; on TLS an EOF without close_notify):
    # the error it keeps for the next receive must not hold its comm in a cycle.
    async with pair_factory(kind) as new_pair:

        async def one() -> None:
            async with new_pair() as (client, server):
                await _round_trip(client, server)
                client.abort()
                await client.aclose()  # (a stream that cannot close synchronously)
                with anyio.fail_after(10):
                    for _ in range(2):
                        with pytest.raises((anyio.BrokenResourceError, anyio.EndOfStream)):
                            await server.receive()
                await server.aclose()

        await leaves_no_cycles(one)


@pytest.mark.parametrize("tls", [None, "tls1.3"])
async def test_listener_connections(tls: str | None) -> None:
    """The ways a listener's connection ends: a handler that returns, a peer that
    resets in the handler, one that sends no preamble, one that sends garbage,
    and (TLS) one that completes its handshake and leaves."""
    options: dict[str, Any] = {"handshake_timeout": 0.2}
    client_options: dict[str, Any] = {}
    if tls is not None:
        options["ssl_context"] = server_context(TLS_VERSIONS[tls])
        client_options["ssl_context"] = client_context(TLS_VERSIONS[tls])

    async def echo(comm: anyio_comm.Comm) -> None:
        with contextlib.suppress(anyio.BrokenResourceError):
            async for message in comm:
                await comm.send(message)

    async with listen_address(tls or "tcp") as address:
        async with anyio_comm.listen(address, echo, **options) as listener:
            host, port = listener.address.split("://")[1].rsplit(":", 1)

            async def raw() -> anyio.abc.ByteStream:
                return await anyio.connect_tcp(host, int(port))

            # (each way in a function of its own: the client's objects are out of
            # reach of what the others leave, such as the cycle that anyio's TLS
            # stream leaves on trio and Python 3.12 when it is closed forcefully)
            async def graceful() -> None:
                async with await anyio_comm.connect(listener.address, **client_options) as comm:
                    await comm.send(b"x")
                    await comm.receive()

            async def reset() -> None:
                comm = await anyio_comm.connect(listener.address, **client_options)
                await comm.send(b"x")
                await comm.receive()
                comm.abort()

            async def silent() -> None:  # until the timeout
                async with await raw() as stream:
                    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                        await stream.receive()

            async def garbage() -> None:
                async with await raw() as stream:
                    await stream.send(b"GET / HTTP/1.1\r\n\r\n")
                    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                        while True:
                            await stream.receive()

            async def tls_and_leave() -> None:
                context = client_options["ssl_context"]
                assert isinstance(context, ssl.SSLContext)
                stream = await anyio.connect_tcp(
                    host, int(port), ssl_context=context, tls_hostname="localhost"
                )
                await anyio.aclose_forcefully(stream)

            async def one() -> None:
                with anyio.fail_after(10):
                    for way in (graceful, reset, silent, garbage):
                        await way()
                    if tls is not None:
                        await tls_and_leave()
                    # the server's side of each ends before the next round
                    while listener.active_connections:
                        await anyio.sleep(0.01)

            await leaves_no_cycles(one)
