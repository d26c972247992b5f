"""``Transport.drained``: after a read that returned a count, True only when what more can
be received shows as the socket's readiness (so the receive engines wait rather than read
again), on plain sockets and over TLS 1.2 and 1.3, on every backend. Whenever it says so,
the next read finds nothing before a wait; whenever OpenSSL still holds bytes or the end of
the session, it does not say so."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
from typing import TYPE_CHECKING

import anyio
import pytest

from anyio_comm._transports.rawsocket import SocketTransport
from anyio_comm._transports.tls import FIRST_CIPHER_BUFFER, TLSTransport

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


# -- over TLS, against a peer whose ciphertext is cut where the test likes ------------


class Peer:
    """The other end: an ``SSLObject`` whose records the test sends on its socket."""

    def __init__(
        self, sslobj: ssl.SSLObject, outgoing: ssl.MemoryBIO, sock: socket.socket
    ) -> None:
        self.sslobj, self.outgoing, self.sock = sslobj, outgoing, sock

    def records(self, *payloads: bytes) -> bytes:
        """The ciphertext of one record per payload (not sent)."""
        for payload in payloads:
            self.sslobj.write(payload)
        return self.outgoing.read()

    def close_notify(self) -> bytes:
        with contextlib.suppress(ssl.SSLError):
            self.sslobj.unwrap()
        return self.outgoing.read()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)


@contextlib.asynccontextmanager
async def tls_receiver(kind: str) -> AsyncIterator[tuple[TLSTransport, Peer, socket.socket]]:
    """A server's TLS transport (and its socket) with its session set up in memory, and
    the client that talks to it."""
    version = TLS_VERSIONS[kind]
    a, b = socket.socketpair()
    receiver = TLSTransport(SocketTransport(b), server_context(version), server_side=True)
    ours = receiver._start_session()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    theirs = client_context(version).wrap_bio(incoming, outgoing, server_hostname="localhost")
    done = [False, False]
    while not all(done):
        for i, sslobj in enumerate((ours, theirs)):
            if not done[i]:
                with contextlib.suppress(ssl.SSLWantReadError):
                    sslobj.do_handshake()
                    done[i] = True
        incoming.write(receiver._outgoing.read())
        if not all(done):
            receiver._incoming.write(outgoing.read())
    receiver._outgoing.read()
    try:
        yield receiver, Peer(theirs, outgoing, a), b
    finally:
        receiver.abort()
        a.close()


def socket_readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def checked_read(
    transport: TLSTransport, sock: socket.socket, size: int = 65536
) -> tuple[bytes | None, bool]:
    """One read (after ``readable()`` if the socket is readable, as the readiness
    callback does); what it read and whether it said drained. When it says so, the next
    call answers None, and so does one after ``readable()`` while the socket shows
    nothing: OpenSSL holds nothing it could deliver."""
    if socket_readable(sock):
        transport.readable()
    buffer = memoryview(bytearray(size))
    n = transport.receive_into_nowait(buffer)
    drained = bool(n) and transport.drained
    if drained:
        assert transport.receive_into_nowait(memoryview(bytearray(65536))) is None
        if not socket_readable(sock):
            transport.readable()
            assert transport.receive_into_nowait(memoryview(bytearray(65536))) is None
    return (None if n is None else bytes(buffer[:n])), drained


TLS_KINDS = ["tls1.2", "tls1.3"]


@pytest.mark.parametrize("kind", TLS_KINDS)
async def test_a_record_cut_in_two(kind: str) -> None:
    async with tls_receiver(kind) as (transport, peer, sock):
        record = peer.records(b"x" * 100)
        peer.send(record[:10])
        assert checked_read(transport, sock) == (None, False)
        peer.send(record[10:])
        assert checked_read(transport, sock) == (b"x" * 100, True)


@pytest.mark.parametrize("kind", TLS_KINDS)
async def test_a_record_and_the_start_of_the_next(kind: str) -> None:
    """OpenSSL takes the first bytes of the second record: the socket has the rest."""
    async with tls_receiver(kind) as (transport, peer, sock):
        first = peer.records(b"a" * 100)
        second = peer.records(b"b" * 100)
        peer.send(first + second[:10])
        data, _ = checked_read(transport, sock)
        assert data == b"a" * 100
        assert checked_read(transport, sock) == (None, False)
        peer.send(second[10:])
        assert checked_read(transport, sock) == (b"b" * 100, True)


@pytest.mark.parametrize("kind", TLS_KINDS)
async def test_a_large_write_is_drained_only_at_its_end(kind: str) -> None:
    """100 KB in one write: the first reads fill the ciphertext buffer, so the socket
    is not empty yet."""
    async with tls_receiver(kind) as (transport, peer, sock):
        peer.send(peer.records(b"L" * 100_000))
        got = b""
        saids = []
        for _ in range(1000):
            data, drained = checked_read(transport, sock, 1 << 20)
            got += data or b""
            saids.append(drained)
            if drained or data is None:
                break
        assert got == b"L" * 100_000
        assert saids[-1] and not any(saids[:-1])


@pytest.mark.parametrize("kind", TLS_KINDS)
async def test_records_that_end_where_the_ciphertext_buffer_does(kind: str) -> None:
    """The first socket read fills the ciphertext buffer and ends at a record's end:
    OpenSSL holds nothing, yet the socket does: not drained."""
    async with tls_receiver(kind) as (transport, peer, sock):
        probe = peer.records(b"?")
        peer.send(probe)
        assert checked_read(transport, sock) == (b"?", True)
        payload = FIRST_CIPHER_BUFFER - (len(probe) - 1)
        records = peer.records(*[bytes([65 + i]) * payload for i in range(3)])
        assert len(records) == 3 * FIRST_CIPHER_BUFFER
        peer.send(records)
        assert checked_read(transport, sock, 1 << 20) == (b"A" * payload, False)


@pytest.mark.parametrize("kind", TLS_KINDS)
async def test_close_notify_in_a_later_segment_makes_the_socket_readable(kind: str) -> None:
    async with tls_receiver(kind) as (transport, peer, sock):
        peer.send(peer.records(b"last"))
        assert checked_read(transport, sock) == (b"last", True)
        peer.send(peer.close_notify())
        with anyio.fail_after(1):
            await transport.wait_readable()
        assert checked_read(transport, sock) == (b"", False)


@pytest.mark.parametrize("kind", TLS_KINDS)
async def test_a_tcp_close_after_a_drained_read_is_a_ragged_eof(kind: str) -> None:
    async with tls_receiver(kind) as (transport, peer, sock):
        peer.send(peer.records(b"last"))
        assert checked_read(transport, sock) == (b"last", True)
        peer.sock.shutdown(socket.SHUT_WR)
        with anyio.fail_after(1):
            await transport.wait_readable()
        with pytest.raises(anyio.BrokenResourceError, match="close_notify"):
            checked_read(transport, sock)


@pytest.mark.parametrize("kind", TLS_KINDS)
async def test_our_send_eof_between_reads(kind: str) -> None:
    """send_eof() keeps the unread ciphertext out of OpenSSL during its shutdown: the
    data behind is still read after it, and drained still tells the truth."""
    async with tls_receiver(kind) as (transport, peer, sock):
        peer.send(peer.records(b"a" * 10, b"b" * 10))
        assert checked_read(transport, sock, 10) == (b"a" * 10, False)
        await transport.send_eof()
        assert checked_read(transport, sock) == (b"b" * 10, True)
        peer.send(peer.records(b"c" * 10) + peer.close_notify())
        assert checked_read(transport, sock) == (b"c" * 10, False)
        assert checked_read(transport, sock) == (b"", False)
