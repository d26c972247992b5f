"""``send_batch`` / ``receive_batch`` and their frames forms, written from their
docstrings: order kept, nothing lost (cancellation, an end or a bad message behind
a batch), all or nothing on the sending side, on every backend and transport."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.lowlevel
import pytest
from anyio import BrokenResourceError, ClosedResourceError, EndOfStream

from anyio_comm import (
    CloseCode,
    CloseReason,
    Limits,
    LocalProtocolError,
    PeerClosedOK,
    RemoteProtocolError,
    SerializationError,
)

from .helpers import TRANSPORTS, connected_pair

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("kind", TRANSPORTS)]

#: seconds the bytes of a batch are given to arrive (loopback: far more than enough)
ARRIVE = 0.1


async def receive_all(comm: Any, count: int, max_messages: int = 64) -> list[list[Any]]:
    """Batches from ``comm.receive_batch`` until ``count`` messages came."""
    batches: list[list[Any]] = []
    with anyio.fail_after(10):
        while sum(map(len, batches)) < count:
            batches.append(await comm.receive_batch(max_messages))
    return batches


#: the transports whose comm reads what the socket holds at once (over the others a
#: write waits for the peer's reads, or the comm reads a byte stream's chunks as it
#: waits: a batch is what they delivered)
BUFFERED = {"tcp", "tcp6", "unix", "tls1.2", "tls1.3"}


async def test_a_batch_arrives_in_order_and_is_received_at_once(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        messages = [{"n": n, "pad": b"p" * (n % 7)} for n in range(40)]
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_batch, messages)
            await anyio.sleep(ARRIVE)
            batches = await receive_all(server, 40)
        assert [m for b in batches for m in b] == messages
        if kind in BUFFERED:
            assert len(batches) == 1  # everything that had arrived, in one call
        # a second round, taken three at a time
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_batch, messages[:10])
            await anyio.sleep(ARRIVE)
            batches = await receive_all(server, 10, max_messages=3)
        assert all(1 <= len(b) <= 3 for b in batches)
        assert [m for b in batches for m in b] == messages[:10]
        if kind in BUFFERED:
            assert [len(b) for b in batches] == [3, 3, 3, 1]


async def test_receive_batch_waits_for_the_first_message(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        async with anyio.create_task_group() as tg:

            async def later() -> None:
                await anyio.sleep(0.05)
                await client.send("first")

            tg.start_soon(later)
            with anyio.fail_after(10):
                assert await server.receive_batch() == ["first"]


async def test_frames_batches(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        messages = [[b"a", bytearray(b"b" * 100)], [memoryview(b"")], [b"c" * 70_000, b"d"]]
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames_batch, messages)
            received: list[Any] = []
            with anyio.fail_after(10):
                while len(received) < 3:
                    received += await server.receive_frames_batch()
        assert [[bytes(f) for f in frames] for frames in received] == [
            [bytes(f) for f in frames] for frames in messages
        ]


async def test_a_batch_over_the_peers_limits_sends_nothing(kind: str) -> None:
    async with connected_pair(kind, limits=Limits(max_message_size=1000)) as (client, server):
        with pytest.raises(LocalProtocolError, match="message 1 of the batch"):
            await client.send_batch([b"ok", b"x" * 5000, b"also ok"])
        with pytest.raises(LocalProtocolError, match="message 0 of the batch"):
            await client.send_frames_batch([[b"x" * 5000]])
        with pytest.raises(SerializationError):
            await client.send_batch(["ok", object()])
        await client.send_batch([])  # nothing to send
        await client.send("next")
        with anyio.fail_after(10):
            assert await server.receive_batch() == ["next"]  # nothing before it


async def test_a_cancelled_receive_batch_takes_nothing(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        with anyio.move_on_after(0.05):
            await server.receive_batch()  # cancelled while it waits
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_batch, list(range(5)))
            await anyio.sleep(ARRIVE)
            with anyio.CancelScope() as scope:
                scope.cancel()
                await server.receive_batch()  # cancelled at its checkpoint
            assert [m for b in await receive_all(server, 5) for m in b] == list(range(5))


class FailsOnce:
    """A receive engine whose receive_nowait() raises once, right after it returned a
    message (a failure that is not sticky); the rest is the real engine's."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._state = "before"

    def receive_nowait(self) -> Any:
        if self._state == "returned":
            self._state = "failed"
            raise BrokenResourceError("one-shot")
        frames = self._real.receive_nowait()
        if frames is not None and self._state == "before":
            self._state = "returned"
        return frames

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


async def test_an_error_behind_a_batch_is_raised_once_by_the_next_call(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure that the receive engine reports once (not a sticky end) is kept for
    the next call, which raises it (and the comm is broken from then on)."""
    async with connected_pair(kind) as (client, server):
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_batch, ["first", "second", "third"])
            with anyio.fail_after(10):
                assert await server.receive() == "first"
            monkeypatch.setattr(server, "_receiver", FailsOnce(server._receiver))  # type: ignore[attr-defined]
            await anyio.sleep(ARRIVE)
            with anyio.fail_after(10):
                assert await server.receive_batch() == ["second"]
                with pytest.raises(BrokenResourceError, match="one-shot"):
                    await server.receive_batch()
                with pytest.raises(BrokenResourceError):
                    await server.receive_batch()


async def test_the_end_behind_a_batch_is_raised_by_the_next_call(kind: str) -> None:
    async with connected_pair(kind) as (client, server):

        async def send_and_close() -> None:
            await client.send_batch([1, 2, 3])
            await client.aclose()

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_and_close)
            await anyio.sleep(ARRIVE)
            assert [m for b in await receive_all(server, 3) for m in b] == [1, 2, 3]
        with anyio.fail_after(10), pytest.raises(EndOfStream):
            await server.receive_batch()
    # closed with a reason: said after the messages, by the next call
    async with connected_pair(kind) as (client, server):

        async def send_and_say_why() -> None:
            await client.send_batch([1, 2])
            await client.aclose(CloseReason(CloseCode.GOING_AWAY, "", "done for today"))

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_and_say_why)
            await anyio.sleep(ARRIVE)
            assert [m for b in await receive_all(server, 2) for m in b] == [1, 2]
        with anyio.fail_after(10), pytest.raises(PeerClosedOK):
            await server.receive_batch()
        assert server.peer_close_reason is not None
        assert server.peer_close_reason.text == "done for today"


async def test_a_bad_message_behind_a_batch_is_refused_by_the_next_call(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                client.send_frames_batch, [[b"\xa2ok"], [b"\xc1 not msgpack"], [b"\xa4late"]]
            )
            await anyio.sleep(ARRIVE)
            with anyio.fail_after(10):
                assert await server.receive_batch() == ["ok"]
            with pytest.raises(RemoteProtocolError):
                if kind in BUFFERED:  # (it arrived with the batch: refused whoever asks)
                    await server.receive_frames_batch()
                else:
                    await server.receive_batch()
            with pytest.raises(BrokenResourceError):
                await server.receive_batch()
        assert server.closed


async def test_batch_arguments_and_a_closed_comm(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        for bad in (0, -1, 1.5, True):
            with pytest.raises(ValueError, match="max_messages"):
                await server.receive_batch(bad)
            with pytest.raises(ValueError, match="max_messages"):
                await server.receive_frames_batch(bad)
        await client.aclose()
        with pytest.raises(ClosedResourceError):
            await client.send_batch([])
        with pytest.raises(ClosedResourceError):
            await client.send_batch(["x"])
        with pytest.raises(ClosedResourceError):
            await client.receive_batch()


async def test_an_empty_batch_sends_nothing_and_is_a_send_all_the_same(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()
            before = ticks
            for _ in range(20):
                await client.send_batch([])  # lets other tasks run, as sends do
            assert ticks > before
            tg.cancel_scope.cancel()
        with anyio.CancelScope() as scope:
            scope.cancel()
            with pytest.raises(anyio.get_cancelled_exc_class()):
                await client.send_batch([])  # a cancellation point
        await client.send("after")
        with anyio.fail_after(10):
            assert await server.receive_batch() == ["after"]  # nothing before it
        sent = anyio.Event()

        async def send_large() -> None:
            await client.send(b"x" * 50_000_000)
            sent.set()

        async with anyio.create_task_group() as tg:
            # another task's send in progress (it does not fit the peer's buffers,
            # unless the event loop's transport takes any write: asyncio's own)
            tg.start_soon(send_large)
            await anyio.wait_all_tasks_blocked()
            if not sent.is_set():
                with pytest.raises(anyio.BusyResourceError):
                    await client.send_batch([])
            tg.cancel_scope.cancel()
    async with connected_pair(kind) as (client, server):
        await client.send_eof()
        with pytest.raises(ClosedResourceError):
            await client.send_batch([])
