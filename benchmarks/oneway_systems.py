"""The systems of :mod:`benchmarks.oneway`: one sender streams, one receiver counts.

Every message is ``size`` bytes whose first 8 are a little-endian tag: the
sender's connection index in the top 16 bits, its sequence number on that
connection below. The receiver checks every message's tag against the next one
it expects on that connection (a message lost, repeated or out of order is an
error) and counts it in :class:`Tally`. Each system is a pair of functions:

* ``receive(case, tally, ready)``: listen on 127.0.0.1 (a free port), call
  ``ready(address)``, then receive and count on every connection until the
  process ends; it owns the event loop (or threads) of the receiving process;
* ``send(case, address, deadline)``: open ``case.connections`` connections and
  send on each, as fast as the system lets it, until ``deadline``
  (``time.monotonic``), ``MAX_MESSAGES`` messages, or the receiver goes away
  (the runner stops the sending process once the receiver has its figures).

A system over TLS (``System.tls``) takes one more argument, the SSL context of
its end.

Systems (``SYSTEMS``): anyio-comm's per-message API (``send`` / ``async for``),
its frames API (``send_frames`` / ``receive_frames``) and its batch API
(``send_batch`` of :data:`BATCH` messages / ``receive_batch``) on asyncio, uvloop
and trio; the per-message API over ``tls://`` (TLS 1.3: ``anyio-comm-tls``);
the raw asyncio floor (``asyncio.Protocol``: a ``transport.write`` per
message and a drain every 64, a ``BufferedProtocol`` cutting messages out of its
buffer); plain AnyIO streams written the plainest way (an 8-byte length prefix,
``stream.send()`` per message, ``stream.receive()`` accumulated into a
``bytearray``); pyzmq PUSH/PULL with blocking sockets (a thread per connection)
and with ``zmq.asyncio``. Two diagnostic pairs, run only when named, measure
one end of the per-message API each: ``anyio-comm-rx`` (its receiver, fed by
the batch sender: what the receiving end can take) and ``anyio-comm-tx`` (its
sender, read by the batch receiver: what the sending end can give). A third,
``floor-task`` (asyncio, uvloop, trio), is the least a per-message ``await
send(obj)`` / ``await receive()`` API can cost in Python: no library, only what
every such API must do per message (see its section below).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import ssl
    from collections.abc import Callable

#: the most messages one sending connection sends in one case
MAX_MESSAGES: Final = 50_000_000
#: the floor's sender waits for the transport to drain after this many writes
DRAIN_EVERY: Final = 64
#: messages per send_batch, and the most per receive_batch (anyio-comm-batch)
BATCH: Final = 64
_TAG = struct.Struct("<Q")
_LENGTH = struct.Struct("<Q")
_INDEX_SHIFT = 48
#: what ends a sender: the receiver went away
_GONE = (OSError, EOFError, ConnectionError)


class Tally:
    """The messages received, and the first error seen (a lost or reordered one)."""

    __slots__ = ("error", "n")

    def __init__(self) -> None:
        self.n = 0
        self.error: str | None = None

    def wrong(self, expected: int, tag: int) -> None:
        if self.error is None:
            self.error = (
                f"connection {tag >> _INDEX_SHIFT}: expected message "
                f"{expected & ((1 << _INDEX_SHIFT) - 1)}, got {tag & ((1 << _INDEX_SHIFT) - 1)}"
            )


def payloads(index: int, size: int) -> Callable[[int], bytes]:
    """The function giving connection ``index``'s message number ``seq``."""
    base = index << _INDEX_SHIFT
    filler = bytes(range(256)) * (size // 256 + 1)
    filler = filler[: size - 8]
    pack = _TAG.pack

    def payload(seq: int) -> bytes:
        return pack(base + seq) + filler

    return payload


# -- anyio-comm ------------------------------------------------------------------


async def _comm_receive(
    case: Any,
    tally: Tally,
    ready: Callable[[str], object],
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    import anyio

    import anyio_comm

    frames_api = case.system == "anyio-comm-frames"
    batch_api = case.system in ("anyio-comm-batch", "anyio-comm-tx")

    async def handle(comm: anyio_comm.Comm) -> None:
        expected = -1
        unpack = _TAG.unpack_from
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            if batch_api:
                while True:
                    for message in await comm.receive_batch(BATCH):
                        (tag,) = unpack(message)
                        if expected < 0:
                            expected = tag
                        elif tag != expected:
                            tally.wrong(expected, tag)
                        expected += 1
                        tally.n += 1
            elif frames_api:
                while True:
                    (frame,) = await comm.receive_frames()
                    (tag,) = unpack(frame)
                    if expected < 0:
                        expected = tag
                    elif tag != expected:
                        tally.wrong(expected, tag)
                    expected += 1
                    tally.n += 1
            else:
                async for message in comm:
                    (tag,) = unpack(message)
                    if expected < 0:
                        expected = tag
                    elif tag != expected:
                        tally.wrong(expected, tag)
                    expected += 1
                    tally.n += 1

    if ssl_context is None:
        listening = anyio_comm.listen("tcp://127.0.0.1:0", handle)
    else:
        listening = anyio_comm.listen("tls://127.0.0.1:0", handle, ssl_context=ssl_context)
    async with listening as listener:
        ready(listener.address)
        await anyio.sleep_forever()


async def _comm_send(
    case: Any, address: str, deadline: float, ssl_context: ssl.SSLContext | None = None
) -> None:
    import anyio

    import anyio_comm

    frames_api = case.system == "anyio-comm-frames"
    batch_api = case.system in ("anyio-comm-batch", "anyio-comm-rx")

    async def one(index: int) -> None:
        payload = payloads(index, case.size)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, *_GONE):
            tls = {} if ssl_context is None else {"ssl_context": ssl_context}
            async with await anyio_comm.connect(address, timeout=30, **tls) as comm:
                seq = 0
                while seq < MAX_MESSAGES:
                    if batch_api:
                        await comm.send_batch([payload(seq + i) for i in range(BATCH)])
                        seq += BATCH
                        if not seq & 1023 and time.monotonic() > deadline:
                            return
                        continue
                    if frames_api:
                        await comm.send_frames([payload(seq)])
                    else:
                        await comm.send(payload(seq))
                    seq += 1
                    if not seq & 1023 and time.monotonic() > deadline:
                        return

    async with anyio.create_task_group() as tg:
        for index in range(case.connections):
            tg.start_soon(one, index)


# -- plain AnyIO streams ---------------------------------------------------------


async def _streams_receive(_case: Any, tally: Tally, ready: Callable[[str], object]) -> None:
    import anyio
    from anyio.abc import SocketAttribute

    async def handle(stream: Any) -> None:
        buffer = bytearray()
        expected = -1
        unpack = _TAG.unpack_from
        async with stream:
            with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                while True:
                    buffer += await stream.receive()
                    start = 0
                    size = len(buffer)
                    while size - start >= 8:
                        (length,) = unpack(buffer, start)
                        end = start + 8 + length
                        if end > size:
                            break
                        message = bytes(buffer[start + 8 : end])
                        start = end
                        (tag,) = unpack(message)
                        if expected < 0:
                            expected = tag
                        elif tag != expected:
                            tally.wrong(expected, tag)
                        expected += 1
                        tally.n += 1
                    del buffer[:start]

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        ready(f"tcp://127.0.0.1:{listener.extra(SocketAttribute.local_port)}")
        await listener.serve(handle)


async def _streams_send(case: Any, address: str, deadline: float) -> None:
    import anyio

    host, _, port = address.removeprefix("tcp://").rpartition(":")

    async def one(index: int) -> None:
        payload = payloads(index, case.size)
        prefix = _LENGTH.pack(case.size)
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, *_GONE):
            async with await anyio.connect_tcp(host, int(port)) as stream:
                seq = 0
                while seq < MAX_MESSAGES:
                    await stream.send(prefix + payload(seq))
                    seq += 1
                    if not seq & 1023 and time.monotonic() > deadline:
                        return

    async with anyio.create_task_group() as tg:
        for index in range(case.connections):
            tg.start_soon(one, index)


# -- the raw asyncio floor -------------------------------------------------------


def _compact(buffer: bytearray, start: int, end: int) -> tuple[int, int]:
    """Make room in a 64 KiB read buffer before a read: what is not cut out yet
    (``start`` to ``end``) moves to its start when it is empty or less than 4 KiB
    is left behind it. Returns the new ``start, end``."""
    if start == end:
        return 0, 0
    if end > 65536 - 4096:
        buffer[: end - start] = buffer[start:end]
        return 0, end - start
    return start, end


class _BufferedReceiver(asyncio.BufferedProtocol):
    """A 64 KiB buffer that the event loop reads into (see :func:`_compact`)."""

    def __init__(self) -> None:
        self._buffer = bytearray(65536)
        self._view = memoryview(self._buffer)
        self._start = 0
        self._end = 0

    def get_buffer(self, _sizehint: int) -> memoryview:
        self._start, self._end = _compact(self._buffer, self._start, self._end)
        return self._view[self._end :]


class _FloorReceiver(_BufferedReceiver):
    """Cuts length-prefixed messages out of its 64 KiB buffer, in the loop's callback."""

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self._tally = tally
        self._expected = -1

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        buffer, start, end = self._buffer, self._start, self._end
        unpack = _TAG.unpack_from
        tally = self._tally
        expected = self._expected
        while end - start >= 8:
            (length,) = unpack(buffer, start)
            stop = start + 8 + length
            if stop > end:
                break
            message = bytes(self._view[start + 8 : stop])
            start = stop
            (tag,) = unpack(message)
            if expected < 0:
                expected = tag
            elif tag != expected:
                tally.wrong(expected, tag)
            expected += 1
            tally.n += 1
        self._start = start
        self._expected = expected


class _FloorSender(asyncio.Protocol):
    def __init__(self) -> None:
        self.resumed: asyncio.Future[None] | None = None
        self.lost = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def pause_writing(self) -> None:
        self.resumed = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.resumed is not None and not self.resumed.done():
            self.resumed.set_result(None)
        self.resumed = None

    def connection_lost(self, _exc: Exception | None) -> None:
        self.lost = True
        self.resume_writing()


async def _floor_receive(_case: Any, tally: Tally, ready: Callable[[str], object]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _FloorReceiver(tally), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ready(f"tcp://127.0.0.1:{port}")
    async with server:
        await server.serve_forever()


async def _floor_send(case: Any, address: str, deadline: float) -> None:
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    loop = asyncio.get_running_loop()
    # The writes after the receiver left (before the loop sees it) are expected:
    # asyncio's and uvloop's "socket.send() raised exception." would only be noise.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)

    async def one(index: int) -> None:
        payload = payloads(index, case.size)
        prefix = _LENGTH.pack(case.size)
        transport, protocol = await loop.create_connection(_FloorSender, host, int(port))
        try:
            seq = 0
            while seq < MAX_MESSAGES and not protocol.lost:
                transport.write(prefix + payload(seq))
                seq += 1
                if not seq % DRAIN_EVERY:
                    resumed = protocol.resumed
                    if resumed is not None:
                        await resumed
                    else:
                        await asyncio.sleep(0)
                    if not seq & 1023 and time.monotonic() > deadline:
                        return
        finally:
            transport.abort()

    await asyncio.gather(*(one(index) for index in range(case.connections)))


# -- the task floor: the least a per-message async API can cost -------------------
#
# What any library with ``await send(obj)`` and ``await receive()`` must do per
# message, and nothing more: msgpack each object, frame it with a length, and
# write the queue in one call every YIELD_EVERY sends (as anyio-comm's writes
# behind do); cut the messages out of the stream, hand them to the task that
# awaits ``receive()`` through a future, unpack each one, and let the event loop
# run every YIELD_EVERY receives that did not wait (anyio-comm's checkpoint rule).
# No checks, no limits, no cancellation, no frames out of band: a ceiling for
# any design of the per-message API in Python, not a library to use.

#: floor-task: sends or receives that did not wait between two yields to the loop
YIELD_EVERY: Final = 8


def _cut(buffer: bytearray, start: int, end: int, queue: collections.deque[bytes]) -> int:
    """Queue the whole length-prefixed messages of ``buffer[start:end]``; return
    where the first one not whole begins."""
    unpack, view = _LENGTH.unpack_from, memoryview(buffer)
    while end - start >= 8:
        (length,) = unpack(buffer, start)
        stop = start + 8 + length
        if stop > end:
            break
        queue.append(bytes(view[start + 8 : stop]))
        start = stop
    return start


class _TaskFloorProtocol(_BufferedReceiver):
    """Cuts length-prefixed messages into a queue; wakes the task that waits."""

    def __init__(self) -> None:
        super().__init__()
        self.queue: collections.deque[bytes] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None
        self.ended = False

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        self._start = _cut(self._buffer, self._start, self._end, self.queue)
        self._wake()

    def connection_lost(self, _exc: Exception | None) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and (self.queue or self.ended):
            self.waiter = None
            waiter.set_result(None)


async def _task_floor_receive_asyncio(tally: Tally, ready: Callable[[str], object]) -> None:
    import msgpack

    loop = asyncio.get_running_loop()
    unpackb = msgpack.unpackb

    async def handle(protocol: _TaskFloorProtocol) -> None:
        queue, ran = protocol.queue, 0

        async def receive() -> Any:
            nonlocal ran
            if queue:
                ran += 1
                if ran >= YIELD_EVERY:
                    ran = 0
                    await asyncio.sleep(0)
            else:
                while not queue:
                    if protocol.ended:
                        raise EOFError
                    protocol.waiter = loop.create_future()
                    await protocol.waiter
                ran = 0
            return unpackb(queue.popleft())

        await _count(receive, tally)

    tasks: set[asyncio.Task[None]] = set()

    def accepted() -> _TaskFloorProtocol:
        protocol = _TaskFloorProtocol()
        task = loop.create_task(handle(protocol))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        return protocol

    server = await loop.create_server(accepted, "127.0.0.1", 0)
    ready(f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    async with server:
        await server.serve_forever()


async def _task_floor_receive_trio(tally: Tally, ready: Callable[[str], object]) -> None:
    import msgpack
    import trio

    unpackb = msgpack.unpackb

    async def handle(sock: trio.socket.SocketType) -> None:
        buffer = bytearray(65536)
        view = memoryview(buffer)
        queue: collections.deque[bytes] = collections.deque()
        start = end = ran = 0

        async def receive() -> Any:  # (trio's socket calls are checkpoints)
            nonlocal start, end, ran
            if queue:
                ran += 1
                if ran >= YIELD_EVERY:
                    ran = 0
                    await trio.lowlevel.checkpoint()
                return unpackb(queue.popleft())
            while not queue:
                start, end = _compact(buffer, start, end)
                n = await sock.recv_into(view[end:])
                if not n:
                    raise EOFError
                end += n
                start = _cut(buffer, start, end, queue)
            ran = 0
            return unpackb(queue.popleft())

        with sock:
            await _count(receive, tally)

    with trio.socket.socket() as listener:
        await listener.bind(("127.0.0.1", 0))
        listener.listen()
        ready(f"tcp://127.0.0.1:{listener.getsockname()[1]}")
        async with trio.open_nursery() as nursery:
            while True:
                sock, _ = await listener.accept()
                nursery.start_soon(handle, sock)


async def _count(receive: Callable[[], Any], tally: Tally) -> None:
    """Check and count what ``receive()`` gives until the sender leaves."""
    expected = -1
    unpack = _TAG.unpack_from
    with contextlib.suppress(EOFError, OSError):
        while True:
            (tag,) = unpack(await receive())
            if expected < 0:
                expected = tag
            elif tag != expected:
                tally.wrong(expected, tag)
            expected += 1
            tally.n += 1


async def _task_floor_receive(case: Any, tally: Tally, ready: Callable[[str], object]) -> None:
    if case.backend == "trio":
        await _task_floor_receive_trio(tally, ready)
    else:
        await _task_floor_receive_asyncio(tally, ready)


async def _task_floor_send(case: Any, address: str, deadline: float) -> None:
    import anyio
    import msgpack

    host, _, port = address.removeprefix("tcp://").rpartition(":")
    trio_backend = case.backend == "trio"
    packb, pack = msgpack.packb, _LENGTH.pack
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # (as the floor's sender)

    async def one(index: int) -> None:
        payload = payloads(index, case.size)
        pending: list[bytes] = []
        if trio_backend:
            import trio

            sock = trio.socket.socket()
            await sock.connect((host, int(port)))

            async def flush() -> None:
                data = memoryview(b"".join(pending))
                pending.clear()
                while data:  # (a checkpoint each)
                    data = data[await sock.send(data) :]

            close = sock.close
        else:
            loop = asyncio.get_running_loop()
            transport, protocol = await loop.create_connection(_FloorSender, host, int(port))

            async def flush() -> None:
                transport.writelines(pending)
                pending.clear()
                if protocol.resumed is not None:
                    await protocol.resumed
                else:
                    await asyncio.sleep(0)
                if protocol.lost:
                    raise EOFError

            close = transport.abort

        async def send(obj: Any) -> None:
            data = packb(obj)
            pending.append(pack(len(data)) + data)
            if len(pending) >= YIELD_EVERY:
                await flush()

        try:
            with contextlib.suppress(EOFError, *_GONE):
                seq = 0
                while seq < MAX_MESSAGES:
                    await send(payload(seq))
                    seq += 1
                    if not seq & 1023 and time.monotonic() > deadline:
                        return
        finally:
            close()

    async with anyio.create_task_group() as tg:
        for index in range(case.connections):
            tg.start_soon(one, index)


# -- pyzmq -----------------------------------------------------------------------


def _zmq_receive_blocking(_case: Any, tally: Tally, ready: Callable[[str], object]) -> None:
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ready(f"tcp://127.0.0.1:{port}")
    expected: dict[int, int] = {}
    unpack = _TAG.unpack_from
    while True:
        message = sock.recv()
        (tag,) = unpack(message)
        index = tag >> _INDEX_SHIFT
        want = expected.get(index, tag)
        if tag != want:
            tally.wrong(want, tag)
        expected[index] = tag + 1
        tally.n += 1


def _zmq_send_blocking(case: Any, address: str, deadline: float) -> None:
    import zmq

    context = zmq.Context()

    def one(index: int) -> None:
        payload = payloads(index, case.size)
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        with contextlib.suppress(zmq.ZMQError):
            for seq in range(MAX_MESSAGES):
                sock.send(payload(seq), copy=False)
                if not seq & 1023 and time.monotonic() > deadline:
                    break
        sock.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(case.connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    context.term()


async def _zmq_receive_asyncio(_case: Any, tally: Tally, ready: Callable[[str], object]) -> None:
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()
    sock = context.socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ready(f"tcp://127.0.0.1:{port}")
    expected: dict[int, int] = {}
    unpack = _TAG.unpack_from
    while True:
        message = await sock.recv()
        (tag,) = unpack(message)
        index = tag >> _INDEX_SHIFT
        want = expected.get(index, tag)
        if tag != want:
            tally.wrong(want, tag)
        expected[index] = tag + 1
        tally.n += 1


async def _zmq_send_asyncio(case: Any, address: str, deadline: float) -> None:
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context()

    async def one(index: int) -> None:
        payload = payloads(index, case.size)
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            for seq in range(MAX_MESSAGES):
                await sock.send(payload(seq), copy=False)
                if not seq & 1023 and time.monotonic() > deadline:
                    return
        finally:
            sock.close()

    await asyncio.gather(*(one(index) for index in range(case.connections)))
    context.term()


@dataclass(frozen=True)
class System:
    """A system of the one-way benchmark: its functions and the backends it runs on."""

    name: str
    backends: tuple[str, ...]
    receive: Callable[..., Any]
    send: Callable[..., Any]
    requires: tuple[str, ...] = ()
    #: the functions are plain (threads), not coroutine functions
    blocking: bool = False
    #: run only when named in ``--systems``
    diagnostic: bool = False
    #: over TLS 1.3: the functions take an SSL context (the receiver's, the sender's)
    tls: bool = False


_ASYNC = ("asyncio", "uvloop", "trio")

SYSTEMS: dict[str, System] = {
    s.name: s
    for s in (
        System("anyio-comm", _ASYNC, _comm_receive, _comm_send),
        System("anyio-comm-frames", _ASYNC, _comm_receive, _comm_send),
        System("anyio-comm-batch", _ASYNC, _comm_receive, _comm_send),
        System(
            "anyio-comm-tls", _ASYNC, _comm_receive, _comm_send, requires=("trustme",), tls=True
        ),
        System("anyio-comm-rx", _ASYNC, _comm_receive, _comm_send, diagnostic=True),
        System("anyio-comm-tx", _ASYNC, _comm_receive, _comm_send, diagnostic=True),
        System("floor", ("asyncio", "uvloop"), _floor_receive, _floor_send),
        System("floor-task", _ASYNC, _task_floor_receive, _task_floor_send, diagnostic=True),
        System("anyio-streams", _ASYNC, _streams_receive, _streams_send),
        System(
            "zmq-blocking",
            ("threads",),
            _zmq_receive_blocking,
            _zmq_send_blocking,
            requires=("zmq",),
            blocking=True,
        ),
        System(
            "zmq-asyncio", ("asyncio",), _zmq_receive_asyncio, _zmq_send_asyncio, requires=("zmq",)
        ),
    )
}
