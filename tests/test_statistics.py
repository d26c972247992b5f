"""Comm.statistics(), from its docstring and CommStatistics': each counter
checked against traffic of known size, on every backend and transport.

Sizes come from the wire format (docs/wire-format.md): a message of n frames
is a 4-byte frame count, n 8-byte lengths, then the frames; a compressed
frame carries an 8-byte compressed length before its bytes."""

from __future__ import annotations

import os
import socket
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio.abc import SocketAttribute

import anyio_comm
from anyio_comm import CloseCode, CloseReason, CommStatistics, Limits, ReceiveBudget

from .certs import client_context, server_context
from .helpers import (
    ADDRESS_TRANSPORTS,
    TRANSPORTS,
    connected_pair,
    listen_arguments,
    shrink_socket_buffers,
)

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Sequence

    from anyio.abc import ByteStream

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024
#: the transports over a socket of this process (tcp, unix, tls)
SOCKET_KINDS = {"tcp", "tcp6", "unix", "tls1.2", "tls1.3"}
#: messages of every shape, as their frames' sizes: the small one-frame
#: message, one read straight into its buffer, a body with a large frame, many
#: short frames, an empty frame and a message of no frame at all
SHAPES: list[list[int]] = [
    [10],
    [0],
    [1000],
    [100_000],
    [3 * MiB],
    [10, 5000],
    [100, 300_000],
    [20] * 40,
    [],
    [7, 0, 70_000, 3],
]


def wire_size(shape: Sequence[int]) -> int:
    return 4 + 8 * len(shape) + sum(shape)


def frames_of(shape: Sequence[int]) -> list[bytes]:
    return [bytes([index % 251]) * size for index, size in enumerate(shape)]


def delta(after: CommStatistics, before: CommStatistics) -> dict[str, int]:
    names = ["messages", "frames", "bytes"]
    change = {
        f"{name}_sent": getattr(after, f"{name}_sent") - getattr(before, f"{name}_sent")
        for name in names
    }
    change.update(
        {
            f"{name}_received": getattr(after, f"{name}_received")
            - getattr(before, f"{name}_received")
            for name in names
        }
    )
    return change


def is_push(kind: str, backend: str) -> bool:
    """Whether the event loop reads this comm ahead of its receives (the
    queue that queued_messages counts)."""
    return backend != "trio" and kind in SOCKET_KINDS


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_the_counters_follow_traffic_of_known_size(kind: str) -> None:
    """Each shape sent one way and echoed back: both ends count its messages,
    frames and wire bytes, each way, and the largest message."""
    with anyio.fail_after(30):
        async with connected_pair(kind) as (client, server):
            await client.send_frames([b"hello"])
            await server.receive_frames()
            await server.send_frames([b"hello"])
            await client.receive_frames()
            before = (client.statistics(), server.statistics())
            for shape in SHAPES:
                # (sent from a task: a large message waits for a receive to read it)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client.send_frames, frames_of(shape))
                    frames = await server.receive_frames()
                assert [bytes(frame) for frame in frames] == frames_of(shape)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(server.send_frames, frames)
                    echoed = await client.receive_frames()
                assert [len(frame) for frame in echoed] == shape
            after = (client.statistics(), server.statistics())
    one_way = {
        "messages": len(SHAPES),
        "frames": sum(map(len, SHAPES)),
        "bytes": sum(map(wire_size, SHAPES)),
    }
    expected = {f"{name}_{way}": n for name, n in one_way.items() for way in ("sent", "received")}
    assert delta(after[0], before[0]) == expected
    assert delta(after[1], before[1]) == expected
    largest = max(map(sum, SHAPES))
    for end in after:
        assert end.largest_message_sent == largest
        assert end.largest_message_received == largest
        assert end.queued_messages == 0
        assert end.queued_bytes == 0
    # Both ends count the same bytes of the stream, their preambles included.
    assert after[0].bytes_sent == after[1].bytes_received
    assert after[1].bytes_sent == after[0].bytes_received
    assert after[0].bytes_sent > one_way["bytes"] + wire_size([5])


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_batches_count_every_message(kind: str) -> None:
    shapes = [[10], [20, 30], [], [40_000]]
    with anyio.fail_after(30):
        async with connected_pair(kind) as (client, server):
            before = (client.statistics(), server.statistics())
            await client.send_frames_batch([frames_of(shape) for shape in shapes])
            received: list[Any] = []
            while len(received) < len(shapes):
                received += await server.receive_frames_batch()
            after = (client.statistics(), server.statistics())
    assert [[len(frame) for frame in frames] for frames in received] == shapes
    assert after[0].messages_sent - before[0].messages_sent == 4
    assert after[0].frames_sent - before[0].frames_sent == 4
    assert after[0].bytes_sent - before[0].bytes_sent == sum(map(wire_size, shapes))
    assert after[1].messages_received - before[1].messages_received == 4
    assert after[1].bytes_received - before[1].bytes_received == sum(map(wire_size, shapes))


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_batch_refused_whole_counts_nothing(kind: str) -> None:
    """A batch with a message over the peer's limits sends nothing, and
    counts nothing; one refused alone neither."""
    with anyio.fail_after(30):
        async with connected_pair(kind, limits=Limits(max_message_size=1000)) as (client, server):
            await client.send_frames([b"x"])
            await server.receive_frames()
            before = client.statistics()
            with pytest.raises(anyio_comm.LocalProtocolError):
                await client.send_frames_batch([[b"a" * 10], [b"b" * 2000], [b"c"]])
            with pytest.raises(anyio_comm.LocalProtocolError):
                await client.send_frames([b"b" * 2000])
            assert client.statistics() == before
            await client.send_frames([b"a" * 10])
            assert (await server.receive_frames())[0] == b"a" * 10
            after = client.statistics()
    assert after.messages_sent == before.messages_sent + 1
    assert after.bytes_sent == before.bytes_sent + wire_size([10])
    assert after.largest_message_sent == 10


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_queued_messages_are_those_no_receive_took_yet(
    kind: str, anyio_backend_name: str
) -> None:
    """Over a socket on asyncio and uvloop the event loop decodes messages
    ahead of the receives: they are received, and queued until taken. Elsewhere
    a message is received when a receive reads it, and nothing is queued."""
    sizes = [100, 2000, 30]
    with anyio.fail_after(30):
        async with connected_pair(kind) as (client, server):
            for size in sizes:
                await client.send_frames([b"q" * size])
            await anyio.sleep(0.1)
            if is_push(kind, anyio_backend_name):
                while server.statistics().queued_messages < len(sizes):
                    await anyio.sleep(0.01)
                queued = server.statistics()
                assert queued.messages_received == queued.queued_messages == len(sizes)
                assert queued.queued_bytes >= sum(sizes)
                await server.receive_frames()
                assert server.statistics().queued_messages == len(sizes) - 1
            else:
                assert server.statistics().messages_received == 0
                assert server.statistics().queued_messages == 0
                await server.receive_frames()
                assert server.statistics().messages_received == 1
            for _ in sizes[1:]:
                await server.receive_frames()
            done = server.statistics()
    assert done.messages_received == len(sizes)
    assert done.queued_messages == done.queued_bytes == 0


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_cancelled_send_is_not_counted(kind: str) -> None:
    """A send cancelled before any of its bytes went counts nothing: both
    ends still agree."""
    with anyio.fail_after(30):
        async with connected_pair(kind) as (client, server):
            await client.send_frames([b"first"])
            await server.receive_frames()
            before = client.statistics()
            with anyio.CancelScope() as scope:
                scope.cancel()
                await client.send_frames([b"x" * 100_000])
            with anyio.CancelScope() as scope:
                scope.cancel()
                await client.send_frames_batch([[b"a"], [b"b", b"c"]])
            assert client.statistics() == before
            await client.send_frames([b"last"])
            assert await server.receive_frames() == [b"last"]
            ours, theirs = client.statistics(), server.statistics()
    assert ours.messages_sent == theirs.messages_received == before.messages_sent + 1
    assert ours.bytes_sent == theirs.bytes_received
    assert ours.largest_message_sent == theirs.largest_message_received == 5


@pytest.mark.parametrize(
    "kind", [t for t in TRANSPORTS if getattr(t, "values", [t])[0] in {"tcp", "tcp6", "unix"}]
)
async def test_a_send_cancelled_while_it_waits_is_not_counted(kind: str) -> None:
    """Small sends to a peer that reads nothing, until one waiting for room is
    cancelled: once the peer read everything, both ends agree on what went.
    (Over TLS such a cancel breaks the connection: its records were begun.)"""
    with anyio.fail_after(30):
        async with connected_pair(kind) as (client, server):
            shrink_socket_buffers(client, server)
            sent = 0
            with anyio.move_on_after(0.3) as scope:
                while True:
                    await client.send_frames([b"s" * 1000])
                    sent += 1
            assert scope.cancelled_caught
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.send_frames, [b"end"])
                received = 0
                while bytes((await server.receive_frames())[0]) != b"end":
                    received += 1
            ours, theirs = client.statistics(), server.statistics()
    assert received == sent
    assert ours.messages_sent == theirs.messages_received
    assert ours.bytes_sent == theirs.bytes_received


@pytest.mark.parametrize(("size", "count"), [(MiB, 8), (1000, 4000)], ids=["1MiB", "1KB"])
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_send_waits_are_the_peers_backpressure(kind: str, size: int, count: int) -> None:
    """A peer that reads nothing for 0.3 s makes a sender of 8 MiB, in large
    messages or in small ones (which wait behind the queue written behind
    their sends), wait about that long over sockets; over other streams no
    wait is counted."""
    payload = b"w" * size
    with anyio.fail_after(30):
        async with connected_pair(kind) as (client, server):
            if kind in SOCKET_KINDS:
                shrink_socket_buffers(client, server)
            assert client.statistics().send_waits == 0

            async def send() -> None:
                for _ in range(count):
                    await client.send_frames([payload])

            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                await anyio.sleep(0.3)
                for _ in range(count):
                    assert await server.receive_frames() == [payload]
            waits = client.statistics()
    if kind in SOCKET_KINDS:
        assert waits.send_waits >= 1
        assert 0.2 <= waits.send_wait_seconds < 10
    else:
        assert waits.send_waits == 0
        assert waits.send_wait_seconds == 0.0
    assert server.statistics().send_waits == 0


async def _raw_peer(address: str, tls: bool) -> ByteStream:
    """A peer that speaks the wire format by hand: its preamble sent, the
    listener's read (at least its fixed part)."""
    host, port = address.split("://")[1].rsplit(":", 1)
    stream: ByteStream = await anyio.connect_tcp(
        host,
        int(port),
        tls=tls,
        ssl_context=client_context() if tls else None,
        tls_hostname="localhost" if tls else None,
    )
    from anyio_comm._sansio.wire import encode_preamble

    await stream.send(encode_preamble(Limits()))
    received = b""
    while len(received) < 32:
        received += await stream.receive()
    return stream


@asynccontextmanager
async def _budget_listener(
    scheme: str, handler: Any, budget: ReceiveBudget
) -> AsyncIterator[tuple[anyio_comm.Listener, dict[str, Any]]]:
    """A listener over ``scheme`` (tcp or tls) with ``budget``, and the keyword
    arguments of a client's connect()."""
    kwargs: dict[str, Any] = {"receive_budget": budget}
    client_kwargs: dict[str, Any] = {}
    if scheme == "tls":
        kwargs["ssl_context"] = server_context()
        client_kwargs["ssl_context"] = client_context()
    async with anyio_comm.listen(f"{scheme}://127.0.0.1:0", handler, **kwargs) as listener:
        yield listener, client_kwargs


@pytest.mark.parametrize("scheme", ["tcp", "tls"])
async def test_budget_waits_are_counted_with_their_time(scheme: str) -> None:
    """A peer holds 3 MiB of a 4 MiB budget with half a message for 0.3 s: a
    client's 3 MiB message waits for it, and its comm counts that wait."""
    from anyio_comm._sansio.wire import encode_header

    budget = ReceiveBudget(4 * MiB)
    comms: list[anyio_comm.Comm] = []
    got = anyio.Event()

    async def handler(comm: anyio_comm.Comm) -> None:
        comms.append(comm)
        async for frames in comm:
            assert len(frames) == 3 * MiB
            got.set()

    with anyio.fail_after(30):
        async with _budget_listener(scheme, handler, budget) as (listener, client_kwargs):
            holder = await _raw_peer(listener.address, scheme == "tls")
            body = bytes(3 * MiB)
            await holder.send(encode_header([len(body)]) + body[:MiB])
            while budget.in_use < 3 * MiB:
                await anyio.sleep(0.01)
            async with await anyio_comm.connect(
                listener.address, timeout=10, **client_kwargs
            ) as client:
                await client.send(bytes(3 * MiB))
                while budget.waiting < 1:
                    await anyio.sleep(0.01)
                (waiting,) = [comm for comm in comms if comm.statistics().budget_waits]
                assert waiting.statistics().budget_wait_seconds < 10
                await anyio.sleep(0.3)
                assert waiting.statistics().budget_wait_seconds >= 0.25  # (the current wait)
                during = listener.statistics().budget
                await holder.send(body[MiB:])
                await got.wait()
                counted = waiting.statistics()
                after = listener.statistics().budget
            await anyio.aclose_forcefully(holder)
    assert counted.budget_waits == 1
    assert 0.25 <= counted.budget_wait_seconds < 10
    assert client.statistics().budget_waits == 0  # (the client has no budget)
    assert during is not None and after is not None
    assert (during.max_bytes, during.waiting, during.waits) == (4 * MiB, 1, 1)
    assert during.in_use >= 3 * MiB
    assert during.wait_seconds >= 0.25  # (the wait in progress)
    assert (after.waiting, after.waits, after.stalls_closed) == (0, 1, 0)
    assert after.wait_seconds == pytest.approx(counted.budget_wait_seconds)


@pytest.mark.parametrize("scheme", ["tcp", "tls"])
async def test_connections_closed_for_stalling_are_counted(scheme: str) -> None:
    """A peer holds budget with half a message and stops while a client waits:
    it is closed after stall_timeout, and the budget counts it."""
    from anyio_comm._sansio.wire import encode_header

    budget = ReceiveBudget(3 * MiB, stall_timeout=0.3)
    with anyio.fail_after(30):
        async with _budget_listener(scheme, echo, budget) as (listener, client_kwargs):
            holder = await _raw_peer(listener.address, scheme == "tls")
            await holder.send(encode_header([2 * MiB]) + bytes(1000))
            await _until(lambda: budget.in_use >= 2 * MiB)
            async with await anyio_comm.connect(
                listener.address, timeout=10, **client_kwargs
            ) as client:
                await client.send(bytes(2 * MiB))
                assert len(await client.receive()) == 2 * MiB
            stats = listener.statistics()
            await anyio.aclose_forcefully(holder)
    assert stats.budget is not None
    assert stats.budget.stalls_closed == 1
    assert stats.budget.waits >= 1


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_close_reasons_are_kept_on_both_ends(kind: str) -> None:
    reason = CloseReason(0x4001, "done", "all sent")
    with anyio.fail_after(30):
        async with connected_pair(kind) as (client, server):
            assert client.statistics().close_reason is None
            assert server.statistics().peer_close_reason is None
            await client.aclose(reason)
            with pytest.raises(anyio_comm.PeerClosedOK):
                await server.receive()
            assert client.statistics().close_reason == reason
            assert server.statistics().peer_close_reason == reason
            assert server.statistics().close_reason is None


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_failure_told_to_the_peer_is_the_close_reason(kind: str) -> None:
    """A peer that breaks the protocol is told so, and the reason is kept."""
    with anyio.fail_after(30):
        async with connected_pair(kind) as (client, server):
            await client.send_frames([b"\xc1"])  # no msgpack value begins with 0xc1
            with pytest.raises(anyio_comm.ProtocolError):
                await server.receive()
            told = server.statistics().close_reason
            assert told is not None and told.code == CloseCode.PROTOCOL_ERROR
            with pytest.raises(anyio_comm.PeerClosedError):
                await client.receive()
            assert client.statistics().peer_close_reason == told


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_connect_and_handshake_times(kind: str) -> None:
    started = anyio.current_time()
    with anyio.fail_after(30):
        async with connected_pair(kind) as (client, server):
            elapsed = anyio.current_time() - started
            ours, theirs = client.statistics(), server.statistics()
    if kind in SOCKET_KINDS:  # (connect() over a socket)
        assert ours.connect_seconds is not None
        assert 0 <= ours.connect_seconds <= elapsed
    else:
        assert ours.connect_seconds is None
    assert theirs.connect_seconds is None  # (accepted, not opened)
    for end in (ours, theirs):
        assert 0 <= end.handshake_seconds <= elapsed
    if kind.startswith("tls"):
        assert ours.handshake_seconds > 0


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_compression_is_counted_both_ways(kind: str) -> None:
    """A compressible 1 MiB frame goes compressed: both ends count its bytes
    before and on the wire, which the byte counters carry; an incompressible
    one goes as it is and changes neither."""
    pytest.importorskip("cramjam")
    with anyio.fail_after(30):
        async with connected_pair(kind, compression="lz4") as (client, server):
            await client.send_frames([b"x"])
            await server.receive_frames()
            before = (client.statistics(), server.statistics())
            assert before[0].compression_ratio_sent is None
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.send_frames, [b"abcd" * (MiB // 4)])
                assert await server.receive_frames() == [b"abcd" * (MiB // 4)]
            after = (client.statistics(), server.statistics())
            noise = os.urandom(MiB)
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.send_frames, [noise])
                assert await server.receive_frames() == [noise]
            last = (client.statistics(), server.statistics())
    sent, received = after
    assert sent.compressed_bytes_sent == received.compressed_bytes_received == MiB
    wire = sent.compressed_wire_bytes_sent
    assert 8 < wire < MiB // 10
    assert received.compressed_wire_bytes_received == wire
    assert sent.bytes_sent - before[0].bytes_sent == 4 + 8 + wire
    assert received.bytes_received - before[1].bytes_received == 4 + 8 + wire
    assert sent.compression_ratio_sent == MiB / wire
    assert received.compression_ratio_received == MiB / wire
    assert sent.largest_message_sent == received.largest_message_received == MiB
    assert last[0].compressed_bytes_sent == MiB
    assert last[0].bytes_sent - sent.bytes_sent == wire_size([MiB])
    assert last[1].compressed_bytes_received == MiB


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_statistics_outlive_the_comm(kind: str) -> None:
    with anyio.fail_after(30):
        async with connected_pair(kind) as (client, server):
            await client.send_frames([b"z" * 99])
            await server.receive_frames()
        assert client.closed
        closed = client.statistics()
    assert closed.messages_sent == 1
    assert closed.largest_message_sent == 99


async def test_an_accepted_comm_counts_what_its_handler_sees() -> None:
    """The listener's side of a plain TCP connection, from its handler."""
    seen: list[CommStatistics] = []

    async def handler(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)
        seen.append(comm.statistics())

    with anyio.fail_after(30):
        async with anyio_comm.listen("tcp://127.0.0.1:0", handler) as listener:
            async with await anyio_comm.connect(listener.address) as client:
                for size in (1, 10, 100):
                    await client.send(b"m" * size)
                    await client.receive()
                client.extra(SocketAttribute.raw_socket).setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\0" * 8
                )
                mine = client.statistics()
            while not seen:
                await anyio.sleep(0.01)
    (theirs,) = seen
    assert theirs.messages_received == mine.messages_sent == 3
    assert theirs.messages_sent == mine.messages_received == 3
    assert theirs.bytes_received == mine.bytes_sent
    assert theirs.bytes_sent == mine.bytes_received


# -- listeners ------------------------------------------------------------------

LISTENER_KINDS = [*ADDRESS_TRANSPORTS, "tls"]


async def _raw_connect(address: str) -> ByteStream:
    if address.startswith("unix://"):
        return await anyio.connect_unix(address[len("unix://") :])
    host, port = address.split("://")[1].rsplit(":", 1)
    return await anyio.connect_tcp(host.strip("[]"), int(port))


async def _until(condition: Any) -> None:
    with anyio.fail_after(10):
        while not condition():
            await anyio.sleep(0.01)


@pytest.mark.parametrize("kind", LISTENER_KINDS)
async def test_a_listener_counts_its_connections_and_how_handlers_end(kind: str) -> None:
    """Three connections: their handlers return, raise, and let the end of
    the connection through."""
    release = anyio.Event()

    async def handler(comm: anyio_comm.Comm) -> None:
        what = await comm.receive()
        await release.wait()
        if what == "raise":
            raise ValueError("as asked")
        if what == "end":
            await comm.receive()  # the client closed: EndOfStream goes through

    async with listen_arguments(kind) as (address, server_kwargs, client_kwargs):
        async with anyio_comm.listen(address, handler, **server_kwargs) as listener:
            fresh = listener.statistics()
            assert (fresh.accepted, fresh.handshaking, fresh.active) == (0, 0, 0)
            assert fresh.refused == fresh.handshake_failures == fresh.handlers == {}
            assert fresh.budget is not None and fresh.budget.in_use == 0
            clients = [
                await anyio_comm.connect(listener.address, timeout=10, **client_kwargs)
                for _ in range(3)
            ]
            for client, what in zip(clients, ["return", "raise", "end"], strict=True):
                await client.send(what)
            await _until(lambda: listener.statistics().active == 3)
            assert listener.statistics().accepted == 3
            release.set()
            await clients[2].aclose()
            await _until(lambda: sum(listener.statistics().handlers.values()) == 3)
            ended = listener.statistics()
            for client in clients:
                await client.aclose()
    assert ended.accepted == 3
    assert ended.active == ended.handshaking == 0
    assert ended.handlers == {"returned": 1, "raised": 1, "connection-ended": 1}
    assert ended.handshake_failures == {}


@pytest.mark.parametrize("kind", [*ADDRESS_TRANSPORTS[:3], "tls"])
async def test_a_listener_counts_failed_handshakes_by_why(kind: str) -> None:
    """A peer that speaks another protocol, one that says nothing, and one
    that closes at once; over TLS, a peer that does not speak TLS."""
    async with listen_arguments(kind) as (address, server_kwargs, _):
        async with anyio_comm.listen(
            address, echo, handshake_timeout=0.3, **server_kwargs
        ) as listener:
            plain = listener.address.replace("tls://", "tcp://")
            foreign = await _raw_connect(plain)
            await foreign.send(
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" if kind != "tls" else b"\0" * 64
            )
            silent = await _raw_connect(plain)
            closing = await _raw_connect(plain)
            await closing.aclose()
            await _until(lambda: sum(listener.statistics().handshake_failures.values()) == 3)
            failed = listener.statistics()
            await foreign.aclose()
            await silent.aclose()
    expected = {"protocol" if kind != "tls" else "tls": 1, "timeout": 1, "closed": 1}
    assert failed.handshake_failures == expected
    assert failed.accepted == 3
    assert failed.handlers == {}
    assert failed.handshaking == 0


async def echo(comm: anyio_comm.Comm) -> None:
    async for message in comm:
        await comm.send(message)


@pytest.mark.parametrize("kind", [*ADDRESS_TRANSPORTS[:3], "tls"])
async def test_a_handshake_cut_by_shutdown_is_counted(kind: str) -> None:
    async with listen_arguments(kind) as (address, server_kwargs, _):
        async with anyio_comm.listen(address, echo, **server_kwargs) as listener:
            silent = await _raw_connect(listener.address.replace("tls://", "tcp://"))
            await _until(lambda: listener.statistics().handshaking == 1)
            await listener.shutdown(grace_period=1)
            cut = listener.statistics()
            await silent.aclose()
    assert cut.handshaking == 0
    assert cut.refused == {"shutdown": 1}
    assert cut.handshake_failures == {}
