"""anyio_comm.rpc over several addresses, and retries, from the RPC guide ("The
pool") and the docstrings of ``Pool`` and ``Retry``: a pool balances calls over
its addresses (round robin, or the least loaded), sets a failed address aside
for a while, and sends idempotent calls again on the errors a ``Retry`` names,
within the caller's deadline; a ``Retry`` is also a client interceptor. Every
backend; TCP, TLS and the other address transports."""

from __future__ import annotations

import math
import random
import socket
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import pytest
from anyio.abc import SocketAttribute

import anyio_comm
from anyio_comm import rpc

from .helpers import ADDRESS_TRANSPORTS, listen_arguments, rpc_server_and_client

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio

KINDS = [*ADDRESS_TRANSPORTS, "tls"]


class Named:
    """A server's methods, which say which server answered."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.release = anyio.Event()
        self.failures_left = 0

    async def who(self) -> str:
        self.calls += 1
        return self.name

    async def hold(self) -> str:
        self.calls += 1
        await self.release.wait()
        return self.name

    async def flaky_too(self) -> str:
        return await self.flaky()

    async def flaky(self) -> str:
        """Raises (as a remote error) until ``failures_left`` is spent."""
        self.calls += 1
        if self.failures_left:
            self.failures_left -= 1
            raise rpc.OverloadedError("flaky", "X", "not now")  # a handler's own error
        return self.name


@asynccontextmanager
async def servers(
    kind: str, count: int, **serve_arguments: Any
) -> AsyncIterator[tuple[list[Named], list[str], dict[str, Any]]]:
    """``count`` servers listening over ``kind``; their methods, addresses, and
    the connecting side's keyword arguments."""
    async with AsyncExitStack() as stack:
        methods = [Named(f"s{i}") for i in range(count)]
        addresses = []
        client_kwargs: dict[str, Any] = {}
        for named in methods:
            address, server_kwargs, client_kwargs = await stack.enter_async_context(
                listen_arguments(kind)
            )
            server = await stack.enter_async_context(
                rpc.serve(address, named, **server_kwargs, **serve_arguments)
            )
            addresses.append(server.address)
        yield methods, addresses, client_kwargs


@pytest.mark.parametrize("kind", KINDS)
async def test_round_robin_takes_the_addresses_in_turn(kind: str) -> None:
    with anyio.fail_after(20):
        async with servers(kind, 3) as (_, addresses, client_kwargs):
            async with rpc.Pool(addresses, **client_kwargs) as pool:
                answers = [await pool.call("who") for _ in range(9)]
                async with pool.client() as remote:  # also picked in turn
                    answers.append(await remote.call("who"))
    assert sorted(answers[:9]) == ["s0"] * 3 + ["s1"] * 3 + ["s2"] * 3
    assert answers[:3] == answers[3:6] == answers[6:9]  # a fixed turn
    assert answers[9] == answers[0]


@pytest.mark.parametrize("kind", KINDS)
async def test_least_loaded_avoids_a_busy_address(kind: str) -> None:
    with anyio.fail_after(20):
        async with servers(kind, 2) as (methods, addresses, client_kwargs):
            async with (
                rpc.Pool(addresses, balance="least_loaded", **client_kwargs) as pool,
                anyio.create_task_group() as tg,
            ):
                # five calls held on s0 (sent to it directly)
                held: list[str] = []

                async def hold() -> None:
                    async with pool.client(addresses[0]) as remote:
                        held.append(await remote.call("hold"))

                for _ in range(5):
                    tg.start_soon(hold)
                while methods[0].calls < 5:
                    await anyio.sleep(0.01)
                answers = [await pool.call("who") for _ in range(6)]
                methods[0].release.set()
    assert answers == ["s1"] * 6
    assert held == ["s0"] * 5


@pytest.mark.parametrize("kind", KINDS)
async def test_an_address_that_fails_is_set_aside(kind: str) -> None:
    """A server that is gone: the calls go to the others at once (nothing
    was sent to it), and it is not tried again for ``set_aside`` seconds."""
    with anyio.fail_after(20):
        async with servers(kind, 2) as (_, addresses, client_kwargs):
            async with servers(kind, 1) as (_, (gone,), _kwargs):
                pass  # it listened, and no longer does
            async with rpc.Pool(
                [gone, *addresses], set_aside=0.5, connect_timeout=2, **client_kwargs
            ) as pool:
                started = anyio.current_time()
                answers = [await pool.call("who") for _ in range(6)]
                assert anyio.current_time() - started < 1.5
                assert sorted(answers) == ["s0"] * 3 + ["s1"] * 3
                assert pool.connections(gone) == 0


async def test_an_address_set_aside_is_tried_again_later() -> None:
    with anyio.fail_after(20):
        async with servers("tcp", 1) as (_, (address,), _kwargs):
            pass  # a port that served, and no longer does
        async with servers("tcp", 1) as (_, (up,), _kwargs):
            async with rpc.Pool([address, up], set_aside=0.3) as pool:
                assert [await pool.call("who") for _ in range(3)] == ["s0"] * 3
                late = Named("late")
                async with rpc.serve(address, late):
                    await anyio.sleep(0.4)  # the address's time aside ran out
                    answers = {await pool.call("who") for _ in range(4)}
                assert answers == {"s0", "late"}


async def test_all_addresses_unreachable_raise_the_last_error() -> None:
    async with servers("tcp", 2) as (_, (one, two), _kwargs):
        pass  # ports that served, and no longer do
    with anyio.fail_after(20):
        async with rpc.Pool([one, two], connect_timeout=2) as pool:
            with pytest.raises(OSError):
                await pool.call("who")


@pytest.mark.parametrize("kind", KINDS)
async def test_an_idempotent_call_is_retried_on_another_address(kind: str) -> None:
    """The server answering first refuses at its limit: a method the Retry
    names is sent again, to the other server; another one is not."""
    with anyio.fail_after(20):
        async with servers(kind, 2, max_calls=1, overload="reject") as (
            methods,
            addresses,
            client_kwargs,
        ):
            retry = rpc.Retry({"who"}, attempts=3, initial_backoff=0.01)
            async with rpc.Pool(addresses, retry=retry, **client_kwargs) as pool:
                async with anyio.create_task_group() as tg:
                    # both servers busy with one call each: the next is refused
                    async def hold(address: str) -> None:
                        async with pool.client(address) as remote:
                            await remote.call("hold")

                    for address in addresses:
                        tg.start_soon(hold, address)
                    while sum(m.calls for m in methods) < 2:
                        await anyio.sleep(0.01)
                    with pytest.raises(rpc.OverloadedError):
                        await pool.call("flaky")  # not idempotent: sent once
                    flaky_calls = sum(m.calls for m in methods)
                    methods[1].release.set()  # s1 frees its slot
                    with anyio.fail_after(5):
                        while True:  # (until s1's slot is free again)
                            try:
                                assert await pool.call("who") == "s1"
                                break
                            except rpc.OverloadedError:
                                await anyio.sleep(0.01)
                    methods[0].release.set()
                assert flaky_calls == 2  # the two holds; flaky was refused once


async def test_retries_stop_at_the_callers_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backoff that would outlast the caller's deadline is not waited: the
    last error comes at once. (Each backoff drawn at its bound, 0.5 s, beyond
    the deadline's 0.3 s: a smaller draw could start an attempt that the
    deadline then cuts, which is the caller's TimeoutError.)"""
    monkeypatch.setattr(random, "uniform", lambda low, high: high)
    async with servers("tcp", 1, max_calls=1, overload="reject") as (methods, addresses, _):
        retry = rpc.Retry({"who"}, attempts=50, initial_backoff=0.5, max_backoff=0.5)
        async with rpc.Pool(addresses, retry=retry) as pool, anyio.create_task_group() as tg:

            async def hold() -> None:
                await pool.call("hold")

            tg.start_soon(hold)
            while not methods[0].calls:
                await anyio.sleep(0.01)
            started = anyio.current_time()
            with pytest.raises(rpc.OverloadedError), anyio.fail_after(0.3):
                await pool.call("who")
            assert anyio.current_time() - started < 0.3
            assert methods[0].calls == 1  # (the hold: "who" was refused, never run)
            methods[0].release.set()


@pytest.mark.parametrize("kind", KINDS)
async def test_a_retry_is_a_client_interceptor(kind: str) -> None:
    """Over one connection: the handler fails twice with an error the Retry
    names, the third attempt returns; a method it does not name fails once."""
    methods = Named("only")
    retry = rpc.Retry({"flaky"}, attempts=3, initial_backoff=0.001, retry_on=(rpc.RemoteError,))
    with anyio.fail_after(20):
        async with rpc_server_and_client(
            kind, methods, connect_arguments={"interceptors": [retry]}
        ) as (_, client):
            methods.failures_left = 2
            assert await client.call("flaky") == "only"
            assert methods.calls == 3
            methods.failures_left = 5
            with pytest.raises(rpc.RemoteError):
                await client.call("flaky")  # three attempts, all failed
            assert methods.calls == 6
            methods.failures_left = 1
            with pytest.raises(rpc.RemoteError):
                await client.call("flaky_too")  # not named: sent once
            assert methods.calls == 7


def test_retry_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="attempts"):
        rpc.Retry({"m"}, attempts=0)
    with pytest.raises(ValueError, match="backoff"):
        rpc.Retry({"m"}, initial_backoff=-1)
    with pytest.raises(ValueError, match="backoff"):
        rpc.Retry({"m"}, max_backoff=math.inf)
    with pytest.raises(ValueError, match="multiplier"):
        rpc.Retry({"m"}, multiplier=0.5)
    with pytest.raises(TypeError, match="retry_on"):
        rpc.Retry({"m"}, retry_on=(ValueError,))  # type: ignore[arg-type]
    assert rpc.Retry(lambda name: name.startswith("get_")).idempotent("get_x")


async def test_pool_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="balance"):
        rpc.Pool(["tcp://127.0.0.1:1"], balance="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="set_aside"):
        rpc.Pool(["tcp://127.0.0.1:1"], set_aside=0)
    with pytest.raises(TypeError, match="one str"):
        rpc.Pool("tcp://127.0.0.1:1")  # type: ignore[arg-type]
    async with rpc.Pool() as pool:
        with pytest.raises(ValueError, match="addresses"):
            await pool.call("who")
        with pytest.raises(ValueError, match="addresses"):
            async with pool.client():
                pass


@pytest.mark.parametrize("kind", KINDS)
async def test_a_call_whose_server_went_away_is_retried_elsewhere(kind: str) -> None:
    """The first server shuts down under an idempotent call: the call is sent
    again, to the other server, and the first is set aside."""
    first, second = Named("s0"), Named("s1")
    retry = rpc.Retry({"hold"}, initial_backoff=0.01)
    with anyio.fail_after(20):
        async with (
            listen_arguments(kind) as (address0, server_kwargs, client_kwargs),
            listen_arguments(kind) as (address1, _, _k),
            rpc.serve(address0, first, **server_kwargs) as server0,
            rpc.serve(address1, second, **server_kwargs) as server1,
            rpc.Pool([server0.address, server1.address], retry=retry, **client_kwargs) as pool,
            anyio.create_task_group() as tg,
        ):
            second.release.set()
            answers: list[str] = []

            async def call() -> None:
                answers.append(await pool.call("hold"))

            tg.start_soon(call)
            while not first.calls:
                await anyio.sleep(0.01)
            await server0.shutdown()  # its call is cut: the caller sees UnavailableError
            with anyio.fail_after(5):
                while not answers:
                    await anyio.sleep(0.01)
            assert answers == ["s1"]
            assert [await pool.call("who") for _ in range(3)] == ["s1"] * 3  # s0 set aside


async def test_a_pool_takes_the_connections_options_by_name() -> None:
    """Pool takes anyio_comm.connect's arguments and the fields of Options by
    name (its own idle_timeout aside: the connections' comes from options=);
    an unknown name is a TypeError."""
    with pytest.raises(TypeError, match="bogus"):
        rpc.Pool(bogus=1)  # type: ignore[call-arg]
    async with servers("tcp", 1) as (_, addresses, _kwargs):
        with anyio.fail_after(20):
            async with rpc.Pool(
                addresses, keepalive=10.0, options=anyio_comm.Options(keepalive=None)
            ) as pool:
                async with pool.client() as remote:
                    sock = remote.comm.extra(SocketAttribute.raw_socket)
                    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
                    if hasattr(socket, "TCP_KEEPIDLE"):  # (10 s: idle 5 s, as for connect)
                        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5


async def test_an_address_whose_handshake_fails_is_set_aside() -> None:
    """A listener that is not an anyio-comm server (it closes what it accepts):
    the call goes to the next address, and that one is set aside."""

    async def close_at_once(stream: anyio.abc.SocketStream) -> None:
        await stream.aclose()

    with anyio.fail_after(20):
        async with (
            await anyio.create_tcp_listener(local_host="127.0.0.1") as listener,
            anyio.create_task_group() as tg,
            servers("tcp", 1) as (_, (good,), _kwargs),
        ):
            tg.start_soon(listener.serve, close_at_once)
            port = listener.extra(SocketAttribute.local_port)
            bad = f"tcp://127.0.0.1:{port}"
            async with rpc.Pool([bad, good], set_aside=30) as pool:
                assert [await pool.call("who") for _ in range(4)] == ["s0"] * 4
                with pytest.raises((anyio.BrokenResourceError, anyio_comm.CommError)):
                    async with pool.client(bad):
                        pass
            tg.cancel_scope.cancel()


async def test_a_busy_address_is_skipped_but_not_set_aside() -> None:
    """Its one connection is in use past wait_timeout: the call goes to the
    other address, and the busy one is picked again in turn."""
    with anyio.fail_after(20):
        async with servers("tcp", 2) as (methods, addresses, _kwargs):
            async with (
                rpc.Pool(
                    addresses, max_per_address=1, max_users_per_connection=1, wait_timeout=0.1
                ) as pool,
                anyio.create_task_group() as tg,
            ):

                async def hold() -> None:
                    async with pool.client(addresses[0]) as remote:
                        await remote.call("hold")

                tg.start_soon(hold)
                while not methods[0].calls:
                    await anyio.sleep(0.01)
                assert await pool.call("who") == "s1"  # s0's connection is taken
                methods[0].release.set()
                await anyio.sleep(0.05)
                assert sorted([await pool.call("who") for _ in range(2)]) == ["s0", "s1"]


def test_a_retry_of_one_str_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="one str"):
        rpc.Retry("get")
