"""Connections to RPC servers, shared by the calls of many tasks."""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final

import anyio

from .._compat import final
from .._connect import HAPPY_EYEBALLS_DELAY, connect
from .._options import resolve_options
from .._sansio.errors import CommError
from ._balance import Balance, Balancer
from ._client import DEFAULT_PING_TIMEOUT, DEFAULT_STREAM_WINDOW, Client, check_ping
from ._errors import RPCError, UnavailableError
from ._interceptors import check_interceptors
from ._outbox import DEFAULT_LIMIT

if TYPE_CHECKING:
    import ssl
    from collections.abc import AsyncIterator, Sequence
    from types import TracebackType

    from anyio.abc import TaskGroup

    from .._compat import Unpack
    from .._options import Options, PooledOptionsKeywords
    from ._interceptors import ClientInterceptor
    from ._retry import Retry

__all__ = ["Pool"]

logger = logging.getLogger("anyio_comm.rpc")

#: connections per address, and users of one connection at once, by default
DEFAULT_MAX_PER_ADDRESS: Final = 4
DEFAULT_MAX_USERS: Final = 100
#: seconds an unused connection stays open, by default
DEFAULT_IDLE_TIMEOUT: Final = 30.0
#: seconds a failed address is not picked, by default
DEFAULT_SET_ASIDE: Final = 5.0


class NoRoomError(TimeoutError):
    """No connection to an address had room within the pool's
    ``wait_timeout`` (the address is busy, not broken)."""


#: what making a connection raises when it fails (TimeoutError is an OSError)
_CONNECT_ERRORS: Final = (OSError, anyio.BrokenResourceError, CommError)


class _PooledClient:
    """A :class:`Client` over one of the pool's connections: how many
    ``client()`` blocks use it now (``users``) and, while none does, since when
    (``idle_since``)."""

    __slots__ = ("address", "client", "idle_since", "users")

    def __init__(self, address: str, client: Client, now: float) -> None:
        self.address = address
        self.client = client
        self.users = 0
        self.idle_since = now


@final
class Pool:
    """Connections to RPC servers, shared by the calls of many tasks.

    ``async with pool.client(address) as remote`` gives a :class:`Client` over
    one of at most ``max_per_address`` connections to ``address``: the one with
    the fewest users, as long as it has fewer than ``max_users_per_connection``;
    when all have that many, a new one (one connection is made at a time per
    address: the tasks that need one meanwhile wait for it, and if it cannot be
    made they all raise why). Calls of the tasks that share a connection are
    multiplexed over it. When there are ``max_per_address`` connections, all
    full, the task waits for a user to leave, at most ``wait_timeout`` seconds.
    A connection whose peer went away is replaced at the next use; one unused
    for ``idle_timeout`` seconds is closed. New connections are made with
    ``anyio_comm.connect(retry=True)``: a server that is not up yet is retried
    with jittered exponential backoff until ``connect_timeout`` (not so with
    several ``addresses``, where another address serves meanwhile).

    Given ``addresses``, the pool balances over them: ``pool.client()``
    without an address, and :meth:`call`, use the next one in turn
    (``balance="round_robin"``) or the one with the fewest calls in flight
    (``"least_loaded"``). An address whose connection could not be made, or
    whose connection ended under a call, is set aside for ``set_aside``
    seconds: the others are picked meanwhile (all of them set aside: the one
    set aside first is tried again). :meth:`call` also sends a call again
    when ``retry`` (a :class:`Retry`) says so, to a newly picked address.

    Use it as an async context manager; leaving the block closes every
    connection (calls in flight raise :exc:`anyio.ClosedResourceError`).

    Args:
        addresses: the servers to balance over (they serve the same
            methods), for ``client()`` without an address and :meth:`call`.
        balance: ``"round_robin"`` or ``"least_loaded"``.
        set_aside: seconds a failed address is not picked.
        retry: which calls :meth:`call` sends again, and how (None: none;
            a call whose connection could not be made is tried at the next
            address anyway, as nothing was sent).
        max_per_address: connections to one address at once.
        max_users_per_connection: ``client()`` blocks sharing one connection.
        idle_timeout: seconds before an unused connection is closed (``None``:
            never).
        wait_timeout: seconds ``client()`` waits for a connection with room
            (``None``: no limit beyond the caller's own deadline).
        connect_timeout: seconds a new connection may take, retries included.
        max_queued: see :func:`~anyio_comm.rpc.open_client`.
        stream_window: see :func:`~anyio_comm.rpc.open_client`.
        interceptors: see :func:`~anyio_comm.rpc.open_client` (the clients of
            every connection use them).
        ping_interval: see :func:`~anyio_comm.rpc.open_client` (every
            connection pings so).
        ping_timeout: see :func:`~anyio_comm.rpc.open_client`.
        options: as for :func:`anyio_comm.connect`, and so are
            ``ssl_context``, ``server_hostname``, ``early_data``,
            ``happy_eyeballs_delay`` and the fields of
            :class:`~anyio_comm.Options` as keywords but ``idle_timeout``,
            which is the pool's own above (the connections' comes from
            ``options``); an unknown name is a TypeError.

    Raises:
        ValueError: a limit is below 1, a timeout, ``set_aside`` or
            ``ping_interval`` is not positive, or ``balance`` is neither
            value.
        TypeError: an interceptor is not callable, or a keyword is not an
            option.
    """

    def __init__(
        self,
        addresses: Sequence[str] = (),
        *,
        balance: Balance = "round_robin",
        set_aside: float = DEFAULT_SET_ASIDE,
        retry: Retry | None = None,
        max_per_address: int = DEFAULT_MAX_PER_ADDRESS,
        max_users_per_connection: int = DEFAULT_MAX_USERS,
        idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT,
        wait_timeout: float | None = None,
        connect_timeout: float = 10.0,
        max_queued: int = DEFAULT_LIMIT,
        stream_window: int = DEFAULT_STREAM_WINDOW,
        interceptors: Sequence[ClientInterceptor] = (),
        ping_interval: float | None = None,
        ping_timeout: float = DEFAULT_PING_TIMEOUT,
        options: Options | None = None,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        early_data: bool = False,
        happy_eyeballs_delay: float = HAPPY_EYEBALLS_DELAY,
        **keywords: Unpack[PooledOptionsKeywords],
    ) -> None:
        if max_per_address < 1 or max_users_per_connection < 1:
            raise ValueError("max_per_address and max_users_per_connection must be at least 1")
        for name, value in (
            ("idle_timeout", idle_timeout),
            ("wait_timeout", wait_timeout),
            ("connect_timeout", connect_timeout),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive")
        if max_queued < 1 or stream_window < 1:
            raise ValueError("max_queued and stream_window must be at least 1")
        if balance not in ("round_robin", "least_loaded"):
            raise ValueError(f"balance must be 'round_robin' or 'least_loaded', not {balance!r}")
        if not set_aside > 0:
            raise ValueError("set_aside must be positive")
        if isinstance(addresses, str):
            raise TypeError("addresses must be a sequence of addresses, not one str")
        self._balancer = Balancer(addresses, balance, set_aside, anyio.current_time)
        self._retry = retry
        self._max_per_address = max_per_address
        self._max_users = max_users_per_connection
        self._idle_timeout = idle_timeout
        self._wait_timeout = wait_timeout
        self._connect_timeout = connect_timeout
        self._max_queued = max_queued
        self._stream_window = stream_window
        self._interceptors = check_interceptors(interceptors)
        check_ping(ping_interval, ping_timeout)
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        self._connect_arguments: dict[str, Any] = {
            "options": resolve_options("rpc.Pool", options, keywords),
            "ssl_context": ssl_context,
            "server_hostname": server_hostname,
            "early_data": early_data,
            "happy_eyeballs_delay": happy_eyeballs_delay,
        }
        self._connections: dict[str, list[_PooledClient]] = {}
        #: the addresses a connection is being made to
        self._opening: dict[str, int] = {}
        #: per address, the connections that could not be made, and the last error
        self._failures: dict[str, tuple[int, Exception | None]] = {}
        self._changed = anyio.Event()
        self._task_group: TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._closed = False

    def connections(self, address: str | None = None) -> int:
        """The open connections (to ``address``, or to all)."""
        if address is not None:
            return len(self._connections.get(address, ()))
        return sum(map(len, self._connections.values()))

    async def __aenter__(self) -> Pool:
        if self._stack is not None or self._closed:
            raise RuntimeError("a Pool is entered once")
        async with contextlib.AsyncExitStack() as stack:
            self._task_group = await stack.enter_async_context(anyio.create_task_group())
            stack.callback(self._task_group.cancel_scope.cancel)
            stack.push_async_callback(self._close_all)
            if self._idle_timeout is not None:
                self._task_group.start_soon(self._close_idle, name="rpc pool: idle connections")
            self._stack = stack.pop_all()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._closed = True
        stack = self._stack
        assert stack is not None
        # (not handed the block's exception: the task group would put it in an
        # ExceptionGroup; it propagates as it is once the connections are closed)
        await stack.__aexit__(None, None, None)

    @asynccontextmanager
    async def client(self, address: str | None = None) -> AsyncIterator[Client]:
        """A :class:`Client` to ``address`` over a pooled connection, for the
        block; without an address, to one of the pool's ``addresses``, picked
        as ``balance`` says. A block that raises :exc:`UnavailableError` (its
        connection ended) sets its address aside.

        Raises:
            ValueError: no address was given, and the pool has none.
            TimeoutError: no connection had room within ``wait_timeout``, or a
                new one could not be made within ``connect_timeout``.
            OSError: the connection failed (see :func:`anyio_comm.connect`);
                the tasks that waited for that connection raise the same error.
            CommError: the handshake failed (a peer that is not an anyio-comm
                server; anyio.BrokenResourceError when it closed the
                connection). A connection that could not be made sets its
                address aside.
            anyio.ClosedResourceError: the pool is closed.
            RuntimeError: the pool was not entered.
        """
        if address is None:
            address = self._pick()
        try:
            pooled = await self._acquire(address)
        except NoRoomError:
            raise
        except _CONNECT_ERRORS:
            self._balancer.set_aside(address)
            raise
        try:
            yield pooled.client
        except UnavailableError:
            self._balancer.set_aside(address)
            raise
        finally:
            self._release(pooled)

    def _pick(self, avoid: str | None = None) -> str:
        """One of the pool's addresses, for the next call.

        Raises:
            ValueError: the pool has no addresses.
        """
        if not self._balancer.addresses:
            raise ValueError("give client() an address, or the Pool its addresses")
        return self._balancer.pick(self._load, avoid)

    def _load(self, address: str) -> int:
        """The calls in flight to ``address``."""
        return sum(c.client.calls_in_flight for c in self._connections.get(address, ()))

    def _release(self, pooled: _PooledClient) -> None:
        pooled.users -= 1
        if pooled.users == 0:
            pooled.idle_since = anyio.current_time()
        self._signal()

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on one of the pool's ``addresses``, picked as
        ``balance`` says: :meth:`Client.call` over a pooled connection. When
        the connection cannot be made, the call goes to the next address
        (nothing was sent), once per address at most; when it fails with an
        error that ``retry`` retries, for one of its methods, it is sent again,
        to another address when there is one, after a backoff, within the
        caller's deadline.

        Raises:
            ValueError: the pool has no addresses.
            OSError: no connection could be made (the last address's error;
                TimeoutError when it took too long, or no connection had room
                within ``wait_timeout``).
            CommError: the last address's handshake failed (a peer that is
                not an anyio-comm server; anyio.BrokenResourceError when it
                closed the connection).
            RPCError: the call failed, as :meth:`Client.call` raises (the last
                attempt's error).
        """
        retry = self._retry
        sends = 0
        unreachable = 0
        address: str | None = None
        while True:
            address = self._pick(avoid=address)
            try:
                pooled = await self._acquire(address)
            except NoRoomError:  # busy, not broken: another address, if any
                unreachable += 1
                if unreachable >= len(self._balancer.addresses):
                    raise
                continue
            except _CONNECT_ERRORS:
                self._balancer.set_aside(address)
                unreachable += 1
                if unreachable >= len(self._balancer.addresses):
                    raise
                continue
            sends += 1
            try:
                result = await pooled.client.call(method, *args, **kwargs)
            except RPCError as exc:
                if isinstance(exc, UnavailableError):
                    self._balancer.set_aside(address)
                if retry is None or not retry.retries(method, exc, sends):
                    raise
                failure = exc
            else:
                self._balancer.restore(address)
                return result
            finally:
                self._release(pooled)
            await retry.back_off(sends, failure)  # (its connection given back meanwhile)

    async def _acquire(self, address: str) -> _PooledClient:
        if self._task_group is None:
            raise RuntimeError("enter the Pool (async with) before using it")
        deadline = math.inf if self._wait_timeout is None else self._wait_timeout
        deadline += anyio.current_time()
        failures = self._failures.get(address, (0, None))[0]
        while True:
            if self._closed:
                raise anyio.ClosedResourceError
            count, error = self._failures.get(address, (0, None))
            if count != failures and error is not None:
                # the connection this task waited for could not be made: the same
                # error (a copy, so that each task's traceback is its own)
                raise copy.copy(error) from error
            live = [c for c in self._connections.get(address, ()) if c.client.usable]
            best = min(live, key=lambda c: c.users, default=None)
            if best is not None and best.users < self._max_users:
                best.users += 1
                return best
            if not self._opening.get(address) and len(live) < self._max_per_address:
                return await self._open(address)
            changed = self._changed
            if self._opening.get(address):
                await changed.wait()  # for the connection being made: no wait_timeout
            else:
                with anyio.move_on_after(max(deadline - anyio.current_time(), 0)) as waited:
                    await changed.wait()
                if waited.cancelled_caught:
                    raise NoRoomError(f"no connection to {address} had room within wait_timeout")

    async def _open(self, address: str) -> _PooledClient:
        self._opening[address] = 1
        try:
            comm = await connect(
                address,
                timeout=self._connect_timeout,
                # (a server not up yet is waited for, unless another can serve)
                retry=len(self._balancer.addresses) < 2,
                **self._connect_arguments,
            )
        except Exception as exc:
            count = self._failures.get(address, (0, None))[0]
            self._failures[address] = (count + 1, exc)
            raise
        finally:
            del self._opening[address]
            self._signal()
        pooled = _PooledClient(
            address,
            Client(
                comm,
                max_queued=self._max_queued,
                stream_window=self._stream_window,
                interceptors=self._interceptors,
                ping_interval=self._ping_interval,
                ping_timeout=self._ping_timeout,
            ),
            anyio.current_time(),
        )
        pooled.users = 1
        self._connections.setdefault(address, []).append(pooled)
        assert self._task_group is not None
        self._task_group.start_soon(self._run, pooled, name=f"rpc pool: {address}")
        return pooled

    async def _run(self, pooled: _PooledClient) -> None:
        try:
            await pooled.client.run()
        except Exception:  # a bug: never take the pool's other connections with it
            logger.exception("rpc pool: the connection to %s failed", pooled.address)
        finally:
            with anyio.CancelScope(shield=True):
                await pooled.client.aclose()
            connections = self._connections.get(pooled.address)
            if connections is not None and pooled in connections:
                connections.remove(pooled)
                if not connections:
                    del self._connections[pooled.address]
            self._signal()

    async def _close_idle(self) -> None:
        timeout = self._idle_timeout
        assert timeout is not None
        while True:
            await anyio.sleep(timeout / 4)
            now = anyio.current_time()
            for connections in list(self._connections.values()):
                for pooled in list(connections):
                    if pooled.users == 0 and now - pooled.idle_since >= timeout:
                        await pooled.client.aclose()  # its _run removes it

    async def _close_all(self) -> None:
        self._closed = True
        with anyio.CancelScope(shield=True):
            for connections in list(self._connections.values()):
                for pooled in list(connections):
                    await pooled.client.aclose()
        self._signal()

    def _signal(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()
