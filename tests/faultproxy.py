"""A fault-injecting TCP proxy for tests, on asyncio, uvloop and trio.

::

    async with FaultProxy("127.0.0.1", port) as proxy:
        comm = await anyio_comm.connect(proxy.address)
        ...
        proxy.stall_downstream()     # stop forwarding server -> client
        ...
        proxy.resume()               # forward again

The proxy listens on ``127.0.0.1`` (an ephemeral port) and, for every client
connection it accepts, opens one connection to the target and forwards the
bytes of both directions: *upstream* (client -> server) and *downstream*
(server -> client). Each direction follows a :class:`Policy`, set at
construction and changeable at any time; a change takes effect at once, even
for a forwarder blocked waiting for data or for room to write.

Faults a policy can inject, per direction:

* ``delay``: sleep this long before forwarding each chunk read from the
  source (one ``recv``, up to 64 KiB);
* ``split``: write in pieces of at most this many bytes (``1``: byte by
  byte), each its own ``send`` followed by a checkpoint, so the receiver can
  run between pieces and see them as separate reads;
* ``stall_after``: once this many bytes went through, forward nothing more
  (and stop reading the source, so backpressure reaches the sender) while
  keeping the connection open; clearing it (:meth:`FaultProxy.resume`)
  forwards the rest;
* ``cut_after``: once this many bytes went through, close the whole
  connection (both sockets): with a FIN, or with a RST (``SO_LINGER`` 0)
  when ``reset`` is true; as with any socket, the kernel sends a RST instead
  of a FIN to a side whose bytes the proxy had not read yet (a sender still
  in the middle of a large write);
* ``half_close_after``: once this many bytes went through, forward an EOF
  (``shutdown(SHUT_WR)``) in this direction only, and forward nothing more
  in it; the other direction goes on.

Byte thresholds count the bytes of that direction of *each* connection since
it was accepted (the target's and the client's byte streams, so for TLS they
count ciphertext); the thresholds are exact: the proxy forwards exactly that
many bytes, splitting a chunk if needed. Without faults the proxy is
transparent: an EOF from one side is forwarded as an EOF (half-close), and a
reset from one side (or a failed write to it) resets both.

At run time: :meth:`FaultProxy.set_policy` and its shortcuts
(``stall_*``, ``resume``, ``cut_*``, ``half_close_*``, and :meth:`FaultProxy.cut`
for every current connection at once); byte counters per direction, summed
(:attr:`FaultProxy.upstream_bytes`, :attr:`FaultProxy.downstream_bytes`) and
per connection (:attr:`FaultProxy.connections`), and
:meth:`FaultProxy.wait_forwarded` to wait until so many bytes went through.

Everything runs in a task group owned by the proxy, with nothing but AnyIO's
socket readiness primitives (``wait_readable`` / ``wait_writable``) over
non-blocking sockets, so the same code runs on every backend. Leaving the
``async with`` block cancels the forwarders and closes every socket.
"""

from __future__ import annotations

import errno
import socket
import struct
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

import anyio
from anyio import CancelScope, wait_readable, wait_writable
from anyio.lowlevel import checkpoint

if TYPE_CHECKING:
    from types import TracebackType

    from anyio.abc import TaskGroup

__all__ = ["DIRECTIONS", "Direction", "FaultProxy", "Policy", "ProxyConnection"]

Direction = Literal["upstream", "downstream"]
DIRECTIONS: tuple[Direction, Direction] = ("upstream", "downstream")
CHUNK = 65536


@dataclass(frozen=True)
class Policy:
    """The faults injected into one direction of every proxied connection.

    Attributes:
        delay: seconds to sleep before forwarding each chunk read.
        split: largest write, in bytes (``1``: byte by byte); ``None`` writes
            each chunk whole.
        stall_after: stop forwarding once this many bytes went through
            (``0``: at once); ``None`` never stalls.
        cut_after: close the connection once this many bytes went through;
            ``None`` never cuts.
        reset: a cut resets the connection (RST) instead of closing it (FIN).
        half_close_after: forward an EOF in this direction once this many
            bytes went through, and nothing after it; ``None`` never does.
    """

    delay: float = 0.0
    split: int | None = None
    stall_after: int | None = None
    cut_after: int | None = None
    reset: bool = False
    half_close_after: int | None = None

    def __post_init__(self) -> None:
        if self.delay < 0:
            raise ValueError("delay must not be negative")
        if self.split is not None and self.split < 1:
            raise ValueError("split must be at least 1")


def _close(sock: socket.socket, *, reset: bool) -> None:
    if sock.fileno() < 0:
        return
    if reset:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    sock.close()


class ProxyConnection:
    """One proxied connection: its two sockets and its byte counters.

    Attributes:
        upstream_bytes: bytes forwarded client -> server so far.
        downstream_bytes: bytes forwarded server -> client so far.
        outbound_address: ``(host, port)`` of the proxy's socket to the
            target, i.e. the peer address the target sees (``None`` until
            connected).
        closed: set once both sockets are closed.
        reset: whether the proxy ended the connection with a RST.
    """

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.server: socket.socket | None = None
        self.upstream_bytes = 0
        self.downstream_bytes = 0
        self.outbound_address: tuple[str, int] | None = None
        self.closed = anyio.Event()
        self.reset = False
        self.cut_requested = False
        self._scope: CancelScope | None = None

    def _cut(self, *, reset: bool) -> None:
        """End both forwarders; the sockets are then closed (with a RST if ``reset``)."""
        self.cut_requested = True
        self.reset = self.reset or reset
        if self._scope is not None:
            self._scope.cancel()

    def forwarded(self, direction: Direction) -> int:
        """Bytes forwarded in ``direction`` so far."""
        return self.upstream_bytes if direction == "upstream" else self.downstream_bytes


class FaultProxy:
    """A TCP proxy to ``target_host:target_port`` that injects faults.

    Args:
        target_host: where to connect for each accepted connection.
        target_port: the target's port.
        upstream: the client -> server policy.
        downstream: the server -> client policy.
        buffer_size: if given, ``SO_RCVBUF`` and ``SO_SNDBUF`` of every proxy
            socket (the kernel doubles it), to keep the bytes buffered inside
            the proxy small.

    Use as ``async with FaultProxy(...) as proxy``; :attr:`address` is where
    clients connect.
    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        upstream: Policy | None = None,
        downstream: Policy | None = None,
        buffer_size: int | None = None,
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self._policies: dict[Direction, Policy] = {
            "upstream": upstream or Policy(),
            "downstream": downstream or Policy(),
        }
        self._buffer_size = buffer_size
        self._listener: socket.socket | None = None
        self._task_group: TaskGroup | None = None
        self._exit_stack: AsyncExitStack | None = None
        self._changed = anyio.Event()
        self._progress: anyio.Event | None = None
        self._wakeups: set[CancelScope] = set()
        self.connections: list[ProxyConnection] = []

    # -- lifecycle ---------------------------------------------------------

    async def __aenter__(self) -> FaultProxy:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._configure(listener)
            listener.bind(("127.0.0.1", 0))
            listener.listen(128)
            listener.setblocking(False)
            async with AsyncExitStack() as stack:
                self._task_group = await stack.enter_async_context(anyio.create_task_group())
                self._task_group.start_soon(self._accept_loop, listener)
                self._exit_stack = stack.pop_all()
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._task_group is not None and self._exit_stack is not None
        self._task_group.cancel_scope.cancel()
        try:
            return await self._exit_stack.__aexit__(exc_type, exc, tb)
        finally:
            if self._listener is not None:
                self._listener.close()

    @property
    def port(self) -> int:
        """The port the proxy listens on (on ``127.0.0.1``)."""
        assert self._listener is not None, "the proxy is not running"
        port: int = self._listener.getsockname()[1]
        return port

    @property
    def address(self) -> str:
        """``tcp://127.0.0.1:PORT``: where clients connect."""
        return f"tcp://127.0.0.1:{self.port}"

    # -- policies ----------------------------------------------------------

    def policy(self, direction: Direction) -> Policy:
        """The current policy of ``direction``."""
        return self._policies[direction]

    def set_policy(self, direction: Direction, **changes: Any) -> None:
        """Change fields of ``direction``'s policy (see :class:`Policy`); effective at once."""
        self._policies[direction] = replace(self._policies[direction], **changes)
        self._notify_change()

    def stall_upstream(self, after: int = 0) -> None:
        """Stop forwarding client -> server once ``after`` bytes went through (0: now)."""
        self.set_policy("upstream", stall_after=after)

    def stall_downstream(self, after: int = 0) -> None:
        """Stop forwarding server -> client once ``after`` bytes went through (0: now)."""
        self.set_policy("downstream", stall_after=after)

    def resume(self) -> None:
        """Clear the stalls of both directions: forward everything held back."""
        for direction in DIRECTIONS:
            self._policies[direction] = replace(self._policies[direction], stall_after=None)
        self._notify_change()

    def cut_upstream(self, after: int = 0, *, reset: bool = False) -> None:
        """Close the connection once ``after`` bytes went client -> server (0: now)."""
        self.set_policy("upstream", cut_after=after, reset=reset)

    def cut_downstream(self, after: int = 0, *, reset: bool = False) -> None:
        """Close the connection once ``after`` bytes went server -> client (0: now)."""
        self.set_policy("downstream", cut_after=after, reset=reset)

    def cut(self, *, reset: bool = False) -> None:
        """Close every current connection now (``reset``: with a RST to both ends).

        Unlike ``cut_upstream(0)``, the policies are unchanged: later
        connections are forwarded as before.
        """
        for conn in self.connections:
            conn._cut(reset=reset)

    def half_close_upstream(self, after: int = 0) -> None:
        """Forward an EOF to the server once ``after`` bytes went upstream (0: now)."""
        self.set_policy("upstream", half_close_after=after)

    def half_close_downstream(self, after: int = 0) -> None:
        """Forward an EOF to the client once ``after`` bytes went downstream (0: now)."""
        self.set_policy("downstream", half_close_after=after)

    def _notify_change(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()
        for scope in self._wakeups:
            scope.cancel()

    # -- counters ----------------------------------------------------------

    @property
    def upstream_bytes(self) -> int:
        """Bytes forwarded client -> server, summed over all connections."""
        return sum(c.upstream_bytes for c in self.connections)

    @property
    def downstream_bytes(self) -> int:
        """Bytes forwarded server -> client, summed over all connections."""
        return sum(c.downstream_bytes for c in self.connections)

    def forwarded(self, direction: Direction) -> int:
        """Bytes forwarded in ``direction``, summed over all connections."""
        return self.upstream_bytes if direction == "upstream" else self.downstream_bytes

    async def wait_forwarded(self, direction: Direction, nbytes: int) -> None:
        """Return once at least ``nbytes`` went through in ``direction`` (all
        connections together). Bound it with ``anyio.fail_after``.
        """
        while self.forwarded(direction) < nbytes:
            await self._wait_progress()

    async def wait_connections(self, count: int) -> None:
        """Return once ``count`` connections were accepted and connected to the target."""
        while sum(c.outbound_address is not None for c in self.connections) < count:
            await self._wait_progress()

    async def _wait_progress(self) -> None:
        if self._progress is None:
            self._progress = anyio.Event()
        await self._progress.wait()

    def _notify_progress(self) -> None:
        progress, self._progress = self._progress, None
        if progress is not None:
            progress.set()

    # -- machinery ---------------------------------------------------------

    def _configure(self, sock: socket.socket) -> None:
        if self._buffer_size is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self._buffer_size)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._buffer_size)

    async def _interruptible_wait(self, sock: socket.socket, *, writable: bool) -> None:
        """Wait until ``sock`` is ready, or until a policy changes."""
        with CancelScope() as scope:
            self._wakeups.add(scope)
            try:
                if writable:
                    await wait_writable(sock)
                else:
                    await wait_readable(sock)
            finally:
                self._wakeups.discard(scope)

    async def _accept_loop(self, listener: socket.socket) -> None:
        assert self._task_group is not None
        while True:
            await wait_readable(listener)
            try:
                client, _ = listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                continue
            self._task_group.start_soon(self._run_connection, client)

    async def _run_connection(self, client: socket.socket) -> None:
        conn = ProxyConnection(client)
        self.connections.append(conn)
        try:
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            server = conn.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._configure(server)
            server.setblocking(False)
            server.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            err = server.connect_ex((self.target_host, self.target_port))
            if err in (errno.EINPROGRESS, errno.EAGAIN):
                await wait_writable(server)
                err = server.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                conn.reset = True  # the target refused: refuse the client too
                return
            conn.outbound_address = server.getsockname()[:2]
            self._notify_progress()
            if conn.cut_requested:  # cut() while we were connecting
                return
            async with anyio.create_task_group() as tg:
                conn._scope = tg.cancel_scope
                tg.start_soon(self._forward, conn, "upstream")
                tg.start_soon(self._forward, conn, "downstream")
        finally:
            _close(client, reset=conn.reset)
            if conn.server is not None:
                _close(conn.server, reset=conn.reset)
            conn.closed.set()
            self._notify_progress()

    async def _forward(self, conn: ProxyConnection, direction: Direction) -> None:
        assert conn.server is not None
        if direction == "upstream":
            src, dst = conn.client, conn.server
        else:
            src, dst = conn.server, conn.client
        buffer = bytearray(CHUNK)
        pending = memoryview(b"")
        delayed = True
        while True:
            policy = self._policies[direction]
            count = conn.forwarded(direction)
            if policy.cut_after is not None and count >= policy.cut_after:
                conn._cut(reset=policy.reset)
                return
            if policy.half_close_after is not None and count >= policy.half_close_after:
                self._shutdown(dst)
                return
            if policy.stall_after is not None and count >= policy.stall_after:
                await self._changed.wait()
                continue
            if not pending:
                try:
                    n = src.recv_into(buffer)
                except (BlockingIOError, InterruptedError):
                    await self._interruptible_wait(src, writable=False)
                    continue
                except OSError:
                    conn._cut(reset=True)  # reset by that side: reset the other
                    return
                if not n:
                    self._shutdown(dst)  # a FIN: forward the half-close
                    return
                pending = memoryview(buffer)[:n]
                delayed = False
            if policy.delay and not delayed:
                await anyio.sleep(policy.delay)
                delayed = True
                continue  # the policy may have changed meanwhile
            size = pending.nbytes
            for limit in (policy.cut_after, policy.half_close_after, policy.stall_after):
                if limit is not None:
                    size = min(size, limit - count)
            if policy.split is not None:
                size = min(size, policy.split)
            try:
                sent = dst.send(pending[:size])
            except (BlockingIOError, InterruptedError):
                await self._interruptible_wait(dst, writable=True)
                continue
            except OSError:
                conn._cut(reset=True)  # that side is gone: reset the other
                return
            pending = pending[sent:]
            if direction == "upstream":
                conn.upstream_bytes += sent
            else:
                conn.downstream_bytes += sent
            self._notify_progress()
            if policy.split is not None:
                await checkpoint()

    @staticmethod
    def _shutdown(sock: socket.socket) -> None:
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
