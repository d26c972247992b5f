"""from_stream over arbitrary AnyIO byte streams."""

from __future__ import annotations

import anyio
import pytest
from anyio.abc import SocketAttribute

from anyio_comm import Comm, RemoteProtocolError, from_stream
from anyio_comm.testing import memory_byte_stream_pair


class _NoHalfClose(anyio.abc.ByteStream):
    """A byte stream without half-close, like anyio's TLSStream."""

    def __init__(self, inner: anyio.abc.ByteStream) -> None:
        self.inner = inner

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self.inner.receive(max_bytes)

    async def send(self, item: bytes) -> None:
        await self.inner.send(item)

    async def send_eof(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_send_eof_unsupported_leaves_comm_usable() -> None:
    a, b = memory_byte_stream_pair()
    comms: dict[str, Comm] = {}

    async def open_one(stream: anyio.abc.ByteStream, name: str) -> None:
        comms[name] = await from_stream(stream, local_address=name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(open_one, _NoHalfClose(a), "client")
        tg.start_soon(open_one, b, "server")
    client, server = comms["client"], comms["server"]
    async with client, server:
        with pytest.raises(NotImplementedError):
            await client.send_eof()
        await client.send("still works")
        assert await server.receive() == "still works"


async def test_from_stream_handshake_timeout() -> None:
    a, b = memory_byte_stream_pair()
    async with b:
        with pytest.raises(TimeoutError):
            await from_stream(a, handshake_timeout=0.1)  # nobody answers


async def test_memory_stream_pair_is_bounded_and_copies() -> None:
    a, b = memory_byte_stream_pair(max_chunks=2, chunk_size=4)
    async with a, b:
        data = bytearray(b"12345678")
        await a.send(data)  # two chunks fit
        data[:] = b"xxxxxxxx"  # the sender may reuse its buffer at once
        with anyio.move_on_after(0.1) as scope:
            await a.send(b"more")  # a third chunk does not
        assert scope.cancelled_caught
        assert await b.receive() == b"1234"
        assert await b.receive(2) == b"56"
        assert await b.receive() == b"78"
        await a.send_eof()
        with pytest.raises(anyio.EndOfStream):
            await b.receive()


def test_memory_stream_pair_validation() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        memory_byte_stream_pair(max_chunks=0)


@pytest.mark.parametrize("ending", ["timeout", "cancelled", "bad peer"])
async def test_from_stream_closes_the_stream_when_setup_fails(ending: str) -> None:
    """The comm owns the stream from the start: a failed or cancelled handshake closes
    it (an AnyIO socket stream has no synchronous close, so this needs an aclose)."""
    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(SocketAttribute.local_port)
        accepted: list[anyio.abc.SocketStream] = []

        async def accept() -> None:
            peer = await listener.listeners[0].accept()  # type: ignore[attr-defined]
            accepted.append(peer)
            if ending == "bad peer":
                await peer.send(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        async with anyio.create_task_group() as tg:
            tg.start_soon(accept)
            stream = await anyio.connect_tcp("127.0.0.1", port)
        sock = stream.extra(SocketAttribute.raw_socket)
        async with accepted[0]:
            if ending == "timeout":
                with pytest.raises(TimeoutError, match="handshake_timeout"):
                    await from_stream(stream, handshake_timeout=0.1)
            elif ending == "bad peer":
                with anyio.fail_after(10), pytest.raises(RemoteProtocolError):
                    await from_stream(stream)
            else:
                with anyio.move_on_after(0.1) as scope:
                    await from_stream(stream)
                assert scope.cancelled_caught
            assert sock.fileno() == -1  # closed
