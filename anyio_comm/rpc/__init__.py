"""Request/response calls over anyio-comm: many calls multiplexed over one
comm, deadlines and cancellation that reach the server, typed remote errors,
and server-side limits.

::

    async def add(a: int, b: int) -> int:
        return a + b

    async with anyio_comm.rpc.serve("tcp://127.0.0.1:0", {"add": add}) as server:
        async with anyio_comm.rpc.connect(server.address) as remote:
            assert await remote.call("add", 1, 2) == 3

The messages are ordinary anyio-comm messages (see
:mod:`anyio_comm.rpc._protocol` and the RPC guide).
"""

from __future__ import annotations

from contextlib import asynccontextmanager as _asynccontextmanager
from typing import TYPE_CHECKING as _TYPE_CHECKING

from .._connect import HAPPY_EYEBALLS_DELAY as _HAPPY_EYEBALLS_DELAY
from .._connect import connect as _connect_comm
from .._options import resolve_options as _resolve_options
from ._client import (
    DEFAULT_PING_TIMEOUT,
    DEFAULT_STREAM_WINDOW,
    Client,
    Stream,
    WithMetadata,
    open_client,
)
from ._client import check_ping as _check_ping
from ._context import CallContext, CallKind, current_call
from ._errors import (
    ApplicationError,
    BadCallError,
    DeadlineExceededError,
    InvalidArgumentsError,
    MethodNotFoundError,
    OverloadedError,
    RemoteError,
    RPCError,
    UnavailableError,
)
from ._health import HEALTH_METHOD, HealthStatus
from ._input import DEFAULT_INPUT_WINDOW, InputStream
from ._interceptors import ClientInterceptor, OutgoingCall, Proceed, ServerInterceptor
from ._interceptors import check_interceptors as _check_interceptors
from ._outbox import DEFAULT_LIMIT as _DEFAULT_LIMIT
from ._pool import Pool
from ._retry import Retry
from ._sending import Channel, Upload
from ._server import Server, serve
from ._statistics import Histogram, MethodStatistics, ServerStatistics

if _TYPE_CHECKING:
    import ssl
    from collections.abc import AsyncIterator, Sequence

    from .._compat import Unpack
    from .._options import Options, OptionsKeywords

__all__ = [
    "DEFAULT_INPUT_WINDOW",
    "DEFAULT_PING_TIMEOUT",
    "DEFAULT_STREAM_WINDOW",
    "HEALTH_METHOD",
    "ApplicationError",
    "BadCallError",
    "CallContext",
    "CallKind",
    "Channel",
    "Client",
    "ClientInterceptor",
    "DeadlineExceededError",
    "HealthStatus",
    "Histogram",
    "InputStream",
    "InvalidArgumentsError",
    "MethodNotFoundError",
    "MethodStatistics",
    "OutgoingCall",
    "OverloadedError",
    "Pool",
    "Proceed",
    "RPCError",
    "RemoteError",
    "Retry",
    "Server",
    "ServerInterceptor",
    "ServerStatistics",
    "Stream",
    "UnavailableError",
    "Upload",
    "WithMetadata",
    "connect",
    "current_call",
    "open_client",
    "serve",
]


@_asynccontextmanager
async def connect(
    address: str,
    *,
    max_queued: int = _DEFAULT_LIMIT,
    stream_window: int = DEFAULT_STREAM_WINDOW,
    interceptors: Sequence[ClientInterceptor] = (),
    ping_interval: float | None = None,
    ping_timeout: float = DEFAULT_PING_TIMEOUT,
    options: Options | None = None,
    timeout: float | None = None,
    retry: bool = False,
    ssl_context: ssl.SSLContext | None = None,
    server_hostname: str | None = None,
    early_data: bool = False,
    happy_eyeballs_delay: float = _HAPPY_EYEBALLS_DELAY,
    **keywords: Unpack[OptionsKeywords],
) -> AsyncIterator[Client]:
    """Connect to the RPC server at ``address``; a :class:`Client` until the
    block ends.

    Args:
        address: the server's address.
        max_queued: messages queued for sending before calls wait for room.
        stream_window: items of a stream the server may send ahead.
        interceptors: see :func:`open_client`.
        ping_interval: see :func:`open_client`.
        ping_timeout: see :func:`open_client`.
        options: as for :func:`anyio_comm.connect`, and so are ``timeout``,
            ``retry``, ``ssl_context``, ``server_hostname``, ``early_data``,
            ``happy_eyeballs_delay`` and the fields of
            :class:`~anyio_comm.Options` as keywords.

    Raises:
        ValueError: ``max_queued`` or ``stream_window`` is below 1, or
            ``ping_interval`` or ``ping_timeout`` is not positive.
        TypeError: an interceptor is not callable.
        OSError, TimeoutError, ...: as :func:`anyio_comm.connect` raises.
    """
    # (what the client would refuse is refused before connecting)
    interceptors = _check_interceptors(interceptors)
    if min(max_queued, stream_window) < 1:
        raise ValueError("max_queued and stream_window must be at least 1")
    _check_ping(ping_interval, ping_timeout)
    comm = await _connect_comm(
        address,
        options=_resolve_options("rpc.connect", options, keywords),
        timeout=timeout,
        retry=retry,
        ssl_context=ssl_context,
        server_hostname=server_hostname,
        early_data=early_data,
        happy_eyeballs_delay=happy_eyeballs_delay,
    )
    async with open_client(
        comm,
        max_queued=max_queued,
        stream_window=stream_window,
        interceptors=interceptors,
        ping_interval=ping_interval,
        ping_timeout=ping_timeout,
    ) as client:
        yield client
