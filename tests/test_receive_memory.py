"""What a peer can make a listener hold: memory committed as bytes arrive, the
listener's receive budget (backpressure, stalled holders closed), and the
deadline of a message that has begun (plain TCP and TLS, every backend)."""

from __future__ import annotations

import gc
import os
import socket
import ssl
import tracemalloc
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import msgpack
import pytest
from anyio.streams.tls import TLSStream

import anyio_comm
from anyio_comm import (
    Comm,
    Limits,
    MessageTimeoutError,
    ReceiveBudget,
    ReceiveBudgetError,
)
from anyio_comm._sansio.budget import message_cost
from anyio_comm._sansio.serialization import Serializer
from anyio_comm._sansio.wire import Capability, encode_header, encode_preamble

from .certs import client_context, server_context
from .helpers import ADDRESS_TRANSPORTS, listen_address

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from anyio.abc import ByteStream

pytestmark = pytest.mark.anyio

MiB = 1024 * 1024
SCHEMES = ["tcp", "tls"]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@asynccontextmanager
async def echo_listener(
    scheme: str, **kwargs: Any
) -> AsyncIterator[tuple[anyio_comm.Listener, list[BaseException]]]:
    """A listener whose handler echoes messages, and how its handlers ended."""
    ended: list[BaseException] = []

    async def handler(comm: Comm) -> None:
        try:
            async for message in comm:
                await comm.send(message)
        except BaseException as exc:
            ended.append(exc)
            raise

    if scheme == "tls":
        kwargs["ssl_context"] = server_context()
    async with anyio_comm.listen(f"{scheme}://127.0.0.1:0", handler, **kwargs) as listener:
        yield listener, ended


def wire(message: object) -> bytes:
    """``message`` as the bytes a comm sends for it (header and frames)."""
    frames = [bytes(frame) for frame in Serializer().dumps(message)]
    return encode_header([len(frame) for frame in frames]) + b"".join(frames)


async def raw_peer(listener: anyio_comm.Listener, scheme: str) -> ByteStream:
    """A peer that speaks the wire format by hand: preamble sent, peer's read."""
    host, port = listener.address.split("://")[1].rsplit(":", 1)
    stream: ByteStream
    if scheme == "tls":
        stream = await anyio.connect_tcp(
            host, int(port), tls=True, ssl_context=client_context(), tls_hostname="localhost"
        )
    else:
        stream = await anyio.connect_tcp(host, int(port))
    await stream.send(encode_preamble(Limits()))
    received = b""
    while len(received) < 32:  # the listener's preamble
        received += await stream.receive()
    return stream


async def connect(listener: anyio_comm.Listener, scheme: str, **kwargs: Any) -> Comm:
    if scheme == "tls":
        kwargs["ssl_context"] = client_context()
    return await anyio_comm.connect(listener.address, timeout=10, **kwargs)


async def round_trips(listener: anyio_comm.Listener, scheme: str) -> None:
    async with await connect(listener, scheme) as comm:
        for i in range(20):
            await comm.send({"i": i})
            assert await comm.receive() == {"i": i}
        payload = os.urandom(MiB)
        await comm.send(payload)
        assert bytes(await comm.receive()) == payload


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_peers_declaring_1_gib_frames_commit_no_memory(scheme: str) -> None:
    """32 peers each declare a 1 GiB frame and send nothing more: the listener's
    memory barely moves (RSS and tracemalloc), and a client is served."""
    peers = 32
    gc.collect()
    tracemalloc.start()
    try:
        with anyio.fail_after(60):
            async with echo_listener(scheme) as (listener, _ended):
                await round_trips(listener, scheme)  # warm up
                rss_before = rss()
                traced_before = tracemalloc.get_traced_memory()[0]
                streams = []
                for _ in range(peers):
                    stream = await raw_peer(listener, scheme)
                    await stream.send(encode_header([2**30]) + b"x" * 1000)
                    streams.append(stream)
                budget = listener.receive_budget
                assert budget is not None
                while budget.waiting < peers - 1:  # one is admitted alone, the rest wait
                    await anyio.sleep(0.01)
                await round_trips(listener, scheme)
                grown = rss() - rss_before
                traced = tracemalloc.get_traced_memory()[0] - traced_before
                assert grown < 48 * MiB, f"RSS grew by {grown / MiB:.1f} MiB"
                assert traced < 24 * MiB, f"tracemalloc: {traced / MiB:.1f} MiB"
                for stream in streams:
                    await anyio.aclose_forcefully(stream)
                while budget.in_use or budget.waiting:
                    await anyio.sleep(0.01)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_peers_sending_many_empty_frames_make_no_frame_objects(scheme: str) -> None:
    """8 peers each send the header of a message of 16,384 frames, all empty but
    the last, of which they send nothing (128 KiB each). As frame objects that would
    be 6 MB a peer; the listener holds at most 8 times what they sent, plus what
    a connection costs anyway (its read-ahead buffer, the comm; 256 KiB here).
    A client is served meanwhile, and a legitimate message of that shape arrives
    whole."""
    peers, count = 8, 16_384
    lengths = [0] * (count - 1) + [100]
    header = encode_header(lengths)
    frames = [b""] * (count - 1) + [os.urandom(100)]

    async def echo_frames(comm: Comm) -> None:
        received = await comm.receive_frames()
        await comm.send_frames(received)

    kwargs: dict[str, Any] = {}
    if scheme == "tls":
        kwargs["ssl_context"] = server_context()
    gc.collect()
    tracemalloc.start()
    try:
        with anyio.fail_after(60):
            async with (
                echo_listener(scheme) as (listener, _ended),
                anyio_comm.listen(
                    f"{scheme}://127.0.0.1:0", echo_frames, **kwargs
                ) as frames_listener,
            ):
                await round_trips(listener, scheme)  # warm up
                traced_before = tracemalloc.get_traced_memory()[0]
                streams = []
                for _ in range(peers):
                    stream = await raw_peer(listener, scheme)
                    await stream.send(header)
                    streams.append(stream)
                budget = listener.receive_budget
                assert budget is not None
                while budget.in_use < peers * message_cost(sum(lengths), len(lengths)):
                    await anyio.sleep(0.01)
                await anyio.sleep(0.2)  # let the handlers read what came
                traced = tracemalloc.get_traced_memory()[0] - traced_before
                sent = peers * len(header)
                assert traced < 8 * sent + peers * 256 * 1024, (
                    f"tracemalloc: {traced / MiB:.1f} MiB for {sent / MiB:.1f} MiB sent"
                )
                tracemalloc.stop()  # (it makes allocations ten times slower)
                await round_trips(listener, scheme)
                async with await connect(frames_listener, scheme) as comm:
                    await comm.send_frames(frames)
                    assert [bytes(f) for f in await comm.receive_frames()] == frames
                for stream in streams:
                    await anyio.aclose_forcefully(stream)
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", ADDRESS_TRANSPORTS)
async def test_taken_messages_give_their_budget_back_on_every_transport(kind: str) -> None:
    """Whichever engine a connection gets (the push engine over sockets on asyncio,
    the pull engine over inproc:// and on trio), every message's reservation is
    released when it is taken, many-frame messages included."""
    budget = ReceiveBudget(16 * MiB)
    payloads = [os.urandom(200_000), [os.urandom(100) for _ in range(2000)]]

    async def handler(comm: Comm) -> None:
        async for message in comm:
            await comm.send(budget.in_use)
            del message

    with anyio.fail_after(20):
        async with (
            listen_address(kind) as address,
            anyio_comm.listen(address, handler, receive_budget=budget) as listener,
            await anyio_comm.connect(listener.address, timeout=10) as comm,
        ):
            for payload in payloads * 3:
                await comm.send(payload)
                assert await comm.receive() == 0
    assert budget.in_use == 0 and budget.waiting == 0


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_budget_backpressure_delivers_everything(scheme: str) -> None:
    """A peer sends half of a 3 MiB message to a listener whose budget holds 4 MiB:
    three clients' 3 MiB messages wait (their connections are not read), then
    go through one after the other once it completes; every message arrives
    intact and the budget never holds more than its size."""
    budget = ReceiveBudget(4 * MiB)
    size = 3 * MiB
    got: dict[int, bytes] = {}
    peak = 0

    async def handler(comm: Comm) -> None:
        nonlocal peak
        async for message in comm:
            peak = max(peak, budget.in_use)
            got[message["n"]] = bytes(message["data"])
            await comm.send("ok")

    kwargs: dict[str, Any] = {"receive_budget": budget}
    if scheme == "tls":
        kwargs["ssl_context"] = server_context()
    payloads = {n: os.urandom(size) for n in range(4)}
    with anyio.fail_after(60):
        async with anyio_comm.listen(f"{scheme}://127.0.0.1:0", handler, **kwargs) as listener:
            slow = await raw_peer(listener, scheme)
            data = wire({"n": 0, "data": payloads[0]})
            await slow.send(data[: len(data) // 2])
            while budget.in_use < size:
                await anyio.sleep(0.01)

            async def client(n: int) -> None:
                async with await connect(listener, scheme) as comm:
                    await comm.send({"n": n, "data": payloads[n]})
                    assert await comm.receive() == "ok"

            async with anyio.create_task_group() as tg:
                for n in (1, 2, 3):
                    tg.start_soon(client, n)
                while budget.waiting < 3:
                    await anyio.sleep(0.01)
                assert budget.in_use <= budget.max_bytes
                assert not got
                await slow.send(data[len(data) // 2 :])
            await anyio.aclose_forcefully(slow)
    assert got == payloads
    assert peak <= budget.max_bytes
    assert budget.in_use == 0 and budget.waiting == 0


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_a_stalled_holder_is_closed_for_a_waiting_client(scheme: str) -> None:
    """A peer that declares a message and stops holds the budget; once a client
    waits for it, the stalled peer is closed after stall_timeout and the
    client's message goes through."""
    budget = ReceiveBudget(3 * MiB, stall_timeout=0.5)
    with anyio.fail_after(30):
        async with echo_listener(scheme, receive_budget=budget) as (listener, ended):
            stream = await raw_peer(listener, scheme)
            await stream.send(encode_header([2 * MiB]) + b"x" * 1000)
            while budget.in_use < 2 * MiB:
                await anyio.sleep(0.01)
            payload = os.urandom(2 * MiB)
            async with await connect(listener, scheme) as comm:
                await comm.send(payload)
                started = anyio.current_time()
                assert bytes(await comm.receive()) == payload
                waited = anyio.current_time() - started
            assert 0.4 < waited < 10
            with pytest.raises((anyio.EndOfStream, anyio.BrokenResourceError, OSError)):
                while True:  # the stalled peer was closed
                    await stream.receive()
            await anyio.aclose_forcefully(stream)
            while not ended:
                await anyio.sleep(0.01)
            (error,) = ended
            assert isinstance(error, ReceiveBudgetError)
            assert "without progress" in str(error)


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_a_message_that_stops_half_way_times_out(scheme: str) -> None:
    with anyio.fail_after(30):
        async with echo_listener(scheme, message_timeout=0.3) as (listener, ended):
            stream = await raw_peer(listener, scheme)
            await stream.send(encode_header([100_000]) + b"x" * 10_000)
            started = anyio.current_time()
            while not ended:
                await anyio.sleep(0.01)
            elapsed = anyio.current_time() - started
            (error,) = ended
            assert isinstance(error, MessageTimeoutError)
            assert "10012 bytes" in str(error)  # header and what arrived
            # 0.3 s, plus 10,012 bytes at the default 64 KiB/s: 0.15 s
            assert 0.4 < elapsed < 5
            await anyio.aclose_forcefully(stream)


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_a_trickled_message_times_out_and_a_steady_one_completes(scheme: str) -> None:
    options = {"message_timeout": 0.5, "min_receive_rate": 20_000}
    with anyio.fail_after(30):
        async with echo_listener(scheme, **options) as (listener, ended):
            # steady: 200 KB at about 100 KB/s, four times the message_timeout in all
            stream = await raw_peer(listener, scheme)
            data = wire(os.urandom(200_000))
            for i in range(0, len(data), 10_000):
                await stream.send(data[i : i + 10_000])
                await anyio.sleep(0.1)
            echoed = b""
            while len(echoed) < len(data):
                echoed += await stream.receive()
            assert echoed == data  # echoed as it was sent
            assert not ended
            # trickled: 100 bytes every 0.1 s, far below 20,000 bytes/s
            for _ in range(40):
                if ended:
                    break
                try:
                    await stream.send(encode_header([1_000_000]) if _ == 0 else b"y" * 100)
                except (anyio.BrokenResourceError, OSError):
                    break
                await anyio.sleep(0.1)
            while not ended:
                await anyio.sleep(0.01)
            (error,) = ended
            assert isinstance(error, MessageTimeoutError)
            await anyio.aclose_forcefully(stream)


async def test_time_the_application_spends_elsewhere_does_not_count() -> None:
    """The deadline runs only while receive() waits for the peer: half a message
    arrives, the handler is busy elsewhere for twice the message_timeout, then the
    rest comes soon after it starts to receive."""

    async def handler(comm: Comm) -> None:
        await anyio.sleep(0.6)  # busy elsewhere, past the message_timeout
        async for message in comm:
            await comm.send(message)

    with anyio.fail_after(30):
        async with anyio_comm.listen(
            "tcp://127.0.0.1:0", handler, message_timeout=0.3, min_receive_rate=0
        ) as listener:
            stream = await raw_peer(listener, "tcp")
            data = wire(b"h" * 200_000)
            await stream.send(data[: len(data) // 2])
            await anyio.sleep(0.7)  # the handler waits about 0.1 s of it
            await stream.send(data[len(data) // 2 :])
            echoed = b""
            while len(echoed) < len(data):
                echoed += await stream.receive()
            assert echoed == data
            await anyio.aclose_forcefully(stream)


async def test_message_timeout_can_be_turned_off() -> None:
    with anyio.fail_after(30):
        async with echo_listener("tcp", message_timeout=None) as (listener, ended):
            stream = await raw_peer(listener, "tcp")
            data = wire(b"x" * 100_000)
            await stream.send(data[:100])
            await anyio.sleep(0.5)
            await stream.send(data[100:])
            echoed = b""
            while len(echoed) < len(data):
                echoed += await stream.receive()
            assert echoed == data
            assert not ended
            await anyio.aclose_forcefully(stream)


async def test_the_budget_can_be_shared_and_turned_off() -> None:
    shared = ReceiveBudget(8 * MiB)
    with anyio.fail_after(30):
        async with echo_listener("tcp", receive_budget=shared) as (first, _first_ended):
            async with echo_listener("tcp", receive_budget=shared) as (second, _second_ended):
                assert first.receive_budget is second.receive_budget is shared
                await round_trips(first, "tcp")
                await round_trips(second, "tcp")
        async with echo_listener("tcp", receive_budget=None) as (listener, _ended):
            assert listener.receive_budget is None
            await round_trips(listener, "tcp")
        async with echo_listener("tcp", receive_budget=5 * MiB) as (listener, _ended):
            assert listener.receive_budget is not None
            assert listener.receive_budget.max_bytes == 5 * MiB
    with pytest.raises(ValueError, match="negative"):
        async with anyio_comm.listen("tcp://127.0.0.1:0", lambda comm: None, receive_budget=-1):
            pass
    assert shared.in_use == 0


async def test_queued_messages_hold_budget_until_taken(anyio_backend_name: str) -> None:
    """Messages a push engine decoded ahead of the handler stay counted until
    the handler takes them (on trio, nothing is read ahead of the handler)."""
    budget = ReceiveBudget(64 * MiB)
    size = MiB
    seen: list[int] = []
    proceed = anyio.Event()

    async def handler(comm: Comm) -> None:
        await proceed.wait()
        async for message in comm:
            seen.append(len(message))

    with anyio.fail_after(30):
        async with anyio_comm.listen(
            "tcp://127.0.0.1:0", handler, receive_budget=budget
        ) as listener:
            async with await anyio_comm.connect(listener.address) as comm:
                for _ in range(3):
                    await comm.send(b"m" * size)
                await anyio.sleep(0.2)
                assert budget.in_use <= 3 * message_cost(size, 2) + 3 * message_cost(size, 1)
                if anyio_backend_name == "trio":
                    assert budget.in_use == 0  # nothing read ahead of the handler
                else:  # the push engine parsed the first header: reserved, not taken
                    assert budget.in_use >= message_cost(size, 1)
                proceed.set()
                while len(seen) < 3:
                    await anyio.sleep(0.01)
            while budget.in_use:
                await anyio.sleep(0.01)
    assert seen == [size] * 3


@pytest.mark.parametrize("layer", ["frames", "message"])
@pytest.mark.parametrize("scheme", SCHEMES)
async def test_taken_messages_of_many_tiny_frames_hold_under_8_times_their_size(
    scheme: str, layer: str
) -> None:
    """4 peers each send 4 whole messages of 16,384 frames of 2 bytes (the default
    limit, 160 KiB on the wire; out-of-band frames each referenced from the body
    for the message layer), which a handler takes (``receive_frames()`` or
    ``receive()``) and keeps. As frame objects they would be 6.2 MB each; the
    listener holds less than 8 times what was sent, plus what a connection costs
    anyway (256 KiB here)."""
    peers, per_peer, count = 4, 4, 16_384
    if layer == "frames":
        frames = [b"xy"] * count
    else:
        refs = [msgpack.ExtType(1, i.to_bytes(4, "big")) for i in range(count - 1)]
        frames = [msgpack.packb(refs), *[b"xy"] * (count - 1)]
    message = encode_header([len(f) for f in frames]) + b"".join(frames)
    kept: list[object] = []

    async def keep(comm: Comm) -> None:
        while True:
            if layer == "frames":
                kept.append(await comm.receive_frames())
            else:
                kept.append(await comm.receive())

    kwargs: dict[str, Any] = {}
    if scheme == "tls":
        kwargs["ssl_context"] = server_context()
    gc.collect()
    tracemalloc.start()
    try:
        with anyio.fail_after(60):
            async with anyio_comm.listen(f"{scheme}://127.0.0.1:0", keep, **kwargs) as listener:
                warm = await raw_peer(listener, scheme)  # (a connection's own costs, once)
                await warm.send(message)
                while not kept:
                    await anyio.sleep(0.01)
                kept.clear()
                gc.collect()
                traced_before = tracemalloc.get_traced_memory()[0]
                streams = []
                for _ in range(peers):
                    stream = await raw_peer(listener, scheme)
                    for _ in range(per_peer):
                        await stream.send(message)
                    streams.append(stream)
                while len(kept) < peers * per_peer:
                    await anyio.sleep(0.01)
                gc.collect()
                traced = tracemalloc.get_traced_memory()[0] - traced_before
                sent = peers * per_peer * len(message)
                assert traced < 8 * sent + peers * 256 * 1024, (
                    f"tracemalloc: {traced / MiB:.1f} MiB for {sent / MiB:.1f} MiB sent"
                )
                if layer == "frames":
                    assert all(f == frames for f in kept)
                else:
                    assert all(m == [b"xy"] * (count - 1) for m in kept)
                for stream in [warm, *streams]:
                    await anyio.aclose_forcefully(stream)
    finally:
        tracemalloc.stop()


# -- peers that send nothing -------------------------------------------------------


def _tls_sessions() -> int:
    """The ``ssl.SSLObject`` instances alive (each holds an OpenSSL session)."""
    gc.collect()
    return sum(isinstance(o, ssl.SSLObject) for o in gc.get_objects())


def _package_traced() -> int:
    """Bytes traced as allocated by the package's own lines (not the event loop's,
    whose debug mode records a stack per callback)."""
    gc.collect()
    package = os.path.join(os.path.dirname(anyio_comm.__file__), "*")
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, package)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_silent_peers_cost_no_read_buffer(scheme: str) -> None:
    """64 peers connect and send nothing at all (no preamble; over TLS not even a
    ClientHello): until the handshake_timeout drops them, each costs the listener
    a few KiB, not a read-ahead buffer (64 KiB) or a TLS session with its
    ciphertext buffer; and a client is served meanwhile."""
    peers = 64
    gc.collect()
    tracemalloc.start()
    sockets: list[socket.socket] = []
    try:
        with anyio.fail_after(60):
            async with echo_listener(scheme) as (listener, _ended):
                await round_trips(listener, scheme)  # warm up
                host, port = listener.address.split("://")[1].rsplit(":", 1)
                connections = listener._server.connections
                sessions_before = _tls_sessions()
                traced_before = _package_traced()
                for _ in range(peers):
                    sock = socket.create_connection((host, int(port)))
                    sock.setblocking(False)
                    sockets.append(sock)
                while len(connections) < peers:  # each in its handshake
                    await anyio.sleep(0.01)
                await anyio.sleep(0.1)  # (and waiting for its peer's bytes)
                traced = _package_traced() - traced_before
                assert traced < peers * 8 * 1024, f"{traced / peers:.0f} bytes per silent peer"
                assert _tls_sessions() <= sessions_before  # (the warm-up may be gone)
                await round_trips(listener, scheme)
    finally:
        tracemalloc.stop()
        for sock in sockets:
            sock.close()


async def test_a_tls_client_that_waits_before_its_client_hello_is_served() -> None:
    """The listener makes a TLS session only once the client's first bytes can be
    read: a client that connects, waits, then speaks is served as any other."""
    async with echo_listener("tls", handshake_timeout=5) as (listener, _ended):
        host, port = listener.address.split("://")[1].rsplit(":", 1)
        with anyio.fail_after(10):
            tcp = await anyio.connect_tcp(host, int(port))
            await anyio.sleep(0.2)
            stream = await TLSStream.wrap(
                tcp, hostname="localhost", ssl_context=client_context(), standard_compatible=False
            )
            async with stream:
                await stream.send(encode_preamble(Limits()) + wire({"late": True}))
                received = b""
                expected = len(encode_preamble(Limits(), {Capability.CLOSE_REASONS}))
                expected += len(wire({"late": True}))
                while len(received) < expected:
                    received += await stream.receive()
                assert received.endswith(wire({"late": True}))


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_messages_in_the_same_write_as_the_preamble(scheme: str) -> None:
    """A peer's preamble and its first messages arrive in one read of the small
    buffer that waits for the preamble: every message is delivered, those begun
    in that read included."""
    messages = [{"i": i, "pad": "x" * (i % 97)} for i in range(300)]
    data = encode_preamble(Limits()) + b"".join(map(wire, messages))
    async with echo_listener(scheme) as (listener, _ended):
        host, port = listener.address.split("://")[1].rsplit(":", 1)
        stream: ByteStream
        if scheme == "tls":
            stream = await anyio.connect_tcp(
                host, int(port), tls=True, ssl_context=client_context(), tls_hostname="localhost"
            )
        else:
            stream = await anyio.connect_tcp(host, int(port))
        async with stream:
            await stream.send(data)
            expected = len(encode_preamble(Limits(), {Capability.CLOSE_REASONS}))
            expected += len(data) - len(encode_preamble(Limits()))
            received = b""
            with anyio.fail_after(10):
                while len(received) < expected:
                    received += await stream.receive()
            assert received[-(len(data) - len(encode_preamble(Limits()))) :] == b"".join(
                map(wire, messages)
            )
