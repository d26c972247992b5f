"""Client side: open a connection to an address and return a Comm."""

from __future__ import annotations

import ipaddress
import math
import os
import random
import socket
import ssl
from typing import TYPE_CHECKING, Any, Final

import anyio
from anyio import BrokenResourceError, wait_writable

from ._addressing import Address, check_tls_options, format_socket_address, parse_address
from ._comm import Comm, establish
from ._inproc import connect_inproc
from ._options import CommOptions, check_seconds, make_options
from ._sansio.decoder import DEFAULT_READ_BUFFER_SIZE
from ._sansio.serialization import DEFAULT_OOB_THRESHOLD
from ._transports.rawsocket import SocketTransport
from ._transports.stream import StreamTransport
from ._transports.tls import TLSTransport

if TYPE_CHECKING:
    from anyio.abc import ByteStream

    from ._sansio.buffers import Allocator
    from ._sansio.wire import Limits
    from ._transports.base import Transport

__all__ = [
    "configure_socket",
    "connect",
    "from_stream",
    "keepalive_settings",
    "open_socket",
    "resolve_tcp",
]

_HAS_UNIX: Final = hasattr(socket, "AF_UNIX")
#: keepalive probes sent before the connection is declared dead
KEEPALIVE_PROBES: Final = 5
#: connect(retry=True): the first pause is about this long, then it doubles ...
RETRY_FIRST_DELAY: Final = 0.02
#: ... up to this
RETRY_MAX_DELAY: Final = 1.0


def keepalive_settings(seconds: float) -> tuple[int, int, int, int]:
    """TCP keepalive parameters that detect a dead peer in about ``seconds``.

    Returns:
        ``(idle, interval, probes, user_timeout_ms)``: probes start after
        ``idle`` seconds of silence and repeat every ``interval`` seconds; after
        ``probes`` unanswered probes (or ``user_timeout_ms`` with sent data
        unacknowledged) the kernel reports the connection dead.
    """
    idle = max(1, int(seconds / 2))
    interval = max(1, int((seconds - idle) / KEEPALIVE_PROBES))
    return idle, interval, KEEPALIVE_PROBES, max(1, int(seconds * 1000))


def configure_socket(sock: socket.socket, keepalive: float | None = None) -> None:
    """Make ``sock`` non-blocking; for TCP, disable Nagle's algorithm and set keepalive."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if keepalive is not None:
            idle, interval, probes, user_timeout = keepalive_settings(keepalive)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            # TCP_KEEPIDLE is TCP_KEEPALIVE on macOS; TCP_USER_TIMEOUT is Linux only
            for name, value in (
                ("TCP_KEEPIDLE", idle),
                ("TCP_KEEPALIVE", idle),
                ("TCP_KEEPINTVL", interval),
                ("TCP_KEEPCNT", probes),
                ("TCP_USER_TIMEOUT", user_timeout),
            ):
                option = getattr(socket, name, None)
                if option is not None:
                    sock.setsockopt(socket.IPPROTO_TCP, option, value)


async def _connect_socket(sock: socket.socket, sockaddr: Any) -> None:
    try:
        sock.connect(sockaddr)
    except (BlockingIOError, InterruptedError):
        await wait_writable(sock)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err)) from None


async def resolve_tcp(host: str, port: int, *, passive: bool = False) -> list[tuple[Any, ...]]:
    """Resolve ``host`` like ``getaddrinfo``, without a lookup for IP literals.

    (On asyncio, ``getaddrinfo`` runs in a worker thread: a round trip through
    the thread pool for every connection to ``127.0.0.1``, otherwise.)

    Raises:
        socket.gaierror: the name does not resolve.
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if ip is None or "%" in host:  # names, and IPv6 literals with a scope
        return await anyio.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE if passive else 0
        )
    if ip.version == 6:
        return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port, 0, 0))]
    return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]


async def open_socket(
    scheme: str, host: str, port: int, path: str, keepalive: float | None = None
) -> socket.socket:
    """Connect a non-blocking TCP or Unix socket.

    Tries every address ``host`` resolves to, in order, and raises the last
    error if none accepts.

    Raises:
        OSError: resolution failed (``socket.gaierror``) or no address
            accepted the connection.
    """
    if scheme == "unix":
        if not _HAS_UNIX:  # pragma: no cover
            raise OSError("Unix sockets are not supported on this platform")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await _connect_socket(sock, path)
        except BaseException:
            sock.close()
            raise
        return sock

    infos = await resolve_tcp(host, port)
    error: OSError | None = None
    for family, type_, proto, _, sockaddr in infos:
        sock = socket.socket(family, type_, proto)
        try:
            configure_socket(sock, keepalive)
            await _connect_socket(sock, sockaddr)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    assert error is not None
    raise error


def _with_address(exc: OSError, address: str) -> OSError:
    """The same error, its message naming the address we tried to reach."""
    if exc.errno is None or isinstance(exc, ssl.SSLError):
        return exc  # our own messages already say it; TLS errors keep their fields
    what = "resolving" if isinstance(exc, socket.gaierror) else "connecting to"
    clear = type(exc)(exc.errno, f"{exc.strerror} ({what} {address})")
    return clear.with_traceback(exc.__traceback__)


def _retry_delay(attempt: int) -> float:
    """Exponential backoff with jitter: half the nominal delay, plus up to half again."""
    nominal = min(RETRY_MAX_DELAY, RETRY_FIRST_DELAY * 2.0 ** min(attempt, 20))
    return nominal / 2 + random.uniform(0, nominal / 2)


async def connect(
    address: str,
    *,
    timeout: float | None = None,
    retry: bool = False,
    keepalive: float | None = None,
    idle_timeout: float | None = None,
    limits: Limits | None = None,
    read_buffer_size: int = DEFAULT_READ_BUFFER_SIZE,
    allocator: Allocator | None = None,
    oob_threshold: int = DEFAULT_OOB_THRESHOLD,
    allow_pickle: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
) -> Comm:
    """Connect to ``address`` and complete the anyio-comm handshake.

    Args:
        address: ``tcp://host:port`` (``tcp://[::1]:port`` for IPv6),
            ``tls://host:port``, ``unix:///path`` or ``inproc://name``.
        timeout: seconds for connecting and the handshakes (TLS and
            anyio-comm) together, retries included; ``None`` waits as long as
            the operating system does (and with ``retry``, retries forever).
        retry: keep trying while the peer is not up yet: after a refused
            connection, a missing ``unix://`` socket file or ``inproc://``
            name, a failed name lookup, an unreachable network, or a
            connection dropped during the handshake, wait and try again
            (exponential backoff from about 20 ms to 1 s, with jitter) until
            ``timeout`` expires. TLS errors and protocol errors are not retried.
        keepalive: for TCP and TLS, turn on TCP keepalive so that a peer that
            vanished without a word (host down, network cut) is detected in
            about this many seconds of silence (probes start after half of it);
            on Linux, also unacknowledged sent data fails the connection after
            this long (``TCP_USER_TIMEOUT``). ``None`` leaves the system default
            (keepalive off).
        idle_timeout: :meth:`Comm.receive` fails with :exc:`IdleTimeoutError`
            (and the connection is closed) when no byte arrives for this many
            seconds while it waits; ``None`` waits forever.
        limits: our receive limits, announced to the peer.
        read_buffer_size: size of the read-ahead buffer (>= 4096).
        allocator: allocates receive buffers, ``allocator(n)`` returning a
            writable buffer of ``n`` bytes (default ``bytearray``).
        oob_threshold: bytes-like values of at least this size travel as
            out-of-band frames.
        allow_pickle: pickle what msgpack cannot encode and accept pickled
            data from the peer. Trusted peers only.
        ssl_context: required for ``tls://`` (and only allowed there): the
            client context, e.g. ``ssl.create_default_context(cafile=...)``.
        server_hostname: the name to verify the server certificate against
            (and to send as SNI); defaults to the address's host.

    Returns:
        The connected comm; close it with ``aclose()`` or ``async with``.

    Raises:
        ValueError: malformed address, unknown scheme, invalid option, or
            ``ssl_context`` missing for ``tls://`` (or given for another scheme).
        TypeError: a duration option is not a number.
        ssl.SSLError: the TLS handshake failed; ``ssl.SSLCertVerificationError``
            for an untrusted or expired certificate or a hostname mismatch.
        TimeoutError: ``timeout`` expired; with ``retry``, its ``__cause__``
            is the error of the last attempt.
        OSError: the connection failed, and the message names the address:
            ``socket.gaierror`` (the name did not resolve),
            ``ConnectionRefusedError`` (nobody listens there; also for an
            ``inproc://`` name with no listener), ``FileNotFoundError`` (no
            ``unix://`` socket file), ``OSError`` with ``errno.ENETUNREACH`` or
            ``errno.EHOSTUNREACH`` (no route).
        RemoteProtocolError: the peer does not speak anyio-comm.
        anyio.BrokenResourceError: the connection failed during the handshake.
    """
    parsed = parse_address(address)
    check_tls_options(parsed, ssl_context)
    check_seconds("timeout", timeout)
    check_seconds("keepalive", keepalive)
    options = make_options(
        limits, read_buffer_size, allocator, oob_threshold, allow_pickle, idle_timeout
    )
    deadline = math.inf if timeout is None else anyio.current_time() + timeout
    attempt = 0
    while True:
        try:
            with anyio.move_on_after(deadline - anyio.current_time()) as scope:
                return await _connect_once(
                    address, parsed, options, keepalive, ssl_context, server_hostname
                )
        except ssl.SSLError:
            raise
        except (OSError, BrokenResourceError) as exc:
            if not retry:
                raise
            last_error: BaseException = exc
        else:
            assert scope.cancelled_caught
            message = f"connecting to {address} timed out after {timeout:g} s"
            if attempt:
                message += f" and {attempt + 1} attempts; last error: {last_error!r}"
                raise TimeoutError(message) from last_error
            raise TimeoutError(message)
        remaining = deadline - anyio.current_time()
        delay = _retry_delay(attempt)
        attempt += 1
        if delay >= remaining:
            await anyio.sleep(max(0.0, remaining))
            raise TimeoutError(
                f"could not connect to {address} within {timeout:g} s "
                f"({attempt} attempts); last error: {last_error!r}"
            ) from last_error
        await anyio.sleep(delay)


async def _connect_once(
    address: str,
    parsed: Address,
    options: CommOptions,
    keepalive: float | None,
    ssl_context: ssl.SSLContext | None,
    server_hostname: str | None,
) -> Comm:
    if parsed.scheme == "inproc":
        return await connect_inproc(parsed.path, options)
    try:
        sock = await open_socket(parsed.scheme, parsed.host, parsed.port, parsed.path, keepalive)
    except OSError as exc:
        raise _with_address(exc, address) from None
    transport: Transport = SocketTransport(sock)
    try:
        if parsed.scheme == "unix":
            local, peer = "unix://", address
            name = sock.getsockname()
            if name:
                local = format_socket_address(sock.family, name)
        else:
            local = format_socket_address(sock.family, sock.getsockname(), parsed.scheme)
            peer = format_socket_address(sock.family, sock.getpeername(), parsed.scheme)
        if ssl_context is not None:
            transport = TLSTransport(
                transport,
                ssl_context,
                server_side=False,
                server_hostname=server_hostname or parsed.host,
            )
        return await establish(transport, options, local_address=local, peer_address=peer)
    except BaseException:
        transport.abort()
        raise


async def from_stream(
    stream: ByteStream,
    *,
    timeout: float | None = None,
    idle_timeout: float | None = None,
    limits: Limits | None = None,
    read_buffer_size: int = DEFAULT_READ_BUFFER_SIZE,
    allocator: Allocator | None = None,
    oob_threshold: int = DEFAULT_OOB_THRESHOLD,
    allow_pickle: bool = False,
    local_address: str = "stream://",
    peer_address: str = "stream://",
) -> Comm:
    """Run the anyio-comm protocol over any AnyIO byte stream.

    Both ends call this (the handshake is symmetric). Every byte is copied
    through the stream's ``receive()`` / ``send()``: the generic path, for
    streams a socket address cannot describe (a ``TLSStream`` you built, a
    stapled or memory stream, ...). The comm owns ``stream`` and closes it.

    Args:
        stream: a connected :class:`anyio.abc.ByteStream`.
        timeout: seconds for the handshake.
        local_address, peer_address: strings reported by the comm.
        idle_timeout, limits, read_buffer_size, allocator, oob_threshold, allow_pickle: as
            in :func:`connect`.

    Raises:
        ValueError: invalid option.
        TypeError: a duration option is not a number.
        TimeoutError: ``timeout`` expired.
        RemoteProtocolError: the peer does not speak anyio-comm.
        anyio.BrokenResourceError: the stream failed during the handshake.
    """
    check_seconds("timeout", timeout)
    options = make_options(
        limits, read_buffer_size, allocator, oob_threshold, allow_pickle, idle_timeout
    )
    transport = StreamTransport(stream)
    try:
        with anyio.fail_after(timeout):
            return await establish(
                transport, options, local_address=local_address, peer_address=peer_address
            )
    except BaseException:
        transport.abort()
        raise
