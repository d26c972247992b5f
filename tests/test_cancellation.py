"""Cancellation at every await point, driven systematically, on every backend.

How the k-th checkpoint is reached
----------------------------------
:func:`run_cancelled_after` runs an operation inside a cancel scope and starts
a helper task that runs ``await anyio.lowlevel.checkpoint()`` ``k`` times and
then cancels that scope. Each checkpoint of the helper is one turn of the
event loop: every other runnable task gets to run once and the loop polls for
I/O (asyncio and uvloop: one round of ready callbacks; trio: one scheduler
batch). So ``k`` counts event-loop turns since the operation started, and the
cancellation lands wherever the operation is suspended after the ``k``-th
turn: its own checkpoint, a wait for the socket, or the peer's progress (the
peer runs in the same loop and advances on every turn too). Only AnyIO's
public API is used, so the same sweep runs unchanged on every backend. To
give an operation many suspension points, the large messages go through a
:class:`~tests.faultproxy.FaultProxy` with small socket buffers, and the
byte-level sweeps through one that forwards a piece per turn.

:func:`sweep` tries k = 0, 1, 2, ... (every k up to 20, then with a stride that
grows by a third each time) until the operation completes before its scope
is cancelled, and fails if it never does within 2000 turns. After every
attempt the test checks the invariant:

* a cancelled **send** either wrote nothing (the comm still works and the
  peer never sees that message) or broke the comm (``BrokenResourceError``
  afterwards); the peer receives every earlier message intact and in order,
  then a later message or the end of the stream (``EndOfStream`` after a clean
  end, ``BrokenResourceError`` after a break), never a partial or reordered one;
* a cancelled **send_eof** either sent nothing (sending goes on) or sent the
  end of the stream and says so (``ClosedResourceError`` on the next send);
  receiving goes on either way;
* a cancelled **receive** loses nothing: the next ``receive()`` returns the
  same message intact, then the next one;
* a cancelled **connect** (TCP and TLS, handshake included) leaks no file
  descriptor and no task, on either side, and the listener keeps serving;
* a **listener** cancelled while a client trickles its preamble, or a client
  vanishing in the middle of it, leaves nothing behind either, and the client
  receives nothing, or exactly the listener's preamble, before the end.
"""

from __future__ import annotations

import functools
import logging
import socket
import ssl
from collections import Counter
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import pytest
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream, wait_all_tasks_blocked
from anyio.abc import SocketAttribute
from anyio.lowlevel import checkpoint

import anyio_comm
from anyio_comm import Comm, Limits
from anyio_comm._sansio.close import CloseCode, CloseReason, encode_close_record
from anyio_comm._sansio.wire import Capability, encode_preamble

from .certs import client_context, server_context
from .faultproxy import FaultProxy, Policy
from .helpers import open_fds, running_tasks

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

T = TypeVar("T")

DENSE = 20
#: the most turns tried: a TLS handshake's steps run in worker threads, and while the
#: task that counts turns keeps the loop busy a step's thread may wait for a CPU for
#: milliseconds, thousands of turns (measured on trio: a connect of 150-700 turns in
#: one run took 1,300-12,500 in another, its thread's step up to 48 ms)
MAX_K = 100_000
KINDS = ["tcp", "tls1.3"]
#: socket buffers on the path of the large messages (the kernel doubles it): the
#: message then needs a few hundred turns of the loop. They are set on the proxy's
#: sockets before they connect, and on the sender's socket (shrinking a receive
#: buffer after the connection is up leaves TCP waiting on its timers instead)
SMALL_BUFFER = 16 * 1024
PART = 192 * 1024
PARTS = 3


def schedule() -> Iterator[int]:
    """0, 1, ..., 20, then a stride growing by a third each step, up to MAX_K."""
    k = 0
    while k <= MAX_K:
        yield k
        k += 1 if k < DENSE else k // 3


@dataclass
class Attempt(Generic[T]):
    """How ``operation`` ended under :func:`run_cancelled_after`."""

    completed: bool
    value: T | None = None
    error: Exception | None = None


async def run_cancelled_after(k: int, operation: Callable[[], Awaitable[T]]) -> Attempt[T]:
    """Run ``operation()``; cancel it after ``k`` turns of the event loop unless it
    completed by then. Its exceptions are returned, not raised."""
    attempt: Attempt[T] = Attempt(completed=False)
    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as scope:

            async def cancel_after_k_turns() -> None:
                for _ in range(k):
                    await checkpoint()
                scope.cancel()

            tg.start_soon(cancel_after_k_turns)
            try:
                attempt.value = await operation()
                attempt.completed = True
            except Exception as exc:
                attempt.error = exc
            finally:
                tg.cancel_scope.cancel()  # the helper, if it is still counting
    return attempt


async def sweep(trial: Callable[[int], Awaitable[bool]]) -> list[int]:
    """Run ``trial(k)`` for k in :func:`schedule` until it reports completion; return
    the k tried."""
    tried = []
    for k in schedule():
        tried.append(k)
        with anyio.fail_after(20):
            if await trial(k):
                return tried
    pytest.fail(f"the operation never completed within {MAX_K} turns of the loop")


def pattern(size: int, seed: int) -> bytes:
    """Recognizable bytes: any shift, truncation or mix-up changes them."""
    unit = bytes((seed * 31 + i) % 251 for i in range(251))
    return (unit * (size // 251 + 1))[:size]


PARTS_DATA = [pattern(PART, seed) for seed in range(PARTS)]


def big_message(seq: int) -> dict[str, Any]:
    """A message of PARTS out-of-band frames of PART bytes each (4 frames in all)."""
    return {"seq": seq, "parts": [memoryview(part) for part in PARTS_DATA]}


def assert_intact(message: Any, seq: int) -> None:
    assert message["seq"] == seq
    if "parts" in message:
        assert [bytes(part) for part in message["parts"]] == PARTS_DATA


def shrink_send_buffer(comm: Comm) -> None:
    sock: socket.socket = comm.extra(SocketAttribute.raw_socket)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)


@functools.cache
def tls_context(server: bool) -> ssl.SSLContext:
    """One context per side for the whole module (building one loads the system's CA
    store: tens of milliseconds, per connection otherwise)."""
    version = ssl.TLSVersion.TLSv1_3
    return server_context(version) if server else client_context(version)


def tls_options(kind: str, *, server: bool) -> dict[str, Any]:
    return {"ssl_context": tls_context(server)} if kind == "tls1.3" else {}


def scheme(kind: str) -> str:
    return "tls" if kind == "tls1.3" else "tcp"


def port_of(listener: anyio_comm.Listener) -> int:
    return int(listener.address.rsplit(":", 1)[1])


class Pairs:
    """Connects ``(client, server)`` comm pairs to one listener; the caller closes both."""

    def __init__(self, kind: str, options: dict[str, Any]) -> None:
        self.kind = kind
        self.options = options
        self._send, self._receive = anyio.create_memory_object_stream[Comm](1)
        self._listener: anyio_comm.Listener | None = None

    async def handler(self, comm: Comm) -> None:
        await self._send.send(comm)
        await anyio.sleep_forever()  # the test owns the comm

    @property
    def port(self) -> int:
        assert self._listener is not None
        return port_of(self._listener)

    async def new(self, port: int | None = None) -> tuple[Comm, Comm]:
        """Connect to the listener, or to ``port`` (a proxy in front of it)."""
        address = f"{scheme(self.kind)}://127.0.0.1:{port or self.port}"
        with anyio.fail_after(10):
            client = await anyio_comm.connect(
                address, timeout=10, **self.options, **tls_options(self.kind, server=False)
            )
            return client, await self._receive.receive()


@asynccontextmanager
async def comm_pairs(kind: str, **options: Any) -> AsyncIterator[Pairs]:
    pairs = Pairs(kind, options)
    address = f"{scheme(kind)}://127.0.0.1:0"
    async with (
        pairs._send,
        pairs._receive,
        anyio_comm.listen(
            address, pairs.handler, **options, **tls_options(kind, server=True)
        ) as listener,
    ):
        pairs._listener = listener
        yield pairs


async def drain(comm: Comm, received: list[Any], ending: list[type[BaseException]]) -> None:
    """Receive until the stream ends; record the messages and the exception type."""
    try:
        while True:
            received.append(await comm.receive())
    except (EndOfStream, BrokenResourceError) as exc:
        ending.append(type(exc))


# --- send -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_send_cancelled_at_every_checkpoint(kind: str) -> None:
    """A 576 KiB, 4-frame send over a narrow path (a proxy with small buffers) is
    cancelled after k turns of the loop, so the cancellation lands all through the
    message. A fresh connection per attempt."""
    outcomes: Counter[str] = Counter()
    async with (
        comm_pairs(kind) as pairs,
        FaultProxy("127.0.0.1", pairs.port, buffer_size=SMALL_BUFFER) as proxy,
    ):

        async def trial(k: int) -> bool:
            client, server = await pairs.new(proxy.port)
            async with client, server:
                shrink_send_buffer(client)
                received: list[Any] = []
                ending: list[type[BaseException]] = []
                async with anyio.create_task_group() as tg:
                    tg.start_soon(drain, server, received, ending)
                    await client.send({"seq": 0})
                    attempt = await run_cancelled_after(k, lambda: client.send(big_message(1)))
                    assert attempt.error is None
                    end: type[BaseException]
                    if attempt.completed:
                        outcome, expected, end = "completed", [0, 1, 2], EndOfStream
                    elif client.closed:
                        outcome, expected, end = "broken", [0], BrokenResourceError
                        for operation in (lambda: client.send({"seq": 2}), client.receive):
                            with pytest.raises(BrokenResourceError):
                                await operation()
                    else:
                        outcome, expected, end = "nothing sent", [0, 2], EndOfStream
                    if not client.closed:
                        await client.send({"seq": 2})
                        await client.send_eof()
                outcomes[outcome] += 1
                assert [message["seq"] for message in received] == expected, outcome
                for message in received:
                    assert_intact(message, message["seq"])
                assert ending == [end], outcome
            return attempt.completed

        await sweep(trial)
    # the sweep really cancelled sends in the middle of the message
    assert outcomes["broken"] >= 5, outcomes
    assert outcomes["completed"] == 1


def delay_writes(comm: Comm, turns: int) -> None:
    """Make the socket under ``comm`` (under TLS: under the TLS layer) look full for
    ``turns`` turns of the loop at each write, like a peer that reads slowly."""
    transport = comm._transport
    inner = getattr(transport, "_inner", transport)
    send_all = inner.send_all

    async def slow_send_all(buffers: Any) -> bool:
        for _ in range(turns):
            await checkpoint()  # nothing written yet: cancelling here loses nothing
        await send_all(buffers)
        return True  # it waited

    inner.send_all = slow_send_all  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("kind", "slow"),
    [("tcp", False), ("tls1.3", False), ("tls1.3", True)],
    ids=["tcp", "tls1.3", "tls1.3-slow-socket"],
)
async def test_send_eof_cancelled_at_every_checkpoint(kind: str, slow: bool) -> None:
    """send_eof() cancelled after k turns either sent nothing (the next send works,
    and the peer gets that message before the end of the stream) or committed the
    EOF and knows it (the next send raises ClosedResourceError; calling send_eof()
    again finishes it). Never a broken comm: receiving goes on either way.
    "slow-socket": the close_notify waits for room in the socket for a few turns."""
    outcomes: Counter[str] = Counter()
    async with comm_pairs(kind) as pairs:

        async def trial(k: int) -> bool:
            client, server = await pairs.new()
            async with client, server:
                await client.send({"seq": 0})
                if slow:
                    delay_writes(client, 10)
                attempt = await run_cancelled_after(k, client.send_eof)
                assert attempt.error is None
                try:
                    await client.send({"seq": 1})
                except ClosedResourceError:
                    outcome = "completed" if attempt.completed else "cancelled, eof committed"
                    expected = [0]
                else:
                    assert not attempt.completed
                    outcome, expected = "nothing sent", [0, 1]
                with anyio.fail_after(10):
                    await client.send_eof()  # finishes a cancelled one, else a no-op
                outcomes[outcome] += 1
                assert not client.closed
                received: list[Any] = []
                ending: list[type[BaseException]] = []
                with anyio.fail_after(10):
                    await drain(server, received, ending)
                assert [message["seq"] for message in received] == expected, outcome
                assert ending == [EndOfStream], outcome
                await server.send({"reply": k})
                with anyio.fail_after(10):
                    assert await client.receive() == {"reply": k}
            return attempt.completed

        await sweep(trial)
    assert outcomes["completed"] == 1
    if slow:  # it was cancelled while the close_notify waited
        assert outcomes["cancelled, eof committed"] >= 5, outcomes


# --- receive ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_receive_cancelled_at_every_checkpoint_resumes(kind: str) -> None:
    """A 576 KiB receive over a narrow path is cancelled after k turns (the message
    arrives in many pieces); the next receive returns it intact, then the next
    message. One connection for every attempt."""
    cancelled = 0
    async with (
        comm_pairs(kind) as pairs,
        FaultProxy("127.0.0.1", pairs.port, buffer_size=SMALL_BUFFER) as proxy,
    ):
        client, server = await pairs.new(proxy.port)
        async with client, server:
            shrink_send_buffer(client)

            async def send_two(seq: int) -> None:
                await client.send(big_message(seq))
                await client.send({"seq": seq + 1})

            async def trial(k: int) -> bool:
                nonlocal cancelled
                seq = 2 * k
                async with anyio.create_task_group() as tg:
                    tg.start_soon(send_two, seq)
                    attempt = await run_cancelled_after(k, server.receive)
                    assert attempt.error is None
                    assert not server.closed
                    message = attempt.value if attempt.completed else await server.receive()
                    cancelled += not attempt.completed
                    assert_intact(message, seq)
                    assert await server.receive() == {"seq": seq + 1}
                return attempt.completed

            await sweep(trial)
            await client.send_eof()
            with anyio.fail_after(10), pytest.raises(EndOfStream):
                await server.receive()
    assert cancelled >= 5


@pytest.mark.parametrize(
    ("kind", "idle_timeout"),
    [("tcp", None), ("tls1.3", None), ("tcp", 60.0)],
    ids=["tcp", "tls1.3", "tcp-idle-timeout"],
)
async def test_receive_cancelled_at_every_byte_resumes(
    kind: str, idle_timeout: float | None
) -> None:
    """Through a proxy that forwards one byte per loop turn, a receive is cancelled
    after k turns, so the cancellation falls at every position of the message: in
    the frame count, the length table, the body and the out-of-band frame (over TLS,
    in the record header and body). The next receive still returns it intact. With
    an idle_timeout (that never expires here), receive takes its timed path: a
    cancellation from outside is still not mistaken for an idle peer."""
    cancelled = 0
    async with (
        comm_pairs(kind, oob_threshold=16, idle_timeout=idle_timeout) as pairs,
        FaultProxy("127.0.0.1", pairs.port) as proxy,
    ):
        client, server = await pairs.new(proxy.port)
        async with client, server:
            proxy.set_policy("upstream", split=1)

            async def trial(k: int) -> bool:
                nonlocal cancelled
                message = {"seq": k, "data": pattern(40, k)}  # 2 frames, 75 bytes
                await client.send(message)
                attempt = await run_cancelled_after(k, server.receive)
                assert attempt.error is None
                assert not server.closed
                if attempt.completed:
                    received = attempt.value
                else:
                    cancelled += 1
                    received = await server.receive()
                assert received == message
                return attempt.completed

            tried = await sweep(trial)
    assert cancelled >= DENSE and len(tried) > DENSE


# --- connect and the listener's handshake --------------------------------------------------------


async def echo(comm: Comm) -> None:
    async for message in comm:
        await comm.send(message)


async def assert_serves(address: str, kind: str) -> None:
    with anyio.fail_after(10):
        async with await anyio_comm.connect(
            address, timeout=10, **tls_options(kind, server=False)
        ) as comm:
            await comm.send({"still": "serving"})
            assert await comm.receive() == {"still": "serving"}


async def assert_back_to(
    fds: int, tasks: int, listener: anyio_comm.Listener | None = None
) -> None:
    """Both ends of an abandoned connection close: the process gets back to ``fds`` open
    file descriptors and ``tasks`` tasks, and the listener counts no connection."""
    with anyio.move_on_after(10):
        while (
            open_fds() != fds
            or running_tasks() != tasks
            or (listener is not None and listener.active_connections)
        ):
            await anyio.sleep(0.002)
    assert (open_fds(), running_tasks()) == (fds, tasks)
    assert listener is None or listener.active_connections == 0


def assert_nothing_logged_above_debug(caplog: pytest.LogCaptureFixture) -> None:
    ours = [r for r in caplog.records if r.name == "anyio_comm" and r.levelno > logging.DEBUG]
    assert not ours, [r.getMessage() for r in ours]


async def open_and_close_a_stream() -> None:
    """uvloop (libuv) opens one descriptor, ``/dev/null``, the first time a loop
    creates a stream, and keeps it: do that before counting descriptors."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(SocketAttribute.local_port)
        async with await anyio.connect_tcp("127.0.0.1", port):
            pass


@pytest.mark.parametrize(
    ("kind", "split"),
    [("tcp", None), ("tcp", 1), ("tls1.3", None), ("tls1.3", 64)],
    ids=["tcp-direct", "tcp-trickled", "tls1.3-direct", "tls1.3-trickled"],
)
async def test_connect_cancelled_at_every_checkpoint(
    kind: str, split: int | None, caplog: pytest.LogCaptureFixture
) -> None:
    """connect() (TCP connect, TLS handshake, preamble exchange) is cancelled after k
    turns: no file descriptor or task is left on either side, the listener counts no
    connection, and it still serves; the connect that completed works. "trickled":
    through a proxy writing pieces of ``split`` bytes (one per turn), so the
    handshakes take many turns and are cancelled all through."""
    caplog.set_level(logging.DEBUG, logger="anyio_comm")
    completed_comms = 0
    address = f"{scheme(kind)}://127.0.0.1:0"
    policy = Policy(split=split)
    async with (
        anyio_comm.listen(address, echo, **tls_options(kind, server=True)) as listener,
        FaultProxy("127.0.0.1", port_of(listener), upstream=policy, downstream=policy) as proxy,
    ):
        target = f"{scheme(kind)}://127.0.0.1:{proxy.port if split else port_of(listener)}"
        await wait_all_tasks_blocked()  # the listener's and the proxy's tasks have started
        fds, tasks = open_fds(), running_tasks()
        await assert_serves(target, kind)
        await assert_back_to(fds, tasks, listener)

        async def trial(k: int) -> bool:
            nonlocal completed_comms
            attempt = await run_cancelled_after(
                k,
                lambda: anyio_comm.connect(target, timeout=10, **tls_options(kind, server=False)),
            )
            assert attempt.error is None
            if attempt.value is not None:
                completed_comms += 1
                async with attempt.value as comm:
                    await comm.send(k)
                    assert await comm.receive() == k
            await assert_back_to(fds, tasks, listener)
            return attempt.completed

        tried = await sweep(trial)
        await assert_serves(target, kind)
    assert completed_comms == 1
    if split:
        assert len(tried) > DENSE
    assert_nothing_logged_above_debug(caplog)


PREAMBLE = encode_preamble(Limits(), {Capability.CLOSE_REASONS})
#: what a listener that stops a handler outside receive() tells a client that accepts
#: close records
INTERRUPTED = encode_close_record(
    CloseReason(CloseCode.INTERRUPTED, "", "the listener stopped while handling a message")
)


async def trickle_preamble(stream: anyio.abc.ByteStream) -> None:
    """Send our preamble one byte per turn of the loop."""
    for i in range(len(PREAMBLE)):
        await stream.send(PREAMBLE[i : i + 1])
        await checkpoint()


async def read_to_end(stream: anyio.abc.ByteStream, received: bytearray) -> None:
    """Receive until the listener closes (a FIN or a reset)."""
    try:
        while True:
            received += await stream.receive()
    except (EndOfStream, BrokenResourceError):
        pass


async def test_listener_cancelled_during_handshake(caplog: pytest.LogCaptureFixture) -> None:
    """A raw client trickles its preamble; the listener (its accept loop, the
    handshake, then the handler) is cancelled after k turns. Everything closes, and
    the client receives nothing, or exactly the listener's preamble and, once the
    handler ran (it sleeps, outside receive()), the close record of a listener that
    interrupted it, before the end."""
    caplog.set_level(logging.DEBUG, logger="anyio_comm")
    await open_and_close_a_stream()
    fds, tasks = open_fds(), running_tasks()
    outcomes: Counter[str] = Counter()

    async def trial(k: int) -> bool:
        handshake_done = anyio.Event()
        received = bytearray()
        completed = False

        async def handler(comm: Comm) -> None:
            handshake_done.set()
            await anyio.sleep_forever()

        async def trickle(stream: anyio.abc.ByteStream) -> None:
            try:
                await trickle_preamble(stream)
            except BrokenResourceError:
                pass  # the listener went away first

        async def client(stream: anyio.abc.ByteStream) -> None:
            async with stream, anyio.create_task_group() as client_tg:
                client_tg.start_soon(trickle, stream)
                await read_to_end(stream, received)  # from the start, as the listener sends

        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as scope:
                async with anyio_comm.listen("tcp://127.0.0.1:0", handler) as listener:
                    port = port_of(listener)
                    stream = await anyio.connect_tcp("127.0.0.1", port)
                    tg.start_soon(client, stream)
                    attempt = await run_cancelled_after(k, handshake_done.wait)
                    completed = attempt.completed
                    if not completed:
                        scope.cancel()  # run_cancelled_after stopped at our own wait
                        await checkpoint()
        outcomes["completed" if completed else "cancelled"] += 1
        if completed:
            assert bytes(received) == PREAMBLE + INTERRUPTED
        else:
            assert bytes(received) in (b"", PREAMBLE, PREAMBLE + INTERRUPTED)
        outcomes["preamble received" if received else "nothing received"] += 1
        await assert_back_to(fds, tasks)
        return completed

    await sweep(trial)
    assert outcomes["completed"] == 1
    assert_nothing_logged_above_debug(caplog)


async def test_client_vanishing_mid_preamble_at_every_checkpoint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A raw client trickling its preamble gives up after k turns and closes: the
    listener drops that connection (a handler runs, and sees the end of the stream,
    exactly when the whole preamble had been sent), leaves no descriptor or task
    behind, and keeps serving."""
    caplog.set_level(logging.DEBUG, logger="anyio_comm")
    handlers = 0

    async def handler(comm: Comm) -> None:
        nonlocal handlers
        handlers += 1
        await echo(comm)

    async with anyio_comm.listen("tcp://127.0.0.1:0", handler) as listener:
        port = port_of(listener)
        await open_and_close_a_stream()
        await wait_all_tasks_blocked()  # the listener's tasks have started
        fds, tasks = open_fds(), running_tasks()
        await assert_serves(listener.address, "tcp")
        await assert_back_to(fds, tasks, listener)
        handlers = 0

        async def trial(k: int) -> bool:
            sent = 0
            handlers_before = handlers

            async def handshake(stream: anyio.abc.ByteStream) -> None:
                nonlocal sent
                for i in range(len(PREAMBLE)):
                    await stream.send(PREAMBLE[i : i + 1])
                    sent += 1
                    await checkpoint()
                received = bytearray()
                while len(received) < len(PREAMBLE):
                    received += await stream.receive()
                assert bytes(received) == PREAMBLE

            async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                attempt = await run_cancelled_after(k, lambda: handshake(stream))
            assert attempt.error is None
            await assert_back_to(fds, tasks, listener)
            # a handler ran (and saw the end) exactly when the whole preamble went out
            assert handlers - handlers_before == (sent == len(PREAMBLE))
            return attempt.completed

        tried = await sweep(trial)
        await assert_serves(listener.address, "tcp")
    assert len(tried) > DENSE
    assert_nothing_logged_above_debug(caplog)
