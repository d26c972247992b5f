"""anyio_comm.rpc: calls, errors, deadlines, cancellation, limits, on every
backend and transport (TLS included)."""

from __future__ import annotations

import contextvars
import math
import random
import time
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import msgpack
import pytest
from anyio.lowlevel import checkpoint

import anyio_comm
import anyio_comm.testing
from anyio_comm import rpc
from anyio_comm._sansio.close import CloseCode
from anyio_comm.rpc._protocol import Call, ErrorCode, Notify, decode

from .helpers import ADDRESS_TRANSPORTS, listen_arguments, rpc_server_and_client

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]


class AppError(Exception):
    pass


class Methods:
    """The server's methods, and what they saw."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.started: dict[str, anyio.Event] = {}
        self.notes: list[Any] = []
        self.noted = anyio.Event()
        self.running = 0
        self.most_running = 0

    async def add(self, a: int, b: int) -> int:
        return a + b

    def add_sync(self, a: int, b: int) -> int:
        return a + b

    async def echo(self, value: Any, delay: float = 0.0) -> Any:
        if delay:
            await anyio.sleep(delay)
        return value

    async def fail(self, text: str) -> None:
        raise AppError(text)

    async def fail_with_type_error(self) -> None:
        raise TypeError("raised inside")

    async def slow(self, name: str = "slow", seconds: float = 30.0) -> str:
        self.started.setdefault(name, anyio.Event()).set()
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await anyio.sleep(seconds)
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(name)
            raise
        finally:
            self.running -= 1
        return name

    async def note(self, value: Any) -> None:
        self.notes.append(value)
        self.noted.set()

    async def unserializable(self) -> object:
        return object()

    async def later(self, seconds: float) -> AsyncIterator[str]:
        await anyio.sleep(seconds)
        yield "late"

    async def count(self, n: int, fail_at: int | None = None) -> AsyncIterator[int]:
        self.produced = 0
        try:
            for i in range(n):
                if i == fail_at:
                    raise AppError(f"failed at {i}")
                self.produced = i + 1
                yield i
        except (GeneratorExit, anyio.get_cancelled_exc_class()):
            self.cancelled.append("count")  # closed while it waited, or cancelled
            raise


@asynccontextmanager
async def server_and_client(
    kind: str = "tcp", methods: Any = None, **serve_arguments: Any
) -> AsyncIterator[tuple[rpc.Server, rpc.Client, Methods]]:
    methods = methods or Methods()
    async with rpc_server_and_client(kind, methods, **serve_arguments) as (server, client):
        yield server, client, methods


@pytest.mark.parametrize("kind", KINDS)
async def test_calls_on_every_transport(kind: str) -> None:
    with anyio.fail_after(20):
        async with server_and_client(kind) as (_server, client, _methods):
            assert await client.call("add", 1, 2) == 3
            assert await client.call("add_sync", a=2, b=5) == 7
            payload = bytes(range(256)) * 4096  # out-of-band, zero-copy
            assert bytes(await client.call("echo", payload)) == payload
            assert await client.call("echo", {"k": [1, "x", None]}) == {"k": [1, "x", None]}


async def test_a_mapping_of_functions() -> None:
    async def mul(a: int, b: int) -> int:
        return a * b

    with anyio.fail_after(10):
        async with (
            rpc.serve("tcp://127.0.0.1:0", {"mul": mul, "neg": lambda x: -x}) as server,
            rpc.connect(server.address) as client,
        ):
            assert await client.call("mul", 6, 7) == 42
            assert await client.call("neg", 5) == -5


async def test_many_concurrent_calls_are_matched() -> None:
    rng = random.Random(1)
    results: dict[int, Any] = {}
    with anyio.fail_after(30):
        async with server_and_client() as (_server, client, _methods):

            async def one(i: int) -> None:
                results[i] = await client.call("echo", i, delay=rng.random() / 100)

            async with anyio.create_task_group() as tg:
                for i in range(300):
                    tg.start_soon(one, i)
            assert client.calls_in_flight == 0
    assert results == {i: i for i in range(300)}


async def test_remote_errors_are_typed() -> None:
    with anyio.fail_after(10):
        async with server_and_client() as (_server, client, _methods):
            with pytest.raises(rpc.RemoteError) as info:
                await client.call("fail", "it broke")
            assert info.value.remote_type == f"{__name__}.AppError"
            assert info.value.remote_message == "it broke"
            assert info.value.method == "fail"
            assert "it broke" in str(info.value)
            with pytest.raises(rpc.MethodNotFoundError, match="nope"):
                await client.call("nope")
            with pytest.raises(rpc.InvalidArgumentsError) as bad:
                await client.call("add", 1)
            assert isinstance(bad.value, TypeError)
            with pytest.raises(rpc.RemoteError, match="raised inside") as inside:
                await client.call("fail_with_type_error")
            assert not isinstance(inside.value, rpc.InvalidArgumentsError)
            with pytest.raises(rpc.RemoteError, match="SerializationError"):
                await client.call("unserializable")
            with pytest.raises(rpc.MethodNotFoundError):
                await client.call("_private")
            with pytest.raises(anyio_comm.SerializationError):
                await client.call("echo", object())
            assert await client.call("add", 1, 1) == 2  # the connection is fine


async def test_a_long_error_message_is_cut() -> None:
    with anyio.fail_after(10):
        async with server_and_client() as (_server, client, _methods):
            with pytest.raises(rpc.RemoteError) as info:
                await client.call("fail", "x" * 100_000)
            assert len(info.value.remote_message) == 1024
            assert info.value.remote_message.endswith("...")


async def test_a_deadline_travels_with_the_call_and_cancels_the_handler() -> None:
    with anyio.fail_after(10):
        async with server_and_client() as (_server, client, methods):
            with pytest.raises(TimeoutError), anyio.fail_after(0.2):
                await client.call("slow", "deadline")
            with anyio.fail_after(5):
                while "deadline" not in methods.cancelled:
                    await anyio.sleep(0.01)
            assert await client.call("add", 2, 2) == 4
            assert methods.running == 0


async def test_the_server_enforces_the_deadline_it_was_sent() -> None:
    """A call whose timeout passes on the server fails with DEADLINE_EXCEEDED
    (the caller itself waits longer here)."""
    methods = Methods()
    with anyio.fail_after(10):
        async with rpc.serve("tcp://127.0.0.1:0", methods) as server:
            comm = await anyio_comm.connect(server.address)
            async with comm:
                await comm.send(Call(7, "slow", ["server"], {}, 0.1).encode())
                reply = decode(await comm.receive())
            assert reply.id == 7 and reply.code is ErrorCode.DEADLINE_EXCEEDED  # type: ignore[union-attr]
            assert methods.cancelled == ["server"]


@pytest.mark.parametrize("scope", ["fail_after", "move_on_after"])
@pytest.mark.parametrize("api", ["call", "stream"])
async def test_the_callers_deadline_wins_over_a_deadline_reply_that_came_with_it(
    scope: str, api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's DEADLINE_EXCEEDED reply is taken, and the caller's own deadline
    passes before the caller runs again (the event loop was held up): the caller's
    scope reports it, as TimeoutError from fail_after or nothing from move_on_after,
    not DeadlineExceededError. (Over TCP the reply and the caller's timer can come in
    one pass of the event loop, the reply first.)"""
    from anyio_comm.rpc import _client
    from anyio_comm.rpc._protocol import ErrorReply

    finish = _client._Pending.finish

    def finish_then_hold_up(pending: Any, outcome: Any) -> None:
        finish(pending, outcome)
        # the caller's deadline passes before the caller runs again
        time.sleep(0.15)

    monkeypatch.setattr(_client._Pending, "finish", finish_then_hold_up)

    ours, theirs = await anyio_comm.testing.comm_pair()
    async with ours, theirs:
        async with rpc.open_client(ours) as client:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:

                    async def late_deadline_reply() -> None:
                        hello = decode(await theirs.receive())  # the client's first message
                        assert isinstance(hello, Notify) and hello.method == "rpc.hello"
                        call = decode(await theirs.receive())
                        assert isinstance(call, Call) and call.timeout is not None
                        reply = ErrorReply(call.id, ErrorCode.DEADLINE_EXCEEDED, "X", "late")
                        await theirs.send(reply.encode())

                    tg.start_soon(late_deadline_reply)

                    async def calling() -> None:
                        if api == "call":
                            await client.call("slow")
                        else:
                            async with client.stream("items") as items:
                                async for _ in items:
                                    pass

                    if scope == "fail_after":
                        with pytest.raises(TimeoutError) as info, anyio.fail_after(0.1):
                            await calling()
                        assert not isinstance(info.value, rpc.DeadlineExceededError)
                    else:
                        with anyio.move_on_after(0.1) as moved:
                            await calling()
                        assert moved.cancelled_caught


async def test_a_cancelled_call_cancels_its_handler_and_nothing_else() -> None:
    with anyio.fail_after(10):
        async with server_and_client() as (_server, client, methods):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call, "slow", "victim")
                await methods.started.setdefault("victim", anyio.Event()).wait()
                other = anyio.Event()

                async def survivor() -> None:
                    assert await client.call("slow", "survivor", 0.3) == "survivor"
                    other.set()

                tg.start_soon(survivor)
                await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
            assert not other.is_set()  # cancelled with the group
            with anyio.fail_after(5):
                while len(methods.cancelled) < 2:
                    await anyio.sleep(0.01)
            assert sorted(methods.cancelled) == ["survivor", "victim"]
            assert await client.call("echo", "after") == "after"


async def test_cancel_at_every_checkpoint() -> None:
    """A call cancelled after 0, 1, 2, ... checkpoints, while other calls run:
    each other call gets its own reply, the victim gets its own or is
    cancelled, and the connection stays healthy."""
    with anyio.fail_after(60):
        async with server_and_client() as (server, client, _methods):
            steps = 0
            finished = False
            while not finished and steps < 200:
                outcome: list[Any] = []

                async def victim(value: int, scope: anyio.CancelScope, out: list[Any]) -> None:
                    with scope:
                        out.append(await client.call("echo", value))

                async def others(base: int) -> None:
                    for i in range(3):
                        assert await client.call("echo", base + i) == base + i

                scope = anyio.CancelScope()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(others, 10_000 * steps)
                    tg.start_soon(victim, steps, scope, outcome)
                    for _ in range(steps):
                        await checkpoint()
                    scope.cancel()
                if outcome:
                    assert outcome == [steps]
                    finished = True  # from here on the call completes first
                steps += 1
            assert finished
            assert await client.call("echo", "healthy") == "healthy"
            assert client.calls_in_flight == 0
            with anyio.fail_after(5):
                while server.calls_running:
                    await anyio.sleep(0.01)


async def test_overloaded_calls_are_rejected_by_option() -> None:
    with anyio.fail_after(10):
        async with server_and_client(max_calls_per_connection=2, overload="reject") as (
            _server,
            client,
            methods,
        ):
            async with anyio.create_task_group() as tg:
                for name in ("a", "b"):
                    tg.start_soon(client.call, "slow", name, 0.5)
                    await methods.started.setdefault(name, anyio.Event()).wait()
                with pytest.raises(rpc.OverloadedError):
                    await client.call("slow", "c", 0.5)
            assert await client.call("add", 1, 2) == 3


async def test_calls_beyond_the_limit_wait() -> None:
    with anyio.fail_after(20):
        async with server_and_client(max_calls=2) as (_server, client, methods):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(client.call, "slow", f"w{i}", 0.05)
            assert methods.most_running == 2


async def test_notify_runs_without_a_reply() -> None:
    with anyio.fail_after(10):
        async with server_and_client() as (_server, client, methods):
            await client.notify("note", {"x": 1})
            await methods.noted.wait()
            assert methods.notes == [{"x": 1}]
            await client.notify("nope")  # logged by the server, nothing comes back
            await client.notify("fail", "logged")
            assert await client.call("add", 1, 2) == 3


async def test_calls_in_flight_fail_when_the_server_goes() -> None:
    with anyio.fail_after(10):
        methods = Methods()
        async with rpc.serve("tcp://127.0.0.1:0", methods) as server:
            address = server.address
            client_cm = rpc.connect(address)
            client = await client_cm.__aenter__()
            try:
                async with anyio.create_task_group() as tg:

                    async def waiting() -> None:
                        with pytest.raises(rpc.UnavailableError):
                            await client.call("slow", "gone")

                    tg.start_soon(waiting)
                    await methods.started.setdefault("gone", anyio.Event()).wait()
                    await server.listener.shutdown(0.1)
                with pytest.raises(rpc.UnavailableError):
                    await client.call("add", 1, 2)
                assert not client.usable
            finally:
                await client_cm.__aexit__(None, None, None)


async def test_a_closed_client_refuses_calls() -> None:
    with anyio.fail_after(10):
        async with server_and_client() as (_server, client, _methods):
            await client.aclose()
            with pytest.raises(anyio.ClosedResourceError):
                await client.call("add", 1, 2)


async def test_a_client_that_breaks_the_protocol_is_closed_with_a_reason() -> None:
    with anyio.fail_after(10):
        async with rpc.serve("tcp://127.0.0.1:0", Methods()) as server:
            async with await anyio_comm.connect(server.address) as comm:
                await comm.send(["not", "rpc"])
                with pytest.raises(anyio_comm.PeerClosedError) as info:
                    await comm.receive()
                assert info.value.reason.code is CloseCode.PROTOCOL_ERROR


async def test_serve_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="overload"):
        async with rpc.serve("tcp://127.0.0.1:0", {}, overload="drop"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="at least 1"):
        async with rpc.serve("tcp://127.0.0.1:0", {}, max_calls=0):
            pass
    with pytest.raises(ValueError, match="max_waiting_per_connection at least 0"):
        async with rpc.serve("tcp://127.0.0.1:0", {}, max_waiting_per_connection=-1):
            pass
    with pytest.raises(TypeError, match="not callable"):
        async with rpc.serve("tcp://127.0.0.1:0", {"x": 1}):
            pass


async def test_streams_with_flow_control() -> None:
    with anyio.fail_after(20):
        async with server_and_client() as (_server, client, methods):
            async with client.stream("count", 100) as items:
                assert [item async for item in items] == list(range(100))
            # a consumer that stops taking items stops the producer a window ahead
            async with client.stream("count", 1000) as items:
                assert await items.__anext__() == 0
                await anyio.sleep(0.2)
                assert methods.produced <= 1 + 16 + 1
                # ... while other calls go on
                assert await client.call("add", 1, 2) == 3
            # leaving early cancelled the generator on the server
            with anyio.fail_after(5):
                while "count" not in methods.cancelled:
                    await anyio.sleep(0.01)
            async with client.stream("count", 10, fail_at=3) as items:
                got = []
                with pytest.raises(rpc.RemoteError, match="failed at 3"):
                    async for item in items:
                        got.append(item)
                assert got == [0, 1, 2]
            with pytest.raises(rpc.BadCallError, match="use stream"):
                await client.call("count", 3)
            with pytest.raises(rpc.BadCallError, match="use call"):
                async with client.stream("add", 1, 2) as items:
                    async for _ in items:
                        pass
            with pytest.raises(rpc.InvalidArgumentsError):
                async with client.stream("count") as items:
                    async for _ in items:
                        pass
            assert client.calls_in_flight == 0


def test_messages_are_checked() -> None:
    from anyio_comm.rpc._protocol import ProtocolViolation

    good = Call(1, "m", [1], {"k": 2}, 1.5, False).encode()
    assert decode(msgpack.unpackb(msgpack.packb(good))) == Call(1, "m", [1], {"k": 2}, 1.5)
    for bad in (
        [],
        {},
        [99],
        [0, 1, "m", [], {}, None],
        [0, -1, "m", [], {}, None, False],
        [0, 1, 2, [], {}, None, False],
        [0, 1, "m", {}, {}, None, False],
        [0, 1, "m", [], {1: 2}, None, False],
        [0, 1, "m", [], {}, -1, False],
        [0, 1, "m", [], {}, math.inf, False],
        [0, 1, "m", [], {}, None, 1],
        [2, 1, "no-such-code", "T", "m"],
        [2, 1, [], "T", "m"],  # an unhashable code
        [2, 1, "error", 3, "m"],
        [6, 1, 0],
    ):
        with pytest.raises(ProtocolViolation):
            decode(bad)


async def test_cancels_are_read_while_a_connection_is_at_its_limit() -> None:
    """Calls beyond the limit wait; cancelling them (no deadline) cancels the
    running handler and withdraws the waiting call, and the connection goes on."""
    with anyio.fail_after(10):
        async with server_and_client(max_calls_per_connection=1) as (server, client, methods):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call, "slow", "running")
                await methods.started.setdefault("running", anyio.Event()).wait()
                tg.start_soon(client.call, "slow", "waiting")
                await anyio.sleep(0.1)
                assert "waiting" not in methods.started
                tg.cancel_scope.cancel()
            while methods.running or server.calls_running:
                await anyio.sleep(0.01)
            # ("waiting" may get the slot as "running" ends, before its cancel is read)
            assert "running" in methods.cancelled
            assert sorted(methods.cancelled) == sorted(methods.started)
            assert await client.call("add", 1, 2) == 3


async def test_a_call_cancelled_while_it_waits_never_starts() -> None:
    with anyio.fail_after(10):
        async with server_and_client(max_calls_per_connection=1) as (server, client, methods):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call, "slow", "running", 0.3)
                await methods.started.setdefault("running", anyio.Event()).wait()
                with anyio.move_on_after(0.1):  # its deadline passes, and a cancel follows
                    await client.call("slow", "queued")
            while server.calls_running:
                await anyio.sleep(0.01)
            assert "queued" not in methods.started
            assert await client.call("add", 1, 2) == 3


async def test_a_client_that_leaves_at_the_limit_has_its_calls_cancelled() -> None:
    methods = Methods()
    with anyio.fail_after(10):
        async with rpc.serve("tcp://127.0.0.1:0", methods, max_calls_per_connection=1) as server:
            async with rpc.connect(server.address) as client, anyio.create_task_group() as tg:
                tg.start_soon(client.call, "slow", "c")
                await methods.started.setdefault("c", anyio.Event()).wait()
                tg.start_soon(client.call, "slow", "d")  # waits for the slot
                await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
            while server.calls_running:
                await anyio.sleep(0.01)
            # every handler that started was cancelled ("d" may start as "c" ends)
            assert "c" in methods.cancelled
            assert sorted(methods.cancelled) == sorted(methods.started)


async def test_a_stream_and_a_call_share_a_limit_of_one() -> None:
    """The stream's credits are read while the call waits for its slot."""
    with anyio.fail_after(10):
        async with server_and_client(max_calls_per_connection=1) as (_server, client, _methods):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call, "add", 1, 2)
                async with client.stream("count", 100) as items:
                    assert [item async for item in items] == list(range(100))


@pytest.mark.parametrize("waiting", [1, 0])
async def test_calls_beyond_the_waiting_limit_are_rejected(waiting: int) -> None:
    """Beyond the calls that run and ``max_waiting_per_connection`` that wait
    (0 is a limit too: none waits), calls fail at once; the others go on."""
    with anyio.fail_after(10):
        async with server_and_client(
            max_calls_per_connection=1, max_waiting_per_connection=waiting
        ) as (_server, client, methods):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call, "slow", "a", 0.3)
                await methods.started.setdefault("a", anyio.Event()).wait()
                if waiting:
                    tg.start_soon(client.call, "slow", "b", 0.01)  # waits
                    await anyio.sleep(0.05)
                with pytest.raises(rpc.OverloadedError):
                    await client.call("add", 1, 2)
            assert await client.call("add", 1, 2) == 3
            assert methods.most_running == 1


async def test_a_rejecting_server_admits_exactly_its_limit() -> None:
    """Calls that arrive together are admitted as they are read: never more than
    the limit, whatever the tasks' order."""
    with anyio.fail_after(10):
        async with server_and_client(max_calls_per_connection=2, overload="reject") as (
            _server,
            client,
            methods,
        ):
            outcomes: list[str] = []

            async def one(i: int) -> None:
                try:
                    await client.call("slow", f"b{i}", 0.2)
                    outcomes.append("ok")
                except rpc.OverloadedError:
                    outcomes.append("overloaded")

            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(one, i)
            assert sorted(outcomes) == ["ok"] * 2 + ["overloaded"] * 8
            assert methods.most_running == 2


async def test_replies_wait_for_a_client_that_does_not_read() -> None:
    """A client that sends calls and reads no reply makes the server queue at
    most max_queued of them, then stop reading it."""
    methods = Methods()
    with anyio.fail_after(10):
        async with rpc.serve("tcp://127.0.0.1:0", methods, max_queued=16) as server:
            async with await anyio_comm.connect(server.address) as comm:
                with anyio.move_on_after(1):
                    for i in range(100_000):
                        await comm.send(Call(i, "nope", [], {}, None).encode())
                (session,) = server._sessions
                assert len(session.outbox._queue) <= 17


async def test_notifications_are_bounded_per_connection(caplog: pytest.LogCaptureFixture) -> None:
    with anyio.fail_after(10):
        async with server_and_client(max_calls_per_connection=2, max_waiting_per_connection=3) as (
            server,
            client,
            methods,
        ):
            for i in range(50):
                await client.notify("slow", f"n{i}", 0.2)
            while "on this connection): the server is at its limit" not in caplog.text:
                await anyio.sleep(0.01)
            (session,) = server._sessions
            assert session.tasks <= 5 and methods.most_running <= 2
            while session.tasks:
                await anyio.sleep(0.01)
            assert await client.call("echo", "after") == "after"


async def test_calls_fail_when_the_client_stops_under_them() -> None:
    """Calls from tasks outside the client's block raise once the block is left,
    by cancellation too; they do not hang."""
    with anyio.fail_after(10):
        async with rpc.serve("tcp://127.0.0.1:0", Methods()) as server:
            outcome: list[str] = []

            async def call(client: rpc.Client) -> None:
                try:
                    await client.call("slow", "outer", 5)
                except anyio.ClosedResourceError:
                    outcome.append("closed")

            async with anyio.create_task_group() as outer:
                with anyio.CancelScope() as scope:
                    async with rpc.connect(server.address) as client:
                        outer.start_soon(call, client)
                        await anyio.sleep(0.1)
                        scope.cancel()
                        await anyio.sleep(5)
            assert outcome == ["closed"]


async def test_a_stream_item_over_the_clients_limits_ends_the_stream() -> None:
    async def gen() -> AsyncIterator[Any]:
        yield 1
        yield b"x" * 5000
        yield 3

    with anyio.fail_after(10):
        async with (
            rpc.serve("tcp://127.0.0.1:0", {"gen": gen}) as server,
            rpc.connect(server.address, limits=anyio_comm.Limits(max_message_size=1000)) as client,
        ):
            got = []
            with pytest.raises(rpc.RemoteError) as info:
                async with client.stream("gen") as items:
                    async for item in items:
                        got.append(item)
            assert got == [1]
            assert info.value.remote_type == "anyio_comm.LocalProtocolError"


async def test_remote_type_of_a_package_error_is_its_public_name() -> None:
    """An anyio-comm error a handler lets through is named as users import it."""

    async def relay() -> None:
        raise rpc.UnavailableError("next", "UNAVAILABLE", "the next hop is down")

    async def bad_body() -> None:
        raise anyio_comm.SerializationError("no")

    with anyio.fail_after(10):
        async with (
            rpc.serve("tcp://127.0.0.1:0", {"relay": relay, "bad": bad_body}) as server,
            rpc.connect(server.address) as client,
        ):
            with pytest.raises(rpc.RemoteError) as info:
                await client.call("relay")
            assert info.value.remote_type == "anyio_comm.rpc.UnavailableError"
            with pytest.raises(rpc.RemoteError) as info:
                await client.call("bad")
            assert info.value.remote_type == "anyio_comm.SerializationError"


async def test_a_stream_has_one_reader() -> None:
    with anyio.fail_after(10):
        async with server_and_client() as (_server, client, _methods):
            async with client.stream("later", 30) as items:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(items.__anext__)
                    await anyio.wait_all_tasks_blocked()  # the first reader waits
                    with pytest.raises(anyio.BusyResourceError):
                        await items.__anext__()
                    tg.cancel_scope.cancel()


async def test_shutdown_lets_running_calls_finish() -> None:
    methods = Methods()
    with anyio.fail_after(10):
        async with rpc.serve("tcp://127.0.0.1:0", methods) as server:
            results: list[Any] = []
            async with rpc.connect(server.address) as client, anyio.create_task_group() as tg:

                async def call() -> None:
                    results.append(await client.call("slow", "finishing", 0.3))

                tg.start_soon(call)
                await methods.started.setdefault("finishing", anyio.Event()).wait()
                tg.start_soon(server.shutdown, 5)
                await anyio.sleep(0.05)
                with pytest.raises(rpc.UnavailableError, match="shutting down"):
                    await client.call("add", 1, 2)
            assert results == ["finishing"]
            with pytest.raises(OSError):
                await anyio_comm.connect(server.address, timeout=1)


async def test_shutdown_cancels_what_outlives_its_grace_period() -> None:
    methods = Methods()
    with anyio.fail_after(10):
        async with rpc.serve("tcp://127.0.0.1:0", methods) as server:
            async with rpc.connect(server.address) as client, anyio.create_task_group() as tg:

                async def call() -> None:
                    with pytest.raises(rpc.UnavailableError):
                        await client.call("slow", "long", 30)

                tg.start_soon(call)
                await methods.started.setdefault("long", anyio.Event()).wait()
                await server.shutdown(0.1)
            assert methods.cancelled == ["long"]
    with pytest.raises(ValueError, match="negative"):
        await server.shutdown(-1)


USER: contextvars.ContextVar[str | None] = contextvars.ContextVar("USER", default=None)


async def test_each_call_has_a_context_of_its_own() -> None:
    """A context variable a handler sets is not seen by later calls (they may run
    on the same worker task), for coroutines, plain functions and streams."""

    async def login(name: str) -> str | None:
        USER.set(name)
        await checkpoint()
        return USER.get()

    def login_sync(name: str) -> str | None:
        USER.set(name)
        return USER.get()

    async def logins(name: str) -> AsyncIterator[str | None]:
        USER.set(name)
        yield USER.get()
        yield USER.get()

    async def whoami() -> str | None:
        return USER.get()

    handlers = {"login": login, "login_sync": login_sync, "logins": logins, "whoami": whoami}
    with anyio.fail_after(10):
        async with (
            rpc.serve("tcp://127.0.0.1:0", handlers, max_calls_per_connection=1) as server,
            rpc.connect(server.address) as client,
        ):
            assert await client.call("login", "alice") == "alice"
            assert await client.call("whoami") is None
            assert await client.call("login_sync", "bob") == "bob"
            assert await client.call("whoami") is None
            async with client.stream("logins", "carol") as items:
                assert [item async for item in items] == ["carol", "carol"]
            assert await client.call("whoami") is None


async def test_calls_cancelled_while_queued_make_room() -> None:
    """Calls that time out while they wait leave the queue at once: the waiting
    limit counts live calls only."""
    with anyio.fail_after(10):
        async with server_and_client(max_calls_per_connection=1, max_waiting_per_connection=3) as (
            _server,
            client,
            methods,
        ):
            async with anyio.create_task_group() as tg:
                tg.start_soon(client.call, "slow", "busy", 0.5)
                await methods.started.setdefault("busy", anyio.Event()).wait()
                for _ in range(6):
                    # (the server may answer at the deadline before the caller's
                    # own timer fires: either way the call leaves the queue)
                    with anyio.move_on_after(0.02), suppress(rpc.DeadlineExceededError):
                        await client.call("add", 1, 1)
                assert await client.call("add", 2, 2) == 4  # waited, not rejected


async def test_queued_calls_do_not_run_after_the_client_left() -> None:
    ran: list[int] = []
    gate = anyio.Event()

    async def block() -> bytes:
        await gate.wait()
        return b"x" * 20_000_000  # more than the socket takes: the reply waits

    def record(i: int) -> int:
        ran.append(i)
        return i

    with anyio.fail_after(20):
        async with rpc.serve(
            "tcp://127.0.0.1:0",
            {"block": block, "record": record},
            max_calls_per_connection=1,
            max_queued=1,
        ) as server:
            comm = await anyio_comm.connect(server.address)
            await comm.send(Call(0, "block", [], {}, None).encode())
            for i in range(1, 21):
                await comm.send(Call(i, "record", [i], {}, None).encode())
            await anyio.sleep(0.2)
            gate.set()
            before = -1
            while before != len(ran):  # until the worker waits for room for a reply
                before = len(ran)
                await anyio.sleep(0.3)
            comm.abort()
            await anyio.sleep(0.5)
            assert len(ran) == before < 20


async def test_a_stream_read_after_its_block_raises() -> None:
    with anyio.fail_after(10):
        async with server_and_client() as (_server, client, _methods):
            async with client.stream("count", 100) as items:
                assert await items.__anext__() == 0
            with pytest.raises(anyio.ClosedResourceError):
                await items.__anext__()


async def test_long_method_names_are_cut_in_replies() -> None:
    with anyio.fail_after(10):
        async with (
            rpc.serve("tcp://127.0.0.1:0", Methods()) as server,
            rpc.connect(server.address, limits=anyio_comm.Limits(max_message_size=1000)) as client,
        ):
            with pytest.raises(rpc.MethodNotFoundError) as info:
                await client.call("m" * 2000)
            assert len(info.value.remote_message) < 200
            assert await client.call("add", 1, 2) == 3


# -- the pool ---------------------------------------------------------------------


async def test_pool_shares_and_caps_connections() -> None:
    methods = Methods()
    with anyio.fail_after(20):
        async with (
            rpc.serve("tcp://127.0.0.1:0", methods) as server,
            rpc.Pool(max_per_address=3, max_users_per_connection=5) as pool,
        ):
            address = server.address
            async with pool.client(address) as remote:
                assert await remote.call("add", 1, 2) == 3
            async with pool.client(address) as again:
                assert again is remote  # reused
            assert pool.connections(address) == 1
            results: dict[int, Any] = {}
            users: list[int] = []

            async def user(i: int) -> None:
                async with pool.client(address) as remote:
                    users.append(pool.connections(address))
                    results[i] = await remote.call("echo", i, delay=0.02)

            async with anyio.create_task_group() as tg:
                for i in range(60):
                    tg.start_soon(user, i)
            assert results == {i: i for i in range(60)}
            assert max(users) == pool.connections(address) == 3
            assert pool.connections() == 3


async def test_pool_waits_for_room_within_its_timeout() -> None:
    with anyio.fail_after(10):
        async with (
            rpc.serve("tcp://127.0.0.1:0", Methods()) as server,
            rpc.Pool(max_per_address=1, max_users_per_connection=1, wait_timeout=0.1) as pool,
        ):
            async with pool.client(server.address):
                with pytest.raises(TimeoutError):
                    async with pool.client(server.address):
                        pass
            async with pool.client(server.address) as remote:  # room again
                assert await remote.call("add", 2, 3) == 5


async def test_pool_closes_idle_connections_and_replaces_broken_ones() -> None:
    with anyio.fail_after(10):
        async with (
            rpc.serve("tcp://127.0.0.1:0", Methods()) as server,
            rpc.Pool(idle_timeout=0.2) as pool,
        ):
            async with pool.client(server.address) as remote:
                await remote.call("add", 1, 1)
            assert pool.connections(server.address) == 1
            while pool.connections(server.address):
                await anyio.sleep(0.02)
            async with pool.client(server.address) as remote:
                remote.comm.abort()  # the connection breaks under its user
                with pytest.raises((rpc.UnavailableError, anyio.ClosedResourceError)):
                    await remote.call("add", 1, 1)
            async with pool.client(server.address) as fresh:
                assert fresh is not remote
                assert await fresh.call("add", 2, 2) == 4


async def test_pool_retries_a_server_that_is_not_up_yet(tmp_path: Any) -> None:
    address = f"unix://{tmp_path}/rpc.sock"
    with anyio.fail_after(10):
        async with rpc.Pool(connect_timeout=5) as pool:
            result: list[int] = []

            async def caller() -> None:
                async with pool.client(address) as remote:
                    result.append(await remote.call("add", 20, 22))

            async with anyio.create_task_group() as tg:
                tg.start_soon(caller)
                await anyio.sleep(0.3)
                async with rpc.serve(address, Methods()):
                    while not result:
                        await anyio.sleep(0.01)
            assert result == [42]


async def test_pool_must_be_open() -> None:
    pool = rpc.Pool()
    with pytest.raises(RuntimeError, match="enter"):
        async with pool.client("tcp://127.0.0.1:1"):
            pass
    async with pool:
        pass
    with pytest.raises(anyio.ClosedResourceError):
        async with pool.client("tcp://127.0.0.1:1"):
            pass
    with pytest.raises(ValueError, match="at least 1"):
        rpc.Pool(max_per_address=0)
    with pytest.raises(ValueError, match="positive"):
        rpc.Pool(idle_timeout=0)


async def test_an_error_in_the_pool_block_propagates_as_it_is() -> None:
    with pytest.raises(KeyError):
        async with rpc.Pool():
            raise KeyError("mine")


async def test_pool_makes_one_connection_at_a_time() -> None:
    with anyio.fail_after(10):
        async with (
            rpc.serve("tcp://127.0.0.1:0", Methods()) as server,
            rpc.Pool(max_per_address=4) as pool,
        ):

            async def user() -> None:
                async with pool.client(server.address) as remote:
                    await remote.call("echo", 1, delay=0.05)

            async with anyio.create_task_group() as tg:
                for _ in range(10):
                    tg.start_soon(user)
            assert pool.connections(server.address) == 1


async def test_pool_waiters_share_a_failed_connections_error() -> None:
    """Tasks waiting for the one connection being made all raise its error, at
    once, rather than trying again one after another."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as dead:
        port = dead.extra(anyio.abc.SocketAttribute.local_port)
    address = f"tcp://127.0.0.1:{port}"  # nothing listens there now
    errors: list[str] = []
    with anyio.fail_after(10):
        async with rpc.Pool(max_per_address=1, connect_timeout=0.5) as pool:

            async def user() -> None:
                try:
                    async with pool.client(address):
                        pass
                except (OSError, TimeoutError) as exc:
                    errors.append(type(exc).__name__)

            start = anyio.current_time()
            async with anyio.create_task_group() as tg:
                for _ in range(5):
                    tg.start_soon(user)
            assert len(errors) == 5
            assert anyio.current_time() - start < 2  # one attempt, not five in a row


async def test_pool_wait_timeout_does_not_cut_a_connection_short(tmp_path: Any) -> None:
    address = f"unix://{tmp_path}/late.sock"
    with anyio.fail_after(10):
        async with rpc.Pool(wait_timeout=0.05, connect_timeout=5) as pool:
            result: list[int] = []

            async def caller() -> None:
                async with pool.client(address) as remote:
                    result.append(await remote.call("add", 1, 1))

            async with anyio.create_task_group() as tg:
                tg.start_soon(caller)
                await anyio.sleep(0.3)  # well past wait_timeout
                async with rpc.serve(address, Methods()):
                    while not result:
                        await anyio.sleep(0.01)
            assert result == [2]


@pytest.mark.parametrize("kind", KINDS)
async def test_serve_in_a_task_group(kind: str) -> None:
    """``await task_group.start(rpc.serve, ...)`` returns the server once it
    listens; it serves until shut down (the task then ends by itself) or
    cancelled."""
    with anyio.fail_after(20):
        async with listen_arguments(kind) as (address, server_kwargs, client_kwargs):
            async with anyio.create_task_group() as tg:
                server = await tg.start(
                    partial(rpc.serve, address, Methods(), max_calls=5, **server_kwargs)
                )
                assert isinstance(server, rpc.Server)
                async with rpc.connect(server.address, timeout=10, **client_kwargs) as client:
                    assert await client.call("add", 1, 2) == 3
                await server.shutdown(1)
            # (the task group ended without being cancelled: the task returned)
            async with anyio.create_task_group() as tg:
                server = await tg.start(partial(rpc.serve, address, Methods(), **server_kwargs))
                async with rpc.connect(server.address, timeout=10, **client_kwargs) as client:
                    assert await client.call("add", 2, 2) == 4
                tg.cancel_scope.cancel()


async def test_serve_and_connect_take_options_by_name() -> None:
    with pytest.raises(TypeError, match="bogus"):
        rpc.serve("tcp://127.0.0.1:0", {}, bogus=1)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="bogus"):
        async with rpc.connect("tcp://127.0.0.1:1", bogus=1):  # type: ignore[call-arg]
            pass
    options = anyio_comm.Options(idle_timeout=30)
    async with (
        rpc.serve("tcp://127.0.0.1:0", Methods(), options=options, message_timeout=5) as server,
        rpc.connect(server.address, options=options, timeout=10) as client,
    ):
        assert await client.call("add", 1, 2) == 3
