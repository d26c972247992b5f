"""Server side: listen on an address and run a handler per connection.

Structure: :func:`listen` owns one task group. In it run one accept loop per
listening socket and one task per connection (handshake, then the user's
handler). Leaving ``listen`` cancels the group, so every handler is
cancelled and every connection closed before ``listen`` returns, then the
listening sockets are closed.

Errors: a connection that fails the handshake (wrong protocol, TLS failure,
timeout, reset) is closed and logged at DEBUG level. A handler that ends
because the connection ended (``EndOfStream``, ``BrokenResourceError``,
``ClosedResourceError``, ``RemoteProtocolError``) is logged at DEBUG. Any
other exception from a handler is a bug or an error of the application: it is
logged with its traceback at ERROR level on the ``anyio_comm`` logger. Either
way only that connection is closed (gracefully: replies the handler sent before
are still delivered) and the listener keeps serving. A peer that announced the
``CLOSE_REASONS`` capability is told why in a close record: ``HANDLER_ERROR``
with the exception's class name and message (never its traceback) after a
handler's exception; when the listener stops a handler (its shutdown, or
leaving :func:`listen`), ``GOING_AWAY`` if the handler was waiting in
``receive()`` between messages (nothing lost), else ``INTERRUPTED`` (an error:
a reply may be lost); a handler that returns closes with the end of the
stream.

Limits and shutdown: with ``max_connections``, the accept loops stop
accepting while that many connections (handshaking or in a handler) are open;
new connections wait in the kernel's backlog (or, for ``inproc://``, before
their handshake). A ``tls://`` listener shares ``handshake_threads`` turns
(a capacity limiter) between the CPU-heavy steps of its TLS handshakes, each
run in a worker thread, and its accepts: under a handshake storm, handshakes
wait their turn and new connections wait in the backlog, while the event loop
keeps serving established connections; a handshake that waits for its client
holds no turn. :meth:`Listener.stop_accepting` stops accepting and nothing
else: connections accepted before it, those in their handshake included, go
on to their handlers (:meth:`Listener.wait_closed` waits until the last one
is closed). :meth:`Listener.shutdown` stops accepting, drops connections
still in their handshake, cancels the handlers that wait in ``receive()`` at
a message boundary (they are between messages, so nothing is lost), gives the
others a grace period to finish, then cancels them. Leaving the
:func:`listen` block cancels whatever is left.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final

import anyio
from anyio import (
    TASK_STATUS_IGNORED,
    BrokenResourceError,
    CancelScope,
    CapacityLimiter,
    ClosedResourceError,
    EndOfStream,
    Event,
    WouldBlock,
    notify_closing,
    wait_readable,
)

from ._addressing import (
    Address,
    check_tls_options,
    format_socket_address,
    format_tcp,
    parse_address,
    with_address,
)
from ._comm import Comm, IdleHook, establish
from ._compat import Unpack, final
from ._connect import configure_socket, not_tls_hint, resolve_tcp
from ._exceptions import ProtocolError, RemoteProtocolError
from ._inproc import register, unregister
from ._options import Options, OptionsKeywords, resolve_options
from ._sansio.budget import DEFAULT_RECEIVE_BUDGET, ReceiveBudget
from ._sansio.close import CloseCode, CloseReason
from ._statistics import ListenerStatistics
from ._transports.rawsocket import SocketTransport
from ._transports.stream import StreamTransport
from ._transports.tls import TLSTransport

if TYPE_CHECKING:
    from anyio.abc import TaskGroup, TaskStatus

    from ._compat import Unpack
    from ._transports.base import Transport
    from ._transports.memory import MemoryByteStream

__all__ = ["Handler", "Listener", "listen", "serve"]

logger = logging.getLogger("anyio_comm")

#: ``async def handler(comm: Comm) -> None``
Handler = Callable[[Comm], Awaitable[Any]]

#: why a handshake fails: the connection is dropped, logged at DEBUG
_HANDSHAKE_ERRORS: Final = (
    EndOfStream,
    BrokenResourceError,
    ClosedResourceError,
    ProtocolError,
    OSError,  # ssl.SSLError included
    TimeoutError,
)
#: how a connection ends while its handler runs: logged at DEBUG
_CONNECTION_ENDED: Final = (
    EndOfStream,
    BrokenResourceError,
    ClosedResourceError,
    RemoteProtocolError,
)
#: accept() errors that mean "out of resources": back off, then retry
_RESOURCE_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: the close record of a connection whose handler the listener stopped between
#: messages (waiting in receive(): nothing lost) ...
_GOING_AWAY: Final = CloseReason(CloseCode.GOING_AWAY, "", "the listener is shutting down")
#: ... and anywhere else (a reply may be lost)
_INTERRUPTED: Final = CloseReason(
    CloseCode.INTERRUPTED, "", "the listener stopped while handling a message"
)
_ACCEPT_BATCH: Final = 64
#: the most TLS handshake steps a listener computes at once, by default
DEFAULT_HANDSHAKE_THREADS: Final = 1
#: an accept that takes no turn (tcp:// and unix:// listeners)
_NO_TURNS: Final = contextlib.nullcontext()


@final
class Listener:
    """A running listener, as yielded by :func:`listen` and started by :func:`serve`."""

    __slots__ = ("_server",)

    def __init__(self, server: _Server) -> None:
        self._server = server

    def __repr__(self) -> str:
        return f"<Listener {self.address} ({self._server.active} connections)>"

    @property
    def address(self) -> str:
        """The contact address, with the real port (``tcp://127.0.0.1:54321``)."""
        return self._server.addresses[0]

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every bound address (a host name may bind IPv4 and IPv6)."""
        return self._server.addresses

    @property
    def active_connections(self) -> int:
        """Connections that completed the handshake and have not closed yet."""
        return self._server.active

    @property
    def max_connections(self) -> int | None:
        """The most connections open at once (handshaking ones included), or ``None``."""
        return self._server.max_connections

    @property
    def handshake_threads(self) -> int | None:
        """The most TLS handshake steps computed at once (see :func:`listen`);
        ``None`` for a listener that is not ``tls://``."""
        limiter = self._server.handshake_limiter
        return None if limiter is None else int(limiter.total_tokens)

    @property
    def receive_budget(self) -> ReceiveBudget | None:
        """The budget of receive memory the connections share (``None``: none);
        its ``in_use`` and ``waiting`` say how much is held and how many wait."""
        return self._server.budget

    def statistics(self) -> ListenerStatistics:
        """What this listener has done so far (see
        :class:`~anyio_comm.ListenerStatistics`); also after it stopped."""
        server = self._server
        budget = server.budget
        return ListenerStatistics(
            accepted=server.accepted,
            handshaking=server.handshaking,
            active=server.active,
            refused=dict(server.refused),
            handshake_failures=dict(server.handshake_failures),
            handlers=dict(server.handlers),
            budget=None if budget is None else budget.statistics(),
        )

    @property
    def accepting(self) -> bool:
        """True until :meth:`stop_accepting` or :meth:`shutdown` was called."""
        return not self._server.accepting_stopped

    @property
    def shutting_down(self) -> bool:
        """True once :meth:`shutdown` was called: handlers may check it between messages."""
        return self._server.shutdown_started

    def stop_accepting(self) -> None:
        """Stop accepting new connections; established ones live on.

        The listening sockets close (``unix://`` socket files are removed,
        ``inproc://`` names freed), so new connections are refused. Connections
        accepted before it go on: those still in their handshake (TLS, the
        preamble exchange) complete it and reach the handler, and every handler
        keeps running until it returns (:meth:`wait_closed` waits for them);
        leaving the :func:`listen` block (or cancelling :func:`serve`) still
        cancels them. Idempotent.

        Synchronous, and callable outside a task (from a callback of the event
        loop, in its thread): the listening sockets may then close only when
        the accept loop has stopped, within a pass of the event loop (a
        connection that reached the backlog meanwhile is reset), while
        ``unix://`` files and ``inproc://`` names are freed at once.
        """
        self._server.stop_accepting()

    async def shutdown(self, grace_period: float = 0.0) -> None:
        """Stop accepting, let the handlers finish, then close every connection.

        In order: the listening sockets close (as :meth:`stop_accepting` does),
        so new connections are refused; connections still in their handshake
        are dropped; handlers waiting in ``receive()`` at a message boundary
        (between messages) are cancelled now, and so is any handler that calls
        ``receive()`` later and would wait there; handlers still running after
        ``grace_period`` seconds are cancelled. Returns once every connection
        is closed. Calling it again (or concurrently) waits for the same
        shutdown. Leaving the :func:`listen` block afterwards has nothing left
        to do, and :func:`serve` returns.

        Do not call it from a handler of this listener: it would wait for its
        own caller.

        After the :func:`listen` block was left, there is nothing to do and
        it returns at once.

        Raises:
            ValueError: ``grace_period`` is negative.
        """
        if not grace_period >= 0:
            raise ValueError(f"grace_period must not be negative, not {grace_period!r}")
        await self._server.shutdown(grace_period)

    async def wait_closed(self) -> None:
        """Wait until the listener accepts no more and every connection it
        accepted is closed: those still in their handshake then (which complete
        it or fail) and those in a handler (which returned).

        Stops nothing itself: it waits for :meth:`stop_accepting` (or
        :meth:`shutdown`) and for the connections to end. Returns at once
        after the :func:`listen` block was left (every connection is closed
        then). A way to stop a listener without cutting any connection::

            listener.stop_accepting()
            await listener.wait_closed()
        """
        await self._server.all_closed.wait()


async def _bind_tcp(host: str, port: int, backlog: int) -> list[socket.socket]:
    infos = await resolve_tcp(host, port, passive=True)
    sockets: list[socket.socket] = []
    seen: set[tuple[int, str]] = set()
    try:
        for family, type_, proto, _, sockaddr in infos:
            if (family, sockaddr[0]) in seen:
                continue
            seen.add((family, sockaddr[0]))
            sock = socket.socket(family, type_, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:
                # bind every family to the port the first one got
                sockaddr = (sockaddr[0], sockets[0].getsockname()[1], *sockaddr[2:])
            sock.bind(sockaddr)
            sock.listen(backlog)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bind_unix(path: str, backlog: int) -> socket.socket:
    """A listening socket bound to ``path``.

    Raises:
        OSError: as the system says (its class and ``errno``), the message
            naming the address ("Address already in use", "AF_UNIX path too
            long" name none).
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise with_address(exc, f"listening on unix://{path}") from None
    except BaseException:
        sock.close()
        raise
    return sock


class _ConnectionTask:
    """The task that runs one accepted connection, as its listener knows it:
    the task's cancel scope, the comm's idle hook, and whether the comm is
    established."""

    __slots__ = ("established", "hook", "scope")

    def __init__(self) -> None:
        self.scope = CancelScope()
        self.hook = IdleHook()
        self.established = False

    def cancel_if_idle(self) -> None:
        """Cancel the task now if it is in its handshake or its handler waits
        between messages, else as soon as it does."""
        if not self.established:
            self.scope.cancel()
        else:
            self.hook.call_when_idle(self.scope.cancel)


class _Server:
    """Runs the accept loops and the per-connection tasks of one listener."""

    def __init__(
        self,
        handler: Handler,
        options: Options,
        ssl_context: ssl.SSLContext | None = None,
        max_connections: int | None = None,
        budget: ReceiveBudget | None = None,
        handshake_threads: int = DEFAULT_HANDSHAKE_THREADS,
    ) -> None:
        self.handler = handler
        self.budget = budget
        self.options = options
        self.ssl_context = ssl_context
        self.scheme = "tls" if ssl_context is not None else "tcp"
        self.task_group: TaskGroup | None = None
        self.listener = Listener(self)
        self.addresses: tuple[str, ...] = ()
        self.max_connections = max_connections
        self.limiter = CapacityLimiter(max_connections) if max_connections else None
        # tls:// only: the turns of the CPU-heavy work of TLS handshakes (see listen())
        self.handshake_limiter = (
            CapacityLimiter(handshake_threads) if ssl_context is not None else None
        )
        #: the accepted connections not closed yet (handshaking or in a handler)
        self.connections: set[_ConnectionTask] = set()
        self.active = 0  # connections whose handler runs
        # what it has done (see ListenerStatistics)
        self.accepted = 0
        self.handshaking = 0
        self.refused: collections.Counter[str] = collections.Counter()
        self.handshake_failures: collections.Counter[str] = collections.Counter()
        self.handlers: collections.Counter[str] = collections.Counter()
        self.accept_scope = CancelScope()
        # closes the listening sockets (set by listen() once they exist)
        self.close_listening: Callable[[], None] = lambda: None
        self.accepting_stopped = False
        self.shutdown_started = False
        self.all_closed = Event()
        self.stopped = Event()

    async def accept_loops(self, sockets: list[socket.socket]) -> None:
        try:
            with self.accept_scope:
                async with anyio.create_task_group() as task_group:
                    for sock in sockets:
                        task_group.start_soon(self.accept_loop, sock)
        finally:
            if self.accepting_stopped:
                # stop_accepting() called outside a task left the sockets to us
                self.close_listening()

    async def accept_loop(self, sock: socket.socket) -> None:
        limiter = self.limiter
        # On a tls:// listener, each accept takes a turn of the handshakes' work
        # (and yields): a storm of connections waits in the backlog, not in memory.
        turns = self.handshake_limiter
        slot: object | None = None
        try:
            while True:
                for _ in range(_ACCEPT_BATCH):
                    if limiter is not None and slot is None:
                        # (held once acquired: a wait cancelled holds nothing)
                        candidate = object()
                        try:
                            limiter.acquire_on_behalf_of_nowait(candidate)
                        except WouldBlock:
                            # at max_connections: leave newcomers in the backlog
                            await limiter.acquire_on_behalf_of(candidate)
                        slot = candidate
                    try:
                        async with turns if turns is not None else _NO_TURNS:
                            if self.accepting_stopped:
                                return  # stopped while this loop waited for its turn
                            conn, _ = sock.accept()
                            self.start_socket_connection(conn, slot)
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        if self.accepting_stopped:
                            return  # stop_accepting() closed the socket under us
                        if exc.errno in _RESOURCE_ERRNOS:
                            self.refused["out-of-resources"] += 1
                            logger.error("accept() failed (%s); retrying in 0.1 s", exc)
                            await anyio.sleep(0.1)
                            break
                        if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                            self.refused["aborted"] += 1
                            continue
                        raise
                    slot = None  # the connection releases it
                else:
                    # a flood of connections: let the handlers run too
                    await anyio.lowlevel.checkpoint()
                    continue
                await wait_readable(sock)
        finally:
            if slot is not None and limiter is not None:
                limiter.release_on_behalf_of(slot)

    def _spawn(self, transport: Transport, local: str, peer: str, slot: object | None) -> None:
        if self.task_group is None or self.accepting_stopped:
            raise RuntimeError("the listener is not running")
        self.task_group.start_soon(
            self.run_connection, transport, local, peer, slot, name=f"anyio_comm {peer}"
        )

    def start_socket_connection(self, conn: socket.socket, slot: object | None) -> None:
        try:
            configure_socket(conn, self.options.keepalive)
            local = format_socket_address(conn.family, conn.getsockname(), self.scheme)
            peer = format_socket_address(conn.family, conn.getpeername(), self.scheme)
        except OSError as exc:  # reset before we got to it
            self.refused["reset"] += 1
            logger.debug("dropping connection: %s", exc)
            conn.close()
            if slot is not None and self.limiter is not None:
                self.limiter.release_on_behalf_of(slot)
            return
        transport: Transport = SocketTransport(conn)
        if self.ssl_context is not None:
            transport = TLSTransport(
                transport,
                self.ssl_context,
                server_side=True,
                handshake_limiter=self.handshake_limiter,
            )
        self._spawn(transport, local, peer, slot)

    def start_inproc_connection(self, stream: MemoryByteStream, peer: str) -> None:
        # inproc connections take their max_connections slot in their own task
        self._spawn(StreamTransport(stream), self.addresses[0], peer, None)

    async def run_connection(
        self, transport: Transport, local: str, peer: str, slot: object | None
    ) -> None:
        limiter = self.limiter
        task = _ConnectionTask()
        self.connections.add(task)
        self.accepted += 1
        started = False
        try:
            with task.scope:
                if limiter is not None and slot is None:
                    candidate = object()
                    await limiter.acquire_on_behalf_of(candidate)
                    slot = candidate
                started = True
                await self._run_connection(task, transport, local, peer)
        finally:
            if not started:  # (stopped while it waited for room: it closes here)
                self.refused["shutdown"] += 1
                transport.abort()
            self.connections.discard(task)
            if slot is not None and limiter is not None:
                limiter.release_on_behalf_of(slot)
            self.check_closed()

    async def _run_connection(
        self, task: _ConnectionTask, transport: Transport, local: str, peer: str
    ) -> None:
        if self.shutdown_started:
            self.refused["shutdown"] += 1
            transport.abort()
            return
        self.handshaking += 1
        try:
            comm = await establish(
                transport,
                self.options,
                local_address=local,
                peer_address=peer,
                hook=task.hook,
                budget=self.budget,
            )
        except _HANDSHAKE_ERRORS as exc:
            self.handshake_failures[_failure_kind(exc)] += 1
            transport.abort()
            hint = ""
            if isinstance(exc, ssl.SSLError) and isinstance(transport, TLSTransport):
                hint = not_tls_hint(transport.peer_first_bytes, "client")
            logger.debug("handshake with %s failed: %r%s", peer, exc, hint and f"; {hint}")
            return
        except BaseException:  # (cancelled: the listener stops)
            self.refused["shutdown"] += 1
            transport.abort()
            raise
        finally:
            self.handshaking -= 1
        task.established = True  # (a shutdown during the handshake cancelled the scope)
        self.active += 1
        reason: CloseReason | None = None
        try:
            try:
                await self.handler(comm)
                self.handlers["returned"] += 1
            except _CONNECTION_ENDED as exc:
                self.handlers["connection-ended"] += 1
                logger.debug("connection %s ended: %r", peer, exc)
            except Exception as exc:
                self.handlers["raised"] += 1
                logger.exception("connection handler for %s raised", peer)
                reason = CloseReason.shortened(
                    CloseCode.HANDLER_ERROR, type(exc).__name__, _message(exc)
                )
            except anyio.get_cancelled_exc_class():
                self.handlers["cancelled"] += 1
                reason = _GOING_AWAY if task.hook.stopped_idle else _INTERRUPTED
                raise
        finally:
            self.active -= 1
            await comm.aclose(reason)

    def stop_accepting(self) -> None:
        self.accepting_stopped = True
        self.accept_scope.cancel()
        self.close_listening()
        self.check_closed()

    def check_closed(self) -> None:
        """Set :attr:`all_closed` once nothing is accepted and no connection is left."""
        if self.accepting_stopped and not self.connections:
            self.all_closed.set()

    async def shutdown(self, grace_period: float) -> None:
        if not self.shutdown_started:
            self.shutdown_started = True
            self.stop_accepting()
            for task in list(self.connections):
                task.cancel_if_idle()
            with anyio.move_on_after(grace_period):
                await self.all_closed.wait()
            for task in list(self.connections):
                task.scope.cancel()
            await self.all_closed.wait()
            self.stopped.set()
        else:
            await self.stopped.wait()


def _failure_kind(exc: BaseException) -> str:
    """How a handshake failed, as ListenerStatistics.handshake_failures counts it."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ssl.SSLError) and not isinstance(
        exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)
    ):
        return "tls"
    if isinstance(exc, ProtocolError):
        return "protocol"
    return "closed"


def _message(exc: BaseException) -> str:
    """``str(exc)``, or a placeholder when that fails."""
    try:
        return str(exc)
    except Exception:
        return f"<unprintable {type(exc).__name__}>"


def _close_sockets(sockets: list[socket.socket]) -> None:
    """Close the listening sockets that are still open.

    Outside a task (a loop callback), the accept loop's wait on a socket cannot
    be told that it closes (``notify_closing`` needs a task), and closing it
    under that wait would let the loop drop the registration of whatever socket
    gets the descriptor next: such sockets are left open here, and the accept
    loop closes them as it stops (its scope is cancelled already).
    """
    for sock in sockets:
        if sock.fileno() >= 0:
            try:
                notify_closing(sock)
            except RuntimeError:  # outside a task: see above
                continue
            sock.close()


def _remove_socket_file(path: str, inode: int) -> None:
    """Remove a ``unix://`` listener's socket file, unless another listener's
    socket took its place."""
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except OSError:
        pass


@asynccontextmanager
async def listen(
    address: str,
    handler: Handler,
    *,
    options: Options | None = None,
    max_connections: int | None = None,
    receive_budget: ReceiveBudget | int | None = DEFAULT_RECEIVE_BUDGET,
    backlog: int = 1024,
    ssl_context: ssl.SSLContext | None = None,
    handshake_threads: int = DEFAULT_HANDSHAKE_THREADS,
    **keywords: Unpack[OptionsKeywords],
) -> AsyncIterator[Listener]:
    """Listen on ``address``; run ``await handler(comm)`` for each connection.

    Use as ``async with listen(address, handler) as listener:``. Each handler
    runs in its own task after a successful handshake; its comm is closed when
    the handler returns. Leaving the block cancels every handler, closes every
    connection and the listening sockets, and (for ``unix://``) removes the
    socket file; for a graceful stop, call :meth:`Listener.shutdown` first.

    Args:
        address: ``tcp://host:port`` (port 0 picks a free port; a host name may
            bind several addresses; an empty host, ``tcp://:port``, binds every
            interface), ``tls://host:port``, ``unix:///path`` or ``inproc://name``
            (``inproc://`` alone picks a fresh name).
        handler: ``async def handler(comm: Comm)``.
        options: per-connection options (:class:`~anyio_comm.Options`), or any
            of its fields as keywords. For a listener: a new connection that
            does not complete its handshakes (TLS and anyio-comm) within
            ``handshake_timeout`` is dropped; with ``idle_timeout``, a handler's
            :meth:`Comm.receive` fails with :exc:`IdleTimeoutError` (and the
            connection is closed, logged at DEBUG) when the client sends nothing
            for that long while the handler waits for it; ``keepalive`` applies
            to every accepted TCP and TLS connection.
        max_connections: the most connections open at once, handshaking ones
            included. At the limit, no more are accepted: new ones wait in the
            ``backlog`` (where the client's ``connect`` waits, and its
            ``timeout`` runs) until a connection closes. ``None``: no limit.
        receive_budget: the receive memory the connections may hold in
            messages not yet taken by their handlers (see
            :class:`~anyio_comm.ReceiveBudget`): a number of bytes (256 MiB by
            default) makes a budget for this listener alone, a
            ``ReceiveBudget`` may be shared with other listeners, ``None``
            turns the budget off.
        backlog: ``listen()`` backlog for socket addresses.
        ssl_context: required for ``tls://`` (and only allowed there): the
            server context, e.g. ``ssl.create_default_context(
            ssl.Purpose.CLIENT_AUTH)`` with ``load_cert_chain(...)``; set its
            ``verify_mode = ssl.CERT_REQUIRED`` for mutual TLS.
        handshake_threads: for ``tls://``, the most TLS handshake steps the
            listener computes at once (default 1; other schemes ignore it). The
            steps that process what a client sent (the key exchange and
            signature for its ClientHello, the check of its Finished) run in
            worker threads, so the event loop keeps serving established
            connections meanwhile; each takes one of these turns, and so does
            each accept of a new connection. Beyond them, handshakes wait their
            turn, in order, and new connections wait in the ``backlog``: a storm
            of handshakes takes at most this many threads' worth of CPU and
            cannot crowd the event loop. A handshake waiting for its client
            holds no turn, so clients that stall in their handshake cannot lock
            others out (``handshake_timeout`` drops them).

    Yields:
        The :class:`Listener`; ``listener.address`` is the contact address.

    Raises:
        ValueError: malformed address, unknown scheme, invalid option, a
            negative ``receive_budget``, a ``handshake_threads`` below 1, or
            ``ssl_context`` missing for ``tls://`` (or given for another scheme).
        TypeError: ``handler`` is not callable, an unknown keyword, or an
            option (or ``receive_budget`` or ``handshake_threads``) of the wrong
            type.
        OSError: the address could not be bound (in use, permission, ...);
            for a ``unix://`` address the message names it.
    """
    parsed: Address = parse_address(address)
    check_tls_options(parsed, ssl_context)
    if not callable(handler):
        raise TypeError("handler must be an async callable taking a Comm")
    resolved = resolve_options("listen", options, keywords)
    if max_connections is not None and (
        isinstance(max_connections, bool)
        or not isinstance(max_connections, int)
        or max_connections < 1
    ):
        raise ValueError(
            f"max_connections must be a positive int or None, not {max_connections!r}"
        )
    if isinstance(handshake_threads, bool) or not isinstance(handshake_threads, int):
        raise TypeError(f"handshake_threads must be an int, not {handshake_threads!r}")
    if handshake_threads < 1:
        raise ValueError(f"handshake_threads must be at least 1, not {handshake_threads!r}")
    budget = (
        receive_budget
        if receive_budget is None or isinstance(receive_budget, ReceiveBudget)
        else ReceiveBudget(receive_budget)
    )
    sockets: list[socket.socket] = []
    unix_path: str | None = None
    inode = -1
    inproc_name: str | None = None
    body_error: Exception | None = None
    wait_closed: Event | None = None  # the server's all_closed, once it exists

    freed = False

    def close_listening() -> None:
        # The address is freed once: after stop_accepting(), another listener
        # may take it. Sockets left open outside a task are closed on a later call.
        nonlocal freed
        if not freed:
            freed = True
            if inproc_name is not None:
                unregister(inproc_name, server.start_inproc_connection)
            if unix_path is not None:
                _remove_socket_file(unix_path, inode)
        _close_sockets(sockets)

    try:
        # Bind before the task group exists, so errors are raised as they are.
        if parsed.scheme in ("tcp", "tls"):
            sockets = await _bind_tcp(parsed.host, parsed.port, backlog)
            addresses = [
                format_tcp(s.getsockname()[0], s.getsockname()[1], parsed.scheme) for s in sockets
            ]
        elif parsed.scheme == "unix":
            sockets = [_bind_unix(parsed.path, backlog)]
            unix_path = parsed.path
            inode = os.stat(unix_path).st_ino
            addresses = [f"unix://{parsed.path}"]
        server = _Server(
            handler, resolved, ssl_context, max_connections, budget, handshake_threads
        )
        if parsed.scheme == "inproc":
            inproc_name = register(parsed.path, server.start_inproc_connection)
            addresses = [f"inproc://{inproc_name}"]
        server.addresses = tuple(addresses)
        server.close_listening = close_listening
        wait_closed = server.all_closed
        async with anyio.create_task_group() as task_group:
            server.task_group = task_group
            task_group.start_soon(server.accept_loops, sockets, name=f"accept {addresses[0]}")
            try:
                yield server.listener
            except Exception as exc:
                # Re-raised below, unwrapped: the task group would put it in
                # an ExceptionGroup. (Cancellation passes through untouched.)
                body_error = exc
            task_group.cancel_scope.cancel()
    finally:
        close_listening()
        if wait_closed is not None:  # every connection is closed now
            wait_closed.set()
    if body_error is not None:
        raise body_error


async def serve(
    address: str,
    handler: Handler,
    *,
    task_status: TaskStatus[Listener] = TASK_STATUS_IGNORED,
    options: Options | None = None,
    max_connections: int | None = None,
    receive_budget: ReceiveBudget | int | None = DEFAULT_RECEIVE_BUDGET,
    backlog: int = 1024,
    ssl_context: ssl.SSLContext | None = None,
    handshake_threads: int = DEFAULT_HANDSHAKE_THREADS,
    **keywords: Unpack[OptionsKeywords],
) -> None:
    """Run a listener; made for :meth:`anyio.abc.TaskGroup.start`.

    ``listener = await task_group.start(serve, "tcp://127.0.0.1:0", handler)``
    returns the :class:`Listener` once it is bound. It runs until cancelled
    (cancelling the task group stops it at once) or until
    ``await listener.shutdown(grace_period)`` completes, when it returns.
    Arguments and errors are those of :func:`listen`.
    """
    async with listen(
        address,
        handler,
        options=resolve_options("serve", options, keywords),
        max_connections=max_connections,
        receive_budget=receive_budget,
        backlog=backlog,
        ssl_context=ssl_context,
        handshake_threads=handshake_threads,
    ) as listener:
        task_status.started(listener)
        await listener._server.stopped.wait()
