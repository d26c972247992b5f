"""Network faults between two comms, injected by :class:`tests.faultproxy.FaultProxy`.

Each test runs a listener whose handler records how its connection ended
(:class:`Service`), connects one client through the proxy (``"proxied"``)
and one directly (``"direct"``, the bystander), injects a fault on the
proxied path, and checks:

* the exact exception each end of the proxied connection gets, within a
  bounded time: ``EndOfStream`` for a clean FIN at a message boundary,
  ``BrokenResourceError`` for an EOF inside a message, for a reset, and over
  TLS for any TCP close without ``close_notify`` (a truncation attack looks
  exactly like that, so it is never reported as a clean end);
* what the handler saw (same rules, on the server side);
* that the bystander on the same listener is unaffected (a checksummed round
  trip) and that the listener forgets the broken connection.

Where the sending end of a cut must fail deterministically, the message is
much larger than everything that can be buffered between the sender and the
cut (the proxy's sockets and the senders' send buffers are small), so the
send cannot have completed before the cut.
"""

from __future__ import annotations

import functools
import hashlib
import random
import socket
import ssl
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio import BrokenResourceError, EndOfStream, wait_all_tasks_blocked
from anyio.abc import SocketAttribute

import anyio_comm
from anyio_comm import CloseCode, Comm, IdleTimeoutError, PeerClosedError, PeerClosedOK

from .certs import client_context, server_context
from .faultproxy import DIRECTIONS, FaultProxy, Policy

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable

KINDS = ["tcp", "tls1.3"]
#: socket buffer size for the proxied path (the kernel doubles it)
SMALL_BUFFER = 32 * 1024
#: far more than the proxied path can buffer: a send this large cannot finish before a cut
BIG = 2 * 1024 * 1024


@functools.lru_cache(maxsize=8)
def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@functools.cache
def tls_client_context() -> ssl.SSLContext:
    """Shared: building a context loads the system's CA store (tens of milliseconds)."""
    return client_context(ssl.TLSVersion.TLSv1_3)


def digest(data: Any) -> str:
    return hashlib.sha256(bytes(data)).hexdigest()


def shrink_send_buffer(comm: Comm) -> None:
    """A small kernel send buffer for ``comm``'s socket (under TLS too: the TCP socket).

    (Only the send buffer: shrinking the receive buffer of a connected socket leaves
    TCP waiting on its timers.)
    """
    sock: socket.socket = comm.extra(SocketAttribute.raw_socket)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)


@dataclass
class Ending:
    """What the handler of one connection saw.

    Attributes:
        received: the ``seq`` of every message it received, in order.
        error: the exception that ended the connection for it.
        done: set when the handler returned.
    """

    received: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    done: anyio.Event = field(default_factory=anyio.Event)


class Service:
    """A listener's handler: greets, serves requests, records how each connection ended.

    A client first sends ``{"hello": name, "small_buffers": bool}``; the
    handler answers ``{"welcome": name}``. Then, per message:

    * ``op="echo"``: send the message back;
    * ``op="send"``: send ``{"seq", "data": payload(size, seed)}``;
    * ``op="digest"``: send ``{"seq", "sha": sha256(data)}``;
    * ``op="sink"``: nothing.

    On ``EndOfStream`` the handler sends ``{"bye": number of messages}``
    (best effort) and returns.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.endings: dict[str, Ending] = {}
        self._listener: anyio_comm.Listener | None = None

    @property
    def listener(self) -> anyio_comm.Listener:
        assert self._listener is not None
        return self._listener

    @property
    def port(self) -> int:
        return int(self.listener.address.rsplit(":", 1)[1])

    async def handler(self, comm: Comm) -> None:
        hello = await comm.receive()
        if hello["small_buffers"]:
            shrink_send_buffer(comm)
        ending = self.endings[hello["hello"]] = Ending()
        try:
            await comm.send({"welcome": hello["hello"]})
            while True:
                try:
                    message = await comm.receive()
                except EndOfStream as exc:
                    ending.error = exc
                    try:
                        await comm.send({"bye": len(ending.received)})
                    except (BrokenResourceError, anyio.ClosedResourceError):
                        pass
                    return
                ending.received.append(message["seq"])
                op = message["op"]
                if op == "echo":
                    await comm.send(message)
                elif op == "send":
                    data = payload(message["size"], message["seed"])
                    await comm.send({"seq": message["seq"], "data": data})
                elif op == "digest":
                    await comm.send({"seq": message["seq"], "sha": digest(message["data"])})
        except Exception as exc:
            ending.error = exc
        finally:
            ending.done.set()

    def address(self, port: int) -> str:
        scheme = "tls" if self.kind == "tls1.3" else "tcp"
        return f"{scheme}://127.0.0.1:{port}"

    async def connect(
        self, port: int, name: str, *, small_buffers: bool = False, **options: Any
    ) -> Comm:
        """Connect to ``127.0.0.1:port`` (the listener or a proxy) and greet as ``name``."""
        if self.kind == "tls1.3":
            options["ssl_context"] = tls_client_context()
        with anyio.fail_after(10):
            comm = await anyio_comm.connect(self.address(port), timeout=10, **options)
            try:
                if small_buffers:
                    shrink_send_buffer(comm)
                await comm.send({"hello": name, "small_buffers": small_buffers})
                assert await comm.receive() == {"welcome": name}
            except BaseException:
                await comm.aclose()
                raise
        return comm

    async def ending(self, name: str) -> Ending:
        """Wait for the handler of ``name`` to return."""
        with anyio.fail_after(10):
            while name not in self.endings:
                await anyio.sleep(0.005)
            ending = self.endings[name]
            await ending.done.wait()
        return ending


@asynccontextmanager
async def running_service(kind: str) -> AsyncIterator[Service]:
    service = Service(kind)
    ssl_context = server_context(ssl.TLSVersion.TLSv1_3) if kind == "tls1.3" else None
    address = service.address(0)
    async with anyio_comm.listen(address, service.handler, ssl_context=ssl_context) as listener:
        service._listener = listener
        yield service


@asynccontextmanager
async def scenario(
    kind: str, **client_options: Any
) -> AsyncIterator[tuple[Service, FaultProxy, Comm, Comm]]:
    """Yield ``(service, proxy, proxied, direct)``; on exit, check the bystander is fine.

    ``client_options`` go to the proxied client's ``connect()``.
    """
    async with running_service(kind) as service:
        direct = await service.connect(service.port, "direct")
        async with direct:
            async with FaultProxy("127.0.0.1", service.port, buffer_size=SMALL_BUFFER) as proxy:
                proxied = await service.connect(
                    proxy.port, "proxied", small_buffers=True, **client_options
                )
                async with proxied:
                    yield service, proxy, proxied, direct
            await assert_unaffected(service, direct)


async def assert_unaffected(service: Service, direct: Comm) -> None:
    """The bystander still round-trips checksummed data; the proxied connection is gone."""
    with anyio.fail_after(10):
        for seq, size in enumerate((10, 100_000)):
            data = payload(size, seq)
            await direct.send({"op": "echo", "seq": seq, "data": data, "sha": digest(data)})
            reply = await direct.receive()
            assert reply["seq"] == seq and digest(reply["data"]) == reply["sha"] == digest(data)
        while service.listener.active_connections != 1:
            await anyio.sleep(0.005)
    assert "direct" in service.endings and not service.endings["direct"].done.is_set()


async def expect(exc_type: type[BaseException], operation: Callable[[], Any]) -> None:
    """``await operation()`` raises exactly ``exc_type`` (not a subclass) within 10 s."""
    with anyio.fail_after(10), pytest.raises(exc_type) as info:
        await operation()
    assert type(info.value) is exc_type, repr(info.value)


def clean_end(kind: str) -> type[BaseException]:
    """What a receiver gets for a TCP FIN at a message boundary: over TLS, without
    ``close_notify``, it is a truncation, never a clean end."""
    return EndOfStream if kind == "tcp" else BrokenResourceError


# --- the peer disappears ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_cut_at_message_boundary(kind: str, reset: bool) -> None:
    """Both ends idle between messages; the path closes: FIN is a clean end, RST is not."""
    async with scenario(kind) as (service, proxy, proxied, _direct):
        await proxied.send({"op": "echo", "seq": 0, "data": b"x"})
        assert (await proxied.receive())["seq"] == 0
        proxy.cut(reset=reset)
        expected = BrokenResourceError if reset else clean_end(kind)
        await expect(expected, proxied.receive)
        await expect(BrokenResourceError if proxied.closed else expected, proxied.receive)
        ending = await service.ending("proxied")
        assert type(ending.error) is expected and ending.received == [0]
        assert proxy.connections[0].reset is reset


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reset", [False, True], ids=["fin", "rst"])
async def test_server_disappears_during_the_handshake(kind: str, reset: bool) -> None:
    """The server -> client path dies inside the listener's preamble (TCP) or its
    first TLS flight: connect fails with BrokenResourceError, or for a FIN in the
    TLS handshake with ssl.SSLEOFError, and the listener goes on serving others."""
    async with running_service(kind) as service:
        direct = await service.connect(service.port, "direct")
        async with direct:
            async with FaultProxy("127.0.0.1", service.port) as proxy:
                proxy.cut_downstream(10 if kind == "tcp" else 100, reset=reset)
                expected: type[BaseException] = BrokenResourceError
                if kind == "tls1.3" and not reset:
                    expected = ssl.SSLEOFError
                await expect(expected, lambda: service.connect(proxy.port, "proxied"))
            await assert_unaffected(service, direct)


#: where an upstream or downstream cut falls, as an offset into the next message's bytes
#: (for TLS: ciphertext, so "header" is inside the first record's 5-byte header)
CUT_POINTS = {
    ("tcp", "header"): 6,  # inside the frame-length table
    ("tcp", "frame"): BIG // 2,
    ("tls1.3", "header"): 3,
    ("tls1.3", "record"): 100,  # inside the first record: message header, body, frame start
    ("tls1.3", "frame"): BIG // 2,  # inside a record in the middle of the frame
}
CUT_CASES = [
    pytest.param(kind, where, reset, id=f"{kind}-{where}-{'rst' if reset else 'fin'}")
    for (kind, where) in CUT_POINTS
    for reset in (False, True)
    if not reset or where == "frame"
]


@pytest.mark.parametrize(("kind", "where", "reset"), CUT_CASES)
async def test_client_disappears_mid_message(kind: str, where: str, reset: bool) -> None:
    """The client -> server path dies inside a large message: the handler's receive
    fails with BrokenResourceError (never a partial message), and so does the client's
    send, which cannot have finished."""
    async with scenario(kind) as (service, proxy, proxied, _direct):
        proxy.cut_upstream(proxy.upstream_bytes + CUT_POINTS[kind, where], reset=reset)
        data = memoryview(payload(BIG, 1))
        await expect(
            BrokenResourceError, lambda: proxied.send({"op": "sink", "seq": 1, "data": data})
        )
        assert proxied.closed
        await expect(BrokenResourceError, lambda: proxied.send({"op": "echo", "seq": 2}))
        await expect(BrokenResourceError, proxied.receive)
        ending = await service.ending("proxied")
        assert type(ending.error) is BrokenResourceError and ending.received == []
        assert proxy.connections[0].reset is reset


@pytest.mark.parametrize(("kind", "where", "reset"), CUT_CASES)
async def test_server_disappears_mid_message(kind: str, where: str, reset: bool) -> None:
    """The server -> client path dies inside a large reply: the client's receive fails
    with BrokenResourceError, and so does the handler's send."""
    async with scenario(kind) as (service, proxy, proxied, _direct):
        proxy.cut_downstream(proxy.downstream_bytes + CUT_POINTS[kind, where], reset=reset)
        await proxied.send({"op": "send", "seq": 1, "size": BIG, "seed": 1})
        await expect(BrokenResourceError, proxied.receive)
        assert proxied.closed
        await expect(BrokenResourceError, proxied.receive)
        await expect(BrokenResourceError, lambda: proxied.send({"op": "echo", "seq": 2}))
        ending = await service.ending("proxied")
        assert type(ending.error) is BrokenResourceError and ending.received == [1]
        assert proxy.connections[0].reset is reset


# --- half-open connections ------------------------------------------------------------------


async def test_half_close_towards_server() -> None:
    """Only client -> server ends (a FIN): the server sees the end of the stream after
    every message, and can still answer; the client receives that, then the end."""
    async with scenario("tcp") as (service, proxy, proxied, _direct):
        for seq in range(3):
            await proxied.send({"op": "sink", "seq": seq})
        with anyio.fail_after(10):
            while len(service.endings["proxied"].received) < 3:
                await anyio.sleep(0.005)
        proxy.half_close_upstream()
        with anyio.fail_after(10):
            assert await proxied.receive() == {"bye": 3}
        await expect(EndOfStream, proxied.receive)
        ending = await service.ending("proxied")
        assert type(ending.error) is EndOfStream and ending.received == [0, 1, 2]


async def test_half_close_towards_server_over_tls() -> None:
    """Over TLS a bare FIN is a truncation: the server's comm breaks, and the client
    then sees its peer close without close_notify."""
    async with scenario("tls1.3") as (service, proxy, proxied, _direct):
        await proxied.send({"op": "sink", "seq": 0})
        with anyio.fail_after(10):
            while not service.endings["proxied"].received:
                await anyio.sleep(0.005)
        proxy.half_close_upstream()
        ending = await service.ending("proxied")
        assert type(ending.error) is BrokenResourceError and ending.received == [0]
        await expect(BrokenResourceError, proxied.receive)


@pytest.mark.parametrize("kind", KINDS)
async def test_half_close_towards_client(kind: str) -> None:
    """Only server -> client ends: the client's receive reports it (EndOfStream over
    TCP, BrokenResourceError over TLS); over TCP it can still send, and the server
    gets every message, then the client's own end of stream."""
    async with scenario(kind) as (service, proxy, proxied, _direct):
        proxy.half_close_downstream()
        await expect(clean_end(kind), proxied.receive)
        ending_error: type[BaseException] = BrokenResourceError
        received = []
        if kind == "tcp":
            await expect(EndOfStream, proxied.receive)  # and again
            for seq in range(3):
                await proxied.send({"op": "sink", "seq": seq})
            await proxied.send_eof()
            ending_error, received = EndOfStream, [0, 1, 2]
        else:
            assert proxied.closed
            await proxied.aclose()  # the client's FIN reaches the server: a ragged EOF
        ending = await service.ending("proxied")
        assert type(ending.error) is ending_error and ending.received == received


# --- a stalled peer -------------------------------------------------------------------------


#: where the stream stalls inside the next message (for TLS: inside a record's header,
#: then inside a record in the middle of the frame)
STALL_POINTS = {"tcp": (7, BIG // 3), "tls1.3": (3, BIG // 3)}


@pytest.mark.parametrize("kind", KINDS)
async def test_receive_timeout_on_stalled_peer_then_resume(kind: str) -> None:
    """A reply stalls mid-message: a receive under fail_after times out, the comm stays
    usable, and once the path resumes the next receive delivers the whole reply."""
    async with scenario(kind) as (service, proxy, proxied, _direct):
        for seq, offset in enumerate(STALL_POINTS[kind]):
            stall_at = proxy.downstream_bytes + offset
            proxy.stall_downstream(stall_at)
            await proxied.send({"op": "send", "seq": seq, "size": BIG, "seed": seq})
            with anyio.fail_after(10):
                # receive while the reply flows up to the stall: each of these short
                # receives times out in the middle of the message, and the next resumes it
                while proxy.downstream_bytes < stall_at:
                    with anyio.move_on_after(0.02):
                        message = await proxied.receive()
                        pytest.fail(f"a message got past the stall: {message!r}")
            with pytest.raises(TimeoutError), anyio.fail_after(0.05):
                await proxied.receive()
            assert not proxied.closed
            assert proxy.downstream_bytes == stall_at  # the rest really was held back
            proxy.resume()
            with anyio.fail_after(10):
                reply = await proxied.receive()
            assert reply["seq"] == seq and reply["data"] == payload(BIG, seq)
        await proxied.send({"op": "echo", "seq": 9, "data": b"after"})
        with anyio.fail_after(10):
            assert await proxied.receive() == {"op": "echo", "seq": 9, "data": b"after"}
    ending = service.endings["proxied"]
    assert ending.received == [0, 1, 9]


@pytest.mark.parametrize("kind", KINDS)
async def test_send_timeout_on_stalled_peer_breaks_the_comm(kind: str) -> None:
    """A send whose timeout expires while it waits on the stalled path, after it wrote
    part of its message, breaks the comm (the stream cannot be resynchronized); the
    handler gets the truncation once the path resumes, never a message."""
    async with scenario(kind) as (service, proxy, proxied, _direct):
        proxy.stall_upstream()
        data = memoryview(payload(BIG, 1))
        timeouts: list[anyio.CancelScope] = []

        async def send_with_timeout() -> None:
            with pytest.raises(TimeoutError), anyio.fail_after(10) as timeout:
                timeouts.append(timeout)
                await proxied.send({"op": "sink", "seq": 1, "data": data})

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send_with_timeout)
                await wait_all_tasks_blocked()  # the send wrote what fits, and waits
                timeouts[0].deadline = anyio.current_time()  # the timeout expires
        assert proxied.closed
        await expect(BrokenResourceError, lambda: proxied.send({"op": "echo", "seq": 2}))
        await expect(BrokenResourceError, proxied.receive)
        proxy.resume()
        ending = await service.ending("proxied")
        assert type(ending.error) is BrokenResourceError and ending.received == []


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["boundary", "mid-message"])
async def test_idle_timeout_on_stalled_peer(kind: str, where: str) -> None:
    """The client has an idle_timeout and the reply stalls: IdleTimeoutError (a
    BrokenResourceError) either way. Between messages nothing is lost, so the comm
    closes gracefully and the handler sees a clean end of stream (over TLS too:
    close_notify is sent); inside a message the connection is broken, and the
    handler's send of the rest fails once the path resumes."""
    async with scenario(kind, idle_timeout=0.3) as (service, proxy, proxied, _direct):
        boundary = where == "boundary"
        stall_at = proxy.downstream_bytes + (0 if boundary else 100)
        proxy.stall_downstream(stall_at)
        # between messages: a small reply, which the handler's send hands to the kernel
        size = 10 if boundary else BIG
        await proxied.send({"op": "send", "seq": 1, "size": size, "seed": 1})
        with anyio.fail_after(10):
            await proxy.wait_forwarded("downstream", stall_at)  # already in our socket
        await expect(IdleTimeoutError, proxied.receive)
        assert proxied.closed
        await expect(BrokenResourceError, proxied.receive)
        if not boundary:
            proxy.resume()  # the handler, blocked sending the rest, now fails
        ending = await service.ending("proxied")
        assert ending.received == [1]
        if boundary:
            # the client said why: IDLE_TIMEOUT, a clean close (an EndOfStream)
            assert type(ending.error) is PeerClosedOK
            assert ending.error.reason.code is CloseCode.IDLE_TIMEOUT
        else:
            # the handler's send fails: the peer's close record, if it was read by
            # then (MESSAGE_TIMEOUT: a message was cut short), else a broken pipe
            assert type(ending.error) in (BrokenResourceError, PeerClosedError)
            if isinstance(ending.error, PeerClosedError):
                assert ending.error.reason.code is CloseCode.MESSAGE_TIMEOUT


# --- slow, fragmented paths -----------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_delayed_byte_by_byte_session_is_intact_and_in_order(kind: str) -> None:
    """Every chunk delayed, every write a single byte (the handshake included for
    TCP; for TLS from the first message on): a dozen pipelined messages, one with an
    out-of-band frame, arrive intact and in order (read_buffer_size 4096, so the
    1100-byte frame is read straight into its own buffer, a byte at a time). Then
    the same session goes on with frames of 300 KB written in pieces of 997 bytes,
    still delayed."""
    one_byte = Policy(delay=0.001, split=1)
    options: dict[str, Any] = {"read_buffer_size": 4096, "oob_threshold": 1024}
    async with running_service(kind) as service:
        start = one_byte if kind == "tcp" else Policy()
        async with FaultProxy(
            "127.0.0.1", service.port, upstream=start, downstream=start
        ) as proxy:
            comm = await service.connect(proxy.port, "proxied", **options)
            async with comm:
                for direction in DIRECTIONS:
                    proxy.set_policy(direction, delay=0.001, split=1)
                sizes = [i * 7 % 40 for i in range(12)]
                sizes[7] = 1100  # out-of-band
                requests: list[dict[str, Any]] = [
                    {"op": "digest", "seq": seq, "data": payload(size, seq)}
                    for seq, size in enumerate(sizes)
                ]

                async def send_all() -> None:
                    for request in requests:
                        await comm.send(request)

                with anyio.fail_after(20):
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(send_all)
                        for request in requests:
                            reply = await comm.receive()
                            assert reply == {"seq": request["seq"], "sha": digest(request["data"])}

                for direction in DIRECTIONS:
                    proxy.set_policy(direction, delay=0.002, split=997)
                large = [
                    {"op": "echo", "seq": 100 + i, "data": payload(300_000 + i, i)}
                    for i in range(2)
                ]
                with anyio.fail_after(20):
                    for request in large:
                        await comm.send(request)
                        reply = await comm.receive()
                        assert reply["seq"] == request["seq"] and reply["data"] == request["data"]
            ending = await service.ending("proxied")
    assert ending.received == [r["seq"] for r in requests + large]
    assert type(ending.error) is EndOfStream
