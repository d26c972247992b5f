"""The Comm contract over every transport, on every backend."""

from __future__ import annotations

import socket

import anyio
import pytest
from anyio import (
    BrokenResourceError,
    BusyResourceError,
    ClosedResourceError,
    EndOfStream,
    wait_all_tasks_blocked,
)
from anyio.abc import SocketAttribute

from anyio_comm import (
    Comm,
    CommAttribute,
    Limits,
    LocalProtocolError,
    RemoteProtocolError,
    SerializationError,
    current_buffer_pool,
)
from anyio_comm._receivers import PushReceiver
from anyio_comm._sansio.pool import size_class

from .helpers import TRANSPORTS, call_soon_outside_any_task, connected_pair

pytestmark = pytest.mark.parametrize("kind", TRANSPORTS)


async def test_messages_roundtrip(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        message = {"op": "put", "n": [1, 2.5, None, True], "s": "x", "b": b"small"}
        await client.send(message)
        assert await server.receive() == message
        await server.send([1, (2, 3)])
        assert await client.receive() == [1, [2, 3]]


async def test_large_payload_is_zero_copy_memoryview(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        payload = bytes(range(256)) * 40_000  # 10 MB
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send, {"data": memoryview(payload), "tiny": b"t"})
            reply = await server.receive()
        data = reply["data"]
        assert isinstance(data, memoryview)
        assert data.nbytes == len(payload) and data.obj is not None
        # its own buffer: a slab of the event loop's buffer pool, of the frame's size class
        assert len(data.obj) == size_class(len(payload))
        assert current_buffer_pool().statistics().buffers_in_use >= 1
        assert data == payload
        assert reply["tiny"] == b"t"


async def test_values_travel_out_of_band_from_16_kib_by_default(kind: str) -> None:
    """The messages guide: a bytes-like value of at least ``oob_threshold`` bytes
    (16384 by default) arrives as a ``memoryview`` over a buffer of its own, a smaller
    one as ``bytes``; a comm given another threshold sends by that one."""
    async with connected_pair(kind) as (client, server):
        for nbytes in (4096, 16383, 16384, 40_000):
            data = bytes(range(256)) * (nbytes // 256) + b"x" * (nbytes % 256)
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.send, {"data": bytearray(data), "n": nbytes})
                reply = await server.receive()
            value = reply["data"]
            assert type(value) is (memoryview if nbytes >= 16384 else bytes), nbytes
            assert value == data
            assert reply["n"] == nbytes
    async with connected_pair(kind, oob_threshold=4096) as (client, server):
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send, {"data": b"y" * 4096})
            reply = await server.receive()
        assert type(reply["data"]) is memoryview
        assert reply["data"] == b"y" * 4096


async def test_several_messages_in_one_write(kind: str) -> None:
    """Comm._send_messages (the RPC writer's batch): the messages arrive in order, one
    over the peer's limits left out and reported, nothing of it sent."""
    async with connected_pair(kind, limits=Limits(max_message_size=1000)) as (a, b):
        messages = [
            [memoryview(b"one")],
            [memoryview(b"x" * 5000)],
            [memoryview(b"t"), memoryview(b"wo")],
        ]
        refused = await a._send_messages(messages)
        assert [index for index, _ in refused] == [1]
        assert isinstance(refused[0][1], LocalProtocolError)
        assert [bytes(f) for f in await b.receive_frames()] == [b"one"]
        assert [bytes(f) for f in await b.receive_frames()] == [b"t", b"wo"]
        await a.send({"still": "usable"})
        assert await b.receive() == {"still": "usable"}


async def test_frames_layer(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        frames = [b"header", bytearray(b"x" * 100_000), memoryview(b""), b"\x00" * 3]
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames, frames)
            received = await server.receive_frames()
        assert [bytes(f) for f in received] == [bytes(f) for f in frames]
        assert all(isinstance(f, memoryview) and not f.readonly for f in received)
        await client.send_frames([])
        assert await server.receive_frames() == []


async def test_large_and_small_messages_back_to_back(kind: str) -> None:
    """Messages read straight into their frames' buffers, each followed in the same
    writes by the next (large ones, a run of small ones, large ones of several
    frames, a large frame behind 4 KB of another): all arrive whole and in order,
    both ways, through both layers."""
    large = [bytes([i]) * (100_000 + i) for i in range(4)]
    batch = [
        {"data": large[0]},
        {"data": large[1]},
        *[{"n": i, "s": b"s" * (i % 50)} for i in range(40)],
        {"a": large[2], "b": b"x" * 70_000, "c": large[3]},
        {"data": b"y" * 300_000},
        {"n": -1},
    ]
    frames = [[b"h" * 4090, large[0]], [large[1][:20_000]], [large[2]], [b"t"]]
    async with connected_pair(kind) as (client, server):
        for sender, receiver in ((client, server), (server, client)):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send_batch, batch)
                assert [await receiver.receive() for _ in batch] == batch
            async with anyio.create_task_group() as tg:
                tg.start_soon(sender.send_frames_batch, frames)
                for expected in frames:
                    assert [bytes(f) for f in await receiver.receive_frames()] == expected


@pytest.mark.parametrize("count", [33, 16_384])
async def test_many_frame_messages(kind: str, count: int) -> None:
    """Messages of more than 32 frames, some shorter than 64 bytes (kept back to back
    until they are taken), in both directions, under and over the read-ahead buffer."""
    frames = [bytes([i % 251]) * (i % 70) for i in range(count)]
    async with connected_pair(kind) as (client, server):
        for sender, receiver in ((client, server), (server, client)):

            async def send(sender: Comm = sender) -> None:
                await sender.send_frames(frames)
                await sender.send_frames([b"after"])

            async with anyio.create_task_group() as tg:
                tg.start_soon(send)
                with anyio.fail_after(10):
                    received = await receiver.receive_frames()
                    after = await receiver.receive_frames()
            assert [bytes(f) for f in received] == frames
            assert all(not f.readonly for f in received)
            assert [bytes(f) for f in after] == [b"after"]


async def test_many_small_messages_in_order(kind: str) -> None:
    async with connected_pair(kind) as (client, server):

        async def produce() -> None:
            for i in range(2000):
                await client.send({"i": i, "pad": b"p" * (i % 50)})
            await client.send_eof()

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            received = [msg["i"] async for msg in server]
        assert received == list(range(2000))


async def test_eof_then_end_of_stream_repeatedly(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        await client.send("last")
        await client.send_eof()
        await client.send_eof()  # idempotent
        assert await server.receive() == "last"
        for _ in range(2):
            with pytest.raises(EndOfStream):
                await server.receive()
        with pytest.raises(ClosedResourceError):
            await client.send("after eof")
        # the other direction still works
        await server.send("reply")
        assert await client.receive() == "reply"


async def test_peer_close_is_end_of_stream(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        await client.send(1)
        await client.aclose()
        assert await server.receive() == 1
        with pytest.raises(EndOfStream):
            await server.receive()


def pushes(comm: Comm) -> bool:
    """The event loop reads for ``comm`` (asyncio or uvloop, over a socket)."""
    return isinstance(comm._receiver, PushReceiver)


async def wait_for_receive_ended(comm: Comm) -> None:
    with anyio.fail_after(10):
        while not comm.receive_ended:
            await anyio.sleep(0.005)


async def test_receive_ended_on_an_idle_comm(kind: str) -> None:
    """The peer's close is seen on a comm nobody receives from where the event loop
    reads; elsewhere once a receive reached it. Not before the messages sent before it."""
    async with connected_pair(kind) as (client, server):
        assert not client.receive_ended and not server.receive_ended
        await client.send("a")
        assert await server.receive() == "a"
        await client.send("b")
        await client.aclose()
        assert client.receive_ended  # closed by us
        await anyio.sleep(0.05)  # time for the end to arrive
        assert not server.receive_ended  # "b" is still to be received
        assert await server.receive() == "b"
        if pushes(server):
            await wait_for_receive_ended(server)
        else:
            await anyio.sleep(0.05)
            assert not server.receive_ended
            with pytest.raises(EndOfStream):
                await server.receive()
        assert server.receive_ended
        assert not server.closed  # the end of the peer's stream closes nothing here
        with pytest.raises(EndOfStream):
            await server.receive()


async def test_receive_ended_after_the_peer_aborts(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        await client.send("x")
        assert await server.receive() == "x"
        client.abort()
        await client.aclose()  # (closes a from_stream stream, which abort() cannot)
        if pushes(server):
            await wait_for_receive_ended(server)
        with anyio.fail_after(10), pytest.raises((EndOfStream, BrokenResourceError)):
            await server.receive()
        assert server.receive_ended


async def test_operations_after_close(kind: str) -> None:
    async with connected_pair(kind) as (client, _server):
        await client.aclose()
        await client.aclose()  # idempotent
        assert client.closed
        for op in (client.receive(), client.send(1), client.send_eof(), client.receive_frames()):
            with pytest.raises(ClosedResourceError):
                await op


async def test_close_wakes_blocked_receiver(kind: str) -> None:
    async with connected_pair(kind) as (client, _server):
        async with anyio.create_task_group() as tg:

            async def close_soon() -> None:
                await wait_all_tasks_blocked()
                await client.aclose()

            tg.start_soon(close_soon)
            with anyio.fail_after(5), pytest.raises(ClosedResourceError):
                await client.receive()


async def test_close_wakes_blocked_sender(kind: str) -> None:
    """A send blocked on a full socket (in ``anyio.wait_writable``) is woken by an
    aclose() from another task: AnyIO's ``notify_closing`` finds waits registered by
    any task of the loop (the socket transport relies on it and cancels no scopes of
    its own)."""
    if kind == "anyio-tcp-stream":
        pytest.skip("asyncio's transports may take every write into their own buffer")
    async with connected_pair(kind) as (client, _server):
        async with anyio.create_task_group() as tg:

            async def close_when_blocked() -> None:
                await wait_all_tasks_blocked()
                await client.aclose()

            tg.start_soon(close_when_blocked)
            with anyio.fail_after(10), pytest.raises((ClosedResourceError, BrokenResourceError)):
                while True:  # the peer does not read: some send blocks, then we close
                    await client.send_frames([b"x" * 1_000_000])
        assert client.closed


async def test_abort_is_synchronous_and_wakes_both_directions(kind: str) -> None:
    if kind == "anyio-tcp-stream":
        pytest.skip("asyncio's transports may take every write into their own buffer")
    async with connected_pair(kind) as (client, server):
        outcomes: list[type[BaseException]] = []

        async def expect_closed(operation: object) -> None:
            with anyio.fail_after(10):
                try:
                    while True:  # a blocked receive, or sends until one blocks
                        await operation()  # type: ignore[operator]
                except (ClosedResourceError, BrokenResourceError) as exc:
                    outcomes.append(type(exc))

        async with anyio.create_task_group() as tg:
            tg.start_soon(expect_closed, client.receive)
            tg.start_soon(expect_closed, lambda: client.send_frames([b"x" * 1_000_000]))
            await wait_all_tasks_blocked()
            client.abort()  # no await: callable from synchronous code
            client.abort()  # idempotent
        assert outcomes.count(ClosedResourceError) >= 1 and len(outcomes) == 2
        assert client.closed
        await client.aclose()  # a no-op now
        with pytest.raises(ClosedResourceError):
            await client.send(1)
        with anyio.fail_after(10), pytest.raises((EndOfStream, BrokenResourceError)):
            while True:  # the peer sees the connection end (a reset over TCP)
                await server.receive_frames()


async def test_abort_outside_any_task_wakes_a_blocked_receive(kind: str) -> None:
    """abort() from a loop callback (a finalizer, a signal handler, a protocol's
    callback): the blocked receive raises ClosedResourceError, the peer sees the end."""
    async with connected_pair(kind) as (client, server):
        outcome: list[BaseException] = []

        async def receive() -> None:
            with anyio.fail_after(10):
                try:
                    await client.receive()
                except ClosedResourceError as exc:
                    outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(receive)
            await wait_all_tasks_blocked()
            call_soon_outside_any_task(client.abort)
        assert len(outcome) == 1
        assert client.closed
        await client.aclose()
        with anyio.fail_after(10), pytest.raises((EndOfStream, BrokenResourceError)):
            await server.receive()


async def test_typed_attributes(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        assert client.extra(CommAttribute.local_address) == client.local_address
        assert client.extra(CommAttribute.peer_address) == client.peer_address
        assert server.extra(CommAttribute.peer_handshake) == server.peer_handshake
        assert client.peer_handshake.limits == Limits()


async def test_concurrent_receive_and_send_are_busy(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.receive)
            await wait_all_tasks_blocked()
            with pytest.raises(BusyResourceError):
                await client.receive()
            await server.send("unblock")
        if kind == "anyio-tcp-stream":
            return  # asyncio's transports take the whole write into their own buffer
        # a blocked sender: fill the pipe so that the first send blocks
        big = b"x" * 50_000_000
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames, [big])
            await wait_all_tasks_blocked()
            with pytest.raises(BusyResourceError):
                await client.send(1)
            tg.start_soon(server.receive_frames)


async def test_cancelled_receive_can_be_retried(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        with anyio.move_on_after(0.05):
            await server.receive()
        await client.send("hello")
        assert await server.receive() == "hello"


async def test_receive_cancelled_with_the_message_already_buffered_keeps_it(kind: str) -> None:
    """A receive that finds its message buffered still yields, and a cancellation
    there keeps the message for the next receive: nothing lost, nothing reordered."""
    async with connected_pair(kind) as (client, server):
        for i in range(3):
            await client.send(i)
        assert await server.receive() == 0
        await anyio.sleep(0.05)  # messages 1 and 2 arrive (read ahead with message 0 or not)
        with anyio.CancelScope() as scope:
            scope.cancel()
            await server.receive()
        assert scope.cancelled_caught
        assert [await server.receive(), await server.receive()] == [1, 2]
        await client.send(3)
        assert await server.receive() == 3


async def test_send_cancelled_mid_message_breaks_the_comm(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        scope = anyio.CancelScope()

        async def send_big() -> None:
            with scope:
                await client.send_frames([b"x" * 100_000_000])  # the peer does not read

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_big)
            await wait_all_tasks_blocked()  # the sender is blocked mid-message
            scope.cancel()
        if not scope.cancelled_caught and kind == "anyio-tcp-stream":
            pytest.skip("the asyncio transport buffered the whole write")
        assert scope.cancelled_caught
        with pytest.raises(BrokenResourceError):
            await client.send("more")
        with pytest.raises(BrokenResourceError):
            await client.receive()
        # the peer sees a broken connection, never a desynchronized stream
        if kind == "anyio-tcp-stream":
            # The generic path may already have handed every byte to asyncio's
            # transport, which can still deliver the whole message: only whole
            # messages may arrive, then the end.
            with anyio.fail_after(10), pytest.raises((BrokenResourceError, EndOfStream)):
                while True:
                    assert [f.nbytes for f in await server.receive_frames()] == [100_000_000]
            return
        with anyio.fail_after(10), pytest.raises(BrokenResourceError):
            await server.receive_frames()


async def test_send_cancelled_before_writing_keeps_the_comm(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        with anyio.CancelScope() as scope:
            scope.cancel()
            await client.send("never")
        assert scope.cancelled_caught
        await client.send("ok")
        assert await server.receive() == "ok"


async def test_serialization_error_sends_nothing(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        with pytest.raises(SerializationError):
            await client.send({"bad": {1, 2}})
        await client.send("fine")
        assert await server.receive() == "fine"


async def test_int_out_of_range_is_named(kind: str) -> None:
    """Comm.send of an int msgpack cannot encode says which and why; nothing is sent."""
    async with connected_pair(kind) as (client, server):
        with pytest.raises(SerializationError, match=r"^int 18446744073709551616 is out of "):
            await client.send({"n": 2**64})
        with pytest.raises(SerializationError, match=r"range \[-2\*\*63, 2\*\*64-1\]$"):
            await client.send([-(2**63) - 1])
        await client.send(2**64 - 1)
        assert await server.receive() == 2**64 - 1


async def test_peer_limits_checked_before_sending(kind: str) -> None:
    async with connected_pair(kind, limits=Limits(max_frame_size=1000)) as (client, server):
        assert client.peer_handshake.limits.max_frame_size == 1000
        with pytest.raises(LocalProtocolError, match="peer's limit"):
            await client.send_frames([b"x" * 1001])
        await client.send_frames([b"x" * 1000])
        assert len((await server.receive_frames())[0]) == 1000


async def test_pickle_opt_in(kind: str) -> None:
    async with connected_pair(kind, allow_pickle=True) as (client, server):
        await client.send({"set": {1, 2}, "c": complex(1, 2)})
        assert await server.receive() == {"set": {1, 2}, "c": complex(1, 2)}


async def test_frames_message_read_as_message_is_protocol_error(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        await client.send_frames([b"\xc1 not msgpack"])
        with pytest.raises(RemoteProtocolError):
            await server.receive()
        with pytest.raises(BrokenResourceError):
            await server.receive()
        with anyio.fail_after(10), pytest.raises((BrokenResourceError, EndOfStream)):
            await client.receive()


async def test_async_iteration_ends_on_close(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        for i in range(3):
            await client.send(i)
        await client.aclose()
        assert [m async for m in server] == [0, 1, 2]


async def test_async_iteration_ends_on_eof_and_raises_what_receive_raises(kind: str) -> None:
    """``async for`` ends where receive() raises EndOfStream (the peer's EOF) and
    raises everything else receive() raises: a body that is not msgpack."""
    async with connected_pair(kind) as (client, server):
        await client.send("a")
        await client.send_eof()
        with anyio.fail_after(10):
            assert [m async for m in server] == ["a"]
            assert [m async for m in server] == []  # (the end, again)
    async with connected_pair(kind) as (client, server):
        await client.send("a")
        await client.send_frames([b"\xc1 not msgpack"])
        received = []
        with anyio.fail_after(10), pytest.raises(RemoteProtocolError):
            async for m in server:
                received.append(m)
        assert received == ["a"]
        with pytest.raises(BrokenResourceError):
            await server.__anext__()


async def test_addresses_and_attributes(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        assert "://" in client.local_address and "://" in client.peer_address
        assert repr(client).startswith("<Comm ")
        if kind in ("tcp", "tcp6"):
            assert client.peer_address == server.local_address
            assert client.local_address == server.peer_address
            _host, port = client.extra(SocketAttribute.remote_address)
            assert port == client.extra(SocketAttribute.remote_port)
            for comm in (client, server):
                sock = comm.extra(SocketAttribute.raw_socket)
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                assert not sock.getblocking()
            assert client.peer_address.endswith(f":{port}")
        if kind == "unix":
            assert client.peer_address == server.local_address
            assert client.extra(SocketAttribute.family).name == "AF_UNIX"
