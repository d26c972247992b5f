"""``Transport.drained``: after a read that returned a count, True only when what more can
be received shows as the socket's readiness (so the receive engines wait rather than read
again), on plain sockets and over TLS 1.2 and 1.3, on every backend. Whenever it says so,
the next read finds nothing before a wait; whenever OpenSSL still holds bytes or the end of
the session, it does not say so."""

from __future__ import annotations

import contextlib
import socket
from typing import TYPE_CHECKING

import anyio
import pytest

from anyio_comm._transports.rawsocket import SocketTransport
from anyio_comm._transports.tls import TLSTransport

from .certs import client_context, server_context
from .helpers import TLS_VERSIONS

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from anyio_comm._transports.base import Transport

pytestmark = pytest.mark.anyio

KINDS = ["tcp", "tls1.2", "tls1.3"]


@contextlib.asynccontextmanager
async def transport_pair(kind: str) -> AsyncIterator[tuple[Transport, Transport]]:
    """A sender and a receiver over a socket pair: plain, or TLS of that version."""
    a, b = socket.socketpair()
    sender: Transport = SocketTransport(a)
    receiver: Transport = SocketTransport(b)
    if kind != "tcp":
        version = TLS_VERSIONS[kind]
        sender = TLSTransport(
            sender, client_context(version), server_side=False, server_hostname="localhost"
        )
        receiver = TLSTransport(receiver, server_context(version), server_side=True)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(receiver.handshake)
                await sender.handshake()
    try:
        yield sender, receiver
    finally:
        sender.abort()
        receiver.abort()


async def read(transport: Transport, size: int) -> tuple[bytes | None, bool]:
    """One read without waiting, after the transport is readable (within 5 s): what it
    returned and whether it then said it is drained."""
    buffer = memoryview(bytearray(size))
    with anyio.fail_after(5):
        await transport.wait_readable()
    n = transport.receive_into_nowait(buffer)
    return (None if n is None else bytes(buffer[:n])), transport.drained


async def settle() -> None:
    """Let what was sent reach the other socket."""
    await anyio.sleep(0.02)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_read_that_took_everything_says_drained(kind: str) -> None:
    async with transport_pair(kind) as (sender, receiver):
        await sender.send_all([b"hello"])
        await settle()
        assert await read(receiver, 1000) == (b"hello", True)
        assert receiver.receive_into_nowait(memoryview(bytearray(1000))) is None


@pytest.mark.parametrize("kind", KINDS)
async def test_a_full_buffer_does_not_say_drained(kind: str) -> None:
    async with transport_pair(kind) as (sender, receiver):
        await sender.send_all([b"first"])
        await sender.send_all([b"second"])
        await settle()
        assert await read(receiver, 5) == (b"first", False)
        assert receiver.receive_into_nowait(memoryview(bytearray(1000))) == 6
        assert receiver.drained


@pytest.mark.parametrize("kind", KINDS)
async def test_the_peers_end_behind_the_data_is_seen_without_waiting_for_more(kind: str) -> None:
    """The data and the end of the peer's stream arrive together, and the peer keeps
    TCP open: after the read of the data, the end is read at once, or the socket is
    readable for it (a plain socket's end). Over TLS, where OpenSSL holds close_notify
    and the socket shows nothing, it does not say drained."""
    async with transport_pair(kind) as (sender, receiver):
        await sender.send_all([b"last words"])
        await sender.send_eof()
        await settle()
        data, drained = await read(receiver, 1000)
        assert data == b"last words"
        if kind != "tcp":
            assert not drained
        if drained:
            with anyio.fail_after(1):
                await receiver.wait_readable()
        assert receiver.receive_into_nowait(memoryview(bytearray(1000))) == 0


@pytest.mark.parametrize("kind", ["tls1.2", "tls1.3"])
async def test_records_openssl_holds_are_not_drained(kind: str) -> None:
    """Two records arrived; the buffer ends inside the second: OpenSSL holds its rest."""
    async with transport_pair(kind) as (sender, receiver):
        await sender.send_all([b"a" * 100])
        await sender.send_all([b"b" * 100])
        await settle()
        data, drained = await read(receiver, 150)
        assert (data, drained) == (b"a" * 100 + b"b" * 50, False)
        assert receiver.receive_into_nowait(memoryview(bytearray(1000))) == 50
        assert receiver.drained
