"""The socket transport's promises, observed on real sockets."""

from __future__ import annotations

import gc
import itertools
import socket
import warnings
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from anyio.abc import SocketAttribute
from anyio.lowlevel import checkpoint

import anyio_comm
from anyio_comm._receivers import (
    MAX_QUEUED_BYTES,
    MAX_QUEUED_MESSAGES,
    PullReceiver,
    PushMode,
    PushReceiver,
)
from anyio_comm._sansio.budget import FRAME_COST
from anyio_comm._sansio.connection import ReceiveStatus
from anyio_comm._transports.rawsocket import IOV_MAX, SocketTransport, _LoopReader

from .certs import client_context, server_context
from .helpers import connected_pair, shrink_socket_buffers

TASK_MODES = (PushMode.TASK_READS, PushMode.TASK_YIELD_DUE, PushMode.TASK_YIELDING)

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable


async def test_large_frames_are_received_into_their_own_buffer() -> None:
    allocated: list[bytearray] = []

    def allocator(n: int) -> bytearray:
        allocated.append(bytearray(n))
        return allocated[-1]

    async with connected_pair("tcp", allocator=allocator) as (client, server):
        transport = server._transport
        assert isinstance(transport, SocketTransport)
        direct = 0
        original = transport.receive_into_nowait

        def spy(buffer: memoryview) -> int | None:
            nonlocal direct
            n = original(buffer)
            if n and allocated and buffer.obj is allocated[-1]:
                direct += n
            return n

        transport.receive_into_nowait = spy  # type: ignore[method-assign]
        payload = bytes(range(256)) * 40_000  # 10 MB
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames, [payload])
            (frame,) = await server.receive_frames()
        assert frame.obj is allocated[-1]
        assert frame == payload
        # all but at most one read-ahead buffer's worth went straight into the frame
        assert direct >= len(payload) - 65536


async def test_more_buffers_than_iov_max_and_partial_sends() -> None:
    frames = [bytes([i % 256]) * 3000 for i in range(IOV_MAX * 3 + 7)]
    async with connected_pair("tcp") as (client, server):
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames, frames)
            received = await server.receive_frames()
        assert [bytes(f) for f in received] == frames


@pytest.mark.parametrize("kind", ["tcp", "unix", "tls1.3", "inproc", "memory"])
async def test_receive_engine_per_backend_and_transport(
    kind: str, anyio_backend_name: str
) -> None:
    """The event loop reads (push) on asyncio and uvloop over sockets; the task reads
    (pull) on trio and over byte streams."""
    async with connected_pair(kind) as (client, server):
        push = anyio_backend_name == "asyncio" and kind in ("tcp", "unix", "tls1.3")
        for comm in (client, server):
            expected = PushReceiver if push else PullReceiver
            assert type(comm._receiver) is expected  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["tcp", "tls1.3"])
async def test_push_engine_stops_reading_at_its_queue_bound(
    kind: str, anyio_backend_name: str
) -> None:
    """A consumer that stops receiving: the loop's callback decodes up to the queue's
    bound, then stops reading (no busy loop; the kernel's buffers fill and the peer's
    sends block); receiving again reads again, and every message arrives in order."""
    if anyio_backend_name != "asyncio":
        pytest.skip("the push engine runs on asyncio and uvloop")
    count = 3000  # 2 MB: more than the kernel's buffers hold (made small)
    async with connected_pair(kind) as (client, server):
        shrink_socket_buffers(client, server)
        receiver = server._receiver  # type: ignore[attr-defined]
        assert isinstance(receiver, PushReceiver)
        sent = 0

        async def produce() -> None:
            nonlocal sent
            for i in range(count):
                await client.send({"i": i, "pad": b"p" * 700})
                sent += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            with anyio.fail_after(10):
                await wait_all_tasks_blocked()  # the producer waits for room
            assert 0 < sent < count
            assert not receiver._registered  # stopped: nothing runs for this socket
            assert receiver.mode is PushMode.QUEUE_FULL
            # 64 messages of ~1 KB with their frame's cost: the count bound, not the bytes'
            assert len(receiver._queue) == MAX_QUEUED_MESSAGES
            assert receiver._queued_bytes < MAX_QUEUED_BYTES
            for i in range(count):
                with anyio.fail_after(10):
                    assert (await server.receive())["i"] == i
        assert receiver._registered


async def test_push_engine_leaves_large_frames_to_the_task(anyio_backend_name: str) -> None:
    """A message with a frame larger than the read-ahead buffer is read by the task:
    while nobody receives, the callback stops at its header, no frame buffer is
    allocated and nothing is queued (reading stops once more bytes arrive); each
    receive then reads one such message."""
    if anyio_backend_name != "asyncio":
        pytest.skip("the push engine runs on asyncio and uvloop")
    payload = b"L" * 200_000
    async with connected_pair("tcp") as (client, server):
        receiver = server._receiver  # type: ignore[attr-defined]
        assert isinstance(receiver, PushReceiver)
        async with anyio.create_task_group() as tg:

            async def produce() -> None:
                for _ in range(200):  # 40 MB: more than the kernel's buffers hold
                    await client.send_frames([payload])

            tg.start_soon(produce)
            with anyio.fail_after(10):
                await wait_all_tasks_blocked()
            assert not receiver._registered
            assert not receiver._queue
            assert (
                receiver._conn.receiving.status is ReceiveStatus.TASK_READS_FRAME
            )  # its buffer is not allocated yet
            for _ in range(200):
                with anyio.fail_after(10):
                    (frame,) = await server.receive_frames()
                assert frame == payload
                assert not receiver._queue


@pytest.mark.parametrize("kind", ["tcp", "tls1.2", "tls1.3"])
async def test_push_engine_alternates_large_and_small_messages(
    anyio_backend_name: str, kind: str
) -> None:
    """Large messages read by the task and small ones read by the callback, sent in
    a burst (over TLS, small ones share records with the end of a large one): every
    message arrives, in order, with nothing left behind in OpenSSL's buffer."""
    messages = [
        [bytes([i % 251]) * (300_000 if i % 3 == 0 else 40)]
        + ([b"x" * 70_000] if i % 5 == 0 else [])
        for i in range(60)
    ]
    async with connected_pair(kind) as (client, server):
        async with anyio.create_task_group() as tg:

            async def produce() -> None:
                for frames in messages:
                    await client.send_frames(frames)

            tg.start_soon(produce)
            for i, frames in enumerate(messages):
                with anyio.fail_after(10):
                    received = await server.receive_frames()
                assert [bytes(f) for f in received] == frames, i
                if i % 7 == 0:
                    await anyio.sleep(0.005)  # let the burst pile up behind a slow consumer


async def test_push_engine_resumes_only_below_its_bounds(anyio_backend_name: str) -> None:
    """Small messages then large ones: taking a small message from a queue that a
    large one pushed over the byte bound does not resume reading, so large messages
    do not pile up behind the small ones (one at most waits)."""
    if anyio_backend_name != "asyncio":
        pytest.skip("the push engine runs on asyncio and uvloop")
    small, large = b"s" * 500, b"L" * 200_000
    smalls, larges = MAX_QUEUED_MESSAGES - 1, 100  # 20 MB of large: the kernel fills
    async with connected_pair("tcp") as (client, server):
        receiver = server._receiver  # type: ignore[attr-defined]
        assert isinstance(receiver, PushReceiver)

        async def produce() -> None:
            for _ in range(smalls):
                await client.send_frames([small])
            for _ in range(larges):
                await client.send_frames([large])

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            with anyio.fail_after(10):
                await wait_all_tasks_blocked()
            for i in range(smalls + larges):
                queued_large = sum(len(frames[0]) == len(large) for frames, _ in receiver._queue)
                assert queued_large <= 1, (i, queued_large)
                assert receiver._queued_bytes <= MAX_QUEUED_BYTES + len(large) + FRAME_COST
                with anyio.fail_after(10):
                    (frame,) = await server.receive_frames()
                assert frame == (small if i < smalls else large)
                await wait_all_tasks_blocked()  # the loop reads what it may


async def test_push_engine_leaves_many_frame_messages_to_the_task(
    anyio_backend_name: str,
) -> None:
    """A frame object costs about 380 bytes beside its bytes: messages of many short
    frames are never queued as frame objects. The loop's callback stops at such a
    message's header and the task reads its frames when it takes it, so a stalled
    consumer's connection holds the read-ahead buffer, not 48 times what came."""
    if anyio_backend_name != "asyncio":
        pytest.skip("the push engine runs on asyncio and uvloop")
    # 8 KB of header each, short frames (packed) and longer ones (their own buffers)
    frames = [bytes([i % 251]) * (i % 70) for i in range(1000)]
    count = 60  # 2.7 MB on the wire: the kernel's buffers fill (made small)
    async with connected_pair("tcp") as (client, server):
        shrink_socket_buffers(client, server)
        receiver = server._receiver  # type: ignore[attr-defined]
        assert isinstance(receiver, PushReceiver)

        async def produce() -> None:
            for _ in range(count):
                await client.send_frames(frames)

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            with anyio.fail_after(20):
                await wait_all_tasks_blocked()
            # The registration is dropped when it fires with no task waiting,
            # which may take one more pass of the event loop after the producer
            # blocked.
            for _ in range(3):
                if not receiver._registered:
                    break
                await checkpoint()
            assert not receiver._registered
            assert not receiver._queue
            assert receiver._conn.receiving.status is ReceiveStatus.TASK_READS_MANY
            for _ in range(count):
                with anyio.fail_after(10):
                    received = await server.receive_frames()
                assert [bytes(f) for f in received] == frames
                assert not receiver._queue


def count_waits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the push engine's waits (the receiving task's wake-ups) in ``[0]``."""
    waits = [0]
    original = PushReceiver.wait

    async def counting_wait(receiver: PushReceiver) -> None:
        waits[0] += 1
        await original(receiver)

    monkeypatch.setattr(PushReceiver, "wait", counting_wait)
    return waits


@pytest.mark.parametrize(("message_timeout", "wakes"), [(None, 1), (60.0, 2)])
async def test_push_engine_wakes_the_task_once_per_message(
    anyio_backend_name: str,
    monkeypatch: pytest.MonkeyPatch,
    message_timeout: float | None,
    wakes: int,
) -> None:
    """A message of small frames that arrives in many pieces is decoded by the loop's
    callback; the receiving task runs once, when it is whole (and once more when it
    begins, to time it, with a message_timeout)."""
    if anyio_backend_name != "asyncio":
        pytest.skip("the push engine runs on asyncio and uvloop")
    async with connected_pair("tcp", message_timeout=message_timeout) as (client, server):
        waits = count_waits(monkeypatch)
        frames = [bytes([i % 256]) * 1000 for i in range(4000)]  # 4 MB: many reads
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames, frames)
            received = await server.receive_frames()
        assert [bytes(f) for f in received] == frames
        assert waits[0] == wakes


@pytest.mark.parametrize("kind", ["tcp", "tls1.3"])
async def test_push_engine_leaves_a_large_frame_to_the_task(
    kind: str, anyio_backend_name: str
) -> None:
    """A large frame's buffer is allocated by the receiving task. Over TCP the task
    reads the rest, and a read that comes up short is followed by one pass of the
    event loop, not a readiness wait. Over TLS a short read says nothing (OpenSSL
    may hold more): the loop's callback fills the buffer and wakes the task with
    the whole message. The loop's registration stays meanwhile."""
    if anyio_backend_name != "asyncio":
        pytest.skip("the push engine runs on asyncio and uvloop")
    async with connected_pair(kind) as (client, server):
        shrink_socket_buffers(client, server)  # many reads per message
        receiver = server._receiver  # type: ignore[attr-defined]
        assert isinstance(receiver, PushReceiver)
        transport = server._transport  # type: ignore[attr-defined]
        inner = getattr(transport, "_inner", transport)  # TLS: count the socket's reads
        events: list[str] = []
        original_read = inner.receive_into_nowait
        original_stop = inner.stop_reading
        original_pause = receiver._pause

        def recording_read(buffer: memoryview) -> int | None:
            n = original_read(buffer)
            if n is not None:
                events.append("read by the task" if receiver.mode in TASK_MODES else "read")
            return n

        def recording_stop() -> None:
            events.append("stop")
            original_stop()

        def recording_pause() -> Awaitable[None]:
            events.append("pause")
            return original_pause()

        inner.receive_into_nowait = recording_read
        inner.stop_reading = recording_stop
        receiver._pause = recording_pause
        payloads = [bytes([i]) * 3_000_000 for i in range(3)]
        for payload in payloads:
            del events[:]
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.send_frames, [b"head", payload])
                with anyio.fail_after(20):
                    head, frame = await server.receive_frames()
            assert head == b"head" and frame == payload
            assert len(events) > 20, events  # (it arrived in many pieces)
            assert "stop" not in events
            if kind == "tcp":
                assert events.count("read by the task") > 20, events
                assert "pause" in events
            else:
                assert events.count("read by the task") <= 3, events
                assert "pause" not in events
            assert receiver.mode is PushMode.LOOP_READS


async def test_the_loop_callback_sends_the_rest_of_a_large_message(
    anyio_backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message larger than the socket takes at once: the loop's writable callback
    sends the rest, and the sending task is woken once, when all of it went."""
    if anyio_backend_name != "asyncio":
        pytest.skip("add_writer is asyncio's")
    from anyio_comm._transports.rawsocket import _LoopWriter

    async with connected_pair("tcp") as (client, server):
        shrink_socket_buffers(client, server)
        calls = 0
        original = _LoopWriter.send_rest

        def counting_send_rest(writer: _LoopWriter, *args: object) -> object:
            nonlocal calls
            calls += 1
            return original(writer, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(_LoopWriter, "send_rest", counting_send_rest)
        payload = bytes(range(256)) * 20_000  # 5 MB
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames, [payload, b"tail"])
            with anyio.fail_after(20):
                frame, tail = await server.receive_frames()
        assert frame == payload and tail == b"tail"
        assert calls == 1
        await client.send("after")
        assert await server.receive() == "after"


async def test_a_send_that_comes_up_short_waits_for_writability(
    anyio_backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the event loop's writable callback (trio; asyncio without add_writer),
    a send that took less than it was offered left the socket full: the task waits
    for writability before it sends again, rather than sending at once the little
    the peer read meanwhile (the first send of a message too, which tries the whole
    gather write in one call)."""
    async with connected_pair("tcp") as (client, server):
        shrink_socket_buffers(client, server)
        transport = client._transport  # type: ignore[attr-defined]
        transport._writer = None  # (asyncio: as on a loop without add_writer)
        events: list[str] = []
        original_wait = transport._wait

        class RecordingSocket:
            """The transport's socket, recording what each send took."""

            def __init__(self, sock: socket.socket) -> None:
                self._sock = sock

            def _record(self, send: Callable[[Any], int], data: Any, size: int) -> int:
                try:
                    sent = send(data)
                except BlockingIOError:
                    events.append("eagain")
                    raise
                events.append("short" if sent < size else "whole")
                return sent

            def send(self, data: Any) -> int:
                return self._record(self._sock.send, data, memoryview(data).nbytes)

            def sendmsg(self, buffers: list[Any]) -> int:
                size = sum(memoryview(b).nbytes for b in buffers)
                return self._record(self._sock.sendmsg, buffers, size)

            def __getattr__(self, name: str) -> Any:
                return getattr(self._sock, name)

        async def recording_wait(readable: bool) -> None:
            events.append("wait" if not readable else "wait readable")
            await original_wait(readable)

        monkeypatch.setattr(transport, "_sock", RecordingSocket(transport._sock))
        transport._wait = recording_wait
        payload = bytes(range(256)) * 8_000  # 2 MB: many refills of a 32 KB buffer
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames, [payload, b"tail"])
            with anyio.fail_after(20):
                frame, tail = await server.receive_frames()
        assert frame == payload and tail == b"tail"
        assert events.count("short") > 5, events
        assert events[0] == "short", events  # (the first gather write, cut short)
        for before, after in itertools.pairwise(events):
            if before in ("short", "eagain"):
                assert after == "wait", events


async def test_loop_without_add_reader_falls_back(
    anyio_backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an event loop without add_reader (Windows' proactor loop), comms read in the
    task with anyio.wait_readable, and closing still wakes a blocked receive."""
    if anyio_backend_name != "asyncio":
        pytest.skip("add_reader is asyncio's")

    def no_add_reader(*args: object) -> None:
        raise NotImplementedError

    monkeypatch.setattr(_LoopReader, "start", no_add_reader)
    monkeypatch.setattr(_LoopReader, "wait", no_add_reader)
    async with connected_pair("tcp") as (client, server):
        for comm in (client, server):
            assert type(comm._receiver) is PullReceiver  # type: ignore[attr-defined]
            assert comm._transport._reader is None  # type: ignore[attr-defined]
        for i in range(3):
            await client.send(i)
            with anyio.fail_after(10):
                assert await server.receive() == i
        async with anyio.create_task_group() as tg:

            async def close_when_blocked() -> None:
                await wait_all_tasks_blocked()
                await server.aclose()

            tg.start_soon(close_when_blocked)
            with anyio.fail_after(5), pytest.raises(anyio.ClosedResourceError):
                await server.receive()


@pytest.mark.parametrize("transport", ["tcp", "tls1.3"])
async def test_comm_dropped_without_closing_frees_its_descriptor_number(transport: str) -> None:
    """A comm garbage-collected without ``aclose()`` leaves no registration behind:
    later connections given the same file descriptor number work."""

    async def echo(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)

    tls = transport != "tcp"
    address = f"{'tls' if tls else 'tcp'}://127.0.0.1:0"
    server_options = {"ssl_context": server_context()} if tls else {}
    client_options = {"ssl_context": client_context()} if tls else {}
    async with anyio_comm.listen(address, echo, **server_options) as listener:
        dropped = await anyio_comm.connect(listener.address, timeout=10, **client_options)
        await dropped.send("first")
        with anyio.fail_after(10):
            assert await dropped.receive() == "first"  # waited: the reader is registered
        fd = dropped.extra(SocketAttribute.raw_socket).fileno()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # the unclosed socket
            del dropped
            gc.collect()
        reused = False
        for i in range(3):
            with anyio.fail_after(10):
                comm = await anyio_comm.connect(listener.address, timeout=10, **client_options)
                async with comm:
                    reused |= comm.extra(SocketAttribute.raw_socket).fileno() == fd
                    await comm.send(i)
                    assert await comm.receive() == i
    if not reused:
        pytest.skip(f"descriptor {fd} was not given to a later connection")


async def test_socket_transport_is_an_anyio_socket_stream() -> None:
    """The transport is an AnyIO SocketStream: the byte-stream methods work, and its
    socket attributes are AnyIO's own."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener:
        port = listener.extra(SocketAttribute.local_port)
        accepted: list[anyio.abc.SocketStream] = []

        async def accept() -> None:
            accepted.append(await listener.listeners[0].accept())  # type: ignore[attr-defined]

        async with anyio.create_task_group() as tg:
            tg.start_soon(accept)
            sock = socket.create_connection(("127.0.0.1", port))
        transport = SocketTransport(sock)
        async with transport, accepted[0] as peer:
            assert isinstance(transport, anyio.abc.SocketStream)
            assert transport.extra(SocketAttribute.remote_port) == port
            assert transport.extra(SocketAttribute.raw_socket) is sock
            await transport.send(b"ping")
            assert await peer.receive() == b"ping"
            await peer.send(b"pong")
            assert await transport.receive(100) == b"pong"
            await peer.send_eof()
            with pytest.raises(anyio.EndOfStream):
                await transport.receive()
