"""Protocol version 2 on live connections, on every backend: capabilities in the
preamble, close records, the pickle capability, and interoperation with a version-1
peer (``tests/v1peer.py``, written from the version-1 specification alone)."""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import msgpack
import pytest
from anyio import BrokenResourceError, EndOfStream
from anyio.streams.tls import TLSStream

import anyio_comm
from anyio_comm import (
    Capability,
    CloseCode,
    CloseReason,
    Comm,
    Handshake,
    Limits,
    PeerClosed,
    PeerClosedError,
    PeerClosedOK,
    RemoteProtocolError,
    SerializationError,
)
from anyio_comm._sansio.close import encode_close_record, parse_close_record
from anyio_comm._sansio.connection import Connection
from anyio_comm._sansio.decoder import EndOfData, FrameDecoder
from anyio_comm._sansio.wire import encode_header, encode_preamble
from anyio_comm.testing import memory_byte_stream_pair

from .certs import client_context, server_context
from .helpers import ADDRESS_TRANSPORTS, TLS_VERSIONS, TRANSPORTS, connected_pair, listen_address
from .v1peer import V1Peer

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

CLOSE_ONLY = frozenset({Capability.CLOSE_REASONS})
#: the transports a raw peer reaches through a TCP socket
RAW_KINDS = ["tcp", "tls1.2", "tls1.3"]
REASONS = [
    CloseReason(CloseCode.HANDLER_ERROR, "ValueError", "bad input"),
    CloseReason(CloseCode.GOING_AWAY, "", "restarting"),
    CloseReason(0xC123, "app-error", "é" * 10),
    CloseReason(0x4001),
]


def client_options(kind: str) -> dict[str, Any]:
    return {"ssl_context": client_context(TLS_VERSIONS[kind])} if kind in TLS_VERSIONS else {}


def server_options(kind: str) -> dict[str, Any]:
    return {"ssl_context": server_context(TLS_VERSIONS[kind])} if kind in TLS_VERSIONS else {}


@dataclasses.dataclass
class Point:
    """Not msgpack-serializable: travels pickled, where pickle is agreed."""

    x: int
    y: int


# -- capabilities -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_capabilities_are_announced_and_read(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        for comm in (client, server):
            assert comm.peer_handshake == Handshake(2, Limits(), CLOSE_ONLY)
    async with connected_pair(kind, allow_pickle=True) as (client, server):
        both = frozenset({Capability.CLOSE_REASONS, Capability.PICKLE})
        assert client.peer_handshake.capabilities == both
        assert server.peer_handshake.capabilities == both
        await client.send({"p": Point(1, 2)})
        assert await server.receive() == {"p": Point(1, 2)}


@asynccontextmanager
async def stream_pair(
    client_options: dict[str, Any], server_options: dict[str, Any]
) -> AsyncIterator[tuple[Comm, Comm]]:
    """Two comms with options of their own, over a memory byte stream."""
    a, b = memory_byte_stream_pair()
    comms: dict[str, Comm] = {}

    async def open_one(name: str, stream: Any, options: dict[str, Any]) -> None:
        comms[name] = await anyio_comm.from_stream(stream, **options)

    async with anyio.create_task_group() as tg:
        tg.start_soon(open_one, "client", a, client_options)
        tg.start_soon(open_one, "server", b, server_options)
    async with comms["client"], comms["server"]:
        yield comms["client"], comms["server"]


async def test_pickle_only_towards_a_peer_that_accepts_it() -> None:
    """A side with allow_pickle sends nothing pickled to a version-2 peer that did
    not announce PICKLE: the send fails before anything is written, and the comm
    stays usable; the other way, msgpack values flow as usual."""
    async with stream_pair({"allow_pickle": True}, {}) as (client, server):
        assert client.peer_handshake.capabilities == CLOSE_ONLY
        assert Capability.PICKLE in server.peer_handshake.capabilities
        with pytest.raises(SerializationError, match="does not accept pickled objects"):
            await client.send({"p": Point(1, 2)})
        await client.send({"p": [1, 2]})
        assert await server.receive() == {"p": [1, 2]}
        await server.send("fine")
        assert await client.receive() == "fine"


# -- close records ----------------------------------------------------------------------


@pytest.mark.parametrize("reason", REASONS, ids=lambda reason: f"{reason.code:#06x}")
@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_close_reason_reaches_the_peer(kind: str, reason: CloseReason) -> None:
    """Every message sent before the close record is received, then the reason: a
    PeerClosedOK (an EndOfStream) for a clean code, a PeerClosedError (a
    BrokenResourceError) for an error code; both are final, and a send after it
    fails."""
    async with connected_pair(kind) as (client, server):

        async def send_then_close() -> None:
            await server.send("one")
            await server.send_frames([b"\x07" * 300_000])
            await server.aclose(reason)

        expected = PeerClosedOK if reason.clean else PeerClosedError
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send_then_close)
                assert await client.receive() == "one"
                frames = await client.receive_frames()
                assert [bytes(frame) for frame in frames] == [b"\x07" * 300_000]
                with pytest.raises(expected) as info:
                    await client.receive()
        assert server.closed
        assert info.value.reason == reason
        assert isinstance(info.value, EndOfStream if reason.clean else BrokenResourceError)
        assert client.peer_close_reason == reason
        assert str(reason) in str(info.value)
        with pytest.raises(expected):
            await client.receive_frames()
        with pytest.raises(PeerClosedError):
            await client.send("too late")
        assert client.closed and client.receive_ended


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_clean_close_ends_iteration_quietly(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        for i in range(3):
            await server.send(i)
        await server.aclose(CloseReason(CloseCode.NORMAL, "", "done"))
        with anyio.fail_after(10):
            assert [message async for message in client] == [0, 1, 2]
        assert client.peer_close_reason == CloseReason(CloseCode.NORMAL, "", "done")


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_close_without_reason_is_an_end_of_stream(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        await server.send("last")
        await server.aclose()
        with anyio.fail_after(10):
            assert await client.receive() == "last"
            with pytest.raises(EndOfStream) as info:
                await client.receive()
        assert not isinstance(info.value, PeerClosed)
        assert client.peer_close_reason is None


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_a_protocol_error_is_told_to_the_peer(kind: str) -> None:
    async with connected_pair(kind) as (client, server):
        await client.send_frames([b"\xc1"])  # not MessagePack
        with anyio.fail_after(10):
            with pytest.raises(RemoteProtocolError):
                await server.receive()
            with pytest.raises(PeerClosedError) as info:
                await client.receive()
        reason = info.value.reason
        assert reason.code is CloseCode.PROTOCOL_ERROR
        assert reason.name == "message-layer"
        assert "malformed message body" in reason.text


@pytest.mark.parametrize("kind", [*ADDRESS_TRANSPORTS, *TLS_VERSIONS])
async def test_an_idle_timeout_is_told_to_the_peer(kind: str) -> None:
    """The listener's idle_timeout closes a quiet connection between messages: a
    clean close (IDLE_TIMEOUT) at the client, which has no idle timeout itself."""
    timed_out: list[BaseException] = []

    async def handler(comm: Comm) -> None:
        try:
            while True:
                await comm.send(await comm.receive())
        except anyio_comm.IdleTimeoutError as exc:
            timed_out.append(exc)

    server_ssl = (
        {"ssl_context": server_context(TLS_VERSIONS[kind])} if kind in TLS_VERSIONS else {}
    )
    client_ssl = (
        {"ssl_context": client_context(TLS_VERSIONS[kind])} if kind in TLS_VERSIONS else {}
    )
    async with (
        listen_address(kind) as address,
        anyio_comm.listen(address, handler, idle_timeout=0.2, **server_ssl) as listener,
    ):
        async with await anyio_comm.connect(listener.address, **client_ssl) as comm:
            await comm.send("ping")
            with anyio.fail_after(10):
                assert await comm.receive() == "ping"
                with pytest.raises(PeerClosedOK) as info:
                    await comm.receive()
    assert info.value.reason == CloseReason(
        CloseCode.IDLE_TIMEOUT, "", "nothing received for 0.2 s"
    )
    assert len(timed_out) == 1


@asynccontextmanager
async def raw_connection(kind: str, port: int) -> AsyncIterator[anyio.abc.ByteStream]:
    """A plain (or TLS) byte stream to 127.0.0.1:``port``; TLS ends with close_notify."""
    stream: anyio.abc.ByteStream = await anyio.connect_tcp("127.0.0.1", port)
    if kind in TLS_VERSIONS:
        stream = await TLSStream.wrap(
            stream, ssl_context=client_context(TLS_VERSIONS[kind]), hostname="localhost"
        )
    async with stream:
        yield stream


async def read_to_end(stream: anyio.abc.ByteStream) -> bytearray:
    """Every byte ``stream`` receives until its end, within 10 s."""
    received = bytearray()
    with anyio.fail_after(10):
        try:
            while True:
                received += await stream.receive()
        except EndOfStream:
            pass
    return received


def port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


@pytest.mark.parametrize("kind", RAW_KINDS)
async def test_a_header_over_the_limits_is_told_to_the_peer(kind: str) -> None:
    """A raw version-2 client that announces CLOSE_REASONS sends a header over the
    listener's max_frames: it reads the listener's preamble, then exactly the close
    record LIMIT_EXCEEDED, max_frames, then the end of the stream."""
    limits = Limits(max_frames=4)
    ssl = {"ssl_context": server_context(TLS_VERSIONS[kind])} if kind in TLS_VERSIONS else {}
    async with (
        listen_address(kind) as address,
        anyio_comm.listen(address, lambda comm: comm.receive(), limits=limits, **ssl) as listener,
        raw_connection(kind, port_of(listener.address)) as stream,
    ):
        await stream.send(encode_preamble(Limits(), CLOSE_ONLY) + encode_header([1] * 5))
        received = await read_to_end(stream)
    preamble = encode_preamble(limits, CLOSE_ONLY)
    assert bytes(received[: len(preamble)]) == preamble
    text = "message has 5 frames; the limit is 4"
    record = encode_close_record(CloseReason(CloseCode.LIMIT_EXCEEDED, "max_frames", text))
    assert bytes(received[len(preamble) :]) == record


@pytest.mark.parametrize("kind", RAW_KINDS)
async def test_a_malformed_close_record_is_answered_as_a_protocol_error(kind: str) -> None:
    """Spec 7.2: a close record whose text_length is over 1024 is a protocol error, which
    its receiver answers as any (section 8): the record PROTOCOL_ERROR, wire-format, then
    the end of the stream; not the silence a well-formed record gets."""
    ssl = {"ssl_context": server_context(TLS_VERSIONS[kind])} if kind in TLS_VERSIONS else {}
    async with (
        listen_address(kind) as address,
        anyio_comm.listen(address, lambda comm: comm.receive(), **ssl) as listener,
        raw_connection(kind, port_of(listener.address)) as stream,
    ):
        # FF FF FF FF, code NORMAL, an empty name, text_length 1025
        record = bytes.fromhex("ffffffff 0000 00 0401")
        await stream.send(encode_preamble(Limits(), CLOSE_ONLY) + record)
        received = await read_to_end(stream)
    preamble = encode_preamble(Limits(), CLOSE_ONLY)
    assert bytes(received[: len(preamble)]) == preamble
    parsed = parse_close_record(received, len(preamble), len(received))
    assert parsed is not None
    reason, end = parsed
    assert end == len(received)
    assert (reason.code, reason.name) == (CloseCode.PROTOCOL_ERROR, "wire-format")


#: a close record's name and text as a hostile peer may send them
HOSTILE_NAME = "rule\x00\x1b[31m"
HOSTILE_TEXT = "\x00\x1b[2J\x1b]0;title\x07\r\nforged line\u202e"


def assert_shown_escaped(shown: str) -> None:
    """``shown`` (lines of text) has the hostile reason's characters escaped, none of
    them raw."""
    for line in shown.splitlines():
        assert line.isprintable(), repr(line)
    assert "rule\\x00\\x1b[31m" in shown
    assert "\\x00\\x1b[2J\\x1b]0;title\\x07\\r\\nforged line\\u202e" in shown


@pytest.mark.parametrize("kind", RAW_KINDS)
async def test_a_peers_close_reason_is_shown_escaped(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A raw peer's close record holds NUL, terminal escape sequences, a line break and
    a bidirectional override: the PeerClosedError's message and the listener's log
    lines show them escaped, while the exception's reason keeps the exact text."""
    caught: list[PeerClosedError] = []

    async def handler(comm: Comm) -> None:
        try:
            await comm.receive()
        except PeerClosedError as exc:
            caught.append(exc)
            raise RuntimeError("the upstream peer went away") from exc

    reason = CloseReason(0xC001, HOSTILE_NAME, HOSTILE_TEXT)
    context = server_context(TLS_VERSIONS[kind]) if kind in TLS_VERSIONS else None
    with caplog.at_level(logging.DEBUG, logger="anyio_comm"):
        async with (
            listen_address(kind) as address,
            anyio_comm.listen(address, handler, ssl_context=context) as listener,
            raw_connection(kind, port_of(listener.address)) as stream,
        ):
            await stream.send(encode_preamble(Limits(), CLOSE_ONLY) + encode_close_record(reason))
            await read_to_end(stream)
    (exc,) = caught
    assert exc.reason == reason  # the exact text, for a program that wants it
    assert_shown_escaped(str(exc))
    logged = [r for r in caplog.records if r.name == "anyio_comm" and r.exc_info]
    assert logged, caplog.text
    assert_shown_escaped(caplog.text)


def test_a_close_reason_is_shown_escaped() -> None:
    """str() of a reason escapes what is not printable in its name and text; the
    fields, and the decoder's end of data, keep the record's exact text."""
    reason = CloseReason(CloseCode.PROTOCOL_ERROR, HOSTILE_NAME, HOSTILE_TEXT)
    assert_shown_escaped(str(reason))
    assert str(reason).startswith("PROTOCOL_ERROR (")
    assert str(CloseReason(CloseCode.NORMAL, "", "é and 日本")) == "NORMAL (é and 日本)"
    decoder = FrameDecoder(capabilities=CLOSE_ONLY)
    decoder.feed(encode_preamble(Limits(), CLOSE_ONLY) + encode_close_record(reason))
    assert decoder.next_handshake() is not None
    with pytest.raises(EndOfData) as info:
        decoder.next_message()
    assert info.value.reason == reason
    assert (info.value.reason.name, info.value.reason.text) == (HOSTILE_NAME, HOSTILE_TEXT)
    assert_shown_escaped(str(info.value))
    assert_shown_escaped(str(PeerClosed.of(reason)))


@pytest.mark.parametrize("kind", ["tcp", "unix", "inproc", "tls1.3"])
async def test_a_listener_tells_why_it_closes(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """A handler's exception: HANDLER_ERROR with the class name and message; the
    listener's shutdown: GOING_AWAY, to a client waiting in receive()."""

    async def handler(comm: Comm) -> None:
        async for message in comm:
            if message == "fail":
                raise KeyError("no such key")
            await comm.send(message)

    server_ssl = {"ssl_context": server_context()} if kind in TLS_VERSIONS else {}
    client_ssl = {"ssl_context": client_context()} if kind in TLS_VERSIONS else {}
    with caplog.at_level(logging.CRITICAL, logger="anyio_comm"):
        async with listen_address(kind) as address:
            async with anyio_comm.listen(address, handler, **server_ssl) as listener:
                async with await anyio_comm.connect(listener.address, **client_ssl) as comm:
                    await comm.send("fail")
                    with anyio.fail_after(10), pytest.raises(PeerClosedError) as info:
                        await comm.receive()
                assert info.value.reason == CloseReason(
                    CloseCode.HANDLER_ERROR, "KeyError", "'no such key'"
                )
                async with await anyio_comm.connect(listener.address, **client_ssl) as comm:
                    await comm.send("echo")
                    assert await comm.receive() == "echo"
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(listener.shutdown, 5)
                        with anyio.fail_after(10), pytest.raises(PeerClosedOK) as info:
                            await comm.receive()
                    assert info.value.reason.code is CloseCode.GOING_AWAY


async def test_a_handler_error_message_is_cut_to_fit() -> None:
    async def handler(comm: Comm) -> None:
        await comm.receive()
        raise RuntimeError("x" * 5000)

    async with anyio_comm.listen("tcp://127.0.0.1:0", handler) as listener:
        async with await anyio_comm.connect(listener.address) as comm:
            await comm.send("go")
            with anyio.fail_after(10), pytest.raises(PeerClosedError) as info:
                await comm.receive()
    reason = info.value.reason
    assert reason.name == "RuntimeError"
    assert reason.text == "x" * 1021 + "..."


# -- a version-1 peer -------------------------------------------------------------------


@pytest.mark.parametrize("kind", RAW_KINDS)
async def test_a_version_1_client_of_a_listener(kind: str) -> None:
    """The listener speaks version 1 to a version-1 client: it reads the client's
    preamble as version 1, echoes, and when its handler fails it closes with the end
    of the stream, never a close record the client cannot parse."""
    handshakes: list[Handshake] = []

    async def handler(comm: Comm) -> None:
        handshakes.append(comm.peer_handshake)
        async for message in comm:
            if message == "fail":
                raise ValueError("nothing to say to a version-1 peer")
            await comm.send(message)

    ssl = {"ssl_context": server_context(TLS_VERSIONS[kind])} if kind in TLS_VERSIONS else {}
    async with (
        listen_address(kind) as address,
        anyio_comm.listen(address, handler, **ssl) as listener,
        raw_connection(kind, port_of(listener.address)) as stream,
    ):
        peer = V1Peer(stream)
        with anyio.fail_after(10):
            version, limits, rest = await peer.handshake()
            assert (version, limits) == (2, (16_384, 2**30, 2**31))
            assert rest == struct.pack("!HH", Capability.CLOSE_REASONS, 0)  # ignored by it
            await peer.send_frames([msgpack.packb({"hello": [1, 2]})])
            assert await peer.receive_frames() == [msgpack.packb({"hello": [1, 2]})]
            await peer.send_frames([msgpack.packb("fail")])
            assert await peer.receive_frames() is None  # a clean end, nothing else
    assert handshakes == [Handshake(1, Limits())]


class V1Server:
    """A version-1 echo server (tests/v1peer.py) on 127.0.0.1, over TLS for the TLS
    kinds: what it received, and whether its client ended the stream cleanly."""

    def __init__(self, kind: str) -> None:
        self.ssl_context = server_context(TLS_VERSIONS[kind]) if kind in TLS_VERSIONS else None
        self.received: list[list[bytes]] = []
        self.ended_cleanly = anyio.Event()
        self.address = ""

    async def serve_one(self, stream: anyio.abc.ByteStream) -> None:
        if self.ssl_context is not None:
            stream = await TLSStream.wrap(stream, server_side=True, ssl_context=self.ssl_context)
        async with stream:
            peer = V1Peer(stream)
            await peer.handshake()
            while (frames := await peer.receive_frames()) is not None:
                self.received.append(frames)
                await peer.send_frames(frames)  # echo
        self.ended_cleanly.set()


@asynccontextmanager
async def v1_server(kind: str) -> AsyncIterator[V1Server]:
    server = V1Server(kind)
    multi = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with multi, anyio.create_task_group() as tg:
        tg.start_soon(multi.serve, server.serve_one)
        port = multi.extra(anyio.abc.SocketAttribute.local_port)
        scheme = "tls" if server.ssl_context is not None else "tcp"
        server.address = f"{scheme}://127.0.0.1:{port}"
        yield server
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("kind", RAW_KINDS)
async def test_connect_to_a_version_1_server(kind: str) -> None:
    """connect() to a version-1 server: version 1, no capabilities; messages flow,
    pickle is used as configured (agreed outside the protocol), and a close with a
    reason reaches the server as the plain end of the stream."""
    async with v1_server(kind) as server:
        with anyio.fail_after(10):
            comm = await anyio_comm.connect(
                server.address, allow_pickle=True, **client_options(kind)
            )
            assert comm.peer_handshake == Handshake(1, Limits())
            await comm.send({"p": Point(3, 4), "data": b"z" * 10_000})
            echoed = await comm.receive()
            assert echoed["p"] == Point(3, 4) and bytes(echoed["data"]) == b"z" * 10_000
            await comm.aclose(CloseReason(CloseCode.HANDLER_ERROR, "X", "not for v1"))
            await server.ended_cleanly.wait()
    assert len(server.received) == 1


async def test_a_version_1_peer_never_gets_a_close_record() -> None:
    """Over a memory stream, a comm closing with a reason, or for a protocol error,
    sends a version-1 peer nothing after its last message."""
    for closing in ("reason", "protocol-error"):
        a, b = memory_byte_stream_pair()
        peer = V1Peer(b)
        async with anyio.create_task_group() as tg:
            tg.start_soon(peer.handshake)
            comm = await anyio_comm.from_stream(a)
        async with b, comm:
            assert comm.peer_handshake == Handshake(1, Limits())
            await comm.send("bye")
            if closing == "reason":
                await comm.aclose(CloseReason(CloseCode.HANDLER_ERROR))
            else:
                await peer.send_frames([b"\xc1"])
                with pytest.raises(RemoteProtocolError):
                    await comm.receive()
            with anyio.fail_after(10):
                assert await peer.receive_frames() == [msgpack.packb("bye")]
                if closing == "reason":  # a graceful close, as in version 1
                    assert await peer.receive_frames() is None
                else:  # an abort (a reset), as in version 1
                    with pytest.raises(BrokenResourceError):
                        await peer.receive_frames()


# -- the sans-IO rules behind them --------------------------------------------------------


def test_close_records_only_to_a_peer_that_accepts_them() -> None:
    from anyio_comm import LocalProtocolError
    from anyio_comm._sansio.connection import ConnectionState

    conn = Connection()
    with pytest.raises(LocalProtocolError, match="preamble"):
        conn.close_record(CloseReason(CloseCode.NORMAL))
    conn.receive_data(encode_preamble(Limits()))  # version 2, no capabilities
    assert conn.next_handshake() == Handshake(2, Limits())
    with pytest.raises(LocalProtocolError, match="close records"):
        conn.close_record(CloseReason(CloseCode.NORMAL))
    assert conn.our_state is ConnectionState.OPEN
    conn = Connection()
    conn.receive_data(encode_preamble(Limits(), CLOSE_ONLY))
    assert conn.next_handshake() is not None
    record = conn.close_record(CloseReason(CloseCode.GOING_AWAY))
    assert record == bytes.fromhex("ffffffff 0001 00 0000")
    assert conn.our_state is ConnectionState.CLOSED
    with pytest.raises(LocalProtocolError):
        conn.send_message([memoryview(b"x")])


def test_a_side_that_did_not_announce_close_reasons_reads_no_record() -> None:
    decoder = FrameDecoder(capabilities=frozenset())
    decoder.feed(encode_preamble(Limits(), CLOSE_ONLY))
    assert decoder.next_handshake() is not None
    decoder.feed(encode_close_record(CloseReason(CloseCode.NORMAL)))
    with pytest.raises(RemoteProtocolError, match="frames") as info:
        decoder.next_message()
    assert info.value.rule == "max_frames"


def test_close_records_even_over_the_largest_frame_count() -> None:
    """With max_frames 2^32 - 1, FF FF FF FF is still a close record."""
    decoder = FrameDecoder(Limits(max_frames=2**32 - 1), capabilities=CLOSE_ONLY)
    decoder.feed(encode_preamble(Limits()) + encode_close_record(CloseReason(7, "n", "t")))
    assert decoder.next_handshake() is not None
    with pytest.raises(EndOfData) as info:
        decoder.next_message()
    assert info.value.reason == CloseReason(7, "n", "t")
    assert info.value.reason.clean  # bit 15 clear, though no code of the spec


def test_close_reason_checks() -> None:
    assert CloseReason(0x8003).code is CloseCode.HANDLER_ERROR
    assert CloseReason(0x4000).clean and not CloseReason(0xC000).clean
    assert str(CloseReason(0xC001, "a", "b")) == "code 0xc001 (a: b)"
    assert str(CloseReason(CloseCode.NORMAL)) == "NORMAL"
    with pytest.raises(ValueError, match="between 0 and 65535"):
        CloseReason(65536)
    with pytest.raises(ValueError, match="text is 1025 bytes"):
        CloseReason(0, "", "t" * 1025)
    with pytest.raises(ValueError, match="name is 256 bytes"):
        CloseReason(0, "n" * 256)
    with pytest.raises(TypeError):
        CloseReason(True)
    with pytest.raises(TypeError):
        CloseReason(0, b"name")  # type: ignore[arg-type]
    cut = CloseReason.shortened(CloseCode.HANDLER_ERROR, "N" * 300, "é" * 600)
    assert len(cut.name.encode()) <= 255 and cut.name.endswith("...")
    assert len(cut.text.encode()) <= 1024 and cut.text.endswith("...")


# -- early data -------------------------------------------------------------------------


async def echo(comm: Comm) -> None:
    async for message in comm:
        await comm.send(message)


@pytest.mark.parametrize("kind", [*ADDRESS_TRANSPORTS, *TLS_VERSIONS])
async def test_early_data_round_trips(kind: str) -> None:
    """connect(early_data=True) to a listener: requests sent at once are answered in
    order, and the server's preamble is known after the first receive."""
    seen: list[Handshake] = []

    async def handler(comm: Comm) -> None:
        seen.append(comm.peer_handshake)
        await echo(comm)

    async with (
        listen_address(kind) as address,
        anyio_comm.listen(address, handler, **server_options(kind)) as listener,
    ):
        with anyio.fail_after(10):
            options = client_options(kind)
            comm = await anyio_comm.connect(listener.address, early_data=True, **options)
            async with comm:
                for i in range(3):
                    await comm.send({"i": i, "data": bytes(5000)})
                for i in range(3):
                    reply = await comm.receive()
                    assert reply["i"] == i and bytes(reply["data"]) == bytes(5000)
                assert comm.handshake_complete
                assert comm.peer_handshake == Handshake(2, Limits(), CLOSE_ONLY)
    assert seen == [Handshake(2, Limits(), CLOSE_ONLY)]


@pytest.mark.parametrize("kind", RAW_KINDS)
async def test_early_data_goes_before_the_servers_preamble(kind: str) -> None:
    """A server that sends its preamble only once it has the client's first message:
    with early_data the client's request goes out anyway (without it, connect would
    wait for that preamble, and both sides would wait for each other)."""
    ssl_context = server_context(TLS_VERSIONS[kind]) if kind in TLS_VERSIONS else None

    async def preamble_after_first_message(stream: anyio.abc.ByteStream) -> None:
        if ssl_context is not None:
            stream = await TLSStream.wrap(stream, server_side=True, ssl_context=ssl_context)
        async with stream:
            conn = Connection()
            first = None
            while first is None:
                conn.receive_data(await stream.receive())
                if conn.peer is None and conn.next_handshake() is None:
                    continue
                first = conn.next_message()
            reply = [bytes(buffer) for buffer in conn.send_message(first)]
            await stream.send(conn.preamble() + b"".join(reply))
            await stream.receive()  # until the client closes

    multi = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with multi, anyio.create_task_group() as tg:
        tg.start_soon(multi.serve, preamble_after_first_message)
        port = multi.extra(anyio.abc.SocketAttribute.local_port)
        scheme = "tls" if ssl_context is not None else "tcp"
        with anyio.fail_after(10):
            comm = await anyio_comm.connect(
                f"{scheme}://127.0.0.1:{port}", early_data=True, **client_options(kind)
            )
            async with comm:
                assert not comm.handshake_complete
                with pytest.raises(RuntimeError, match="has not arrived"):
                    comm.peer_handshake  # noqa: B018
                await comm.send("first")
                assert await comm.receive() == "first"
                assert comm.peer_handshake == Handshake(2, Limits(), CLOSE_ONLY)
        tg.cancel_scope.cancel()


async def test_early_data_over_the_limits_is_refused_by_the_server() -> None:
    """Early messages are not checked against the server's limits (unknown yet): the
    server refuses one over them and says so in a close record."""
    async with anyio_comm.listen(
        "tcp://127.0.0.1:0", echo, limits=Limits(max_message_size=1000)
    ) as listener:
        comm = await anyio_comm.connect(listener.address, early_data=True)
        async with comm:
            await comm.send_frames([bytes(2000)])  # sent: the limits are not known yet
            with anyio.fail_after(10), pytest.raises(PeerClosedError) as info:
                await comm.receive()
            assert info.value.reason.code is CloseCode.LIMIT_EXCEEDED
            assert info.value.reason.name == "max_message_size"
        # once the preamble arrived, the limits are checked before sending
        comm = await anyio_comm.connect(listener.address, early_data=True)
        async with comm:
            await comm.send("ping")
            assert await comm.receive() == "ping"
            with pytest.raises(anyio_comm.LocalProtocolError):
                await comm.send_frames([bytes(2000)])


async def test_early_data_pickles_nothing_before_the_preamble() -> None:
    async with anyio_comm.listen("tcp://127.0.0.1:0", echo, allow_pickle=True) as listener:
        comm = await anyio_comm.connect(listener.address, early_data=True, allow_pickle=True)
        async with comm:
            with pytest.raises(SerializationError):
                await comm.send(Point(1, 2))
            await comm.send("ping")
            assert await comm.receive() == "ping"
            await comm.send(Point(1, 2))  # the server accepts pickle: now it may
            assert await comm.receive() == Point(1, 2)


async def test_early_data_errors_come_at_the_first_receive() -> None:
    """What connect() would have raised: a server that speaks another protocol, or
    none whose preamble comes within handshake_timeout."""

    async def not_anyio_comm(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            await stream.send(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await anyio.sleep(5)

    async def silent(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            await anyio.sleep(5)

    for server, expected in ((not_anyio_comm, RemoteProtocolError), (silent, TimeoutError)):
        multi = await anyio.create_tcp_listener(local_host="127.0.0.1")
        async with multi, anyio.create_task_group() as tg:
            tg.start_soon(multi.serve, server)
            port = multi.extra(anyio.abc.SocketAttribute.local_port)
            comm = await anyio_comm.connect(
                f"tcp://127.0.0.1:{port}", early_data=True, handshake_timeout=0.3
            )
            async with comm:
                await comm.send("sent before anything came back")
                with anyio.fail_after(10), pytest.raises(expected):
                    await comm.receive()
                assert comm.closed
            tg.cancel_scope.cancel()


@pytest.mark.parametrize("kind", RAW_KINDS)
async def test_early_data_to_a_version_1_server(kind: str) -> None:
    """A version-1 server reads early data as it reads any message after a preamble."""
    async with v1_server(kind) as server:
        with anyio.fail_after(10):
            comm = await anyio_comm.connect(
                server.address, early_data=True, **client_options(kind)
            )
            async with comm:
                await comm.send("early")
                assert await comm.receive() == "early"
                assert comm.peer_handshake == Handshake(1, Limits())
    assert server.received == [[msgpack.packb("early")]]


# -- closing with a reason: the edges ------------------------------------------------------


class RawPeer:
    """A version-2 peer over a raw byte stream, reading with the package's own decoder
    (as a side that announced CLOSE_REASONS)."""

    def __init__(self, stream: anyio.abc.ByteStream) -> None:
        self.stream = stream
        self.decoder = FrameDecoder(capabilities=CLOSE_ONLY)

    async def read_all(self) -> tuple[list[list[bytes]], BaseException]:
        """Every message until the end, and how it ended (EndOfData with or without a
        reason, or the transport's error)."""
        messages: list[list[bytes]] = []
        while True:
            try:
                data = await self.stream.receive()
            except (EndOfStream, BrokenResourceError) as exc:
                if isinstance(exc, BrokenResourceError):
                    return messages, exc
                self.decoder.receive_eof()
                data = b""
            if data:
                self.decoder.feed(data)
            try:
                while True:
                    frames = self.decoder.next_message()
                    if frames is None:
                        break
                    messages.append([bytes(frame) for frame in frames])
            except (EndOfData, RemoteProtocolError) as exc:
                return messages, exc


@asynccontextmanager
async def comm_and_raw_peer(
    *, max_chunks: int = 16, **options: Any
) -> AsyncIterator[tuple[Comm, RawPeer]]:
    """A comm over a memory stream to a raw version-2 peer that accepts close records
    and has read the comm's preamble."""
    a, b = memory_byte_stream_pair(max_chunks=max_chunks, chunk_size=65536)
    peer = RawPeer(b)

    async def peer_handshake() -> None:
        await b.send(encode_preamble(Limits(), CLOSE_ONLY))
        while peer.decoder.next_handshake() is None:
            peer.decoder.feed(await b.receive())

    async with anyio.create_task_group() as tg:
        tg.start_soon(peer_handshake)
        comm = await anyio_comm.from_stream(a, **options)
    async with b, comm:
        yield comm, peer


async def test_a_close_record_never_goes_inside_a_message() -> None:
    """aclose(reason) while another task is in the middle of sending a large message to
    a peer that reads slowly: no record is written (it would land inside the message);
    the connection is aborted, and the peer sees the message cut short."""
    async with comm_and_raw_peer(max_chunks=2) as (comm, peer):
        big = b"\x07" * 1_000_000
        sending = anyio.Event()

        async def send_big() -> None:
            sending.set()
            with pytest.raises((anyio.ClosedResourceError, BrokenResourceError)):
                await comm.send_frames([big])

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_big)
            await sending.wait()
            await anyio.wait_all_tasks_blocked()
            await comm.aclose(CloseReason(CloseCode.HANDLER_ERROR, "E", "x"))
        with anyio.fail_after(10):
            messages, end = await peer.read_all()
    assert messages == []  # never completed: no bytes of a record were taken for its own
    assert not (isinstance(end, EndOfData) and end.reason is not None)
    assert isinstance(end, BrokenResourceError) or (isinstance(end, EndOfData) and end.truncated)


async def test_an_error_record_that_cannot_be_written_aborts() -> None:
    """A peer that reads nothing: the record is not taken within CLOSE_RECORD_TIMEOUT,
    and since its reason is an error, the connection is aborted, never ended cleanly;
    aclose() returns within that time."""
    async with comm_and_raw_peer(max_chunks=1) as (comm, peer):
        await comm.send("fill")  # the stream holds one chunk: it is full now
        started = anyio.current_time()
        with anyio.fail_after(5):
            await comm.aclose(CloseReason(CloseCode.HANDLER_ERROR, "E", "not written"))
        assert 0.9 < anyio.current_time() - started < 3
        with anyio.fail_after(10):
            messages, end = await peer.read_all()
    assert messages == [[msgpack.packb("fill")]]
    assert isinstance(end, BrokenResourceError), end  # not a clean end


async def test_a_send_during_aclose_with_a_reason_is_told_closed() -> None:
    async with comm_and_raw_peer(max_chunks=1) as (comm, _peer):
        await comm.send("fill")  # the stream holds one chunk: it is full now
        async with anyio.create_task_group() as tg:
            tg.start_soon(comm.aclose, CloseReason(CloseCode.NORMAL))
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(anyio.ClosedResourceError):
                await comm.send("late")
            with pytest.raises(anyio.ClosedResourceError):
                await comm.send_eof()


async def test_a_message_timeout_is_told_to_the_peer() -> None:
    async with comm_and_raw_peer(message_timeout=0.2, min_receive_rate=0) as (comm, peer):
        await peer.stream.send(encode_header([100]) + b"only part of it")
        with anyio.fail_after(10), pytest.raises(anyio_comm.MessageTimeoutError):
            await comm.receive_frames()
        with anyio.fail_after(10):
            _, end = await peer.read_all()
    assert isinstance(end, EndOfData) and end.reason is not None
    assert end.reason.code is CloseCode.MESSAGE_TIMEOUT and not end.reason.clean


@pytest.mark.parametrize(
    ("limits", "header", "name", "text"),
    [
        (Limits(max_frames=4), [1] * 5, "max_frames", "message has 5 frames; the limit is 4"),
        (
            Limits(max_frame_size=10),
            [11],
            "max_frame_size",
            "frame of 11 bytes exceeds the limit of 10 bytes per frame",
        ),
        (
            Limits(max_message_size=10),
            [6, 6],
            "max_message_size",
            "message of 12 bytes exceeds the limit of 10 bytes per message",
        ),
    ],
    ids=["max_frames", "max_frame_size", "max_message_size"],
)
async def test_each_limit_is_named_in_the_record(
    limits: Limits, header: list[int], name: str, text: str
) -> None:
    async with comm_and_raw_peer(limits=limits) as (comm, peer):
        await peer.stream.send(encode_header(header))
        with anyio.fail_after(10), pytest.raises(RemoteProtocolError):
            await comm.receive_frames()
        with anyio.fail_after(10):
            _, end = await peer.read_all()
    assert isinstance(end, EndOfData)
    assert end.reason == CloseReason(CloseCode.LIMIT_EXCEEDED, name, text)


async def test_a_send_after_the_peers_record_reports_it(anyio_backend_name: str) -> None:
    """The peer closed with a reason while we were only sending: the send fails. On
    asyncio and uvloop the event loop has read the record by then: the send raises
    PeerClosedError, and the comm keeps the reason. On trio the task reads, so the
    record is still in the socket when the send fails: a broken connection (never a
    clean end)."""
    async with connected_pair("tcp") as (client, server):
        reason = CloseReason(CloseCode.HANDLER_ERROR, "E", "gone")
        await server.aclose(reason)
        with anyio.fail_after(10), pytest.raises(BrokenResourceError) as info:
            for _ in range(1000):
                await client.send("still talking")
                await anyio.sleep(0.001)
        with pytest.raises(BrokenResourceError) as again:
            await client.receive()
        if anyio_backend_name == "asyncio":
            assert type(info.value) is PeerClosedError and info.value.reason == reason
            assert type(again.value) is PeerClosedError and client.peer_close_reason == reason


async def test_pickle_hint_when_our_side_has_it_off() -> None:
    """The peer accepts pickle but we do not use it: the error says to turn ours on."""
    async with stream_pair({}, {"allow_pickle": True}) as (client, _server):
        assert Capability.PICKLE in client.peer_handshake.capabilities
        with pytest.raises(SerializationError, match="enable allow_pickle=True"):
            await client.send(Point(1, 2))


def test_peer_closed_exceptions_pickle_and_copy() -> None:
    import copy
    import pickle

    reason = CloseReason(CloseCode.HANDLER_ERROR, "E", "x")
    for exc in (PeerClosedOK(CloseReason(CloseCode.NORMAL)), PeerClosedError(reason)):
        for clone in (pickle.loads(pickle.dumps(exc)), copy.copy(exc), copy.deepcopy(exc)):
            assert type(clone) is type(exc) and clone.reason == exc.reason
            assert str(clone) == str(exc)


def test_unencodable_text_is_refused_or_replaced() -> None:
    with pytest.raises(ValueError, match="UTF-8"):
        CloseReason(CloseCode.NORMAL, "", "bad \udcff name")
    shortened = CloseReason.shortened(CloseCode.HANDLER_ERROR, "E\udcff", "file \udcff.txt")
    assert (shortened.name, shortened.text) == ("E?", "file ?.txt")
    assert encode_close_record(shortened)  # encodable


async def test_a_handler_error_with_an_odd_message(caplog: pytest.LogCaptureFixture) -> None:
    """An exception message with a lone surrogate, or whose str() fails: the client is
    told, and the listener keeps serving."""

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no")

    errors = iter([OSError("no such file: \udcff"), Unprintable()])

    async def handler(comm: Comm) -> None:
        await comm.receive()
        raise next(errors)

    with caplog.at_level(logging.CRITICAL, logger="anyio_comm"):
        async with anyio_comm.listen("tcp://127.0.0.1:0", handler) as listener:
            texts = []
            for _ in range(2):
                async with await anyio_comm.connect(listener.address) as comm:
                    await comm.send("go")
                    with anyio.fail_after(10), pytest.raises(PeerClosedError) as info:
                        await comm.receive()
                    texts.append((info.value.reason.name, info.value.reason.text))
    assert texts == [("OSError", "no such file: ?"), ("Unprintable", "<unprintable Unprintable>")]


@pytest.mark.parametrize("kind", ["tcp", "tls1.3"])
async def test_shutdown_tells_going_away_or_interrupted(kind: str) -> None:
    """A handler stopped while it waited between messages: GOING_AWAY (clean). One
    cancelled in the middle of a request when the grace period ran out: INTERRUPTED
    (an error: its reply is lost)."""
    started = anyio.Event()

    async def handler(comm: Comm) -> None:
        async for message in comm:
            if message == "slow":
                started.set()
                await anyio.sleep(30)
            await comm.send(message)

    async with (
        listen_address(kind) as address,
        anyio_comm.listen(address, handler, **server_options(kind)) as listener,
    ):
        idle = await anyio_comm.connect(listener.address, **client_options(kind))
        busy = await anyio_comm.connect(listener.address, **client_options(kind))
        async with idle, busy:
            await idle.send("hi")
            assert await idle.receive() == "hi"
            await busy.send("slow")
            await started.wait()
            with anyio.fail_after(10):
                await listener.shutdown(grace_period=0.2)
                with pytest.raises(PeerClosedOK) as idle_info:
                    await idle.receive()
                with pytest.raises(PeerClosedError) as busy_info:
                    await busy.receive()
    assert idle_info.value.reason.code is CloseCode.GOING_AWAY
    assert busy_info.value.reason.code is CloseCode.INTERRUPTED


# -- compression ----------------------------------------------------------------------------


def compressible(size: int) -> bytes:
    words = [bytes.fromhex(f"{i:04x}") * 3 for i in range(300)]
    return b" ".join(words[(i * 7919) % 300] for i in range(size // 6 + 1))[:size]


@pytest.mark.parametrize("kind", TRANSPORTS)
async def test_compression_on_every_transport(kind: str) -> None:
    """Both sides turn compression on: large compressible frames travel compressed and
    arrive intact, with the rest of the message (incompressible, small) as it was."""
    pytest.importorskip("cramjam")
    text, noise = compressible(2_000_000), os.urandom(300_000)
    async with connected_pair(kind, compression=("zstd", "lz4")) as (client, server):
        assert client.peer_handshake.compression == ("zstd", "lz4")
        assert client._conn._compressor is not None  # (the sender's side agreed)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:

                async def echo_one() -> None:
                    await server.send(await server.receive())

                tg.start_soon(echo_one)
                await client.send({"text": text, "noise": noise, "small": b"x" * 10, "n": 1})
                reply = await client.receive()
        assert bytes(reply["text"]) == text and bytes(reply["noise"]) == noise
        assert reply["small"] == b"x" * 10 and reply["n"] == 1


async def test_compression_on_one_side_only_sends_frames_as_they_are() -> None:
    pytest.importorskip("cramjam")
    async with stream_pair({"compression": "lz4"}, {}) as (client, server):
        assert client.peer_handshake.compression == ()
        assert client._conn._compressor is None
        text = compressible(500_000)
        await client.send(text)
        assert bytes(await server.receive()) == text
        await server.send(text)
        assert bytes(await client.receive()) == text


@pytest.mark.parametrize("kind", RAW_KINDS)
async def test_compression_towards_a_version_1_server(kind: str) -> None:
    """A version-1 server gets every frame as it is, whatever our compression."""
    pytest.importorskip("cramjam")
    text = compressible(400_000)
    async with v1_server(kind) as server:
        with anyio.fail_after(10):
            comm = await anyio_comm.connect(
                server.address, compression="lz4", **client_options(kind)
            )
            async with comm:
                await comm.send_frames([text])
                assert [bytes(f) for f in await comm.receive_frames()] == [text]
    assert server.received == [[text]]


def test_compression_option_is_checked() -> None:
    pytest.importorskip("cramjam")
    assert anyio_comm.Options(compression="lz4").compression == ("lz4",)
    assert anyio_comm.Options(compression=("zstd", "lz4")).compression == ("zstd", "lz4")
    with pytest.raises(ValueError, match="unknown compression codec"):
        anyio_comm.Options(compression="snappy")
    with pytest.raises(TypeError, match="codec name or a tuple"):
        anyio_comm.Options(compression=["lz4"])  # type: ignore[arg-type]


async def test_early_data_waits_on_for_a_slow_first_reply() -> None:
    """The server's preamble arrives at once but its first reply comes after
    handshake_timeout: that is no handshake timeout."""

    async def slow_echo(comm: Comm) -> None:
        async for message in comm:
            await anyio.sleep(0.6)
            await comm.send(message)

    async with anyio_comm.listen("tcp://127.0.0.1:0", slow_echo) as listener:
        comm = await anyio_comm.connect(listener.address, early_data=True, handshake_timeout=0.2)
        async with comm:
            assert comm.extra(anyio_comm.CommAttribute.peer_handshake, None) in (
                None,
                Handshake(2, Limits(), CLOSE_ONLY),
            )
            await comm.send("slow")
            with anyio.fail_after(10):
                assert await comm.receive() == "slow"
            assert comm.extra(anyio_comm.CommAttribute.peer_handshake) == Handshake(
                2, Limits(), CLOSE_ONLY
            )


async def test_compressed_frames_travel_compressed(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sender wrote for a compressible frame is its compressed form."""
    pytest.importorskip("cramjam")
    from anyio_comm._sansio.compression import Compressor

    sent: list[int] = []
    compress = Compressor.compress

    def spy(self: Compressor, frame: memoryview) -> memoryview | None:
        wire_frame = compress(self, frame)
        sent.append(frame.nbytes if wire_frame is None else -wire_frame.nbytes)
        return wire_frame

    monkeypatch.setattr(Compressor, "compress", spy)
    text = compressible(1_000_000)
    async with connected_pair("tcp", compression="lz4") as (client, server):
        noise = os.urandom(100_000)
        await client.send_frames([text, noise])
        assert [bytes(f) for f in await server.receive_frames()] == [text, noise]
    assert sent[1] == 100_000  # the random frame went as it is
    assert 0 < -sent[0] < 0.5 * len(text)  # the text went compressed


async def test_a_handlers_own_timeout_between_messages_is_not_idleness() -> None:
    """A handler that gave up waiting for a request itself, then took one: when the
    listener's grace period runs out in the middle of it, the client is told
    INTERRUPTED, not GOING_AWAY."""
    busy = anyio.Event()

    async def handler(comm: Comm) -> None:
        with anyio.move_on_after(0.05):
            await comm.receive()  # nothing comes: the handler's own timeout
        await comm.receive()
        busy.set()
        await anyio.sleep(30)

    async with anyio_comm.listen("tcp://127.0.0.1:0", handler) as listener:
        async with await anyio_comm.connect(listener.address) as comm:
            await anyio.sleep(0.2)
            await comm.send("work")
            with anyio.fail_after(10):
                await busy.wait()
                await listener.shutdown(grace_period=0.1)
                with pytest.raises(PeerClosedError) as info:
                    await comm.receive()
    assert info.value.reason.code is CloseCode.INTERRUPTED


def test_no_message_of_the_close_markers_frame_count_to_a_peer_that_reads_records() -> None:
    """A peer whose max_frames is 2^32 - 1 and that accepts close records takes at most
    2^32 - 2 frames (a count of FF FF FF FF begins a record there); a version-1 peer,
    or one without the capability, keeps its announced limit."""
    from anyio_comm._sansio.connection import Connection

    largest = Limits(max_frames=2**32 - 1)
    for capabilities, expected in ((CLOSE_ONLY, 2**32 - 2), (frozenset(), 2**32 - 1)):
        conn = Connection()
        conn.receive_data(encode_preamble(largest, capabilities))
        assert conn.next_handshake() == Handshake(2, largest, capabilities)
        assert conn._send_limits.max_frames == expected
