"""connect(): timeout, retry with backoff, clear errors, TCP keepalive, idle timeout."""

from __future__ import annotations

import errno
import os
import socket
import ssl
from typing import Any

import anyio
import pytest
from anyio import BrokenResourceError, EndOfStream
from anyio.abc import SocketAttribute

import anyio_comm
from anyio_comm import Comm, IdleTimeoutError, RemoteProtocolError
from anyio_comm import _connect as connect_module
from anyio_comm._connect import RETRY_FIRST_DELAY, RETRY_MAX_DELAY, keepalive_settings
from anyio_comm.testing import comm_pair

from .certs import client_context, server_context
from .helpers import ADDRESS_TRANSPORTS, connected_pair, listen_address, temp_unix_address


async def echo(comm: Comm) -> None:
    async for message in comm:
        await comm.send(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- retry -------------------------------------------------------------------


def test_retry_delay_grows_with_jitter_and_is_capped() -> None:
    for attempt in range(30):
        nominal = min(RETRY_MAX_DELAY, RETRY_FIRST_DELAY * 2**attempt)
        delays = {connect_module._retry_delay(attempt) for _ in range(20)}
        assert all(nominal / 2 <= d <= nominal for d in delays), (attempt, delays)
        assert len(delays) > 1, "no jitter"
    assert connect_module._retry_delay(10_000) <= RETRY_MAX_DELAY


@pytest.mark.parametrize("kind", ["tcp", "unix", "inproc"])
async def test_retry_waits_for_a_listener_that_comes_up_late(kind: str) -> None:
    async with temp_unix_address() as unix_address:
        address = {
            "tcp": f"tcp://127.0.0.1:{free_port()}",
            "unix": unix_address,
            "inproc": f"inproc://late-{os.getpid()}-{id(unix_address)}",
        }[kind]
        comms: list[Comm] = []

        async def dial() -> None:
            comms.append(await anyio_comm.connect(address, retry=True, timeout=10))

        async with anyio.create_task_group() as tg:
            tg.start_soon(dial)
            await anyio.sleep(0.3)  # several refused attempts happen meanwhile
            assert not comms
            async with anyio_comm.listen(address, echo):
                with anyio.fail_after(10):
                    while not comms:
                        await anyio.sleep(0.01)
                async with comms[0] as comm:
                    await comm.send({"late": kind})
                    assert await comm.receive() == {"late": kind}


async def test_retry_gives_up_at_the_deadline_with_the_last_error() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    attempts = 0
    real_open_socket = connect_module.open_socket

    async def counting_open_socket(*args: Any) -> socket.socket:
        nonlocal attempts
        attempts += 1
        return await real_open_socket(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(connect_module, "open_socket", counting_open_socket)
        with anyio.fail_after(10), pytest.raises(TimeoutError) as info:
            await anyio_comm.connect(address, retry=True, timeout=0.5)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    assert address in str(info.value)
    assert "Connection refused" in str(info.value)
    assert attempts >= 3  # 10-20 ms, then 20-40 ms, ...: about 5 attempts in 0.5 s


async def test_without_retry_a_refused_connection_fails_at_once_naming_the_address() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    with anyio.fail_after(5), pytest.raises(ConnectionRefusedError) as info:
        await anyio_comm.connect(address, timeout=5)
    assert info.value.errno == errno.ECONNREFUSED
    assert address in str(info.value)


async def test_missing_unix_socket_file_names_the_path() -> None:
    async with temp_unix_address() as address:
        with pytest.raises(FileNotFoundError) as info:
            await anyio_comm.connect(address)
    assert address in str(info.value)


async def test_dns_failure_names_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    # No query leaves the machine: the resolver is replaced by one that fails.
    async def no_such_name(*args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(anyio, "getaddrinfo", no_such_name)
    with pytest.raises(socket.gaierror) as info:
        await anyio_comm.connect("tcp://no-such-host.invalid:4000")
    assert info.value.errno == socket.EAI_NONAME
    assert "resolving tcp://no-such-host.invalid:4000" in str(info.value)

    with anyio.fail_after(10), pytest.raises(TimeoutError) as timeout_info:
        await anyio_comm.connect("tcp://no-such-host.invalid:4000", retry=True, timeout=0.2)
    assert isinstance(timeout_info.value.__cause__, socket.gaierror)


async def test_unreachable_network_names_the_address(monkeypatch: pytest.MonkeyPatch) -> None:
    # An unroutable address cannot be reached from a loopback-only test; the
    # kernel's answer (ENETUNREACH from connect()) is simulated instead.
    async def unreachable(sock: socket.socket, sockaddr: Any) -> None:
        raise OSError(errno.ENETUNREACH, os.strerror(errno.ENETUNREACH))

    monkeypatch.setattr(connect_module, "_connect_socket", unreachable)
    with pytest.raises(OSError) as info:
        await anyio_comm.connect("tcp://127.0.0.1:9")
    assert info.value.errno == errno.ENETUNREACH
    assert "connecting to tcp://127.0.0.1:9" in str(info.value)


async def test_timeout_covers_a_peer_that_never_completes_the_tcp_handshake() -> None:
    # A listening socket that never accepts, with a full accept queue: the
    # kernel drops further SYNs, so connect() itself hangs.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers: list[socket.socket] = []
    try:
        for _ in range(4):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex(server.getsockname())
            fillers.append(filler)
        await anyio.sleep(0.05)
        port = server.getsockname()[1]
        with anyio.fail_after(10), pytest.raises(TimeoutError, match=r"timed out after 0\.3 s"):
            await anyio_comm.connect(f"tcp://127.0.0.1:{port}", timeout=0.3)
    finally:
        for filler in fillers:
            filler.close()
        server.close()


async def test_retry_does_not_retry_a_protocol_error() -> None:
    accepted = 0

    async def garbage(stream: anyio.abc.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        async with stream:
            await stream.send(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, garbage)
        with anyio.fail_after(10), pytest.raises(RemoteProtocolError):
            await anyio_comm.connect(f"tcp://127.0.0.1:{port}", retry=True, timeout=5)
        tg.cancel_scope.cancel()
    assert accepted == 1


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("timeout", -1, ValueError),
        ("timeout", 0, ValueError),
        ("timeout", float("nan"), ValueError),
        ("timeout", "5", TypeError),
        ("keepalive", 0, ValueError),
        ("keepalive", True, TypeError),
        ("idle_timeout", -0.5, ValueError),
    ],
)
async def test_bad_duration_options(option: str, value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match=option):
        await anyio_comm.connect("tcp://127.0.0.1:9", **{option: value})
    with pytest.raises(error, match=option):
        async with anyio_comm.listen(
            "tcp://127.0.0.1:0", echo, **{option if option != "timeout" else "idle_timeout": value}
        ):
            pass  # pragma: no cover


# -- keepalive -----------------------------------------------------------------


def test_keepalive_settings() -> None:
    assert keepalive_settings(30) == (15, 3, 5, 30_000)
    assert keepalive_settings(10) == (5, 1, 5, 10_000)
    assert keepalive_settings(0.5) == (1, 1, 5, 500)


def socket_options(comm: Comm) -> dict[str, int]:
    sock = comm.extra(SocketAttribute.raw_socket)
    options = {"SO_KEEPALIVE": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)}
    for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT"):
        if hasattr(socket, name):
            options[name] = sock.getsockopt(socket.IPPROTO_TCP, getattr(socket, name))
    return options


@pytest.mark.parametrize("kind", ["tcp", "tls1.3"])
async def test_keepalive_on_both_ends(kind: str) -> None:
    received: list[Comm] = []
    done = anyio.Event()

    async def handler(comm: Comm) -> None:
        received.append(comm)
        await done.wait()

    server_kw: dict[str, Any] = {}
    client_kw: dict[str, Any] = {}
    if kind == "tls1.3":
        server_kw["ssl_context"] = server_context(ssl.TLSVersion.TLSv1_3)
        client_kw["ssl_context"] = client_context(ssl.TLSVersion.TLSv1_3)
    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, handler, keepalive=30, **server_kw) as listener:
            async with await anyio_comm.connect(
                listener.address, keepalive=10, timeout=10, **client_kw
            ) as client:
                with anyio.fail_after(10):
                    while not received:
                        await anyio.sleep(0.01)
                names = ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT", "TCP_USER_TIMEOUT")
                expected_client = dict(zip(names, keepalive_settings(10), strict=True))
                expected_server = dict(zip(names, keepalive_settings(30), strict=True))
                client_options = socket_options(client)
                server_options = socket_options(received[0])
                assert client_options.pop("SO_KEEPALIVE") and server_options.pop("SO_KEEPALIVE")
                for name, value in client_options.items():
                    assert value == expected_client[name], name
                for name, value in server_options.items():
                    assert value == expected_server[name], name
                done.set()


async def test_keepalive_is_off_by_default() -> None:
    async with connected_pair("tcp") as (client, server):
        assert socket_options(client)["SO_KEEPALIVE"] == 0
        assert socket_options(server)["SO_KEEPALIVE"] == 0


# -- idle timeout --------------------------------------------------------------


@pytest.mark.parametrize("kind", [*ADDRESS_TRANSPORTS, "memory", "tls1.3"])
async def test_client_idle_timeout(kind: str) -> None:
    async with connected_pair(kind, idle_timeout=0.3) as (client, server):
        assert client.idle_timeout == 0.3
        await server.send("first")
        assert await client.receive() == "first"
        with anyio.fail_after(10), pytest.raises(IdleTimeoutError) as info:
            await client.receive()
        assert isinstance(info.value, TimeoutError)
        assert isinstance(info.value, BrokenResourceError)
        assert client.closed
        with pytest.raises(BrokenResourceError):
            await client.receive()
        with pytest.raises(BrokenResourceError):
            await client.send("too late")
        # the peer sees the connection end
        with anyio.fail_after(10), pytest.raises((EndOfStream, BrokenResourceError)):
            await server.receive()


async def test_idle_timeout_counts_from_the_last_byte_not_from_the_call() -> None:
    # 20 messages 50 ms apart: the whole exchange outlasts the idle timeout
    async with connected_pair("tcp", idle_timeout=0.5) as (client, server):

        async def trickle() -> None:
            for i in range(20):
                await anyio.sleep(0.05)
                await server.send(i)

        async with anyio.create_task_group() as tg:
            tg.start_soon(trickle)
            assert [await client.receive() for _ in range(20)] == list(range(20))


async def test_no_idle_timeout_by_default() -> None:
    async with connected_pair("tcp") as (client, _):
        assert client.idle_timeout is None
        with anyio.move_on_after(0.2) as scope:
            await client.receive()
        assert scope.cancelled_caught
        assert not client.closed


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"idle_timeout": -1}, ValueError),
        ({"read_buffer_size": 1}, ValueError),
        ({"handshake_timeout": "5"}, TypeError),
        ({"options": "not Options"}, TypeError),
        ({"no_such_option": 1}, TypeError),
    ],
)
async def test_comm_pair_raises_bad_options_unwrapped(
    options: dict[str, Any], error: type[Exception]
) -> None:
    with pytest.raises(error):
        await comm_pair(**options)
