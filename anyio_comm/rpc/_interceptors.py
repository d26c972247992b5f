"""Interceptors: code that sees every call, stream and notification of a client
or a server, written once (authentication, logging, metrics, trace propagation).

An interceptor is a coroutine function ``interceptor(call, proceed)``. It may
look at ``call`` (a :class:`~anyio_comm.rpc.CallContext` on the server, an
:class:`OutgoingCall` on the client, which it may change), refuse the call by
raising, and otherwise ``await proceed()``, which runs the next interceptor and,
after the last, the call itself; what it returns is the call's result.
Interceptors run in the order given, the first outermost, in the calling task
(on the server: in the call's own context, within its deadline).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from .._compat import final
from ._context import CallContext, CallKind

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "ClientInterceptor",
    "OutgoingCall",
    "Proceed",
    "ServerInterceptor",
    "check_interceptors",
    "intercepted",
]

_CallT = TypeVar("_CallT")


@final
class OutgoingCall:
    """A call a client makes, as its interceptors see it: they may change its
    arguments and add metadata before ``proceed()`` sends it.

    Attributes:
        kind: ``"call"``, ``"stream"`` or ``"notification"``.
        method: the method called.
        args: its positional arguments (a tuple: replace it to change them).
        kwargs: its keyword arguments (a dict of its own).
        metadata: the metadata sent with it, a dict of its own: what
            :meth:`Client.with_metadata` gave, or empty. Entries added here are
            sent (checked against the limits of metadata when it is sent).
    """

    __slots__ = ("args", "kind", "kwargs", "metadata", "method")

    def __init__(
        self,
        kind: CallKind,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: dict[str, str | bytes],
    ) -> None:
        self.kind: CallKind = kind
        self.method = method
        self.args = args
        self.kwargs = kwargs
        self.metadata = metadata

    def __repr__(self) -> str:
        return f"OutgoingCall(kind={self.kind!r}, method={self.method!r})"


#: what ``proceed`` is: it runs the rest of the chain
Proceed: TypeAlias = Callable[[], Awaitable[Any]]
#: ``async def interceptor(call: CallContext, proceed) -> Any`` (see the module)
ServerInterceptor: TypeAlias = Callable[[CallContext, Proceed], Awaitable[Any]]
#: ``async def interceptor(call: OutgoingCall, proceed) -> Any`` (see the module)
ClientInterceptor: TypeAlias = Callable[[OutgoingCall, Proceed], Awaitable[Any]]


def check_interceptors(interceptors: Sequence[Any]) -> tuple[Any, ...]:
    """``interceptors`` as a tuple.

    Raises:
        TypeError: one of them is not callable, or ``interceptors`` is a
            callable itself rather than a sequence of them.
    """
    if callable(interceptors):
        raise TypeError("interceptors must be a sequence of callables: put the one in a list")
    checked = tuple(interceptors)
    for interceptor in checked:
        if not callable(interceptor):
            raise TypeError(f"an interceptor must be callable, not {interceptor!r:.80}")
    return checked


def intercepted(
    interceptors: tuple[Any, ...], call: _CallT, last: Callable[[], Awaitable[Any]]
) -> Coroutine[Any, Any, Any]:
    """A coroutine that runs ``interceptors`` around ``last``: the first is
    called with ``call`` and a ``proceed`` that calls the second, and so on;
    the last one's ``proceed`` is ``last``."""
    proceed = last
    for interceptor in reversed(interceptors[1:]):
        proceed = partial(interceptor, call, proceed)
    result = interceptors[0](call, proceed)
    if inspect.iscoroutine(result):
        return result
    return _awaited(result)


async def _awaited(awaitable: Awaitable[Any]) -> Any:
    """An awaitable that is not a coroutine, as one."""
    return await awaitable
