"""The socket transport's promises, observed on real sockets."""

from __future__ import annotations

import gc
import socket
import warnings

import anyio
import pytest
from anyio import wait_all_tasks_blocked
from anyio.abc import SocketAttribute

import anyio_comm
from anyio_comm._transports.rawsocket import IOV_MAX, SocketTransport

from .certs import client_context, server_context
from .helpers import connected_pair


async def test_large_frames_are_received_into_their_own_buffer() -> None:
    allocated: list[bytearray] = []

    def allocator(n: int) -> bytearray:
        allocated.append(bytearray(n))
        return allocated[-1]

    async with connected_pair("tcp", allocator=allocator) as (client, server):
        transport = server._transport
        assert isinstance(transport, SocketTransport)
        direct = 0
        original = transport.receive_into_nowait

        def spy(buffer: memoryview) -> int | None:
            nonlocal direct
            n = original(buffer)
            if n and allocated and buffer.obj is allocated[-1]:
                direct += n
            return n

        transport.receive_into_nowait = spy  # type: ignore[method-assign]
        payload = bytes(range(256)) * 40_000  # 10 MB
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames, [payload])
            (frame,) = await server.receive_frames()
        assert frame.obj is allocated[-1]
        assert frame == payload
        # all but at most one read-ahead buffer's worth went straight into the frame
        assert direct >= len(payload) - 65536


async def test_more_buffers_than_iov_max_and_partial_sends() -> None:
    frames = [bytes([i % 256]) * 3000 for i in range(IOV_MAX * 3 + 7)]
    async with connected_pair("tcp") as (client, server):
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send_frames, frames)
            received = await server.receive_frames()
        assert [bytes(f) for f in received] == frames


async def test_idle_reader_is_unregistered(anyio_backend_name: str) -> None:
    if anyio_backend_name != "asyncio":
        pytest.skip("the persistent reader registration is asyncio/uvloop only")
    async with connected_pair("tcp") as (client, server):
        transport = server._transport
        assert isinstance(transport, SocketTransport)
        reader = transport._reader
        assert reader is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.receive)
            await wait_all_tasks_blocked()
            assert reader._registered  # waiting: registered
            await client.send("first")
        assert reader._registered  # kept across waits
        await client.send("nobody is receiving this yet")
        with anyio.fail_after(5):  # a level-triggered wake-up with no waiter...
            while reader._registered:  # ...drops the registration: no busy loop
                await anyio.sleep(0.01)
        assert await server.receive() == "nobody is receiving this yet"
        await client.send("again")
        assert await server.receive() == "again"


async def test_loop_without_add_reader_falls_back(anyio_backend_name: str) -> None:
    if anyio_backend_name != "asyncio":
        pytest.skip("the fallback replaces the asyncio reader registration")

    class NoAddReader:
        """Stands in for a loop whose add_reader() raises, like Windows' proactor."""

        async def wait(self) -> None:
            raise NotImplementedError

        def close(self) -> None:
            pass

    async with connected_pair("tcp") as (client, server):
        transport = server._transport
        assert isinstance(transport, SocketTransport)
        assert transport._reader is not None
        transport._reader.close()
        transport._reader = NoAddReader()  # type: ignore[assignment]
        async with anyio.create_task_group() as tg:
            tg.start_soon(client.send, "via the fallback")
            assert await server.receive() == "via the fallback"
        assert transport._reader is None
        async with anyio.create_task_group() as tg:

            async def close_when_blocked() -> None:
                await wait_all_tasks_blocked()
                await server.aclose()

            tg.start_soon(close_when_blocked)
            with anyio.fail_after(5), pytest.raises(anyio.ClosedResourceError):
                await server.receive()


@pytest.mark.parametrize("transport", ["tcp", "tls1.3"])
async def test_comm_dropped_without_closing_frees_its_descriptor_number(transport: str) -> None:
    """A comm garbage-collected without ``aclose()`` leaves no registration behind:
    later connections given the same file descriptor number work."""

    async def echo(comm: anyio_comm.Comm) -> None:
        async for message in comm:
            await comm.send(message)

    tls = transport != "tcp"
    address = f"{'tls' if tls else 'tcp'}://127.0.0.1:0"
    server_options = {"ssl_context": server_context()} if tls else {}
    client_options = {"ssl_context": client_context()} if tls else {}
    async with anyio_comm.listen(address, echo, **server_options) as listener:
        dropped = await anyio_comm.connect(listener.address, timeout=10, **client_options)
        await dropped.send("first")
        with anyio.fail_after(10):
            assert await dropped.receive() == "first"  # waited: the reader is registered
        fd = dropped.extra(SocketAttribute.raw_socket).fileno()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # the unclosed socket
            del dropped
            gc.collect()
        reused = False
        for i in range(3):
            with anyio.fail_after(10):
                comm = await anyio_comm.connect(listener.address, timeout=10, **client_options)
                async with comm:
                    reused |= comm.extra(SocketAttribute.raw_socket).fileno() == fd
                    await comm.send(i)
                    assert await comm.receive() == i
    if not reused:
        pytest.skip(f"descriptor {fd} was not given to a later connection")


async def test_socket_transport_is_an_anyio_socket_stream() -> None:
    """The transport is an AnyIO SocketStream: the byte-stream methods work, and its
    socket attributes are AnyIO's own."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener:
        port = listener.extra(SocketAttribute.local_port)
        accepted: list[anyio.abc.SocketStream] = []

        async def accept() -> None:
            accepted.append(await listener.listeners[0].accept())  # type: ignore[attr-defined]

        async with anyio.create_task_group() as tg:
            tg.start_soon(accept)
            sock = socket.create_connection(("127.0.0.1", port))
        transport = SocketTransport(sock)
        async with transport, accepted[0] as peer:
            assert isinstance(transport, anyio.abc.SocketStream)
            assert transport.extra(SocketAttribute.remote_port) == port
            assert transport.extra(SocketAttribute.raw_socket) is sock
            await transport.send(b"ping")
            assert await peer.receive() == b"ping"
            await peer.send(b"pong")
            assert await transport.receive(100) == b"pong"
            await peer.send_eof()
            with pytest.raises(anyio.EndOfStream):
                await transport.receive()
