"""Sends made in a burst are written together, written behind the send
(``Comm.send``'s docstring and the ``_comm`` module docstring): nothing lost,
order kept, a caller's buffer never held, errors reported, the queue written by
``aclose`` and ``send_eof``, on every backend and transport."""

from __future__ import annotations

import contextlib
import socket
import ssl
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from anyio import BrokenResourceError, EndOfStream
from anyio.abc import SocketAttribute
from anyio.streams.tls import TLSAttribute

from anyio_comm import PeerClosed, PeerClosedError
from anyio_comm._comm import YIELD_EVERY
from anyio_comm._transports.rawsocket import SocketTransport
from anyio_comm._transports.tls import TLSTransport
from anyio_comm._transports.write_behind import BEHIND_LIMIT

from .certs import client_context, server_context
from .helpers import TLS_VERSIONS, TRANSPORTS, connected_pair, shrink_socket_buffers

pytestmark = [pytest.mark.anyio]

#: transports over a socket of the comm's own, which write behind (TLS: the
#: queued messages encrypted together when written)
SOCKETS = ["tcp", "unix", "tls1.2", "tls1.3"]


def peek(sock: socket.socket) -> int:
    """Bytes waiting in ``sock``, without taking them."""
    try:
        return len(sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except BlockingIOError:
        return 0


async def receive_n(comm: Any, count: int) -> list[Any]:
    with anyio.fail_after(10):
        return [await comm.receive() for _ in range(count)]


class CountingSocket(socket.socket):
    """A socket that counts its writes (swapped in as the class of a live one)."""

    __slots__ = ()
    writes = 0

    def send(self, *args: Any) -> int:
        CountingSocket.writes += 1
        return super().send(*args)

    def sendmsg(self, *args: Any) -> int:
        CountingSocket.writes += 1
        return super().sendmsg(*args)


async def stream_counted(client: Any, server: Any, counted: Any, messages: list[Any]) -> None:
    """Send ``messages`` in a stream from ``client`` while ``server`` reads them,
    with ``counted`` (a live socket or SSLObject) swapped to its counting class."""
    got: list[Any] = []

    async def read() -> None:
        got.extend(await receive_n(server, len(messages)))

    plain = type(counted)
    counting = CountingSocket if isinstance(counted, socket.socket) else CountingSSLObject
    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        counted.__class__ = counting
        counting.writes = 0
        try:
            for message in messages:
                await client.send(message)
        finally:
            counted.__class__ = plain
    assert got == messages


class CountingSSLObject(ssl.SSLObject):
    """An SSLObject that counts its encryptions (swapped in as the class of a live one)."""

    writes = 0

    def write(self, data: Any) -> int:
        CountingSSLObject.writes += 1
        return super().write(data)


@pytest.mark.parametrize("kind", SOCKETS)
async def test_a_stream_of_small_sends_is_written_a_burst_at_a_time(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        count = 40 * YIELD_EVERY
        raw = client.extra(SocketAttribute.raw_socket)
        await stream_counted(client, server, raw, list(range(count)))
        # one write per YIELD_EVERY messages (give or take the first and last)
        assert CountingSocket.writes <= count // YIELD_EVERY + 2


@pytest.mark.parametrize("kind", ["tls1.2", "tls1.3"])
async def test_over_tls_a_stream_of_small_sends_is_encrypted_a_burst_at_a_time(
    kind: str,
) -> None:
    async with connected_pair(kind) as (client, server):
        count = 40 * YIELD_EVERY
        sslobj = client.extra(TLSAttribute.ssl_object)
        messages = [{"n": n, "pad": b"p" * (n % 50)} for n in range(count)]
        await stream_counted(client, server, sslobj, messages)
        # one encryption per YIELD_EVERY messages (give or take the first and last)
        assert CountingSSLObject.writes <= count // YIELD_EVERY + 2


@pytest.mark.parametrize("kind", SOCKETS)
async def test_a_send_after_a_wait_is_written_at_once(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        raw = client.extra(SocketAttribute.raw_socket)
        for n in range(3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.send, f"request {n}")
                with anyio.fail_after(10):
                    assert await client.receive() == f"request {n}"
            raw.__class__ = CountingSocket
            CountingSocket.writes = 0
            try:
                await client.send(f"reply {n}")  # (no yield: nothing else could write it)
                assert CountingSocket.writes == 1
            finally:
                raw.__class__ = socket.socket
            with anyio.fail_after(10):
                assert await server.receive() == f"reply {n}"


@pytest.mark.parametrize("kind", SOCKETS)
async def test_a_send_that_would_overfill_the_queue_writes_it_with_its_own(kind: str) -> None:
    """The queue holds at most BEHIND_LIMIT bytes: the send that would pass it
    writes the queue and itself in one write, in order (over TLS the queue's
    room is reserved for the ciphertext of what the TLS transport keeps)."""
    size = 1900  # (small messages are queued whole: header and body in one bytes)
    per_batch = 10
    batches = 12 * (BEHIND_LIMIT // (size * per_batch) + 1)
    expected = [{"n": n, "pad": bytes([n % 256]) * size} for n in range(batches * per_batch)]
    async with connected_pair(kind) as (client, server):
        got: list[Any] = []

        async def read() -> None:
            got.extend(await receive_n(server, 1 + len(expected)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await client.send("first")  # (the first send of a connection writes at once)
            raw = client.extra(SocketAttribute.raw_socket)
            raw.__class__ = CountingSocket
            CountingSocket.writes = 0
            try:
                for start in range(0, len(expected), per_batch):
                    await client.send_batch(expected[start : start + per_batch])
            finally:
                raw.__class__ = socket.socket
        assert got == ["first", *expected]
        # a write per full queue and the batch that passed its limit (more where
        # the socket took a write in parts), not one per batch
        assert CountingSocket.writes < batches * 3 // 4


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_burst_arrives_while_the_sender_waits_on_something_else(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        got: list[Any] = []
        arrived = anyio.Event()

        async def read() -> None:
            got.extend(await receive_n(server, 5))
            arrived.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.05)
            for n in range(5):
                await client.send({"n": n})
            # The sender now waits on something that is not the comm: the queued
            # sends must go anyway (within the event loop's next pass).
            with anyio.fail_after(5):
                await arrived.wait()
        assert got == [{"n": n} for n in range(5)]


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_order_is_kept_across_queued_and_direct_writes(kind: str) -> None:
    big = bytes(range(256)) * 64  # out-of-band: written before send returns
    rounds: list[tuple[list[Any], list[Any]]] = []  # (sent one by one, then in a batch)
    for round_ in range(30):
        single: list[Any] = [{"r": round_, "i": i} for i in range(round_ % 11)]
        if round_ % 3 == 0:
            single.insert(len(single) // 2, big)
        batch = [{"batch": round_, "i": i} for i in range(3)] if round_ % 4 == 1 else []
        rounds.append((single, batch))
    expected = [m for single, batch in rounds for m in single + batch]
    async with connected_pair(kind) as (client, server):
        got: list[Any] = []

        async def read() -> None:
            got.extend(await receive_n(server, len(expected)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            for single, batch in rounds:
                for item in single:
                    await client.send(item)
                if batch:
                    await client.send_batch(batch)
        assert [bytes(m) if isinstance(m, memoryview) else m for m in got] == expected


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_buffer_sent_out_of_band_may_be_reused_once_send_returns(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        payload = bytearray(b"a" * 10_000)
        got: list[Any] = []

        async def read() -> None:
            got.extend(await receive_n(server, 4))

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await client.send(b"first")
            await client.send(b"second")  # (queued on a socket transport)
            await client.send(payload)  # in the burst, but the caller's buffer
            payload[:] = b"b" * 10_000  # reused as send's docstring allows
            await client.send(b"after")
        assert [bytes(m) for m in got] == [b"first", b"second", b"a" * 10_000, b"after"]


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_aclose_writes_the_queued_sends_first(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        async with anyio.create_task_group() as tg:
            got: list[Any] = []

            async def read() -> None:
                with anyio.fail_after(10):
                    try:
                        while True:
                            got.append(await server.receive())
                    except (EndOfStream, PeerClosed):
                        pass

            tg.start_soon(read)
            await anyio.sleep(0.05)
            for n in range(6):
                await client.send(n)
            with anyio.CancelScope() as scope:
                scope.cancel()  # a cancelled caller too: what send accepted goes
                await client.aclose()
        assert got == list(range(6))


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_send_eof_writes_the_queued_sends_first(kind: str) -> None:
    if kind == "memory":
        pytest.skip("the memory stream of comm_pair cannot half-close")
    async with connected_pair(kind) as (client, server):
        await anyio.sleep(0.05)
        for n in range(6):
            await client.send(n)
        await client.send_eof()
        assert await receive_n(server, 6) == list(range(6))
        with anyio.fail_after(5), pytest.raises(EndOfStream):
            await server.receive()
        await client.send_eof()  # (a no-op the second time)


class FailingSocket(socket.socket):
    """A socket whose writes fail as on a reset connection (swapped in as the
    class of a live one)."""

    __slots__ = ()

    def send(self, *args: Any) -> int:
        raise ConnectionResetError("reset by the test")

    def sendmsg(self, *args: Any) -> int:
        raise ConnectionResetError("reset by the test")


@pytest.mark.parametrize("kind", SOCKETS)
async def test_send_eof_raises_a_failure_of_the_queued_sends(kind: str) -> None:
    """What ``aclose()`` cannot report, ``send_eof()`` does: a queued write that
    failed (the messages' guide, "Streams of small messages")."""
    async with connected_pair(kind) as (client, _server):
        await client.send(0)  # (the first send of a connection writes at once)
        raw = client.extra(SocketAttribute.raw_socket)
        raw.__class__ = FailingSocket
        try:
            await client.send(1)  # queued: it returns, nothing raised yet
            with anyio.fail_after(10), pytest.raises(BrokenResourceError):
                await client.send_eof()
        finally:
            raw.__class__ = socket.socket


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_failed_write_is_reported_by_a_later_send(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        await server.aclose()
        await anyio.sleep(0.05)
        with anyio.fail_after(10), pytest.raises((BrokenResourceError, PeerClosedError)):
            for n in range(10_000):
                await client.send(n)
                if n % 3 == 0:
                    await anyio.sleep(0.001)
        # the comm is broken for good
        with pytest.raises((BrokenResourceError, PeerClosedError)):
            await client.send("more")


@pytest.mark.parametrize("kind", SOCKETS)
async def test_a_queue_the_socket_cannot_take_is_written_as_the_peer_reads(kind: str) -> None:
    """A peer that stops reading fills the socket: the queued writes wait for it
    and so does the sender (backpressure), and everything arrives in order."""
    async with connected_pair(kind) as (client, server):
        shrink_socket_buffers(client, server, 16384)
        count = 1000
        sent = 0
        got: list[Any] = []

        async def write() -> None:
            nonlocal sent
            for n in range(count):
                await client.send({"n": n, "pad": b"p" * 1000})
                sent += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await anyio.sleep(0.2)
            assert sent < count  # the sender waits for the peer
            with anyio.fail_after(20):
                got.extend(await receive_n(server, count))
        assert [m["n"] for m in got] == list(range(count))


# -- the socket transport's queue, on a socket pair -------------------------------


async def test_the_transport_writes_a_queue_the_socket_cannot_take_as_it_drains() -> None:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setblocking(False)
    transport = SocketTransport(a)
    try:
        chunks = [bytes([n]) * 1000 for n in range(60)]
        assert all(transport.send_later([chunk]) for chunk in chunks)
        assert not transport.send_later([b"x" * (BEHIND_LIMIT - 59_000)])  # over the limit
        assert not transport.send_later([bytearray(10)])  # not the transport's own bytes
        await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()
        # the socket took part of the queue; the rest waits for it, and so must
        # later sends, queued or not
        assert not transport.send_later([b"later"])
        received = bytearray()

        async def read() -> None:
            with anyio.fail_after(10):
                while len(received) < 60_000 + 5:
                    await anyio.wait_readable(b)
                    received.extend(b.recv(65536))

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            with anyio.fail_after(10):
                await transport.send_all([b"later"])
        assert bytes(received) == b"".join(chunks) + b"later"
        assert not transport.send_interrupted
    finally:
        await transport.aclose()
        b.close()


@pytest.mark.parametrize("cause", ["peer closed", "seal failed"])
@pytest.mark.parametrize("written_by", ["event loop", "next send"])
async def test_a_failed_queued_write_breaks_the_transport(cause: str, written_by: str) -> None:
    a, b = socket.socketpair()
    transport = SocketTransport(a)
    try:
        if cause == "peer closed":
            b.close()
            assert transport.send_later([b"lost"])
        else:
            sealer = Sealer()
            sealer.error = ValueError("the session above failed")
            assert sealer.queue(transport, b"lost")
        if written_by == "event loop":
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()
            assert transport.send_interrupted
            assert not transport.send_later([b"more"])
        with pytest.raises(BrokenResourceError):
            await transport.send_all([b"more"])
        assert transport.send_interrupted
    finally:
        await transport.aclose()
        b.close()


async def test_abort_and_aclose_write_the_queue() -> None:
    for close in ("abort", "aclose"):
        a, b = socket.socketpair()
        b.setblocking(False)
        transport = SocketTransport(a)
        assert transport.send_later([b"queued"])
        assert transport.send_later([b" twice"])
        if close == "abort":
            transport.abort()  # what the socket takes at once
        else:
            await transport.aclose()
        await anyio.sleep(0.01)
        assert b.recv(100) == b"queued twice"
        assert b.recv(100) == b""
        b.close()


async def test_abort_writes_only_what_the_socket_takes_at_once() -> None:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setblocking(False)
    transport = SocketTransport(a)
    chunk = b"z" * 1000
    while transport.send_later([chunk]):
        pass  # (up to BEHIND_LIMIT: more than the socket takes)
    transport.abort()  # (synchronous: it cannot wait)
    received = bytearray()
    while True:
        try:
            data = b.recv(65536)
        except BlockingIOError:
            break
        if not data:
            break
        received += data
    assert 0 < len(received) < BEHIND_LIMIT
    assert received == b"z" * len(received)
    b.close()


class Sealer:
    """A transport above the socket transport: what it reserved, sealed at the last moment."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.seals = 0
        self.error: Exception | None = None

    def queue(self, transport: SocketTransport, part: bytes) -> bool:
        if not transport.seal_later(len(part), self.seal):
            return False
        self.parts.append(part)
        return True

    def seal(self) -> bytes:
        self.seals += 1
        if self.error is not None:
            raise self.error
        sealed = b"[" + b"".join(self.parts) + b"]"
        self.parts.clear()
        return sealed


async def test_a_sealed_reservation_is_made_once_when_the_queue_is_written() -> None:
    a, b = socket.socketpair()
    b.setblocking(False)
    transport = SocketTransport(a)
    sealer = Sealer()
    try:
        assert transport.send_later([b"before "])
        assert sealer.queue(transport, b"one ")
        assert sealer.queue(transport, b"two")
        assert sealer.seals == 0  # (nothing is made before the queue is written)
        with anyio.fail_after(5):
            await anyio.wait_readable(b)
        assert sealer.seals == 1
        # the reservation takes its place in the queue where the first one was made
        assert b.recv(100) == b"before [one two]"
        # a send that writes takes the reservation first
        assert sealer.queue(transport, b"three")
        await transport.send_all([b" after"])
        assert sealer.seals == 2
        assert b.recv(100) == b"[three] after"
        # while a reservation waits, plain bytes are refused (they would go first)
        assert sealer.queue(transport, b"four")
        assert not transport.send_later([b"refused"])
        assert not transport.seal_later(1, Sealer().seal)  # one transport above at a time
        # the reservation counts toward the queue's limit
        assert sealer.queue(transport, b"x" * (BEHIND_LIMIT - 10))
        assert not sealer.queue(transport, b"y" * 20)
    finally:
        await transport.aclose()
        b.close()


async def test_abort_and_aclose_seal_the_reservation() -> None:
    for close in ("abort", "aclose"):
        a, b = socket.socketpair()
        b.setblocking(False)
        transport = SocketTransport(a)
        sealer = Sealer()
        assert transport.send_later([b"queued "])
        assert sealer.queue(transport, b"sealed")
        if close == "abort":
            transport.abort()
        else:
            await transport.aclose()
        await anyio.sleep(0.01)
        assert b.recv(100) == b"queued [sealed]"
        assert b.recv(100) == b""
        b.close()


@pytest.mark.parametrize("version", ["tls1.2", "tls1.3"])
async def test_over_tls_a_send_cancelled_before_writing_leaves_the_queue_to_be_written(
    version: str,
) -> None:
    """The TLS transport's kept messages were reported sent: a send that encrypts
    them first and is cancelled before writing leaves them queued (and written
    once the peer reads); its own message, reported not sent, does not follow."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client = TLSTransport(
        SocketTransport(a),
        client_context(TLS_VERSIONS[version]),
        server_side=False,
        server_hostname="localhost",
    )
    server = TLSTransport(
        SocketTransport(b), server_context(TLS_VERSIONS[version]), server_side=True
    )
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.handshake)
                await client.handshake()
        b.setblocking(False)
        filled = 0  # (bytes the peer has not read: the socket is full)
        with contextlib.suppress(BlockingIOError):
            while True:
                filled += a.send(b"J" * 65536)
        assert client.send_later([b"Q" * 100])  # reported sent
        with anyio.move_on_after(0.05) as scope:
            await client.send_all([b"C" * 100])
        assert scope.cancelled_caught
        assert client.send_interrupted  # (its message was encrypted: the session is done)
        received = bytearray()
        with anyio.fail_after(10):
            while len(received) < filled + 5 + 100:
                await anyio.wait_readable(b)
                received += b.recv(1 << 20)
            await anyio.sleep(0.05)  # (anything more would have come by now)
        with contextlib.suppress(BlockingIOError):
            received += b.recv(1 << 20)
        assert received[:filled] == b"J" * filled
        record = received[filled:]
        # one application-data record: the queued message, not the cancelled one
        assert record[0] == 23
        assert len(record) == 5 + int.from_bytes(record[3:5], "big")
        assert 100 < len(record) - 5 < 200
    finally:
        client.abort()
        server.abort()


async def test_a_queue_made_as_the_last_one_closes_is_written() -> None:
    """On trio the writing is one task, which ends when the last transport that
    queued closes: a transport queueing just then must still be written."""
    for _ in range(20):
        a, b = socket.socketpair()
        first = SocketTransport(a)
        assert first.send_later([b"one"])
        await anyio.lowlevel.checkpoint()
        first.abort()
        await anyio.lowlevel.checkpoint()
        c, d = socket.socketpair()
        d.setblocking(False)
        second = SocketTransport(c)
        try:
            assert second.send_later([b"two"])
            with anyio.fail_after(5):
                await anyio.wait_readable(d)
            assert d.recv(10) == b"two"
        finally:
            await second.aclose()
            for sock in (b, d):
                sock.close()


def fill(sock: socket.socket) -> int:
    """Write to ``sock`` until its buffers are full; return how much went."""
    sock.setblocking(False)
    total = 0
    try:
        while True:
            total += sock.send(b"f" * 65536)
    except BlockingIOError:
        return total


def drain(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    data = bytearray()
    try:
        while chunk := sock.recv(1 << 20):
            data += chunk
    except BlockingIOError:
        pass
    return bytes(data)


async def test_a_send_cancelled_before_writing_puts_the_queue_back() -> None:
    """The queue rides with the next send that writes; if that send is cancelled
    before anything went, the queue's messages (reported sent) must still go."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    transport = SocketTransport(a)
    try:
        filled = fill(a)
        assert transport.send_later([b"QUEUED"])
        with anyio.move_on_after(0.05) as scope:
            await transport.send_all([b"CANCELLED"])  # (the socket is full: it waits)
        assert scope.cancelled_caught
        assert not transport.send_interrupted
        received = bytearray()
        with anyio.fail_after(10):
            while len(received) < filled + len(b"QUEUED"):
                received += drain(b)
                await anyio.sleep(0.01)
        await anyio.sleep(0.05)
        received += drain(b)
        assert bytes(received[filled:]) == b"QUEUED"
        await transport.send_all([b"NEXT"])  # the transport is still usable
        with anyio.fail_after(10):
            await anyio.wait_readable(b)
        assert drain(b) == b"NEXT"
    finally:
        await transport.aclose()
        b.close()


async def test_a_queue_that_failed_while_the_socket_was_full_is_a_broken_resource() -> None:
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    transport = SocketTransport(a)
    fill(a)
    chunk = b"q" * 1000
    while transport.send_later([chunk]):
        pass
    await anyio.sleep(0.02)  # the queue's write waits for the socket
    b.close()  # and fails
    with anyio.fail_after(10), pytest.raises(BrokenResourceError):
        await transport.send_all([b"next"])
    assert transport.send_interrupted
    await transport.aclose()  # closes, raising nothing
    assert a.fileno() == -1


async def test_a_send_eof_cancelled_in_the_middle_of_the_queue_breaks_the_comm() -> None:
    class Stuck(SocketTransport):
        """A transport whose send_eof() wrote part of the queue, then waits."""

        __slots__ = ()

        async def send_eof(self) -> None:
            self._send_interrupted = True
            await anyio.sleep_forever()

    async with connected_pair("tcp") as (client, _server):
        client._transport.__class__ = Stuck
        with anyio.move_on_after(0.05):
            await client.send_eof()
        with pytest.raises(BrokenResourceError):
            await client.send("after")
