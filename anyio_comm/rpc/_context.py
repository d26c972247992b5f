"""Each call in a context of its own, and what its handler may ask about it.

A connection's calls run one after another on its worker tasks, so they would
share the worker's :mod:`contextvars` context: a variable one call sets (a
user, a trace id) would be seen by the calls that follow, from other callers.
As a task of their own would, calls run in a copy of the context the worker
started with: a plain function through ``Context.run``, a coroutine (and each
step of an async generator) through :class:`InContext`, which resumes it inside
the context at every step. That copy also holds the call's
:class:`CallContext`, which :func:`current_call` returns.
"""

from __future__ import annotations

import math
from contextvars import ContextVar
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal

from anyio.streams.tls import TLSAttribute

from .._compat import final
from ._protocol import Metadata, check_metadata

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine, Generator, Mapping
    from contextvars import Context

    from .._comm import Comm

__all__ = ["CallContext", "CallKind", "InContext", "current_call"]

#: what a call is: arguments in and one result out (``call``), a stream of
#: results out (``stream``), a stream of items in and one result out
#: (``upload``), streams both ways (``channel``), or no result (``notification``)
CallKind = Literal["call", "stream", "upload", "channel", "notification"]

_NO_DEFAULT: Any = object()
_NO_METADATA: Final[Mapping[str, str | bytes]] = MappingProxyType({})


@final
class CallContext:
    """The call a handler serves, and the connection it came on: what
    :func:`current_call` returns inside a handler (and in tasks the handler
    starts, which inherit its context).

    Attributes:
        method: the name the caller called.
        id: the caller's number for the call (``None`` for a notification).
        kind: ``"call"`` (one result), ``"stream"`` (results streamed),
            ``"upload"`` (the caller streams items, one result), ``"channel"``
            (streams both ways) or ``"notification"``.
    """

    __slots__ = ("_clock", "_comm", "_deadline", "_metadata", "_trailers", "id", "kind", "method")

    def __init__(
        self,
        method: str,
        call_id: int | None,
        comm: Comm,
        deadline: float,
        clock: Callable[[], float],
        metadata: Metadata | None = None,
        kind: CallKind = "call",
    ) -> None:
        # (made for every call: only assignments here)
        self.method = method
        self.id = call_id
        self.kind: CallKind = kind
        self._comm = comm
        self._deadline = deadline
        self._clock = clock
        self._metadata = metadata
        self._trailers: Metadata | None = None

    @property
    def metadata(self) -> Mapping[str, str | bytes]:
        """The metadata the caller sent with the call, a read-only map of str
        keys to str or bytes values (empty if it sent none)."""
        metadata = self._metadata
        return _NO_METADATA if metadata is None else MappingProxyType(metadata)

    @property
    def trailers(self) -> Mapping[str, str | bytes]:
        """The trailers set so far, read-only (see :meth:`set_trailer`)."""
        trailers = self._trailers
        return _NO_METADATA if trailers is None else MappingProxyType(trailers)

    def set_trailer(self, key: str, value: str | bytes) -> None:
        """Send ``key: value`` back with the call's reply (its result or its
        error), to a caller that sent metadata (see the RPC guide); a
        notification's go nowhere. Setting a key again replaces its value.

        Raises:
            ValueError: the key is not a non-empty str of at most 128
                characters, the value not a str or bytes, or the trailers
                would exceed the limits of metadata (64 entries, 16 KiB).
        """
        self._trailers = check_metadata({**(self._trailers or {}), key: value}, "trailers")

    @property
    def peer_address(self) -> str:
        """The caller's address, as the connection reports it."""
        return self._comm.peer_address

    @property
    def peer_certificate(self) -> dict[str, Any] | None:
        """The caller's TLS certificate, as :meth:`ssl.SSLSocket.getpeercert`
        decodes it; ``None`` on a connection without TLS, or when the caller
        sent none."""
        certificate: dict[str, Any] | None = self._comm.extra(TLSAttribute.peer_certificate, None)
        return certificate or None

    @property
    def deadline(self) -> float:
        """When the call's deadline passes, on the event loop's clock
        (:func:`anyio.current_time`); ``math.inf`` for none."""
        return self._deadline

    def remaining(self) -> float:
        """Seconds left before the deadline (0 once it passed; ``math.inf`` for
        none)."""
        if self._deadline == math.inf:
            return math.inf
        return max(self._deadline - self._clock(), 0.0)

    def extra(self, attribute: Any, default: Any = _NO_DEFAULT) -> Any:
        """A typed attribute of the connection (``anyio_comm.CommAttribute``,
        ``anyio.streams.tls.TLSAttribute`` over TLS), as the comm's ``extra()``
        gives it, or ``default`` if given and the connection has none.

        Raises:
            anyio.TypedAttributeLookupError: the connection has no such
                attribute and no default was given.
        """
        if default is _NO_DEFAULT:
            return self._comm.extra(attribute)
        return self._comm.extra(attribute, default)

    def __repr__(self) -> str:
        return (
            f"CallContext(kind={self.kind!r}, method={self.method!r}, id={self.id!r},"
            f" peer={self.peer_address!r})"
        )


#: the call of the running handler (set in each call's own context)
CURRENT_CALL: ContextVar[CallContext] = ContextVar("anyio_comm.rpc.current_call")


def current_call() -> CallContext:
    """The call the running handler serves (see :class:`CallContext`).

    Raises:
        RuntimeError: not called from an RPC handler, nor from a task that a
            handler started.
    """
    try:
        return CURRENT_CALL.get()
    except LookupError:
        raise RuntimeError("current_call() is only available inside an RPC handler") from None


class InContext:
    """An awaitable that runs ``coroutine`` with every step inside ``context``."""

    __slots__ = ("_context", "_coroutine")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], context: Context) -> None:
        self._coroutine = coroutine
        self._context = context

    def __await__(self) -> Generator[Any, Any, Any]:
        run = self._context.run
        send = self._coroutine.send
        throw = self._coroutine.throw
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = run(send, value) if error is None else run(throw, error)
            except StopIteration as stop:
                return stop.value
            error = None
            try:
                value = yield yielded
            except BaseException as exc:  # a cancellation, thrown in at the await
                value = None
                error = exc
