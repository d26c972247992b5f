"""listen / serve / connect: addresses, lifecycle, bad peers, leaks, backpressure."""

from __future__ import annotations

import errno
import logging
import os
import socket

import anyio
import pytest
from anyio import BrokenResourceError, EndOfStream

import anyio_comm
from anyio_comm import CloseCode, CloseReason, Comm, PeerClosedError, RemoteProtocolError
from anyio_comm._sansio.wire import Limits, encode_header, encode_preamble

from .certs import client_context, server_context
from .conftest import HAVE_IPV6, HAVE_UNIX
from .helpers import ADDRESS_TRANSPORTS, connected_pair, listen_address, open_fds, running_tasks


async def echo(comm: Comm) -> None:
    async for message in comm:
        await comm.send(message)


async def raw_connect(address: str) -> anyio.abc.ByteStream:
    if address.startswith("unix://"):
        return await anyio.connect_unix(address[len("unix://") :])
    host, port = address[len("tcp://") :].rsplit(":", 1)
    return await anyio.connect_tcp(host.strip("[]"), int(port))


@pytest.mark.parametrize("kind", ADDRESS_TRANSPORTS)
async def test_echo_and_listener_address(kind: str) -> None:
    async with listen_address(kind) as address, anyio_comm.listen(address, echo) as listener:
        assert listener.address.split("://")[0] == address.split("://")[0]
        if kind.startswith("tcp"):
            assert not listener.address.endswith(":0")
        assert repr(listener).startswith("<Listener ")
        async with await anyio_comm.connect(listener.address) as comm:
            for i in range(10):
                await comm.send({"i": i})
                assert await comm.receive() == {"i": i}
            assert listener.active_connections == 1


@pytest.mark.parametrize("kind", ADDRESS_TRANSPORTS)
async def test_leaving_listen_closes_everything(kind: str) -> None:
    fds_before = open_fds()
    tasks_before = running_tasks()
    handler_cancelled = anyio.Event()
    started = 0

    async def handler(comm: Comm) -> None:
        nonlocal started
        started += 1
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            handler_cancelled.set()
            raise

    clients = []
    async with listen_address(kind) as address:
        async with anyio_comm.listen(address, handler) as listener:
            for _ in range(5):
                clients.append(await anyio_comm.connect(listener.address))
            with anyio.fail_after(5):
                while listener.active_connections < 5:
                    await anyio.sleep(0.01)
        assert handler_cancelled.is_set() and started == 5
        assert listener.active_connections == 0
        for client in clients:  # the server side is closed: clients see EOF
            with anyio.fail_after(5), pytest.raises((EndOfStream, BrokenResourceError)):
                await client.receive()
            await client.aclose()
        if kind == "unix":
            assert not os.path.exists(address[len("unix://") :])  # noqa: ASYNC240
        if kind == "inproc":
            with pytest.raises(ConnectionRefusedError):
                await anyio_comm.connect(listener.address)
        elif kind.startswith("tcp"):
            with pytest.raises(OSError):
                await anyio_comm.connect(listener.address, timeout=5)
    assert open_fds() == fds_before
    assert running_tasks() == tasks_before


@pytest.mark.parametrize("kind", ["tcp", "unix"])
@pytest.mark.parametrize(
    "garbage",
    [b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n", os.urandom(64), b"\x16\x03\x01\x00\xa5\x01"],
    ids=["http", "random", "tls-hello"],
)
async def test_foreign_protocols_are_dropped_quickly(kind: str, garbage: bytes) -> None:
    if kind == "unix" and not HAVE_UNIX:
        pytest.skip("no Unix sockets")
    async with listen_address(kind) as address, anyio_comm.listen(address, echo) as listener:
        with anyio.fail_after(5):  # far below the 10 s handshake timeout
            stream = await raw_connect(listener.address)
            async with stream:
                await stream.send(garbage)
                with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError)):
                    while True:  # the listener's preamble, then EOF
                        await stream.receive()
        async with await anyio_comm.connect(listener.address) as comm:
            await comm.send("still serving")
            assert await comm.receive() == "still serving"
        with anyio.fail_after(5):  # the dropped peer never counted as a connection
            while listener.active_connections:
                await anyio.sleep(0.01)


async def test_silent_client_times_out_of_the_handshake() -> None:
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo, handshake_timeout=0.2) as listener:
        stream = await raw_connect(listener.address)
        async with stream:
            with anyio.fail_after(5), pytest.raises((anyio.EndOfStream, BrokenResourceError)):
                while True:
                    await stream.receive()


async def test_client_detects_non_anyio_comm_server() -> None:
    async def http_server(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            await stream.send(b"HTTP/1.1 400 Bad Request\r\n\r\n")

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as server:
        port = server.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, http_server)
            with pytest.raises(RemoteProtocolError, match="does not speak"):
                await anyio_comm.connect(f"tcp://127.0.0.1:{port}", timeout=5)
            tg.cancel_scope.cancel()


async def test_bad_frames_from_peer_close_only_that_connection() -> None:
    limits = Limits(max_frame_size=100)
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo, limits=limits) as listener:
        async with await anyio_comm.connect(listener.address) as good:
            stream = await raw_connect(listener.address)
            async with stream:
                await stream.send(encode_preamble(Limits()))
                await stream.send(encode_header([10**6]))  # over the listener's limit
                with anyio.fail_after(5), pytest.raises((anyio.EndOfStream, BrokenResourceError)):
                    while True:
                        await stream.receive()
            await good.send("ok")
            assert await good.receive() == "ok"


@pytest.mark.parametrize(
    "error",
    [ZeroDivisionError("handler bug"), FileNotFoundError("app file"), TimeoutError("app")],
    ids=["bug", "oserror", "timeout"],
)
async def test_handler_errors_are_logged_and_contained(
    caplog: pytest.LogCaptureFixture, error: Exception
) -> None:
    """An application error in a handler is logged at ERROR, whatever its type; replies
    sent before it are delivered, then the client learns why the connection ended (a
    close record: HANDLER_ERROR, the class name and the message); the listener keeps
    serving."""

    async def buggy(comm: Comm) -> None:
        message = await comm.receive()
        await comm.send("ack")  # delivered even though the handler fails next
        if message == "boom":
            raise error
        await comm.send(message)

    with caplog.at_level(logging.DEBUG, logger="anyio_comm"):
        async with anyio_comm.listen("tcp://127.0.0.1:0", buggy) as listener:
            async with await anyio_comm.connect(listener.address) as comm:
                await comm.send("boom")
                assert await comm.receive() == "ack"
                with anyio.fail_after(5), pytest.raises(PeerClosedError) as info:
                    await comm.receive()
                assert info.value.reason == CloseReason(
                    CloseCode.HANDLER_ERROR, type(error).__name__, str(error)
                )
                assert comm.peer_close_reason == info.value.reason
                with pytest.raises(PeerClosedError):  # and again
                    await comm.receive()
                with pytest.raises(PeerClosedError):  # a send after it fails too
                    await comm.send("more")
            async with await anyio_comm.connect(listener.address) as comm:
                await comm.send("fine")
                assert await comm.receive() == "ack"
                assert await comm.receive() == "fine"
    errors = [r for r in caplog.records if r.name == "anyio_comm" and r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert type(error).__name__ in (errors[0].exc_text or "")


async def test_connection_endings_are_logged_at_debug_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo) as listener:
        with caplog.at_level(logging.DEBUG, logger="anyio_comm"):
            async with await anyio_comm.connect(listener.address) as comm:
                await comm.send("x")
                assert await comm.receive() == "x"
                await comm.send_frames([b"\xc1 not msgpack"])  # RemoteProtocolError there
                with anyio.fail_after(5), pytest.raises((BrokenResourceError, EndOfStream)):
                    await comm.receive()
            with anyio.fail_after(5):
                while listener.active_connections:
                    await anyio.sleep(0.01)
    ours = [r for r in caplog.records if r.name == "anyio_comm"]  # not asyncio's debug mode
    assert not [r for r in ours if r.levelno > logging.DEBUG]
    assert any("RemoteProtocolError" in r.getMessage() for r in ours)


async def test_serve_with_task_group_start() -> None:
    async with anyio.create_task_group() as tg:
        listener = await tg.start(anyio_comm.serve, "tcp://127.0.0.1:0", echo)
        assert isinstance(listener, anyio_comm.Listener)
        async with await anyio_comm.connect(listener.address) as comm:
            await comm.send([1, 2])
            assert await comm.receive() == [1, 2]
        tg.cancel_scope.cancel()


async def test_exception_in_listen_body_propagates() -> None:
    with pytest.raises(KeyError):
        async with anyio_comm.listen("tcp://127.0.0.1:0", echo):
            raise KeyError("body")


@pytest.mark.parametrize(
    "address",
    [
        "tcp://127.0.0.1",
        "tcp://host:99999",
        "tcp://::1:80",
        "tcp://[nothost]:1",
        "http://x:1",
        "tcp//x:1",
        "127.0.0.1:80",
        "unix://",
        "tls-ish://a:1",
        "tcp://a b:1",
    ],
)
async def test_malformed_addresses(address: str) -> None:
    with pytest.raises(ValueError, match=r"address|scheme") as info:
        await anyio_comm.connect(address)
    assert address in str(info.value)
    with pytest.raises(ValueError, match=r"address|scheme"):
        async with anyio_comm.listen(address, echo):
            pass


@pytest.mark.parametrize("scheme", ["tcp", "tls"])
async def test_an_empty_host_listens_on_every_interface(scheme: str) -> None:
    """``tcp://:port`` binds every interface (IPv4 and, where there is one, IPv6);
    a client cannot connect to an empty host."""
    server_options, client_options = {}, {}
    if scheme == "tls":
        server_options = {"ssl_context": server_context()}
        client_options = {"ssl_context": client_context()}
    async with anyio_comm.listen(f"{scheme}://:0", echo, **server_options) as listener:
        port = listener.address.rpartition(":")[2]
        expected = [f"{scheme}://0.0.0.0:{port}"]
        if HAVE_IPV6:
            expected.append(f"{scheme}://[::]:{port}")
        assert sorted(listener.addresses) == sorted(expected)
        for host in ["127.0.0.1", "[::1]"] if HAVE_IPV6 else ["127.0.0.1"]:
            address = f"{scheme}://{host}:{port}"
            async with await anyio_comm.connect(
                address, timeout=10, server_hostname="localhost", **client_options
            ) as comm:
                await comm.send(host)
                with anyio.fail_after(10):
                    assert await comm.receive() == host
        with pytest.raises(ValueError, match="no host to connect to") as info:
            await anyio_comm.connect(f"{scheme}://:{port}", **client_options)
        assert f"{scheme}://:{port}" in str(info.value)


async def test_invalid_options_fail_at_call_site() -> None:
    with pytest.raises(ValueError, match="read_buffer_size"):
        await anyio_comm.connect("tcp://127.0.0.1:1", read_buffer_size=10)
    with pytest.raises(ValueError, match="oob_threshold"):
        await anyio_comm.connect("tcp://127.0.0.1:1", oob_threshold=-1)
    with pytest.raises(TypeError, match="handler"):
        async with anyio_comm.listen("tcp://127.0.0.1:0", "not callable"):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError):
        await anyio_comm.connect(8786)  # type: ignore[arg-type]


async def test_connection_refused() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(ConnectionRefusedError):
            await anyio_comm.connect(f"tcp://127.0.0.1:{port}", timeout=5)


async def test_connect_timeout_covers_the_handshake() -> None:
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as silent:
        port = silent.extra(anyio.abc.SocketAttribute.local_port)
        # the kernel accepts the connection; nobody ever answers the preamble
        with anyio.fail_after(5), pytest.raises(TimeoutError):
            await anyio_comm.connect(f"tcp://127.0.0.1:{port}", timeout=0.2)


async def test_dns_failure_is_oserror() -> None:
    with pytest.raises(OSError):
        await anyio_comm.connect("tcp://no-such-host.invalid:80", timeout=10)


async def test_address_in_use() -> None:
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo) as listener:
        with pytest.raises(OSError):
            async with anyio_comm.listen(listener.address, echo):
                pass
    async with anyio_comm.listen("inproc://taken", echo):
        with pytest.raises(OSError, match="in use"):
            async with anyio_comm.listen("inproc://taken", echo):
                pass


async def test_unknown_inproc_name_is_refused() -> None:
    with pytest.raises(ConnectionRefusedError, match="nobody-here"):
        await anyio_comm.connect("inproc://nobody-here")


@pytest.mark.parametrize("kind", ["tcp", "inproc", "memory"])
async def test_slow_reader_stops_the_writer(kind: str) -> None:
    """Backpressure: with a peer that does not read, sends stall after a bounded amount."""
    async with connected_pair(kind) as (client, server):
        chunk = b"x" * 65536
        sent = 0
        with anyio.move_on_after(1):
            while sent < 2**30:
                await client.send_frames([chunk])
                sent += len(chunk)
        # kernel socket buffers or the memory pipe hold the rest: tens of MB at most
        assert sent < 64 * 2**20
        received = 0
        while received < sent:
            received += len((await server.receive_frames())[0])
        assert received == sent


async def test_many_concurrent_connections() -> None:
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo) as listener:

        async def client(i: int) -> None:
            async with await anyio_comm.connect(listener.address, timeout=10) as comm:
                for j in range(5):
                    payload = os.urandom(i % 7000)
                    await comm.send({"i": i, "j": j, "p": payload})
                    reply = await comm.receive()
                    assert reply["i"] == i and reply["j"] == j and bytes(reply["p"]) == payload

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(100):
                    tg.start_soon(client, i)


async def test_host_name_binds_every_address_on_one_port() -> None:
    async with anyio_comm.listen("tcp://localhost:0", echo) as listener:
        ports = {address.rsplit(":", 1)[1] for address in listener.addresses}
        assert len(ports) == 1
        for address in listener.addresses:
            async with await anyio_comm.connect(address, timeout=5) as comm:
                await comm.send(address)
                assert await comm.receive() == address


# -- unix:// errors name the path -----------------------------------------------------

needs_unix = pytest.mark.skipif(not HAVE_UNIX, reason="no Unix sockets")


@needs_unix
async def test_a_unix_address_in_use_is_named() -> None:
    """Listening where a listener (or a socket file some process left) is: "Address
    already in use", an OSError with its errno, saying which path."""
    async with listen_address("unix") as address, anyio_comm.listen(address, echo):
        with pytest.raises(OSError) as info:
            async with anyio_comm.listen(address, echo):
                pass
        assert info.value.errno == errno.EADDRINUSE
        assert (info.value.strerror or "").startswith(os.strerror(errno.EADDRINUSE))
        assert f"listening on {address}" in str(info.value)
        # the first listener still serves
        async with await anyio_comm.connect(address) as comm:
            await comm.send("still")
            assert await comm.receive() == "still"


@needs_unix
async def test_a_unix_path_in_a_missing_directory_is_named() -> None:
    async with listen_address("unix") as address:
        address = address.replace("/s.sock", "/no-such-directory/s.sock")
        with pytest.raises(FileNotFoundError) as info:
            async with anyio_comm.listen(address, echo):
                pass
        assert info.value.errno == errno.ENOENT
        assert f"listening on {address}" in str(info.value)
        with pytest.raises(FileNotFoundError) as info:
            await anyio_comm.connect(address)
        assert f"connecting to {address}" in str(info.value)


@needs_unix
async def test_a_unix_path_too_long_is_named() -> None:
    """A path longer than AF_UNIX allows (108 bytes on Linux): the error Python raises
    names no path; listen() and connect() raise it as a plain OSError (no errno, as
    Python's) that does."""
    address = "unix:///tmp/" + "x" * 200 + "/s.sock"
    with pytest.raises(OSError) as info:
        async with anyio_comm.listen(address, echo):
            pass
    assert type(info.value) is OSError and info.value.errno is None
    assert str(info.value) == f"AF_UNIX path too long (listening on {address})"
    with pytest.raises(OSError) as info:
        await anyio_comm.connect(address)
    assert type(info.value) is OSError and info.value.errno is None
    assert str(info.value) == f"AF_UNIX path too long (connecting to {address})"
