"""anyio_comm.rpc interceptors, from the RPC guide and the docstrings of
``rpc.serve``, ``rpc.connect``, ``open_client`` and ``Pool``: each sees every
call, stream and notification, the first outermost; ``await proceed()`` runs
the rest and returns the result, raising refuses the call; on the server they
run in the call's context and within its deadline, on the client they may change
the arguments and add metadata, and a stream's interceptor may wrap the items.
Every backend; TCP, TLS and the other address transports."""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Any

import anyio
import pytest

from anyio_comm import rpc

from .helpers import ADDRESS_TRANSPORTS, listen_arguments, rpc_server_and_client

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]

#: what a server interceptor sets, for the handler to read
TRACE: contextvars.ContextVar[str] = contextvars.ContextVar("trace", default="")


class Methods:
    def __init__(self) -> None:
        self.notified = anyio.Event()
        self.seen: list[Any] = []
        self.handled = 0

    async def add(self, a: int, b: int) -> int:
        self.handled += 1
        return a + b

    def traced(self) -> list[Any]:
        call = rpc.current_call()
        return [TRACE.get(), call.kind, dict(call.metadata)]

    async def count(self, n: int) -> AsyncIterator[int]:
        for i in range(n):
            yield i

    async def broken_stream(self) -> AsyncIterator[int]:
        yield 1
        raise ValueError("ran dry")

    async def fail(self) -> None:
        raise ValueError("no good")

    async def slow(self) -> None:
        await anyio.sleep(30)

    async def note(self, value: str) -> None:
        self.seen.append((value, TRACE.get(), rpc.current_call().kind))
        self.notified.set()


class Recorder:
    """A server interceptor that records what it saw, named ``name``."""

    def __init__(self, name: str, log: list[Any]) -> None:
        self.name = name
        self.log = log

    async def __call__(self, call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        self.log.append((self.name, "before", call.kind, call.method))
        try:
            result = await proceed()
        except BaseException as exc:
            self.log.append((self.name, "raised", type(exc).__name__))
            raise
        self.log.append((self.name, "after", result))
        return result


async def set_trace(call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
    """Trace propagation: the caller's trace id into a context variable."""
    TRACE.set(str(call.metadata.get("trace", "none")))
    return await proceed()


@pytest.mark.parametrize("kind", KINDS)
async def test_server_interceptors_see_calls_streams_and_notifications_in_order(
    kind: str,
) -> None:
    log: list[Any] = []
    methods = Methods()
    interceptors = [Recorder("outer", log), set_trace, Recorder("inner", log)]
    with anyio.fail_after(20):
        async with rpc_server_and_client(kind, methods, interceptors=interceptors) as (_, client):
            traced = client.with_metadata({"trace": "t-1"})
            assert await traced.call("traced") == ["t-1", "call", {"trace": "t-1"}]
            assert log == [
                ("outer", "before", "call", "traced"),
                ("inner", "before", "call", "traced"),
                ("inner", "after", ["t-1", "call", {"trace": "t-1"}]),
                ("outer", "after", ["t-1", "call", {"trace": "t-1"}]),
            ]
            log.clear()
            async with client.stream("count", 3) as items:
                assert [item async for item in items] == [0, 1, 2]
            # the stream's interceptors return once its items were sent
            assert log == [
                ("outer", "before", "stream", "count"),
                ("inner", "before", "stream", "count"),
                ("inner", "after", None),
                ("outer", "after", None),
            ]
            log.clear()
            await traced.notify("note", "hello")
            await methods.notified.wait()
            assert methods.seen == [("hello", "t-1", "notification")]
            # a variable an interceptor set stays with its call
            assert await client.call("traced") == ["none", "call", {}]
    assert TRACE.get() == ""


@pytest.mark.parametrize("kind", KINDS)
async def test_a_server_interceptor_refuses_a_call(kind: str) -> None:
    """Authentication: raising instead of proceeding refuses the call, which
    fails as if the handler had raised; the handler does not run."""

    async def authenticate(call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        if call.metadata.get("authorization") != "secret":
            raise PermissionError(f"{call.method} needs a token")
        return await proceed()

    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client(kind, methods, interceptors=[authenticate]) as (
            _,
            client,
        ):
            with pytest.raises(rpc.RemoteError) as caught:
                await client.call("add", 1, 2)
            assert caught.value.remote_type == "PermissionError"
            assert caught.value.remote_message == "add needs a token"
            with pytest.raises(rpc.RemoteError, match="count needs a token"):
                async with client.stream("count", 2) as items:
                    await items.__anext__()
            assert methods.handled == 0
            assert await client.with_metadata({"authorization": "secret"}).call("add", 1, 2) == 3
            assert methods.handled == 1


async def test_server_interceptors_see_errors_and_may_change_them() -> None:
    log: list[Any] = []

    async def translate(call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        try:
            return await proceed()
        except ValueError as exc:
            raise LookupError(f"translated: {exc}") from exc

    async def replace_result(call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        result = await proceed()
        return result * 10 if call.method == "add" else result

    interceptors = [Recorder("outer", log), translate, replace_result]
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", Methods(), interceptors=interceptors) as (
            _,
            client,
        ):
            assert await client.call("add", 1, 2) == 30
            with pytest.raises(rpc.RemoteError) as caught:
                await client.call("fail")
            assert (caught.value.remote_type, caught.value.remote_message) == (
                "LookupError",
                "translated: no good",
            )
            # a stream's error reaches the interceptors once its items were sent
            with pytest.raises(rpc.RemoteError, match="translated: ran dry"):
                async with client.stream("broken_stream") as items:
                    assert await items.__anext__() == 1
                    await items.__anext__()
    assert ("outer", "raised", "LookupError") in log


async def test_arguments_that_do_not_fit_are_refused_through_the_interceptors() -> None:
    """The server's own refusal of arguments reaches the interceptors as the
    caller will see it, and the caller gets INVALID_ARGUMENTS as without them."""
    log: list[Any] = []
    with anyio.fail_after(20):
        async with rpc_server_and_client(
            "tcp", Methods(), interceptors=[Recorder("only", log)]
        ) as (_, client):
            with pytest.raises(rpc.InvalidArgumentsError):
                await client.call("add", 1, 2, 3)
    assert log[-1] == ("only", "raised", "InvalidArgumentsError")


async def test_server_interceptors_run_within_the_deadline() -> None:
    """The interceptors run inside the call's deadline: they see its remaining
    time, and the cancellation at the deadline reaches them."""
    seen: list[Any] = []
    left = anyio.Event()

    async def watch(call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        seen.append(call.remaining())
        try:
            return await proceed()
        finally:
            seen.append("left")
            left.set()

    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", Methods(), interceptors=[watch]) as (_, client):
            with anyio.move_on_after(0.3):
                await client.call("slow")
            with anyio.fail_after(5):
                await left.wait()
    assert 0 < seen[0] <= 0.31  # (the server counts from the arrival)
    assert seen[1:] == ["left"]


async def test_proceed_runs_a_server_call_once() -> None:
    async def twice(call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        await proceed()
        return await proceed()

    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", methods, interceptors=[twice]) as (_, client):
            with pytest.raises(rpc.RemoteError) as caught:
                await client.call("add", 1, 2)
            assert caught.value.remote_type == "RuntimeError"
            assert methods.handled == 1


async def test_an_interceptor_that_is_not_callable_is_a_type_error() -> None:
    async with listen_arguments("tcp") as (address, server_kwargs, client_kwargs):
        with pytest.raises(TypeError, match="interceptor must be callable"):
            async with rpc.serve(address, Methods(), interceptors=[42], **server_kwargs):  # type: ignore[list-item]
                pass
        async with rpc.serve(address, Methods(), **server_kwargs) as server:
            with pytest.raises(TypeError, match="interceptor must be callable"):
                async with rpc.connect(server.address, interceptors=["x"], **client_kwargs):  # type: ignore[list-item]
                    pass
            with pytest.raises(TypeError, match="interceptor must be callable"):
                rpc.Pool(interceptors=[None])  # type: ignore[list-item]


class ClientLog:
    """A client interceptor that records what it saw and adds a trace id."""

    def __init__(self, name: str, log: list[Any]) -> None:
        self.name = name
        self.log = log

    async def __call__(self, call: rpc.OutgoingCall, proceed: rpc.Proceed) -> Any:
        self.log.append((self.name, call.kind, call.method, call.args))
        call.metadata.setdefault("trace", self.name)
        try:
            return await proceed()
        except rpc.RPCError as exc:
            self.log.append((self.name, "failed", type(exc).__name__))
            raise


@pytest.mark.parametrize("kind", KINDS)
async def test_client_interceptors_see_every_call_and_add_metadata(kind: str) -> None:
    log: list[Any] = []
    methods = Methods()

    async def double_arguments(call: rpc.OutgoingCall, proceed: rpc.Proceed) -> Any:
        if call.method == "add":
            call.args = tuple(2 * a for a in call.args)
        return await proceed()

    interceptors = [ClientLog("outer", log), ClientLog("inner", log), double_arguments]
    with anyio.fail_after(20):
        async with rpc_server_and_client(
            kind,
            methods,
            interceptors=[set_trace],
            connect_arguments={"interceptors": interceptors},
        ) as (_, client):
            assert await client.call("add", 1, 2) == 6
            assert await client.call("traced") == ["outer", "call", {"trace": "outer"}]
            # metadata the caller gave is the interceptors' to add to
            assert await client.with_metadata({"trace": "mine", "x": "1"}).call("traced") == [
                "mine",
                "call",
                {"trace": "mine", "x": "1"},
            ]
            async with client.stream("count", 2) as items:
                assert [item async for item in items] == [0, 1]
            await client.notify("note", "n")
            await methods.notified.wait()
            assert methods.seen == [("n", "outer", "notification")]
            with pytest.raises(rpc.RemoteError):
                await client.call("fail")
    assert log == [
        ("outer", "call", "add", (1, 2)),
        ("inner", "call", "add", (1, 2)),
        ("outer", "call", "traced", ()),
        ("inner", "call", "traced", ()),
        ("outer", "call", "traced", ()),
        ("inner", "call", "traced", ()),
        ("outer", "stream", "count", (2,)),
        ("inner", "stream", "count", (2,)),
        ("outer", "notification", "note", ("n",)),
        ("inner", "notification", "note", ("n",)),
        ("outer", "call", "fail", ()),
        ("inner", "call", "fail", ()),
        ("inner", "failed", "RemoteError"),
        ("outer", "failed", "RemoteError"),
    ]


@pytest.mark.parametrize("kind", KINDS)
async def test_a_client_interceptor_wraps_a_streams_items(kind: str) -> None:
    """A stream's ``proceed()`` opens it; what the interceptor returns is what
    the block iterates, and it sees the stream's end, its error, or the block
    left early (its generator is closed)."""
    events: list[str] = []

    async def counting(call: rpc.OutgoingCall, proceed: rpc.Proceed) -> Any:
        if call.kind != "stream":
            return await proceed()
        stream = await proceed()

        async def items() -> AsyncIterator[Any]:
            try:
                async for item in stream:
                    yield item * 100
                events.append("ended")
            except rpc.RPCError as exc:
                events.append(f"failed: {exc.remote_message}")
                raise
            finally:
                events.append("closed")

        return items()

    with anyio.fail_after(20):
        async with rpc_server_and_client(
            kind, Methods(), connect_arguments={"interceptors": [counting]}
        ) as (_, client):
            async with client.stream("count", 3) as items:
                assert [item async for item in items] == [0, 100, 200]
            assert events == ["ended", "closed"]
            events.clear()
            with pytest.raises(rpc.RemoteError, match="ran dry"):
                async with client.stream("broken_stream") as items:
                    async for _ in items:
                        pass
            assert events == ["failed: ran dry", "closed"]
            events.clear()
            async with client.stream("count", 10) as items:
                assert await items.__anext__() == 0
            assert events == ["closed"]
            assert await client.call("add", 1, 1) == 2  # the connection is fine


async def test_a_client_interceptor_may_retry_and_must_return_an_iterator_for_a_stream() -> None:
    """``proceed()`` on the client sends the call each time it is called (a
    retry); a stream's interceptor that returns something else than an async
    iterator is a TypeError; metadata the interceptors make too large is a
    ValueError and nothing is sent."""
    attempts: list[int] = []

    async def retry_once(call: rpc.OutgoingCall, proceed: rpc.Proceed) -> Any:
        if call.kind == "stream":
            await proceed()
            return "not an iterator"
        if call.method == "traced":
            call.metadata["big"] = "x" * (17 * 1024)
        try:
            attempts.append(1)
            return await proceed()
        except rpc.RemoteError:
            attempts.append(2)
            return await proceed()

    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client(
            "tcp", methods, connect_arguments={"interceptors": [retry_once]}
        ) as (_, client):
            with pytest.raises(rpc.RemoteError):
                await client.call("fail")
            assert attempts == [1, 2]
            with pytest.raises(TypeError, match="not the stream"):
                async with client.stream("count", 2):
                    pass
            with pytest.raises(ValueError, match="more than 16384"):
                await client.call("traced")
            assert await client.call("add", 2, 2) == 4


@pytest.mark.parametrize("kind", KINDS)
async def test_a_pools_clients_use_its_interceptors(kind: str) -> None:
    log: list[Any] = []
    async with listen_arguments(kind) as (address, server_kwargs, client_kwargs):
        with anyio.fail_after(20):
            async with (
                rpc.serve(address, Methods(), interceptors=[set_trace], **server_kwargs) as server,
                rpc.Pool(interceptors=[ClientLog("pool", log)], **client_kwargs) as pool,
                pool.client(server.address) as client,
            ):
                assert await client.call("traced") == ["pool", "call", {"trace": "pool"}]
    assert log == [("pool", "call", "traced", ())]


async def test_proceed_runs_a_notification_once() -> None:
    async def twice(call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        if call.kind == "notification":
            await proceed()
        return await proceed()

    methods = Methods()
    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", methods, interceptors=[twice]) as (_, client):
            await client.notify("note", "once")
            await methods.notified.wait()
            assert await client.call("add", 1, 1) == 2  # (the notification ran before)
    assert [seen[0] for seen in methods.seen] == ["once"]


async def test_an_interceptor_that_is_a_plain_callable_runs_in_the_calls_context() -> None:
    """An interceptor may be any callable returning an awaitable: what it does
    before returning it happens in the call's context too."""

    def tag(call: rpc.CallContext, proceed: rpc.Proceed) -> Any:
        TRACE.set("set synchronously")
        return proceed()

    with anyio.fail_after(20):
        async with rpc_server_and_client("tcp", Methods(), interceptors=[tag]) as (_, client):
            assert (await client.call("traced"))[0] == "set synchronously"
    assert TRACE.get() == ""


async def test_one_interceptor_not_in_a_list_is_a_type_error() -> None:
    async with listen_arguments("tcp") as (address, server_kwargs, _):
        with pytest.raises(TypeError, match="sequence of callables"):
            async with rpc.serve(address, Methods(), interceptors=set_trace, **server_kwargs):  # type: ignore[arg-type]
                pass
