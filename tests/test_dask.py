"""dask's comm contract, over dask's own ``tcp://`` and ``tls://`` (the reference) and
anyio-comm's ``anyio+tcp://`` and ``anyio+tls://``: what a test can observe must match.

dask runs on asyncio (and uvloop), never on trio: these tests run on both of those.
Loopback only: every listener is given ``127.0.0.1``.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import sys
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest

pytest.importorskip("distributed")
np = pytest.importorskip("numpy")

import anyio  # noqa: E402
import dask  # noqa: E402
import trustme  # noqa: E402
from distributed.comm import (  # noqa: E402
    CommClosedError,
    connect,
    get_address_host,
    get_local_address_for,
    listen,
    parse_address,
    resolve_address,
)
from distributed.comm.core import FatalCommClosedError  # noqa: E402
from distributed.core import ConnectionPool, Server, rpc  # noqa: E402
from distributed.protocol import Serialize, Serialized, to_serialize  # noqa: E402
from distributed.security import Security  # noqa: E402

import anyio_comm  # noqa: E402

from .conftest import HAVE_IPV6, needs  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import AsyncIterator
    from pathlib import Path

    from distributed.comm.core import Comm, Listener

SCHEMES = ["tcp", "anyio+tcp", "tls", "anyio+tls"]
ANYIO_SCHEMES = ["anyio+tcp", "anyio+tls"]

TLS_SCHEMES = ["tls", "anyio+tls"]

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(params=SCHEMES)
def scheme(request: pytest.FixtureRequest) -> str:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {}), id="asyncio"),
        needs("uvloop", ("asyncio", {"use_uvloop": True}), id="asyncio+uvloop"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


# -- TLS material: dask's Security reads files --------------------------------


class TLSFiles:
    def __init__(self, directory: Path, name: str) -> None:
        ca = trustme.CA()
        self.ca_file = str(directory / f"{name}-ca.pem")
        ca.cert_pem.write_to_path(self.ca_file)
        self.cert_file = str(directory / f"{name}-cert.pem")
        ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(
            self.cert_file
        )

    def security(self, *, trust: TLSFiles | None = None) -> Security:
        """A Security using this certificate, trusting ``trust``'s CA (default: ours)."""
        ca_file = (trust or self).ca_file
        return Security(
            tls_ca_file=ca_file,
            tls_client_cert=self.cert_file,
            tls_scheduler_cert=self.cert_file,
            tls_worker_cert=self.cert_file,
            require_encryption=True,
        )


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[TLSFiles, TLSFiles]:
    directory = tmp_path_factory.mktemp("dask-tls")
    return TLSFiles(directory, "ours"), TLSFiles(directory, "other")


def is_tls(scheme: str) -> bool:
    return scheme.endswith("tls")


def listen_args(scheme: str, files: tuple[TLSFiles, TLSFiles]) -> dict[str, Any]:
    return files[0].security().get_listen_args("scheduler") if is_tls(scheme) else {}


def connect_args(scheme: str, files: tuple[TLSFiles, TLSFiles]) -> dict[str, Any]:
    return files[0].security().get_connection_args("client") if is_tls(scheme) else {}


class Pair:
    """A listener, the client comm and the server comm connected through it."""

    listener: Listener
    client: Comm
    server: Comm


def listen_at(scheme: str, handler: Any, files: tuple[TLSFiles, TLSFiles], **kw: Any) -> Any:
    return listen(f"{scheme}://127.0.0.1:0", handler, **listen_args(scheme, files), **kw)


async def connect_to(
    address: str, scheme: str, files: tuple[TLSFiles, TLSFiles], **kw: Any
) -> Comm:
    return await connect(address, timeout=10, **connect_args(scheme, files), **kw)


async def wait_until(predicate: Any, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@asynccontextmanager
async def pair(
    scheme: str, files: tuple[TLSFiles, TLSFiles], **listen_kw: Any
) -> AsyncIterator[Pair]:
    servers: asyncio.Queue[Comm] = asyncio.Queue()

    async def handle(comm: Comm) -> None:
        await servers.put(comm)

    result = Pair()
    async with listen_at(scheme, handle, files, **listen_kw) as listener:
        result.listener = listener
        result.client = await connect_to(listener.contact_address, scheme, files)
        result.server = await asyncio.wait_for(servers.get(), 10)
        try:
            yield result
        finally:
            await result.client.close()
            await result.server.close()


# -- round trips ---------------------------------------------------------------


@pytest.mark.parametrize("deserialize", [True, False])
async def test_round_trips_of_dask_messages(
    scheme: str, deserialize: bool, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """Plain messages, serialized payloads (to_serialize) and ones already serialized;
    the server deserializes them or, with deserialize=False, keeps them serialized."""
    array = np.arange(100_000, dtype="f8")
    blob = bytes(range(256)) * 1000
    async with pair(scheme, tls_files, deserialize=deserialize) as p:
        plain = [{"op": "ping", "n": 1}, {"ops": [{"i": i} for i in range(100)]}, "s", 7]
        ours = getattr(p.client, "_comm", None)  # (anyio_comm's comm under an anyio+ one)
        for msg in plain:
            if ours is None:  # dask's own comm
                assert await p.client.write(msg) > 0
            else:  # what went on the wire: the stream's bytes that the message added
                before = ours.statistics().bytes_sent
                wrote = await p.client.write(msg)
                assert wrote == ours.statistics().bytes_sent - before > 12
            received = await p.server.read()
            if isinstance(msg, dict) and "ops" in msg:
                assert list(received["ops"]) == msg["ops"]  # (a tuple: dask's msgpack)
            else:
                assert received == msg

        await p.client.write({"data": to_serialize(array), "blob": blob})
        received = await p.server.read()
        assert received["blob"] == blob
        if deserialize:
            np.testing.assert_array_equal(received["data"], array)
            assert received["data"].flags.writeable  # no copy needed to write to it
        else:
            assert isinstance(received["data"], (Serialize, Serialized))
            # passed on as it is: the next hop deserializes it
            await p.server.write({"forwarded": received["data"]})
            np.testing.assert_array_equal((await p.client.read())["forwarded"], array)

        nested = {"a": to_serialize(blob), "b": [to_serialize(array[:10])]}
        await p.client.write({"nested": nested})
        received = (await p.server.read())["nested"]
        if deserialize:
            assert received["a"] == blob
            np.testing.assert_array_equal(received["b"][0], array[:10])
        else:
            assert isinstance(received["a"], (Serialize, Serialized))

        await p.server.write({"reply": to_serialize(array[:5])})
        np.testing.assert_array_equal((await p.client.read())["reply"], array[:5])


async def test_deserialize_false_on_the_connecting_end(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """``connect(deserialize=False)``: what that end reads stays serialized."""
    array = np.arange(1000, dtype="f8")
    servers: asyncio.Queue[Comm] = asyncio.Queue()

    async def handle(comm: Comm) -> None:
        await servers.put(comm)

    async with listen_at(scheme, handle, tls_files) as listener:
        client = await connect_to(listener.contact_address, scheme, tls_files, deserialize=False)
        server = await asyncio.wait_for(servers.get(), 10)
        try:
            await server.write({"data": to_serialize(array), "n": 1})
            received = await client.read()
            assert received["n"] == 1
            assert isinstance(received["data"], (Serialize, Serialized))
        finally:
            await client.close()
            await server.close()


async def test_connect_is_retried_until_a_listener_comes(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """dask's connect() retries a refused connection until its timeout: a listener
    that starts meanwhile gets it."""
    with socket.socket() as probe:  # a port nobody listens on (for now)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"{scheme}://127.0.0.1:{port}"
    connecting = asyncio.ensure_future(
        connect(address, timeout=10, **connect_args(scheme, tls_files))
    )
    await asyncio.sleep(0.5)
    assert not connecting.done()
    async with listen(address, echo, **listen_args(scheme, tls_files)):
        comm = await asyncio.wait_for(connecting, 15)
        await comm.write("late")
        assert await comm.read() == "late"
        await comm.close()


async def test_large_frames(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    """A message of over 100 MB in one frame (dask's tcp:// splits it in shards)."""
    payload = np.random.default_rng(1).integers(0, 255, size=120_000_000, dtype="u1")
    async with pair(scheme, tls_files) as p:
        await asyncio.gather(p.client.write({"x": to_serialize(payload)}), p.server.read())
        write = asyncio.ensure_future(p.client.write({"x": to_serialize(payload)}))
        received = await p.server.read()
        await write
        assert received["x"].nbytes == payload.nbytes
        assert received["x"].flags.writeable
        np.testing.assert_array_equal(received["x"], payload)


async def test_many_concurrent_writers(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    """Several tasks write on one comm at once (dask does): every message arrives
    whole, each writer's in order."""
    writers, per_writer = 8, 40
    async with pair(scheme, tls_files) as p:

        async def write(w: int) -> None:
            for i in range(per_writer):
                size = 10 if i % 3 else 300_000  # large ones take several sends
                await p.client.write(
                    {"w": w, "i": i, "x": to_serialize(np.full(size, w * 1000 + i, "i4"))}
                )

        async def read() -> list[tuple[int, int]]:
            seen = []
            for _ in range(writers * per_writer):
                msg = await p.server.read()
                assert (msg["x"] == msg["w"] * 1000 + msg["i"]).all()
                seen.append((msg["w"], msg["i"]))
            return seen

        *_, seen = await asyncio.gather(*(write(w) for w in range(writers)), read())
        for w in range(writers):
            assert [i for ww, i in seen if ww == w] == list(range(per_writer))


# -- closing -------------------------------------------------------------------


async def test_implicit_close_is_seen_by_the_other_side(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    async def handle(comm: Comm) -> None:
        await comm.close()

    async with listen_at(scheme, handle, tls_files) as listener:
        comm = await connect_to(listener.contact_address, scheme, tls_files)
        with pytest.raises(CommClosedError):
            await comm.write({})
            await comm.read()
        assert comm.closed()
        comm = await connect_to(listener.contact_address, scheme, tls_files)
        with pytest.raises(CommClosedError):
            await comm.read()
        assert comm.closed()


async def test_explicit_close_is_seen_by_the_other_side(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    async with pair(scheme, tls_files) as p:
        await p.client.write({"last": 1})
        await p.client.close()
        assert p.client.closed()
        assert await p.server.read() == {"last": 1}
        with pytest.raises(CommClosedError):
            await p.server.read()
        assert p.server.closed()
        with pytest.raises(CommClosedError):
            await p.client.write({})
        with pytest.raises(CommClosedError):
            await p.client.read()


async def test_a_peer_close_is_seen_on_an_idle_comm(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """closed() turns True once the peer closed, with nobody reading (dask's
    connection pool drops such comms instead of handing them out)."""
    async with pair(scheme, tls_files) as p:
        await p.client.write("x")
        assert await p.server.read() == "x"
        assert not p.server.closed()
        await p.client.close()
        await wait_until(p.server.closed)


async def test_abort_is_synchronous(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    async with pair(scheme, tls_files) as p:
        p.client.abort()
        p.client.abort()
        assert p.client.closed()
        with pytest.raises(CommClosedError):
            await p.client.write({})
        with pytest.raises(CommClosedError):
            await p.server.read()


async def test_a_cancelled_read_closes_the_comm(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """As with tcp://: what the cancelled read took is unknown, so the comm is unusable."""
    async with pair(scheme, tls_files) as p:
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(p.client.read(), 0.05)
        assert p.client.closed()
        with pytest.raises(CommClosedError):
            await p.server.read()


@pytest.mark.parametrize("scheme", ANYIO_SCHEMES)
async def test_a_dropped_comm_is_closed_with_a_warning(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles], caplog: pytest.LogCaptureFixture
) -> None:
    async with pair(scheme, tls_files) as p:
        with caplog.at_level(logging.WARNING, logger="anyio_comm.dask"):
            del p.client
            gc.collect()
            with pytest.raises(CommClosedError):
                await asyncio.wait_for(p.server.read(), 10)
        assert "Closing dangling comm" in caplog.text
        p.client = p.server  # (for the pair's own cleanup)


# -- connecting and listening --------------------------------------------------


async def drop(comm: Comm) -> None:
    comm.abort()


async def echo(comm: Comm) -> None:
    await comm.write(await comm.read())
    await comm.close()


async def test_connect_timeout(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    async with listen_at(scheme, drop, tls_files) as listener:
        address = listener.contact_address
    # (nobody listens there any more)
    started = time.monotonic()
    with pytest.raises(OSError, match="Timed out trying to connect"):
        await connect(address, timeout=0.5, **connect_args(scheme, tls_files))
    assert time.monotonic() - started < 5


async def test_many_listeners(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    listeners = [listen_at(scheme, echo, tls_files) for _ in range(10)]
    for listener in listeners:
        await listener.start()
    try:
        assert len({lst.contact_address for lst in listeners}) == 10
        comms = await asyncio.gather(
            *(connect_to(lst.contact_address, scheme, tls_files) for lst in listeners)
        )
        for i, comm in enumerate(comms):
            await comm.write(i)
        assert [await comm.read() for comm in comms] == list(range(10))
        for comm in comms:
            await comm.close()
    finally:
        for listener in listeners:
            listener.stop()


async def test_repr_and_addresses(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    async with pair(scheme, tls_files) as p:
        listener, client, server = p.listener, p.client, p.server
        prefix = f"{scheme}://127.0.0.1:"
        assert listener.listen_address.startswith(prefix)
        assert listener.contact_address == listener.listen_address
        host, port = listener.get_host_port()
        assert (host, port) == ("127.0.0.1", int(listener.listen_address.rpartition(":")[2]))
        assert client.peer_address == listener.contact_address
        assert server.local_address == listener.contact_address
        assert client.local_address.startswith(prefix)
        assert server.peer_address == client.local_address
        assert parse_address(client.local_address)[0] == scheme
        assert get_address_host(client.peer_address) == "127.0.0.1"
        assert resolve_address(f"{scheme}://localhost:80") == f"{scheme}://127.0.0.1:80"
        assert get_local_address_for(f"{scheme}://127.0.0.1:80") == f"{scheme}://127.0.0.1"
        assert client.same_host
        for comm in (client, server):
            text = repr(comm)
            assert f"local={comm.local_address}" in text
            assert f"remote={comm.peer_address}" in text
        # dask's handshake on top: both sides know each other's address and settings
        assert client.remote_info["address"] == client.peer_address
        assert server.remote_info["address"] == server.peer_address
        assert client.handshake_options == server.handshake_options
        await client.close()
        assert "(closed)" in repr(client)


async def test_an_empty_host_listens_on_every_interface(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    listener = listen(
        f"{scheme}://:0", echo, default_host="127.0.0.1", **listen_args(scheme, tls_files)
    )
    async with listener:
        assert listener.listen_address.startswith(f"{scheme}://0.0.0.0:")
        port = listener.get_host_port()[1]
        assert listener.contact_address == f"{scheme}://127.0.0.1:{port}"
        comm = await connect_to(listener.contact_address, scheme, tls_files)
        await comm.write("hi")
        assert await comm.read() == "hi"
        await comm.close()


async def test_stop_keeps_established_comms(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """stop() (synchronous, also from a loop callback) refuses newcomers; established
    comms go on."""
    async with pair(scheme, tls_files) as p:
        address = p.listener.contact_address
        asyncio.get_running_loop().call_soon(p.listener.stop)
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="non-started"):
            p.listener.contact_address  # noqa: B018
        with pytest.raises(OSError):
            await connect(address, timeout=0.5, **connect_args(scheme, tls_files))
        await p.client.write("still")
        assert await p.server.read() == "still"
        await p.server.write("here")
        assert await p.client.read() == "here"


async def test_a_comm_still_in_its_handshake_outlives_the_listener(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """dask's own helpers (``get_comm_pair``) leave the listen block as soon as the
    client's connect() returns, when the server's side of dask's handshake may not
    be over: stop() stops accepting and nothing else, so that comm reaches the
    handler after it, and the two talk."""
    servers: asyncio.Queue[Comm] = asyncio.Queue()

    async def handle(comm: Comm) -> None:
        await servers.put(comm)

    for _ in range(5):  # (the server's side is often in its handshake at the exit)
        async with listen_at(scheme, handle, tls_files) as listener:
            client = await connect_to(listener.contact_address, scheme, tls_files)
        server = await asyncio.wait_for(servers.get(), 10)
        try:
            await client.write("hello")
            assert await asyncio.wait_for(server.read(), 10) == "hello"
            await server.write("back")
            assert await asyncio.wait_for(client.read(), 10) == "back"
        finally:
            await client.close()
            await server.close()


async def test_stop_then_abort_handshaking_comms(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """What dask's Server does as it stops: stop(), which keeps a connection still
    in dask's handshake, then abort_handshaking_comms(), which ends it at once."""
    listener = listen_at(scheme, drop, tls_files)
    await listener.start()
    host, port = listener.get_host_port()
    ssl_context = connect_args(scheme, tls_files).get("ssl_context")
    # A client that connects and never sends dask's handshake: the server waits in it.
    if scheme.startswith("anyio+"):
        raw = await anyio_comm.connect(
            f"{scheme.removeprefix('anyio+')}://{host}:{port}", ssl_context=ssl_context
        )

        async def receive() -> bytes:
            try:
                return b"".join(bytes(f) for f in await raw.receive_frames())
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio_comm.PeerClosedError):
                return b""

        close = raw.aclose
    else:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=ssl_context, server_hostname="localhost" if ssl_context else None
        )

        async def receive() -> bytes:
            try:
                return await reader.read(65536)
            except ConnectionError:
                return b""

        async def close() -> None:
            writer.close()

    try:
        assert await asyncio.wait_for(receive(), 10)  # the server's handshake: it is in it
        listener.stop()
        with pytest.raises(asyncio.TimeoutError):  # stop() alone keeps it
            while await asyncio.wait_for(receive(), 0.3):
                pass
        listener.abort_handshaking_comms()

        async def until_the_end() -> None:
            while await receive():
                pass

        await asyncio.wait_for(until_the_end(), 10)
    finally:
        await close()


async def test_await_listen_form(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    """``listener = await listen(...)`` starts it, as ``async with`` does."""
    listener = await listen_at(scheme, echo, tls_files)
    try:
        comm = await connect_to(listener.contact_address, scheme, tls_files)
        await comm.write({"x": 1})
        assert await comm.read() == {"x": 1}
        await comm.close()
    finally:
        listener.stop()


async def test_abort_with_a_read_and_a_write_in_flight(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """A read waiting when its comm is aborted raises CommClosedError; a large write
    under way ends at once, with CommClosedError or done (tcp:// may have taken
    what it could into its buffer)."""
    async with pair(scheme, tls_files) as p:
        reading = asyncio.ensure_future(p.client.read())
        big = np.ones(64 * 2**20, dtype="u1")  # more than the socket buffers take
        writing = asyncio.ensure_future(p.client.write({"x": to_serialize(big)}))
        await asyncio.sleep(0.2)
        assert not reading.done()
        p.client.abort()
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(reading, 10)
        try:
            await asyncio.wait_for(writing, 10)
        except CommClosedError:
            pass
        assert p.client.closed()
        with pytest.raises(CommClosedError):
            await p.client.write("after")


async def test_close_with_a_read_in_flight(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    async with pair(scheme, tls_files) as p:
        reading = asyncio.ensure_future(p.client.read())
        await asyncio.sleep(0.1)
        await asyncio.wait_for(p.client.close(), 10)
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(reading, 10)
        with pytest.raises(CommClosedError):
            await p.server.read()


async def test_close_waits_for_a_write_in_flight(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """close() sends what a write under way began before it closes (tcp:// flushes
    its buffer first: it waits while the peer does not read, and a read in flight
    waits with it); the peer gets the whole message, then the end."""
    async with pair(scheme, tls_files) as p:
        big = np.arange(8 * 2**20, dtype="u8")  # 64 MiB: more than the socket buffers take
        writing = asyncio.ensure_future(p.client.write({"x": to_serialize(big)}))
        await asyncio.sleep(0.2)
        closing = asyncio.ensure_future(p.client.close())
        await asyncio.sleep(0.2)
        assert not closing.done()  # the peer has not read yet
        message = await asyncio.wait_for(p.server.read(), 30)
        np.testing.assert_array_equal(message["x"], big)
        await asyncio.wait_for(closing, 10)
        try:
            await writing
        except CommClosedError:  # (which comms may say once closed meanwhile)
            pass
        with pytest.raises(CommClosedError):
            await asyncio.wait_for(p.server.read(), 10)


async def test_handshake_info(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    """What each side tells the other in dask's handshake, and what they agreed."""
    async with pair(scheme, tls_files) as p:
        for comm in (p.client, p.server):
            info = comm.handshake_info()
            assert set(info) >= {"compression", "python", "pickle-protocol"}
            assert comm.local_info["address"] == comm.local_address
            assert set(comm.handshake_options) >= {"compression", "pickle-protocol"}
        assert p.client.handshake_info() == p.server.handshake_info()


@pytest.mark.skipif(not HAVE_IPV6, reason="no IPv6 loopback")
async def test_ipv6(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    async with listen(f"{scheme}://[::1]:0", echo, **listen_args(scheme, tls_files)) as listener:
        assert listener.contact_address.startswith(f"{scheme}://[::1]:")
        assert get_address_host(listener.contact_address) == "::1"
        comm = await connect_to(listener.contact_address, scheme, tls_files)
        assert comm.peer_address == listener.contact_address
        assert comm.local_address.startswith(f"{scheme}://[::1]:")
        await comm.write(b"six")
        assert await comm.read() == b"six"
        await comm.close()


async def test_extra_info(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    async with pair(scheme, tls_files) as p:
        for comm in (p.client, p.server):
            if is_tls(scheme):
                assert set(comm.extra_info) == {"peercert", "cipher"}
                assert dict(x[0] for x in comm.extra_info["peercert"]["subject"])
                _, protocol, bits = comm.extra_info["cipher"]
                assert protocol.startswith("TLS") and bits >= 128
            else:
                assert comm.extra_info == {}


# -- TLS with dask's Security ---------------------------------------------------


@pytest.mark.parametrize("scheme", TLS_SCHEMES)
async def test_tls_untrusted_certificate_fails_at_once(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """A server certificate from a CA the client does not trust: a fatal error, not
    retried until the timeout."""
    ours, other = tls_files
    async with listen_at(scheme, drop, tls_files) as listener:
        started = time.monotonic()
        with pytest.raises(FatalCommClosedError):
            await connect(
                listener.contact_address,
                timeout=20,
                **ours.security(trust=other).get_connection_args("client"),
            )
        assert time.monotonic() - started < 10


@pytest.mark.parametrize("scheme", TLS_SCHEMES)
async def test_tls_client_certificate_not_trusted_by_the_server(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """The server does not trust the client's certificate: a fatal error, not retried."""
    ours, other = tls_files
    async with listen_at(scheme, drop, tls_files) as listener:
        # a client with a certificate from the other CA, trusting our server
        security = Security(
            tls_ca_file=ours.ca_file,
            tls_client_cert=other.cert_file,
            require_encryption=True,
        )
        started = time.monotonic()
        with pytest.raises(FatalCommClosedError, match="UNKNOWN_CA"):
            comm = await connect(
                listener.contact_address, timeout=5, **security.get_connection_args("client")
            )
            await comm.read()
        assert time.monotonic() - started < 10


@pytest.mark.parametrize("scheme", TLS_SCHEMES)
@pytest.mark.parametrize("check_hostname", [False, True])
async def test_tls_wrong_hostname(
    scheme: str, check_hostname: bool, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """dask's contexts do not check the host name (a cluster's certificates rarely name
    its hosts); a context that does refuses a certificate for another name."""
    args = connect_args(scheme, tls_files)
    args["ssl_context"].check_hostname = check_hostname

    async with listen_at(scheme, echo, tls_files) as listener:
        address = listener.contact_address
        if check_hostname:
            with pytest.raises(FatalCommClosedError):
                await connect(address, timeout=10, server_hostname="wrong.example", **args)
        else:
            comm = await connect(address, timeout=10, server_hostname="wrong.example", **args)
            await comm.write(1)
            assert await comm.read() == 1
            await comm.close()


async def test_encryption_required(scheme: str, tls_files: tuple[TLSFiles, TLSFiles]) -> None:
    """With require_encryption, TLS schemes work and the others are refused."""
    args = tls_files[0].security().get_connection_args("client")  # require_encryption=True
    if is_tls(scheme):
        async with listen_at(scheme, echo, tls_files) as listener:
            comm = await connect(listener.contact_address, timeout=10, **args)
            await comm.write(1)
            assert await comm.read() == 1
            await comm.close()
    else:
        with pytest.raises(RuntimeError, match="encryption required"):
            await connect(f"{scheme}://127.0.0.1:1", timeout=1, **args)
        with pytest.raises(RuntimeError, match="encryption required"):
            listen(f"{scheme}://127.0.0.1:0", lambda comm: None, **args)


# -- dask's Server and connection pool ----------------------------------------


async def test_server_rpc_and_connection_pool(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """dask's Server answers rpc calls; its ConnectionPool reuses comms and sees the
    idle ones closed when the server goes away."""

    async def add(x: int, y: int) -> int:
        return x + y

    def echo_array(data: Any) -> Any:
        return to_serialize(data)

    security = tls_files[0].security() if is_tls(scheme) else Security()
    client_args = security.get_connection_args("client")
    server = Server({"add": add, "echo_array": echo_array})
    await server.listen(f"{scheme}://127.0.0.1:0", **listen_args(scheme, tls_files))
    pool = await ConnectionPool(limit=5, connection_args=client_args)
    try:
        address = server.address
        async with rpc(address, connection_args=client_args) as remote:
            assert await remote.add(x=1, y=2) == 3
        results = await asyncio.gather(*(pool(address).add(x=i, y=1) for i in range(20)))
        assert results == [i + 1 for i in range(20)]
        array = np.arange(1_000_000)
        echoed = await pool(address).echo_array(data=to_serialize(array))
        np.testing.assert_array_equal(echoed, array)
        assert pool.open <= 5
        idle = list(pool.available[address])
        assert idle
        await server.close()
        # the pool's idle comms are seen closed by the server, without being used
        await wait_until(lambda: all(comm.closed() for comm in idle))
    finally:
        await pool.close()
        await server.close()


def test_importing_anyio_comm_does_not_import_dask() -> None:
    import subprocess

    code = "import anyio_comm, sys; anyio_comm.Comm; assert 'distributed' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_configuration_is_respected() -> None:
    from anyio_comm.dask import DASK_LIMITS, buffer_pool, dask_allocator, dask_options

    with dask.config.set(
        {"distributed.comm.timeouts.connect": "7s", "distributed.comm.timeouts.tcp": "45s"}
    ):
        options = dask_options()
    assert options.handshake_timeout == 7
    assert options.keepalive == 45
    assert options.message_timeout is None
    assert options.limits == DASK_LIMITS
    # frames larger than 64 KiB go into the process's buffer pool, smaller ones
    # into bytearrays
    assert options.allocator is dask_allocator
    assert type(dask_allocator(1 << 16)) is bytearray
    before = buffer_pool().statistics().buffers_in_use
    large = memoryview(dask_allocator((1 << 16) + 1))
    assert large.nbytes == (1 << 16) + 1 and not large.readonly
    assert type(large.obj) is not bytearray
    assert buffer_pool().statistics().buffers_in_use == before + 1


@pytest.fixture
def fresh_buffer_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dask backend's process-wide pool, made anew from the configuration."""
    import anyio_comm.dask

    monkeypatch.setattr(anyio_comm.dask, "_pool", None)
    monkeypatch.setattr(anyio_comm.dask, "_trim_timer", None)


@pytest.mark.usefixtures("fresh_buffer_pool")
def test_buffer_pool_configuration() -> None:
    from anyio_comm.dask import buffer_pool

    with dask.config.set(
        {"anyio-comm.buffer-pool.max-free": "64 MiB", "anyio-comm.buffer-pool.free-for": "2s"}
    ):
        pool = buffer_pool()
    assert (pool.max_free_bytes, pool.free_for) == (64 * 2**20, 2.0)
    assert pool.max_small_bytes == 4 * 2**20
    assert buffer_pool() is pool  # one per process


@pytest.mark.usefixtures("fresh_buffer_pool")
def test_buffer_pool_max_free_0_keeps_nothing() -> None:
    from anyio_comm.dask import buffer_pool, dask_allocator

    with dask.config.set({"anyio-comm.buffer-pool.max-free": 0}):
        pool = buffer_pool()
    assert (pool.max_free_bytes, pool.max_small_bytes) == (0, 0)
    for nbytes in (8000, 8000, 200_000, 200_000):
        frame = dask_allocator(nbytes)
        del frame
    stats = pool.statistics()
    assert (stats.free_bytes, stats.small_kept_bytes, stats.small_reused) == (0, 0, 0)


@pytest.mark.usefixtures("fresh_buffer_pool")
def test_buffer_pool_defaults_follow_dask() -> None:
    from anyio_comm.dask import buffer_pool

    with dask.config.set({"distributed.worker.memory.recent-to-old-time": "12s"}):
        pool = buffer_pool()
    assert (pool.max_free_bytes, pool.free_for) == (2**30, 12.0)


@pytest.mark.usefixtures("fresh_buffer_pool")
@pytest.mark.parametrize("scheme", ANYIO_SCHEMES)
async def test_received_arrays_reuse_memory_and_held_ones_never_change(
    scheme: str, tls_files: tuple[TLSFiles, TLSFiles]
) -> None:
    """dask's arrays received through the pool: the memory of dropped ones is reused,
    arrays still held (as received, or as views) keep their values; what nothing
    holds is released once free-for passed."""
    from anyio_comm.dask import buffer_pool

    kept = []
    with dask.config.set({"anyio-comm.buffer-pool.free-for": "0.5s"}):
        async with pair(scheme, tls_files) as p:
            for i in range(30):
                array = np.full(2**19, i, dtype="f8")  # 4 MiB
                write = asyncio.ensure_future(p.client.write({"i": i, "x": to_serialize(array)}))
                received = await p.server.read()
                await write
                assert received["i"] == i
                np.testing.assert_array_equal(received["x"], array)
                assert received["x"].flags.writeable
                if i % 4 == 0:
                    kept.append((i, received["x"] if i % 8 else received["x"][10:].view("u1")))
                del received
            gc.collect()
            for i, held in kept:
                assert (held.view("f8") == i).all()
            stats = buffer_pool().statistics()
            assert stats.reused >= 20
            assert stats.buffers_in_use == len(kept)
            del kept, held
            gc.collect()
            await asyncio.sleep(1.5)  # the read's trim timer fires after free-for
            assert buffer_pool().statistics().free_bytes == 0
