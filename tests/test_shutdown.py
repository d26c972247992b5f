"""Listener limits (max_connections), idle timeout and graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from typing import Any

import anyio
import pytest
from anyio import EndOfStream, get_cancelled_exc_class

import anyio_comm
from anyio_comm import CloseCode, Comm, IdleTimeoutError, PeerClosedError
from anyio_comm._sansio.wire import Limits, encode_header, encode_preamble

from .certs import client_context, server_context
from .helpers import (
    ADDRESS_TRANSPORTS,
    call_soon_outside_any_task,
    listen_address,
    open_fds,
    running_tasks,
)

KINDS = [*ADDRESS_TRANSPORTS, "tls1.3"]


def tls_options(kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    if kind != "tls1.3":
        return {}, {}
    return (
        {"ssl_context": server_context(ssl.TLSVersion.TLSv1_3)},
        {"ssl_context": client_context(ssl.TLSVersion.TLSv1_3)},
    )


async def wait_until(predicate: Any, what: str, timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


def refused_errors() -> tuple[type[BaseException], ...]:
    return (ConnectionRefusedError, FileNotFoundError)


# -- max_connections ---------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_max_connections_queues_the_rest(kind: str) -> None:
    server_kw, client_kw = tls_options(kind)
    release = {i: anyio.Event() for i in range(5)}
    running: list[int] = []
    peak = 0

    async def handler(comm: Comm) -> None:
        nonlocal peak
        i = await comm.receive()
        running.append(i)
        peak = max(peak, len(running))
        await comm.send(("started", i))
        await release[i].wait()
        running.remove(i)

    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, handler, max_connections=2, **server_kw) as listener:
            assert listener.max_connections == 2
            results: dict[int, Any] = {}

            async def client(i: int) -> None:
                async with await anyio_comm.connect(
                    listener.address, timeout=20, **client_kw
                ) as c:
                    await c.send(i)
                    results[i] = await c.receive()

            async with anyio.create_task_group() as tg:
                for i in range(5):
                    tg.start_soon(client, i)
                await wait_until(lambda: len(results) == 2, "two served")
                await anyio.sleep(0.2)  # the other three stay queued
                assert len(results) == 2
                assert listener.active_connections == 2
                for i in list(results):
                    release[i].set()
                await wait_until(lambda: len(results) == 4, "four served")
                for i in range(5):
                    release[i].set()
            assert sorted(results) == list(range(5))
            assert all(reply == ["started", i] for i, reply in results.items())
            assert peak == 2
            await wait_until(lambda: listener.active_connections == 0, "all closed")


async def test_max_connections_counts_handshakes_and_queued_clients_can_time_out() -> None:
    done = anyio.Event()

    async def handler(comm: Comm) -> None:
        await done.wait()

    async with anyio_comm.listen("tcp://127.0.0.1:0", handler, max_connections=1) as listener:
        async with await anyio_comm.connect(listener.address, timeout=10):
            # the second one sits in the backlog: its handshake never starts
            with anyio.fail_after(10), pytest.raises(TimeoutError):
                await anyio_comm.connect(listener.address, timeout=0.3)
            done.set()
        # the timed-out client is dropped once its turn comes; the slot is freed
        async with await anyio_comm.connect(listener.address, timeout=10) as comm:
            await comm.send_eof()
            with anyio.fail_after(10), pytest.raises(EndOfStream):
                await comm.receive()


@pytest.mark.parametrize("kind", KINDS)
async def test_leaving_listen_while_connections_wait_for_room_raises_nothing(kind: str) -> None:
    """Connections waiting at max_connections when the listener stops hold no
    slot: nothing is given back that was not taken."""
    server_kw, client_kw = tls_options(kind)
    held = anyio.Event()

    async def handler(comm: Comm) -> None:
        held.set()
        await anyio.sleep_forever()

    async def waiting_client(address: str) -> None:
        with pytest.raises((TimeoutError, OSError, anyio.BrokenResourceError, EndOfStream)):
            await anyio_comm.connect(address, timeout=5, **client_kw)

    with anyio.fail_after(10):
        async with listen_address(kind) as address, anyio.create_task_group() as tg:
            async with anyio_comm.listen(
                address, handler, max_connections=1, **server_kw
            ) as listener:
                first = await anyio_comm.connect(listener.address, timeout=10, **client_kw)
                await held.wait()
                tg.start_soon(waiting_client, listener.address)
                await anyio.sleep(0.2)  # (in the backlog, or waiting for room over inproc://)
            await first.aclose()


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
async def test_bad_max_connections(value: Any) -> None:
    with pytest.raises(ValueError, match="max_connections"):
        async with anyio_comm.listen("tcp://127.0.0.1:0", lambda c: None, max_connections=value):
            pass  # pragma: no cover


# -- idle timeout --------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
async def test_listener_idle_timeout_closes_silent_connections(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    server_kw, client_kw = tls_options(kind)
    seen: list[BaseException] = []

    async def handler(comm: Comm) -> None:
        try:
            async for message in comm:
                await comm.send(message)
        except BaseException as exc:
            seen.append(exc)
            raise

    caplog.set_level(logging.DEBUG, logger="anyio_comm")
    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, handler, idle_timeout=0.3, **server_kw) as listener:
            async with await anyio_comm.connect(listener.address, timeout=10, **client_kw) as c:
                await c.send("hello")
                assert await c.receive() == "hello"
                # then silence: the server closes the connection, gracefully
                with anyio.fail_after(10), pytest.raises(EndOfStream):
                    await c.receive()
            await wait_until(lambda: listener.active_connections == 0, "closed")
    assert len(seen) == 1 and isinstance(seen[0], IdleTimeoutError)
    records = [r for r in caplog.records if r.name == "anyio_comm"]
    assert any("IdleTimeoutError" in r.getMessage() for r in records)
    assert all(r.levelno == logging.DEBUG for r in records)


async def test_listener_idle_timeout_spares_active_clients() -> None:
    async def echo(comm: Comm) -> None:
        async for message in comm:
            await comm.send(message)

    # 20 requests 50 ms apart: the whole exchange outlasts the idle timeout
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo, idle_timeout=0.5) as listener:
        async with await anyio_comm.connect(listener.address, timeout=10) as c:
            for i in range(20):
                await anyio.sleep(0.05)
                await c.send(i)
                assert await c.receive() == i


# -- graceful shutdown ---------------------------------------------------------


async def echo_handler(comm: Comm) -> None:
    async for message in comm:
        await comm.send(message)


async def assert_refused(address: str, client_kw: dict[str, Any]) -> None:
    with anyio.fail_after(10), pytest.raises(refused_errors()):
        await anyio_comm.connect(address, timeout=5, **client_kw)


@pytest.mark.parametrize("kind", KINDS)
async def test_shutdown_ends_idle_handlers_at_once(kind: str) -> None:
    server_kw, client_kw = tls_options(kind)
    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, echo_handler, **server_kw) as listener:
            clients = [
                await anyio_comm.connect(listener.address, timeout=10, **client_kw)
                for _ in range(3)
            ]
            for i, c in enumerate(clients):
                await c.send(i)
                assert await c.receive() == i
            assert not listener.shutting_down
            with anyio.fail_after(10):  # far below the grace period: nobody was busy
                await listener.shutdown(grace_period=60)
            assert listener.shutting_down
            assert listener.active_connections == 0
            for c in clients:
                with anyio.fail_after(10), pytest.raises(EndOfStream):
                    await c.receive()
                await c.aclose()
            await assert_refused(listener.address, client_kw)


@pytest.mark.parametrize("kind", KINDS)
async def test_shutdown_lets_busy_handlers_finish(kind: str) -> None:
    server_kw, client_kw = tls_options(kind)
    busy = anyio.Event()
    finish = anyio.Event()
    outcome: list[str] = []

    async def handler(comm: Comm) -> None:
        try:
            async for request in comm:
                busy.set()
                await finish.wait()  # "work" that outlives the start of the shutdown
                await comm.send({"reply": request})
            outcome.append("returned")
        except get_cancelled_exc_class():
            outcome.append("cancelled")
            raise

    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, handler, **server_kw) as listener:
            async with await anyio_comm.connect(listener.address, timeout=10, **client_kw) as c:
                await c.send("work")
                with anyio.fail_after(10):
                    await busy.wait()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(listener.shutdown, 60)
                    await wait_until(lambda: listener.shutting_down, "shutting down")
                    await anyio.sleep(0.1)
                    assert outcome == []  # busy: not cancelled
                    await assert_refused(listener.address, client_kw)
                    finish.set()
                    # the reply is delivered, then the handler is stopped at
                    # its next receive() and the connection ends cleanly
                    with anyio.fail_after(10):
                        assert await c.receive() == {"reply": "work"}
                    with anyio.fail_after(10), pytest.raises(EndOfStream):
                        await c.receive()
    assert outcome == ["cancelled"]


@pytest.mark.parametrize("kind", ["tcp", "inproc"])
async def test_shutdown_cancels_handlers_after_the_grace_period(kind: str) -> None:
    outcome: list[str] = []

    async def stuck(comm: Comm) -> None:
        await comm.receive()
        try:
            await anyio.sleep_forever()
        finally:
            outcome.append("cancelled")

    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, stuck) as listener:
            async with await anyio_comm.connect(listener.address, timeout=10) as c:
                await c.send("x")
                await wait_until(lambda: listener.active_connections == 1, "connected")
                await anyio.sleep(0.05)
                with anyio.fail_after(10):
                    await listener.shutdown(grace_period=0.2)
                assert outcome == ["cancelled"]
                # stopped in the middle of handling "x": the client is told its reply
                # may be lost
                with anyio.fail_after(10), pytest.raises(PeerClosedError) as info:
                    await c.receive()
                assert info.value.reason.code is CloseCode.INTERRUPTED


async def test_shutdown_waits_for_a_partly_received_message() -> None:
    """A handler in receive() with half a message is busy, not idle."""
    got: list[Any] = []

    async def handler(comm: Comm) -> None:
        async for message in comm:
            got.append(bytes(message))
            await comm.send_frames([b"ack"])

    async with anyio_comm.listen("tcp://127.0.0.1:0", handler) as listener:
        port = int(listener.address.rsplit(":", 1)[1])
        async with await anyio.connect_tcp("127.0.0.1", port) as raw:
            await raw.send(encode_preamble(Limits()))
            body = anyio_comm._sansio.serialization.Serializer().dumps(b"x" * 100)
            message = encode_header([f.nbytes for f in body]) + b"".join(bytes(f) for f in body)
            await raw.send(message[: len(message) // 2])
            await wait_until(lambda: listener.active_connections == 1, "connected")
            await anyio.sleep(0.05)
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.shutdown, 60)
                await anyio.sleep(0.2)
                assert listener.active_connections == 1  # still waiting for the rest
                await raw.send(message[len(message) // 2 :])
                data = b""
                with anyio.fail_after(10):
                    while True:
                        try:
                            data += await raw.receive()
                        except (anyio.EndOfStream, anyio.BrokenResourceError):
                            break
    assert got == [b"x" * 100]
    assert data.endswith(b"ack")


async def test_serve_returns_after_shutdown_and_shutdown_is_idempotent() -> None:
    before_fds, before_tasks = open_fds(), running_tasks()
    async with anyio.create_task_group() as tg:
        listener = await tg.start(anyio_comm.serve, "tcp://127.0.0.1:0", echo_handler)
        async with await anyio_comm.connect(listener.address, timeout=10) as c:
            await c.send(1)
            assert await c.receive() == 1
            with anyio.fail_after(10):
                async with anyio.create_task_group() as inner:
                    inner.start_soon(listener.shutdown, 5)
                    inner.start_soon(listener.shutdown, 5)
                await listener.shutdown()
        # serve() returned by itself: nothing cancels tg here
    assert open_fds() == before_fds
    assert running_tasks() == before_tasks
    with pytest.raises(ValueError, match="grace_period"):
        await listener.shutdown(-1)


async def test_shutdown_drops_connections_still_in_their_handshake() -> None:
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo_handler) as listener:
        port = int(listener.address.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as silent:
            silent.setblocking(False)
            await anyio.sleep(0.1)  # accepted; waiting for our preamble
            with anyio.fail_after(5):
                await listener.shutdown(grace_period=60)
            await anyio.wait_readable(silent)
            data = b""
            while chunk := silent.recv(4096):
                data += chunk
            # it got our preamble at most, then EOF (or a reset)
            assert len(data) < 64


async def test_shutdown_after_leaving_listen_returns_at_once() -> None:
    async with anyio_comm.listen("inproc://", echo_handler) as listener:
        pass
    with anyio.fail_after(5):
        await listener.shutdown(10)
    assert listener.shutting_down


@pytest.mark.parametrize("kind", KINDS)
async def test_a_new_listener_takes_the_address_after_stop_accepting(kind: str) -> None:
    """Once a listener stopped accepting, another may listen on its address (a
    restart without dropping the old connections): the old listener's shutdown
    leaves the new one's address alone."""
    server_options, client_options = tls_options(kind)
    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, echo_handler, **server_options) as old:
            async with await anyio_comm.connect(old.address, timeout=10, **client_options) as a:
                old.stop_accepting()
                async with anyio_comm.listen(old.address, echo_handler, **server_options) as new:
                    assert new.address == old.address
                    await old.shutdown(10)  # the old comm ends with its listener
                    with (
                        anyio.fail_after(10),
                        pytest.raises((EndOfStream, anyio.BrokenResourceError)),
                    ):
                        await a.receive()
                    async with await anyio_comm.connect(
                        old.address, timeout=10, **client_options
                    ) as b:
                        await b.send("new")
                        with anyio.fail_after(10):
                            assert await b.receive() == "new"


@pytest.mark.parametrize(
    "kind",
    ["tcp", pytest.param("unix", marks=ADDRESS_TRANSPORTS[2].marks), "tls1.3"],
)
async def test_stop_accepting_lets_a_handshake_in_progress_reach_the_handler(kind: str) -> None:
    """A connection accepted before stop_accepting() whose handshake (TLS, the
    preamble exchange) completes after it is served; wait_closed() returns once
    it is closed."""
    server_options, client_options = tls_options(kind)
    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, echo_handler, **server_options) as listener:
            if kind == "unix":
                stream: anyio.abc.ByteStream = await anyio.connect_unix(
                    listener.address.removeprefix("unix://")
                )
            else:
                port = int(listener.address.rsplit(":", 1)[1])
                stream = await anyio.connect_tcp("127.0.0.1", port)
            # accepted, and waiting for our first bytes (a ClientHello or a preamble)
            await wait_until(lambda: listener._server.connections, "accepted")
            listener.stop_accepting()
            await _served_after_stop(listener, stream, client_options)
            assert listener.active_connections == 0


async def _served_after_stop(
    listener: anyio_comm.Listener, stream: anyio.abc.ByteStream, client_options: dict[str, Any]
) -> None:
    """Complete the handshake on ``stream`` and a round trip; wait_closed() returns
    once that connection is closed, not before."""
    closed = anyio.Event()

    async def wait_closed() -> None:
        await listener.wait_closed()
        closed.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait_closed)
            if "ssl_context" in client_options:
                stream = await anyio.streams.tls.TLSStream.wrap(
                    stream, hostname="localhost", ssl_context=client_options["ssl_context"]
                )
            async with await anyio_comm.from_stream(stream) as comm:
                await comm.send("late")
                with anyio.fail_after(10):
                    assert await comm.receive() == "late"
                assert listener.active_connections == 1
                await anyio.sleep(0.05)
                assert not closed.is_set()  # (a connection is still open)
            with anyio.fail_after(10):
                await closed.wait()
    finally:
        await anyio.aclose_forcefully(stream)


@pytest.mark.parametrize("kind", KINDS)
async def test_wait_closed(kind: str) -> None:
    """wait_closed() waits for stop_accepting() and for the last connection; it
    returns at once once nothing is left, after shutdown() and after listen()."""
    server_options, client_options = tls_options(kind)
    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, echo_handler, **server_options) as listener:
            with anyio.move_on_after(0.05) as scope:
                await listener.wait_closed()  # still accepting, nothing open
            assert scope.cancelled_caught
            async with await anyio_comm.connect(listener.address, timeout=10, **client_options):
                listener.stop_accepting()
                with anyio.move_on_after(0.05) as scope:
                    await listener.wait_closed()  # a connection is open
                assert scope.cancelled_caught
            with anyio.fail_after(10):
                await listener.wait_closed()
                await listener.shutdown()
                await listener.wait_closed()
        async with anyio_comm.listen(address, echo_handler, **server_options) as other:
            async with await anyio_comm.connect(other.address, timeout=10, **client_options):
                pass
        with anyio.fail_after(10):
            await other.wait_closed()


def notify_closing_in_tasks_only(sock: socket.socket) -> None:
    """``anyio.notify_closing`` as AnyIO releases that ask sniffio for the event
    loop have it: on asyncio, it fails outside a task."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # trio: sniffio knows it in every callback of its thread
    else:
        if asyncio.current_task() is None:
            raise RuntimeError("no task")
    anyio.notify_closing(sock)


@pytest.mark.parametrize("kind", KINDS)
async def test_stop_accepting_outside_any_task(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """stop_accepting() from an event loop callback (as a framework's synchronous
    stop calls it): newcomers are refused soon after, established comms go on."""
    monkeypatch.setattr("anyio_comm._listener.notify_closing", notify_closing_in_tasks_only)
    server_options, client_options = tls_options(kind)
    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, echo_handler, **server_options) as listener:
            async with await anyio_comm.connect(
                listener.address, timeout=10, **client_options
            ) as a:
                call_soon_outside_any_task(listener.stop_accepting)
                await wait_until(lambda: not listener.accepting, "stopped")
                with anyio.fail_after(10):
                    while True:  # the listening socket closes within a pass of the loop
                        try:
                            late = await anyio_comm.connect(
                                listener.address, timeout=5, **client_options
                            )
                        except refused_errors():
                            break
                        await late.aclose()
                        await anyio.sleep(0.01)
                await a.send("still here")
                with anyio.fail_after(10):
                    assert await a.receive() == "still here"
                assert listener.active_connections == 1


@pytest.mark.parametrize("kind", KINDS)
async def test_stop_accepting_keeps_established_connections(kind: str) -> None:
    """stop_accepting() refuses newcomers; established comms go on until their
    handlers return; serve() keeps running until cancelled."""
    server_options, client_options = tls_options(kind)

    async def echo(comm: Comm) -> None:
        async for message in comm:
            await comm.send(message)

    async with listen_address(kind) as address, anyio.create_task_group() as tg:
        listener = await tg.start(
            lambda task_status: anyio_comm.serve(
                address, echo, task_status=task_status, **server_options
            )
        )
        async with await anyio_comm.connect(listener.address, timeout=10, **client_options) as a:
            assert listener.accepting
            listener.stop_accepting()
            listener.stop_accepting()  # idempotent
            assert not listener.accepting and not listener.shutting_down
            with pytest.raises((*refused_errors(), OSError)):
                await anyio_comm.connect(listener.address, timeout=5, **client_options)
            for i in range(3):
                await a.send(i)
                with anyio.fail_after(10):
                    assert await a.receive() == i
            assert listener.active_connections == 1
        await wait_until(lambda: listener.active_connections == 0, "the handler returned")
        tg.cancel_scope.cancel()
