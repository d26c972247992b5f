"""connect() to a host name with several addresses: Happy Eyeballs (RFC 8305).

The resolver is replaced by one that gives a made-up name the loopback
addresses a test needs (each with its own port): one that serves, one that
refuses (a closed port), one that never answers (a "blackhole": a listening
socket that never accepts, whose one-connection queue is full, so the kernel
drops further SYNs and connect() hangs for minutes).
"""

from __future__ import annotations

import errno
import math
import os
import socket
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import anyio
import pytest

import anyio_comm
from anyio_comm import Comm
from anyio_comm import _connect as connect_module
from anyio_comm._connect import HAPPY_EYEBALLS_DELAY, interleave_families

from .certs import client_context, server_context
from .conftest import HAVE_IPV6

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Iterator

NAME = "several.test"  # never looked up: the resolver below answers for it
needs_ipv6 = pytest.mark.skipif(not HAVE_IPV6, reason="::1 does not work on this machine")


async def echo(comm: Comm) -> None:
    async for message in comm:
        await comm.send(message)


def info(host: str, port: int) -> tuple[Any, ...]:
    """One ``getaddrinfo`` result for ``host`` (an IP literal)."""
    if ":" in host:
        return (socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port, 0, 0))
    return (socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))


def resolve_to(monkeypatch: pytest.MonkeyPatch, *infos: tuple[Any, ...]) -> None:
    """Make ``NAME`` resolve to ``infos``, in that order."""

    async def getaddrinfo(host: str, port: Any, **kwargs: Any) -> list[tuple[Any, ...]]:
        assert host == NAME, host
        return list(infos)

    monkeypatch.setattr(anyio, "getaddrinfo", getaddrinfo)


def closed_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct ports nobody listens on: connecting there is refused at once.

    All sockets stay bound until every port is chosen, so the kernel cannot
    hand out the same free port twice.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets = [socket.socket(family) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def closed_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on: connecting there is refused at once."""
    return closed_ports(1, host)[0]


@contextmanager
def blackhole(host: str = "127.0.0.1") -> Iterator[int]:
    """The port of a listener where connect() hangs: its queue is full, it never accepts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = socket.socket(family)
    fillers: list[socket.socket] = []
    try:
        server.bind((host, 0))
        server.listen(0)
        for _ in range(4):
            filler = socket.socket(family)
            fillers.append(filler)
            filler.setblocking(False)
            filler.connect_ex(server.getsockname())
        yield int(server.getsockname()[1])
    finally:
        for filler in fillers:
            filler.close()
        server.close()


@asynccontextmanager
async def serving(host: str = "127.0.0.1") -> AsyncIterator[int]:
    """The port of an echo listener on ``host``."""
    address = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
    async with anyio_comm.listen(address, echo) as listener:
        yield int(listener.address.rpartition(":")[2])


class Attempts:
    """Records every socket connect() tries, and when each attempt started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sockets: list[socket.socket] = []
        self.targets: list[tuple[str, int]] = []
        self.started: list[float] = []
        real = connect_module._connect_socket

        async def recording(sock: socket.socket, sockaddr: Any) -> None:
            self.sockets.append(sock)
            self.targets.append((sockaddr[0], sockaddr[1]))
            self.started.append(anyio.current_time())
            await real(sock, sockaddr)

        monkeypatch.setattr(connect_module, "_connect_socket", recording)

    def open_sockets(self) -> list[socket.socket]:
        return [sock for sock in self.sockets if sock.fileno() != -1]


async def check_echo(comm: Comm) -> None:
    await comm.send({"hello": 1})
    with anyio.fail_after(5):
        assert await comm.receive() == {"hello": 1}


# -- order -------------------------------------------------------------------


def test_families_alternate_starting_with_the_first_returned() -> None:
    a6, b6, c6 = info("::1", 1), info("::1", 2), info("::1", 3)
    a4, b4 = info("127.0.0.1", 4), info("127.0.0.1", 5)
    assert interleave_families([a6, b6, c6, a4, b4]) == [a6, a4, b6, b4, c6]
    assert interleave_families([a4, a6, b6, b4]) == [a4, a6, b4, b6]
    assert interleave_families([a4, b4]) == [a4, b4]
    assert interleave_families([a6]) == [a6]


# -- one address: no race ----------------------------------------------------


async def test_one_address_is_connected_directly(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_race(*args: Any) -> socket.socket:
        raise AssertionError("one address needs no race")

    monkeypatch.setattr(connect_module, "_connect_first", no_race)
    async with serving() as port:
        async with await anyio_comm.connect(f"tcp://127.0.0.1:{port}", timeout=10) as comm:
            await check_echo(comm)
        resolve_to(monkeypatch, info("127.0.0.1", port))
        async with await anyio_comm.connect(f"tcp://{NAME}:{port}", timeout=10) as comm:
            await check_echo(comm)


async def test_localhost_without_a_fake_resolver() -> None:
    async with serving() as port:
        async with await anyio_comm.connect(f"tcp://localhost:{port}", timeout=10) as comm:
            await check_echo(comm)
            assert comm.peer_address == f"tcp://127.0.0.1:{port}"


# -- several addresses -------------------------------------------------------


async def test_a_refused_address_starts_the_next_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = Attempts(monkeypatch)
    refused = closed_port()
    async with serving() as port:
        resolve_to(monkeypatch, info("127.0.0.1", refused), info("127.0.0.1", port))
        with anyio.fail_after(5):  # far less than the delay: the refusal started the next
            comm = await anyio_comm.connect(
                f"tcp://{NAME}:{port}", timeout=20, happy_eyeballs_delay=30
            )
        async with comm:
            await check_echo(comm)
            assert attempts.targets == [("127.0.0.1", refused), ("127.0.0.1", port)]
            assert attempts.open_sockets() == [attempts.sockets[1]]
    assert attempts.open_sockets() == []


async def test_an_address_that_never_answers_is_passed_after_the_delay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts = Attempts(monkeypatch)
    with blackhole() as silent:
        async with serving() as port:
            resolve_to(monkeypatch, info("127.0.0.1", silent), info("127.0.0.1", port))
            start = anyio.current_time()
            # The silent attempt alone would hang for minutes (SYN retransmits).
            with anyio.fail_after(5):
                comm = await anyio_comm.connect(f"tcp://{NAME}:{port}")
            assert anyio.current_time() - start < 5
            async with comm:
                await check_echo(comm)
                assert attempts.targets == [("127.0.0.1", silent), ("127.0.0.1", port)]
                waited = attempts.started[1] - attempts.started[0]
                assert HAPPY_EYEBALLS_DELAY - 0.05 <= waited < 4
                # the pending attempt was cancelled and its socket closed
                assert attempts.open_sockets() == [attempts.sockets[1]]


@pytest.mark.parametrize("delay", [0, 0.05, math.inf])
async def test_the_delay_is_an_option(monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
    attempts = Attempts(monkeypatch)
    with blackhole() as silent:
        async with serving() as port:
            resolve_to(
                monkeypatch,
                info("127.0.0.1", closed_port()),
                info("127.0.0.1", silent),
                info("127.0.0.1", port),
            )
            address = f"tcp://{NAME}:{port}"
            if delay == math.inf:  # one after another: the silent address holds it up
                with pytest.raises(TimeoutError):
                    await anyio_comm.connect(address, timeout=1, happy_eyeballs_delay=delay)
                assert len(attempts.sockets) == 2
                assert attempts.open_sockets() == []
                return
            with anyio.fail_after(5):
                comm = await anyio_comm.connect(address, happy_eyeballs_delay=delay)
            async with comm:
                await check_echo(comm)
                assert len(attempts.sockets) == 3
                assert attempts.open_sockets() == [attempts.sockets[2]]


@pytest.mark.parametrize(
    ("value", "error"),
    [(-0.1, ValueError), (float("nan"), ValueError), ("1", TypeError), (True, TypeError)],
)
async def test_bad_delay(value: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="happy_eyeballs_delay"):
        await anyio_comm.connect("tcp://127.0.0.1:9", happy_eyeballs_delay=value)


async def test_two_that_connect_leave_one_socket_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both attempts connect (each waits for the other's socket before it returns), one
    wins, the other's socket is closed."""
    attempts = Attempts(monkeypatch)
    recording = connect_module._connect_socket
    connected = 0
    both = anyio.Event()

    async def after_both(sock: socket.socket, sockaddr: Any) -> None:
        nonlocal connected
        await recording(sock, sockaddr)
        connected += 1
        if connected % 2 == 0:
            both.set()
        await both.wait()

    monkeypatch.setattr(connect_module, "_connect_socket", after_both)
    async with serving() as port1, serving() as port2:
        resolve_to(monkeypatch, info("127.0.0.1", port1), info("127.0.0.1", port2))
        with anyio.fail_after(5):
            comm = await anyio_comm.connect(f"tcp://{NAME}:{port1}", happy_eyeballs_delay=0)
        async with comm:
            assert connected == 2
            await check_echo(comm)
            assert len(attempts.open_sockets()) == 1
        assert attempts.open_sockets() == []


async def test_tls_over_the_address_that_connected(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = closed_port()
    async with anyio_comm.listen(
        "tls://127.0.0.1:0", echo, ssl_context=server_context()
    ) as listener:
        port = int(listener.address.rpartition(":")[2])
        resolve_to(monkeypatch, info("127.0.0.1", refused), info("127.0.0.1", port))
        with anyio.fail_after(10):
            comm = await anyio_comm.connect(
                f"tls://{NAME}:{port}", ssl_context=client_context(), server_hostname="localhost"
            )
        async with comm:
            await check_echo(comm)
            assert comm.peer_address == f"tls://127.0.0.1:{port}"


# -- every address fails -----------------------------------------------------


async def test_all_refused_is_a_refusal_naming_every_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts = Attempts(monkeypatch)
    ports = closed_ports(3)
    resolve_to(monkeypatch, *(info("127.0.0.1", port) for port in ports))
    address = f"tcp://{NAME}:{ports[0]}"
    with anyio.fail_after(5), pytest.raises(ConnectionRefusedError) as exc_info:
        await anyio_comm.connect(address)
    assert exc_info.value.errno == errno.ECONNREFUSED
    message = str(exc_info.value)
    assert (
        f"Connection refused at 127.0.0.1:{ports[0]}, 127.0.0.1:{ports[1]} "
        f"and 127.0.0.1:{ports[2]}" in message
    )
    assert address in message
    assert attempts.open_sockets() == []

    # retry=True retries it like any refusal, and reports it at the deadline
    with anyio.fail_after(10), pytest.raises(TimeoutError) as timeout_info:
        await anyio_comm.connect(address, retry=True, timeout=0.3)
    assert isinstance(timeout_info.value.__cause__, ConnectionRefusedError)
    assert f"127.0.0.1:{ports[2]}" in str(timeout_info.value)
    assert attempts.open_sockets() == []


async def test_different_failures_are_each_named(monkeypatch: pytest.MonkeyPatch) -> None:
    # An unroutable address cannot be reached from a loopback-only test: the
    # kernel's answer (ENETUNREACH) is simulated for one port.
    unreachable, refused = closed_ports(2)
    real = connect_module._connect_socket

    async def connect_socket(sock: socket.socket, sockaddr: Any) -> None:
        if sockaddr[1] == unreachable:
            raise OSError(errno.ENETUNREACH, os.strerror(errno.ENETUNREACH))
        await real(sock, sockaddr)

    monkeypatch.setattr(connect_module, "_connect_socket", connect_socket)
    resolve_to(monkeypatch, info("127.0.0.1", unreachable), info("127.0.0.1", refused))
    with anyio.fail_after(5), pytest.raises(OSError) as exc_info:
        await anyio_comm.connect(f"tcp://{NAME}:4000")
    assert exc_info.value.errno is None
    assert str(exc_info.value) == (
        f"no address of tcp://{NAME}:4000 accepted the connection: "
        f"127.0.0.1:{unreachable} ({os.strerror(errno.ENETUNREACH)}), "
        f"127.0.0.1:{refused} ({os.strerror(errno.ECONNREFUSED)})"
    )


# -- cancellation ------------------------------------------------------------


async def test_cancelling_connect_closes_every_pending_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    attempts = Attempts(monkeypatch)
    with blackhole() as silent1, blackhole() as silent2:
        resolve_to(monkeypatch, info("127.0.0.1", silent1), info("127.0.0.1", silent2))
        address = f"tcp://{NAME}:{silent1}"
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio_comm.connect, address)
            with anyio.fail_after(5):
                while len(attempts.sockets) < 2:
                    await anyio.sleep(0.01)
            assert len(attempts.open_sockets()) == 2
            tg.cancel_scope.cancel()
        assert attempts.open_sockets() == []

        # the same when connect's own timeout expires
        with anyio.fail_after(5), pytest.raises(TimeoutError, match=r"timed out after 0\.5 s"):
            await anyio_comm.connect(address, timeout=0.5)
        assert len(attempts.sockets) == 4
        assert attempts.open_sockets() == []


# -- IPv6 and IPv4 -----------------------------------------------------------


@needs_ipv6
async def test_ipv6_refused_then_ipv4(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = Attempts(monkeypatch)
    refused6, refused6_again = closed_ports(2, "::1")
    async with serving("127.0.0.1") as port:
        # families alternate: the second IPv6 address waits behind the IPv4 one
        resolve_to(
            monkeypatch,
            info("::1", refused6),
            info("::1", refused6_again),
            info("127.0.0.1", port),
        )
        with anyio.fail_after(5):
            comm = await anyio_comm.connect(f"tcp://{NAME}:{port}")
        async with comm:
            await check_echo(comm)
            assert comm.peer_address == f"tcp://127.0.0.1:{port}"
            assert attempts.targets == [("::1", refused6), ("127.0.0.1", port)]


@needs_ipv6
async def test_ipv4_silent_then_ipv6(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts = Attempts(monkeypatch)
    with blackhole("127.0.0.1") as silent:
        async with serving("::1") as port:
            resolve_to(monkeypatch, info("127.0.0.1", silent), info("::1", port))
            with anyio.fail_after(5):
                comm = await anyio_comm.connect(f"tcp://{NAME}:{port}")
            async with comm:
                await check_echo(comm)
                assert comm.peer_address == f"tcp://[::1]:{port}"
                assert attempts.open_sockets() == [attempts.sockets[1]]
