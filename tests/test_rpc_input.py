"""anyio_comm.rpc uploads and channels, from the RPC guide and the docstrings of
``Client.upload``, ``Client.channel``, ``Upload``, ``Channel`` and
``InputStream``: the handler gets the caller's items as its first argument, in
order, with flow control both ways, deadlines, cancellation and typed errors as
for the other calls; metadata, trailers and interceptors reach them; malformed
input ends the connection. Every backend; TCP, TLS and the other address
transports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import pytest

import anyio_comm
from anyio_comm import rpc
from anyio_comm.rpc._protocol import Call, Credit, End, Item, Result, decode

from .helpers import ADDRESS_TRANSPORTS, rpc_server_and_client

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]


class Methods:
    def __init__(self) -> None:
        self.taken: list[Any] = []
        self.start_taking = anyio.Event()
        self.cancelled = anyio.Event()
        self.kinds: list[str] = []

    async def total(self, items: rpc.InputStream, scale: int = 1) -> int:
        self.kinds.append(rpc.current_call().kind)
        rpc.current_call().set_trailer("seen", "yes")
        total = 0
        async for item in items:
            total += item
        return total * scale

    async def sizes(self, items: rpc.InputStream) -> list[int]:
        return [len(item) async for item in items]

    async def first_two(self, items: rpc.InputStream) -> list[Any]:
        return [await items.__anext__(), await items.__anext__()]

    async def two_then_return(self, items: rpc.InputStream) -> int:
        await items.__anext__()
        await items.__anext__()
        await anyio.sleep(0.2)  # more items arrive meanwhile, never taken
        return 2

    async def take_later(self, items: rpc.InputStream) -> int:
        await self.start_taking.wait()
        async for item in items:
            self.taken.append(item)
        return len(self.taken)

    async def wait_forever(self, items: rpc.InputStream) -> None:
        try:
            await anyio.sleep_forever()
        finally:
            self.cancelled.set()

    async def refuse(self, items: rpc.InputStream) -> None:
        await items.__anext__()
        raise PermissionError("no more")

    async def echo(self, items: rpc.InputStream, prefix: str) -> AsyncIterator[str]:
        self.kinds.append(rpc.current_call().kind)
        async for item in items:
            yield f"{prefix}{item}"
        yield "end"

    async def echo_later(self, items: rpc.InputStream) -> AsyncIterator[Any]:
        await self.start_taking.wait()
        async for item in items:
            yield item

    async def count_to(self, items: rpc.InputStream, n: int) -> AsyncIterator[int]:
        for i in range(n):  # never reads its input
            yield i

    async def plain(self, x: int) -> int:
        return x

    async def no_arguments(self) -> int:
        return 0

    async def sleeper(self) -> None:
        await anyio.sleep_forever()

    async def generator(self) -> AsyncIterator[int]:
        yield 1


@pytest.mark.parametrize("kind", KINDS)
async def test_an_upload_sends_its_items_in_order(kind: str) -> None:
    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client(kind, methods, input_window=4) as (_, client):
            async with client.upload("total", 3) as upload:
                for i in range(200):
                    await upload.send(i)
                assert await upload.finish() == 3 * sum(range(200))
            assert methods.kinds == ["upload"]
            # large items travel out-of-band, as arguments do
            blobs = [bytes(100_000), b"", bytes(3 * 2**20)]
            async with client.upload("sizes") as upload:
                for blob in blobs:
                    await upload.send(blob)
                assert await upload.finish() == [len(blob) for blob in blobs]
            # with metadata, trailers come back
            trailers: dict[str, str | bytes] = {}
            async with client.with_metadata({}, trailers=trailers).upload("total") as upload:
                await upload.send(5)
                assert await upload.finish() == 5
            assert trailers == {"seen": "yes"}


@pytest.mark.parametrize("kind", KINDS)
async def test_a_channel_carries_items_both_ways(kind: str) -> None:
    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client(kind, methods, input_window=2) as (_, client):
            async with client.channel("echo", "> ") as channel:
                for i in range(3):  # in turns, one task
                    await channel.send(i)
                    assert await channel.receive() == f"> {i}"
                await channel.end()
                await channel.end()  # again: nothing happens
                assert [item async for item in channel] == ["end"]
                with pytest.raises(anyio.EndOfStream):
                    await channel.receive()
            assert methods.kinds == ["channel"]

            # a sender and a receiver task, far more items than either window
            received: list[str] = []
            async with client.channel("echo", "") as channel:

                async def send_all() -> None:
                    for i in range(500):
                        await channel.send(i)
                    await channel.end()

                async with anyio.create_task_group() as tg:
                    tg.start_soon(send_all)
                    received.extend([item async for item in channel])
            assert received == [str(i) for i in range(500)] + ["end"]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_handler_that_does_not_take_items_holds_the_sender_back(kind: str) -> None:
    """Flow control: ``send`` returns for ``input_window`` items the handler has
    not taken, and waits for the next until it takes them."""
    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client(kind, methods, input_window=4) as (_, client):
            async with client.upload("take_later") as upload:
                sent = 0
                with anyio.move_on_after(0.5):
                    for i in range(10):
                        await upload.send(i)
                        sent += 1
                assert sent == 4
                methods.start_taking.set()
                for i in range(sent, 10):
                    await upload.send(i)
                assert await upload.finish() == 10
            assert methods.taken == list(range(10))


async def test_a_handler_that_returns_early_breaks_the_sending() -> None:
    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", methods) as (_, client):
            async with client.upload("first_two") as upload:
                await upload.send("a")
                await upload.send("b")
                with pytest.raises(anyio.BrokenResourceError), anyio.fail_after(5):
                    for i in range(100):  # until the result arrived
                        await upload.send(i)
                        await anyio.sleep(0.01)
                assert await upload.finish() == ["a", "b"]
                with pytest.raises(anyio.ClosedResourceError):
                    await upload.send("c")
            async with client.channel("count_to", 3) as channel:
                assert [item async for item in channel] == [0, 1, 2]
                with pytest.raises(anyio.BrokenResourceError):
                    await channel.send("late")
            assert await client.call("plain", 7) == 7  # the connection is fine


@pytest.mark.parametrize("kind", KINDS)
async def test_a_failed_upload_raises_its_error_typed(kind: str) -> None:
    with anyio.fail_after(20):
        async with rpc_server_and_client(kind, Methods()) as (_, client):
            async with client.upload("refuse") as upload:
                await upload.send(1)
                with pytest.raises(rpc.RemoteError) as caught:
                    await upload.finish()
                assert (caught.value.remote_type, caught.value.remote_message) == (
                    "PermissionError",
                    "no more",
                )
            async with client.upload("refuse") as upload:
                await upload.send(1)
                with pytest.raises(rpc.RemoteError, match="no more"), anyio.fail_after(5):
                    while True:  # the error reaches send() once it came back
                        await upload.send(2)
                        await anyio.sleep(0.01)


async def test_wrong_kinds_of_call_are_refused() -> None:
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", Methods()) as (_, client):
            with pytest.raises(rpc.BadCallError):
                async with client.upload("generator") as upload:
                    await upload.finish()
            with pytest.raises(rpc.BadCallError):
                async with client.channel("total") as channel:
                    await channel.receive()
            with pytest.raises(rpc.InvalidArgumentsError):
                async with client.upload("no_arguments") as upload:  # takes no items
                    await upload.finish()
            with pytest.raises(rpc.MethodNotFoundError):
                async with client.upload("nothing") as upload:
                    await upload.send(1)
                    await upload.finish()
            assert await client.call("plain", 1) == 1


@pytest.mark.parametrize("api", ["upload", "channel"])
async def test_deadlines_and_cancellation_reach_the_handler(api: str) -> None:
    method = "wait_forever" if api == "upload" else "echo"
    for how in ("deadline", "leave"):
        methods = Methods()
        if api == "channel":
            methods.echo = _waiting_echo(methods)  # type: ignore[method-assign]
        with anyio.fail_after(20):
            async with rpc_server_and_client("tcp", methods) as (_, client):
                opened = client.upload(method) if api == "upload" else client.channel(method, "")
                if how == "deadline":
                    with pytest.raises(TimeoutError), anyio.fail_after(0.3):
                        async with opened as call:
                            await call.send(1)
                            await anyio.sleep_forever()
                else:
                    async with opened as call:  # left before it ended
                        await call.send(1)
                with anyio.fail_after(5):
                    await methods.cancelled.wait()
                assert await client.call("plain", 2) == 2


def _waiting_echo(methods: Methods) -> Any:
    async def echo(items: rpc.InputStream, prefix: str) -> AsyncIterator[str]:
        try:
            await anyio.sleep_forever()
            yield prefix
        finally:
            methods.cancelled.set()

    return echo


async def test_interceptors_see_uploads_and_channels() -> None:
    seen: list[tuple[str, str, str]] = []

    async def server_side(call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        seen.append(("server", call.kind, call.method))
        return await proceed()

    async def client_side(call: rpc.OutgoingCall, proceed: rpc.Proceed) -> Any:
        seen.append(("client", call.kind, call.method))
        call.metadata["via"] = "interceptor"
        return await proceed()

    with anyio.fail_after(20):
        async with rpc_server_and_client(
            "tcp",
            Methods(),
            interceptors=[server_side],
            connect_arguments={"interceptors": [client_side]},
        ) as (_, client):
            async with client.upload("total") as upload:
                await upload.send(2)
                assert await upload.finish() == 2
            async with client.channel("echo", "") as channel:
                await channel.end()
                assert [item async for item in channel] == ["end"]
    assert seen == [
        ("client", "upload", "total"),
        ("server", "upload", "total"),
        ("client", "channel", "echo"),
        ("server", "channel", "echo"),
    ]


async def test_items_a_handler_left_give_their_budget_back() -> None:
    """Items the handler never took are given back to the receive budget when
    the call ends: a budget that holds a few of them serves upload after
    upload."""
    methods = Methods()
    with anyio.fail_after(30):
        async with rpc_server_and_client(
            "tcp", methods, receive_budget=2 * 2**20, input_window=16
        ) as (_, client):
            for _ in range(4):
                async with client.upload("two_then_return") as upload:
                    with anyio.move_on_after(1):
                        for _ in range(16):
                            await upload.send(bytes(300_000))
                    assert await upload.finish() == 2
            assert await client.call("plain", 3) == 3


@pytest.mark.parametrize(
    ("messages", "why"),
    [
        ([Item(9, 1)], "without input"),  # a running plain call's id
        ([Item(1, i) for i in range(3)], "more input items"),  # a window of 2
        ([End(1), Item(1, 0)], "after its end"),
        ([End(1), End(1)], "twice"),
    ],
)
async def test_malformed_input_ends_the_connection(messages: list[Any], why: str) -> None:
    methods = Methods()
    methods.start_taking = anyio.Event()  # the handler takes nothing
    with anyio.fail_after(20):
        async with (
            rpc.serve("tcp://127.0.0.1:0", methods, input_window=2) as server,
            await anyio_comm.connect(server.address) as comm,
        ):
            await comm.send(Call(1, "take_later", [], {}, None, False, None, True).encode())
            assert decode(await comm.receive()) == Credit(1, 2)
            await comm.send(Call(8, "plain", [1], {}, None).encode())
            assert decode(await comm.receive()) == Result(8, 1)
            await comm.send(Call(9, "sleeper", [], {}, None).encode())
            for message in messages:
                await comm.send(message.encode())
            with pytest.raises(anyio_comm.PeerClosedError) as info:
                await comm.receive()
            assert info.value.reason.code is anyio_comm.CloseCode.PROTOCOL_ERROR
            assert why in info.value.reason.text


async def test_input_for_a_call_that_ended_is_dropped() -> None:
    """Items and ENDs for an id that does not run (the call returned) are
    ignored, as CANCEL and CREDIT are."""
    with anyio.fail_after(20):
        async with (
            rpc.serve("tcp://127.0.0.1:0", Methods()) as server,
            await anyio_comm.connect(server.address) as comm,
        ):
            await comm.send(Item(5, "x").encode())
            await comm.send(End(5).encode())
            await comm.send(Call(6, "plain", [6], {}, None).encode())
            assert decode(await comm.receive()) == Result(6, 6)


async def test_a_waiting_upload_gets_no_credit_until_its_handler_starts() -> None:
    """With one call at a time per connection, a second upload's items wait on
    the client (its send does not return) until the first handler returned."""
    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", methods, max_calls_per_connection=1) as (
            _,
            client,
        ):
            async with (
                client.upload("take_later") as first,
                client.upload("total") as second,
            ):
                await first.send("x")
                with anyio.move_on_after(0.3) as waited:
                    await second.send(1)
                assert waited.cancelled_caught  # no credit: it did not start
                methods.start_taking.set()
                assert await first.finish() == 1
                await second.send(2)  # started now
                assert await second.finish() == 2


@pytest.mark.parametrize("api", ["upload", "channel"])
async def test_ending_while_a_send_waits_sends_nothing_after_the_end(api: str) -> None:
    """A send waiting for credit when another task ends the input raises
    ClosedResourceError and sends nothing: the call and the connection go on."""
    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", methods, input_window=1) as (_, client):
            opened = (
                client.upload("take_later") if api == "upload" else client.channel("echo_later")
            )
            async with opened as call:
                await call.send(0)  # the window is full now
                outcome: list[Any] = []

                async def blocked_send() -> None:
                    try:
                        await call.send(1)
                    except anyio.ClosedResourceError:
                        outcome.append("closed")

                async def finish() -> None:
                    outcome.append(await call.finish())  # type: ignore[union-attr]

                async with anyio.create_task_group() as tg:
                    tg.start_soon(blocked_send)
                    await anyio.sleep(0.1)
                    if api == "upload":
                        tg.start_soon(finish)
                    else:
                        await call.end()  # type: ignore[union-attr]
                    await anyio.sleep(0.1)
                    methods.start_taking.set()
                if api == "upload":
                    assert sorted(map(str, outcome)) == ["1", "closed"]  # (in either order)
                else:
                    assert outcome == ["closed"]
                    assert [item async for item in call] == [0]  # type: ignore[union-attr]
            assert await client.call("plain", 4) == 4


async def test_a_send_that_fails_keeps_its_credit() -> None:
    """An item that cannot be serialized is not sent and uses no credit: with a
    window of one, the next items still go."""
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", Methods(), input_window=1) as (_, client):
            async with client.upload("total") as upload:
                for _ in range(3):
                    with pytest.raises(anyio_comm.SerializationError):
                        await upload.send(object())
                for i in range(5):
                    await upload.send(i)
                assert await upload.finish() == 10


async def test_the_refusal_of_a_wrong_kind_names_the_right_calls() -> None:
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", Methods()) as (_, client):
            with pytest.raises(rpc.BadCallError, match=r"use stream\(\) or channel\(\)"):
                async with client.upload("generator") as upload:
                    await upload.finish()
            with pytest.raises(rpc.BadCallError, match=r"use call\(\) or upload\(\)"):
                async with client.channel("total") as channel:
                    await channel.receive()
