"""Client side: open a connection to an address and return a Comm."""

from __future__ import annotations

import ipaddress
import itertools
import math
import os
import random
import re
import socket
import ssl
from typing import TYPE_CHECKING, Any, Final

import anyio
from anyio import BrokenResourceError, aclose_forcefully, wait_writable
from anyio.abc import SocketAttribute

from ._addressing import (
    Address,
    check_connectable,
    check_tls_options,
    format_socket_address,
    format_tcp,
    parse_address,
    with_address,
)
from ._comm import Comm, establish
from ._exceptions import RemoteProtocolError
from ._inproc import connect_inproc
from ._options import Options, OptionsKeywords, check_seconds, resolve_options
from ._sansio.wire import MAGIC
from ._transports.rawsocket import SocketTransport
from ._transports.stream import StreamTransport
from ._transports.tls import TLSTransport, looks_like_tls_record

if TYPE_CHECKING:
    from anyio.abc import ByteStream

    from ._compat import Unpack
    from ._transports.base import Transport

__all__ = [
    "configure_socket",
    "connect",
    "from_stream",
    "interleave_families",
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
#: connect(): with several addresses, the next attempt starts when the one
#: before failed or after this many seconds (RFC 8305's recommended
#: "Connection Attempt Delay", also anyio.connect_tcp's default)
HAPPY_EYEBALLS_DELAY: Final = 0.25


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
            host or None,  # "": every interface (with passive)
            port,
            type=socket.SOCK_STREAM,
            flags=socket.AI_PASSIVE if passive else 0,
        )
    if ip.version == 6:
        return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port, 0, 0))]
    return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]


async def open_socket(
    scheme: str,
    host: str,
    port: int,
    path: str,
    keepalive: float | None = None,
    happy_eyeballs_delay: float = HAPPY_EYEBALLS_DELAY,
) -> socket.socket:
    """Connect a non-blocking TCP or Unix socket.

    A host name with several addresses is connected the Happy Eyeballs way
    (RFC 8305), as :func:`anyio.connect_tcp` does: see :func:`_connect_first`.
    One address (an IP literal, a name with one address) is connected
    directly.

    Raises:
        OSError: resolution failed (``socket.gaierror``) or no address
            accepted the connection (for several addresses, the message says
            what each one answered).
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
    if len(infos) == 1:
        return await _open_tcp(infos[0], keepalive)
    return await _connect_first(
        scheme, host, port, interleave_families(infos), keepalive, happy_eyeballs_delay
    )


def interleave_families(infos: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``getaddrinfo`` results in the order RFC 8305 (section 4) tries them.

    The address families alternate, starting with the family of the first
    result (the resolver's preference, RFC 6724); within a family the order
    is kept: ``[a6, b6, c6, a4, b4]`` becomes ``[a6, a4, b6, b4, c6]``.
    """
    by_family: dict[int, list[tuple[Any, ...]]] = {}
    for info in infos:
        by_family.setdefault(info[0], []).append(info)
    if len(by_family) == 1:
        return infos
    rounds = itertools.zip_longest(*by_family.values())
    return [info for infos_of_round in rounds for info in infos_of_round if info is not None]


async def _open_tcp(info: tuple[Any, ...], keepalive: float | None) -> socket.socket:
    """A socket connected to one ``getaddrinfo`` result; closed if that fails."""
    family, type_, proto, _, sockaddr = info
    sock = socket.socket(family, type_, proto)
    try:
        configure_socket(sock, keepalive)
        await _connect_socket(sock, sockaddr)
    except BaseException:
        sock.close()
        raise
    return sock


async def _connect_first(
    scheme: str,
    host: str,
    port: int,
    infos: list[tuple[Any, ...]],
    keepalive: float | None,
    delay: float,
) -> socket.socket:
    """The socket of the first of ``infos`` that accepts a connection.

    Each attempt is a task of one task group. The next one starts when the
    attempt started before it failed, or ``delay`` seconds after that one
    started, whichever comes first; the earlier attempts go on meanwhile. The
    first socket connected wins: the task group is cancelled, and every other
    attempt closes its socket (one that connects after the winner closes it
    at once). Cancelling this call does the same and closes the winner too.

    Raises:
        OSError: every attempt failed: see :func:`_attempts_failed`.
    """
    winner: socket.socket | None = None
    failures: list[tuple[int, Any, OSError]] = []

    async def attempt(
        index: int, info: tuple[Any, ...], failed: anyio.Event, group: anyio.CancelScope
    ) -> None:
        nonlocal winner
        try:
            sock = await _open_tcp(info, keepalive)
        except OSError as exc:
            failures.append((index, info[4], exc))
            failed.set()
            return
        if winner is None:
            winner = sock
            group.cancel()
        else:
            sock.close()

    try:
        async with anyio.create_task_group() as tg:
            for index, info in enumerate(infos):
                failed = anyio.Event()
                tg.start_soon(attempt, index, info, failed, tg.cancel_scope)
                with anyio.move_on_after(delay):
                    await failed.wait()
    except BaseException:
        if winner is not None:
            winner.close()
        raise
    if winner is None:
        failures.sort(key=lambda failure: failure[0])
        raise _attempts_failed(scheme, host, port, [(sa, exc) for _, sa, exc in failures])
    return winner


def _attempts_failed(
    scheme: str, host: str, port: int, failures: list[tuple[Any, OSError]]
) -> OSError:
    """The error for a host name none of whose addresses accepted a connection.

    When every address failed the same way (all refused, say), it is that
    error (``ConnectionRefusedError``, its ``errno``) listing the addresses;
    the caller adds the address that was asked for, as for one address.
    Otherwise a plain ``OSError`` (no ``errno``) that names the address asked
    for and, for each address tried, what went wrong.
    """

    def where(sockaddr: Any) -> str:
        return format_tcp(sockaddr[0], sockaddr[1], scheme).partition("://")[2]

    first = failures[0][1]
    if first.errno is not None and all(exc.errno == first.errno for _, exc in failures):
        tried = [where(sockaddr) for sockaddr, _ in failures]
        listed = ", ".join(tried[:-1]) + " and " + tried[-1]
        return OSError(first.errno, f"{first.strerror or os.strerror(first.errno)} at {listed}")
    reasons = ", ".join(f"{where(sockaddr)} ({exc.strerror or exc})" for sockaddr, exc in failures)
    return OSError(
        f"no address of {format_tcp(host, port, scheme)} accepted the connection: {reasons}"
    )


def _with_address(exc: OSError, address: str, scheme: str) -> OSError:
    """The same error, its message naming the address we tried to reach."""
    if isinstance(exc, ssl.SSLError):
        return exc  # TLS errors keep their fields
    if exc.errno is None and scheme != "unix":
        return exc  # our own messages already say it
    # (a unix:// one without errno: Python's "AF_UNIX path too long")
    what = "resolving" if isinstance(exc, socket.gaierror) else "connecting to"
    return with_address(exc, f"{what} {address}")


def _check_delay(delay: float) -> None:
    """Check ``happy_eyeballs_delay``: a number of seconds, 0 to infinity."""
    if isinstance(delay, bool) or not isinstance(delay, (int, float)):
        raise TypeError(f"happy_eyeballs_delay must be a number of seconds, not {delay!r}")
    if not delay >= 0:  # also rejects NaN
        raise ValueError(f"happy_eyeballs_delay must not be negative, not {delay!r}")


#: where in CPython's sources an ``ssl.SSLError`` was made, at the end of its message
_SSL_SOURCE: Final = re.compile(r"\s*\(_ssl\.c:\d+\)$")


def not_tls_hint(first_bytes: bytes, role: str) -> str:
    """What the bytes a peer sent instead of TLS say about it, for an error message
    (``role``: what the peer is, "listener" or "client"); "" when they may begin a
    TLS record, or nothing came: no evidence then."""
    if not first_bytes or looks_like_tls_record(first_bytes):
        return ""
    if len(first_bytes) >= 4 and first_bytes[: len(MAGIC)] == MAGIC[: len(first_bytes)]:
        what = f"the anyio-comm preamble in plain text, as a tcp:// {role} does"
    else:
        what = repr(first_bytes)
    return f"the peer does not speak TLS: it sent {what}"


def _tls_with_address(exc: ssl.SSLError, address: str, first_bytes: bytes) -> ssl.SSLError:
    """The same TLS error (its class, ``reason``, ``library``, ``verify_code``,
    ``verify_message``), its message naming the address, and saying so when the
    peer does not speak TLS at all."""
    text = _SSL_SOURCE.sub("", exc.strerror if isinstance(exc.strerror, str) else str(exc))
    message = f"{text} (TLS handshake with {address})"
    hint = not_tls_hint(first_bytes, "listener")
    if hint:
        message += f": {hint}"
    clear = type(exc)(exc.errno, message)
    clear.__dict__.update(exc.__dict__)
    return clear.with_traceback(exc.__traceback__)


def _handshake_with_address(
    exc: RemoteProtocolError | BrokenResourceError, address: str
) -> RemoteProtocolError | BrokenResourceError:
    """The same handshake error, its message naming the address."""
    message = f"{str(exc) or 'the connection failed'} (handshake with {address})"
    if isinstance(exc, RemoteProtocolError):
        clear: RemoteProtocolError | BrokenResourceError = RemoteProtocolError(
            message, rule=exc.rule
        )
    else:
        clear = BrokenResourceError(message)
    return clear.with_traceback(exc.__traceback__)


def _retry_delay(attempt: int) -> float:
    """Exponential backoff with jitter: half the nominal delay, plus up to half again."""
    nominal = min(RETRY_MAX_DELAY, RETRY_FIRST_DELAY * 2.0 ** min(attempt, 20))
    return nominal / 2 + random.uniform(0, nominal / 2)


async def connect(
    address: str,
    *,
    options: Options | None = None,
    timeout: float | None = None,
    retry: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    early_data: bool = False,
    happy_eyeballs_delay: float = HAPPY_EYEBALLS_DELAY,
    **keywords: Unpack[OptionsKeywords],
) -> Comm:
    """Connect to ``address`` and complete the anyio-comm handshake.

    Args:
        address: ``tcp://host:port`` (``tcp://[::1]:port`` for IPv6),
            ``tls://host:port``, ``unix:///path`` or ``inproc://name``.
        options: per-connection options (:class:`~anyio_comm.Options`); any of
            its fields may also be given as a keyword (``idle_timeout=30``),
            which overrides the field. Our ``limits`` are announced to the
            peer; each attempt's handshake (TLS and anyio-comm) must complete
            within ``handshake_timeout``.
        timeout: seconds for the whole call: connecting and the handshakes,
            retries included; ``None`` waits as long as the operating system
            does (and with ``retry``, retries forever).
        retry: keep trying while the peer is not up yet: after a refused
            connection, a missing ``unix://`` socket file or ``inproc://``
            name, a failed name lookup, an unreachable network, or a
            connection dropped during the handshake, wait and try again
            (exponential backoff from about 20 ms to 1 s, with jitter) until
            ``timeout`` expires. TLS errors and protocol errors are not retried.
        ssl_context: required for ``tls://`` (and only allowed there): the
            client context, e.g. ``ssl.create_default_context(cafile=...)``.
        server_hostname: the name to verify the server certificate against
            (and to send as SNI); defaults to the address's host.
        early_data: return as soon as our preamble is written (after the TLS
            handshake), without waiting for the server's, so that the first
            request goes out at once (saves a round trip and a pass of the
            server's event loop on every new connection). Then the first
            :meth:`~anyio_comm.Comm.receive` reads the server's preamble
            (within ``handshake_timeout``, else :exc:`TimeoutError`) and
            raises what connecting would have raised if it is wrong
            (:exc:`~anyio_comm.RemoteProtocolError`, :exc:`anyio.BrokenResourceError`);
            sends made before it arrived are not checked against the server's
            limits (the server rejects one over them, and the next receive
            raises :exc:`~anyio_comm.PeerClosedError`) and pickle nothing;
            :attr:`~anyio_comm.Comm.peer_handshake` raises :exc:`RuntimeError`
            until it arrived. Works with version-1 servers too.
        happy_eyeballs_delay: for a host name with several addresses, which
            are tried as :func:`anyio.connect_tcp` tries them (Happy Eyeballs,
            RFC 8305: address families alternating, starting with the first
            one the resolver returned), the seconds after which the next
            address is tried while the attempts before it are still pending;
            an attempt that fails starts the next one at once. The first
            connection made wins and the other attempts are abandoned. ``0``
            tries every address at once, ``math.inf`` one after another.

    Returns:
        The connected comm; close it with ``aclose()`` or ``async with``.

    Raises:
        ValueError: malformed address, unknown scheme, invalid option, or
            ``ssl_context`` missing for ``tls://`` (or given for another scheme).
        TypeError: an unknown keyword, or an option of the wrong type.
        ssl.SSLError: the TLS handshake failed; ``ssl.SSLCertVerificationError``
            for an untrusted or expired certificate or a hostname mismatch. The
            message names the address (``... (TLS handshake with
            tls://host:port)``), and says so when the peer does not speak TLS
            (a ``tcp://`` listener); OpenSSL's ``reason``, ``library``,
            ``verify_code`` and ``verify_message`` are kept.
        TimeoutError: ``timeout`` expired (with ``retry``, its ``__cause__``
            is the error of the last attempt), or a handshake took longer than
            ``handshake_timeout``.
        OSError: the connection failed, and the message names the address:
            ``socket.gaierror`` (the name did not resolve),
            ``ConnectionRefusedError`` (nobody listens there; also for an
            ``inproc://`` name with no listener), ``FileNotFoundError`` (no
            ``unix://`` socket file), ``OSError`` with ``errno.ENETUNREACH`` or
            ``errno.EHOSTUNREACH`` (no route), a plain ``OSError`` without
            ``errno`` for a ``unix://`` path longer than the system allows.
        RemoteProtocolError: the peer does not speak anyio-comm; the message
            names the address, and says so when the peer speaks TLS (a
            ``tls://`` listener).
        anyio.BrokenResourceError: the connection failed during the handshake
            (the message names the address); also a TLS 1.3 server's alert
            rejecting our certificate, with the ``ssl.SSLError`` as its
            ``__cause__``.
    """
    parsed = parse_address(address)
    check_connectable(parsed)
    check_tls_options(parsed, ssl_context)
    check_seconds("timeout", timeout)
    _check_delay(happy_eyeballs_delay)
    resolved = resolve_options("connect", options, keywords)
    deadline = math.inf if timeout is None else anyio.current_time() + timeout
    attempt = 0
    while True:
        try:
            with anyio.move_on_after(deadline - anyio.current_time()) as scope:
                return await _connect_once(
                    address,
                    parsed,
                    resolved,
                    ssl_context,
                    server_hostname,
                    early_data,
                    happy_eyeballs_delay,
                )
        except ssl.SSLError:
            raise
        except (OSError, BrokenResourceError) as exc:
            # A TLS 1.3 server rejects a client after the client's handshake:
            # that alert is a TLS error too, and not retried.
            if not retry or isinstance(exc.__cause__, ssl.SSLError):
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
    options: Options,
    ssl_context: ssl.SSLContext | None,
    server_hostname: str | None,
    early_data: bool,
    happy_eyeballs_delay: float,
) -> Comm:
    if parsed.scheme == "inproc":
        return await connect_inproc(parsed.path, options, early_data=early_data)
    started = anyio.current_time()
    try:
        sock = await open_socket(
            parsed.scheme,
            parsed.host,
            parsed.port,
            parsed.path,
            options.keepalive,
            happy_eyeballs_delay,
        )
    except OSError as exc:
        raise _with_address(exc, address, parsed.scheme) from None
    connect_seconds = anyio.current_time() - started
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
        comm = await establish(
            transport, options, local_address=local, peer_address=peer, early_data=early_data
        )
    except ssl.SSLError as exc:
        transport.abort()
        first = transport.peer_first_bytes if isinstance(transport, TLSTransport) else b""
        raise _tls_with_address(exc, address, first) from None
    except (RemoteProtocolError, BrokenResourceError) as exc:
        transport.abort()
        if type(exc) not in (RemoteProtocolError, BrokenResourceError):
            raise
        # (a TLS alert after the handshake stays the cause: connect() does not retry it)
        raise _handshake_with_address(exc, address) from exc.__cause__
    except BaseException:
        transport.abort()
        raise
    comm._connect_seconds = connect_seconds
    return comm


async def from_stream(
    stream: ByteStream,
    *,
    options: Options | None = None,
    local_address: str = "stream://",
    peer_address: str = "stream://",
    **keywords: Unpack[OptionsKeywords],
) -> Comm:
    """Run the anyio-comm protocol over any AnyIO byte stream.

    Both ends call this (the handshake is symmetric). Every byte is copied
    through the stream's ``receive()`` / ``send()``: the generic path, for
    streams a socket address cannot describe (a ``TLSStream`` you built, a
    stapled or memory stream, ...). The call takes ``stream`` over: the comm
    closes it, and if no comm is returned (a failed or cancelled handshake, a
    bad option), ``stream`` has been closed already.

    Args:
        stream: a connected :class:`anyio.abc.ByteStream`.
        options: per-connection options (:class:`~anyio_comm.Options`), or any
            of its fields as keywords. The handshake must complete within
            ``handshake_timeout``; ``keepalive`` applies to the stream's socket
            (:attr:`anyio.abc.SocketAttribute.raw_socket`) when it is a TCP one.
        local_address, peer_address: strings reported by the comm.

    Raises:
        ValueError: invalid option.
        TypeError: an unknown keyword, or an option of the wrong type.
        TimeoutError: the handshake took longer than ``handshake_timeout``.
        RemoteProtocolError: the peer does not speak anyio-comm.
        anyio.BrokenResourceError: the stream failed during the handshake.
    """
    transport = StreamTransport(stream)
    try:
        resolved = resolve_options("from_stream", options, keywords)
        if resolved.keepalive is not None:
            sock = stream.extra(SocketAttribute.raw_socket, None)
            if sock is not None:
                configure_socket(sock, resolved.keepalive)
        return await establish(
            transport, resolved, local_address=local_address, peer_address=peer_address
        )
    except BaseException:
        with anyio.CancelScope(shield=True):
            await aclose_forcefully(transport)
        raise
