"""The serving side: a listener whose connections run their calls on worker
tasks of their own, within limits, each call in a context of its own and
cancelled when its caller cancels it or its deadline passes.

Theory of operation: what a waiting call costs
------------------------------------------------
A call that waits in its connection's queue (for a worker, or for a slot of
the server's) holds its arguments. So that peers cannot make the server hold
more than the listener's receive budget that way, a queued call stays charged
to the budget until its handler starts (or it leaves the queue: cancelled,
its deadline passed, its connection gone):

* a message large enough for the budget to count (at least the read-ahead
  buffer: see :mod:`anyio_comm._sansio.budget`) was reserved when its header
  arrived; the comm hands that reservation to the connection's own account
  (:func:`anyio_comm._comm.keep_taken`) instead of giving it back when the
  message is read, so it stays charged without a gap;
* smaller calls are charged to a per-connection allowance of
  :data:`UNCHARGED_PER_CONNECTION` bytes first (ordinary small calls never
  touch the budget), then to the budget.

When the budget is spent, the connection is not read (backpressure, as for any
message that waits for the budget: the peer's sends block, nothing is dropped):
a large message waits at its header in the comm, a small call beyond the
allowance in :meth:`Server._read`. The count limit
(``max_waiting_per_connection``) still refuses calls with OVERLOADED, as
documented. A queued call whose deadline passes is answered and gives its
charge back when it passes (a timer task per connection, made when the first
call with a deadline waits), not when a worker reaches it. With
``overload="reject"`` calls never wait for a slot: small ones are not charged.
The connection's account is closed by the budget's stall check, like any
connection's, when it holds budget while none of its calls starts or ends for
``stall_timeout`` and others wait for the budget.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import heapq
import inspect
import logging
import math
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, TypeVar, overload

import anyio
from anyio.lowlevel import checkpoint

from .._backend import current_backend
from .._comm import count_work, keep_taken, receive_with_cost
from .._compat import final
from .._listener import DEFAULT_HANDSHAKE_THREADS, listen
from .._options import Options, OptionsKeywords, resolve_options
from .._sansio.budget import DEFAULT_RECEIVE_BUDGET, ReceiveBudget
from .._sansio.close import CloseCode, CloseReason
from .._sansio.errors import LocalProtocolError, SerializationError
from ._context import CURRENT_CALL, CallContext, CallKind, InContext
from ._errors import ApplicationError, error_for
from ._health import HEALTH_METHOD, HealthStatus
from ._input import DEFAULT_INPUT_WINDOW, InputStream
from ._interceptors import check_interceptors, intercepted
from ._outbox import DEFAULT_LIMIT, Outbox
from ._protocol import (
    HELLO_METHOD,
    Call,
    Cancel,
    Credit,
    End,
    ErrorCode,
    ErrorReply,
    Item,
    Notify,
    Ping,
    Pong,
    ProtocolViolation,
    Result,
    decode,
)
from ._statistics import MethodCounters, ServerStatistics

if TYPE_CHECKING:
    import ssl
    from collections.abc import (
        AsyncGenerator,
        AsyncIterator,
        Awaitable,
        Callable,
        Coroutine,
        Sequence,
    )

    from anyio.abc import TaskGroup, TaskStatus
    from typing_extensions import TypeIs

    from .._backend import CancelScopeLike
    from .._comm import Comm
    from .._compat import Unpack
    from .._listener import Listener
    from .._sansio.budget import BudgetAccount
    from ._interceptors import ServerInterceptor

__all__ = ["Server", "serve"]

logger = logging.getLogger("anyio_comm.rpc")

#: characters of a handler's error message sent to the caller
MAX_ERROR_MESSAGE: Final = 1024
#: calls a worker runs one after another before it lets the event loop run
YIELD_EVERY: Final = 16
#: concurrent calls per connection, and in all, by default
DEFAULT_MAX_CALLS_PER_CONNECTION: Final = 100
DEFAULT_MAX_CALLS: Final = 10_000
#: calls of one connection that may wait for a slot, by default
DEFAULT_MAX_WAITING: Final = 1000
#: bytes of queued calls too small for the receive budget to count (see
#: :func:`~anyio_comm._sansio.budget.message_cost`) that one connection holds
#: before they are charged to it
UNCHARGED_PER_CONNECTION: Final = 1024 * 1024


def _type_name(exc: BaseException) -> str:
    """The name a caller sees: ``ValueError``, ``package.module.Error``, and the
    package's own errors by their public name (``anyio_comm.SerializationError``,
    ``anyio_comm.rpc.RPCError``: their ``__module__`` says it; any other class of
    the package, by the public package above its private module)."""
    cls = type(exc)
    module = cls.__module__
    if module == "builtins":
        return cls.__qualname__
    if module.startswith("anyio_comm."):
        parts = module.split(".")
        while any(part.startswith("_") for part in parts):
            parts.pop()
        module = ".".join(parts)
    return f"{module}.{cls.__qualname__}"


def _text(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # a __str__ that fails
        text = f"<{type(exc).__name__} whose message cannot be printed>"
    if len(text) > MAX_ERROR_MESSAGE:
        text = text[: MAX_ERROR_MESSAGE - 3] + "..."
    return text


def _methods(handlers: Mapping[str, Callable[..., Any]] | object) -> dict[str, Callable[..., Any]]:
    if isinstance(handlers, Mapping):
        methods = dict(handlers)
    else:
        methods = {
            name: getattr(handlers, name)
            for name in dir(handlers)
            if not name.startswith("_") and callable(getattr(handlers, name))
        }
    for name, method in methods.items():
        if not isinstance(name, str):
            raise TypeError(f"method names must be str, not {type(name).__name__}")
        if not callable(method):
            raise TypeError(f"the handler of {name!r} is not callable")
        if name in (HEALTH_METHOD, HELLO_METHOD):
            raise ValueError(f"{name!r} is a name the RPC protocol reserves")
    return methods


def _name(method: str) -> str:
    """A method's name for a message or a log line: at most 100 characters."""
    return repr(method if len(method) <= 100 else method[:97] + "...")


#: the message of a call answered at its deadline before its handler started
_WAITED_PAST_DEADLINE: Final = "{} waited past its deadline"


#: what a call is, by its CALL's ``stream`` and ``input``
_KINDS: Final[dict[tuple[bool, bool], CallKind]] = {
    (False, False): "call",
    (True, False): "stream",
    (False, True): "upload",
    (True, True): "channel",
}


def _no_release(nbytes: int) -> None:
    """A listener without a receive budget gives nothing back."""


def _once(run: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
    """``run`` as the ``proceed()`` of the interceptors: it runs the call once,
    and a second call raises RuntimeError."""
    ran = False

    async def proceed() -> Any:
        nonlocal ran
        if ran:
            raise RuntimeError("proceed() runs the call once; it was called before")
        ran = True
        return await run()

    return proceed


def _refusal(call: Call, code: ErrorCode, text: str) -> ErrorReply:
    """The server's own answer to ``call`` (no handler raised it): its ``type``
    is the code's name (``DEADLINE_EXCEEDED``, ``OVERLOADED``, ...), whichever
    step gave it, so that one condition reaches callers as one ``remote_type``."""
    return ErrorReply(call.id, code, code.name, text)


def _failure(call: Call, exc: Exception) -> ErrorReply:
    """The reply to a call whose handler raised ``exc`` (with the status and
    details of an :exc:`ApplicationError`)."""
    if isinstance(exc, ApplicationError):
        text = str(exc.remote_message)
        if len(text) > MAX_ERROR_MESSAGE:
            text = text[: MAX_ERROR_MESSAGE - 3] + "..."
        return ErrorReply(
            call.id, ErrorCode.ERROR, _type_name(exc), text, status=(exc.status, exc.details)
        )
    return ErrorReply(call.id, ErrorCode.ERROR, _type_name(exc), _text(exc))


def _apply(call: Call, method: Callable[..., Any]) -> tuple[Any, ErrorReply | None]:
    """``method`` called with the call's arguments (a value, a coroutine or an
    async generator), or the reply to a call whose arguments do not fit it (a
    TypeError raised inside the method is the method's own).

    Raises:
        Exception: what the method raised when it was called.
    """
    try:
        return method(*call.args, **call.kwargs), None
    except TypeError as exc:
        if _arguments_fit(method, call.args, call.kwargs):
            raise
        return None, ErrorReply(call.id, ErrorCode.INVALID_ARGUMENTS, "TypeError", _text(exc))


def _arguments_fit(method: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> bool:
    try:
        inspect.signature(method).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature to be had: assume they do
        return True
    return True


class _Slots:
    """A counting semaphore whose :meth:`try_take` takes a free slot without
    yielding (AnyIO's CapacityLimiter checkpoints twice per acquisition, which
    the server cannot afford per call); tasks that wait are served first come,
    first served."""

    __slots__ = ("_waiters", "free", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._waiters: collections.deque[anyio.Event] = collections.deque()

    def try_take(self) -> bool:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return True
        return False

    async def take(self) -> None:
        if self.try_take():
            return
        event = anyio.Event()
        self._waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():
                self.give()  # a slot was handed over as this was cancelled: pass it on
            else:
                self._waiters.remove(event)
            raise

    def give(self) -> None:
        if self._waiters:
            self._waiters.popleft().set()  # the slot goes to the first waiter
        else:
            self.free += 1


class _Running:
    """A call's (or a notification's) task, as its session knows it, and a
    streaming call's credit: the items the client is ready for."""

    __slots__ = (
        "allowance",
        "arrived",
        "cancelled_by_client",
        "charge",
        "counters",
        "credit",
        "credited",
        "deadline",
        "failure",
        "holds_slot",
        "input",
        "scope",
        "started",
        "withdrawn",
    )

    def __init__(self, deadline: float = math.inf) -> None:
        self.scope: CancelScopeLike | None = None
        self.cancelled_by_client = False
        #: when the call's timeout passes (it runs while the call waits)
        self.deadline = deadline
        #: a slot of the server's was taken for it when the call came
        self.holds_slot = False
        #: a worker took it from the queue
        self.started = False
        #: taken out of the queue before it started (cancelled, or its deadline passed)
        self.withdrawn = False
        #: why the call failed while it ran (a stream item the client's limits refused)
        self.failure: LocalProtocolError | None = None
        #: bytes of the receive budget, and of the connection's allowance, that its
        #: message holds until its handler starts
        self.charge = 0
        self.allowance = 0
        self.credit = 0
        self.credited: anyio.Event | None = None
        #: the items the client sends an upload or a channel
        self.input: InputStream | None = None
        #: its method's counters (once admitted), and when it arrived (with
        #: detailed statistics)
        self.counters: MethodCounters | None = None
        self.arrived = 0.0

    def add_credit(self, count: int) -> None:
        self.credit += count
        if self.credited is not None:
            self.credited.set()
            self.credited = None

    def cancel(self) -> None:
        if self.scope is not None:
            self.scope.cancel()


def _withdrawn(running: _Running) -> bool:
    """Whether the client cancelled the call (a function: a type checker would
    take the attribute for unchanged since it was last looked at)."""
    return running.cancelled_by_client


_RequestT = TypeVar("_RequestT", Call, Notify)


class _Invocation(Generic[_RequestT]):
    """One call (or notification) from the wire, from the moment its session
    admits it until its handler returns or it leaves the queue: the message
    (the call's id, method name, arguments, timeout), the handler that runs it,
    and its state (deadline, budget charge, slot, cancel scope, credit). Its
    replies go to its session's outbox."""

    __slots__ = ("handler", "request", "state")

    def __init__(self, request: _RequestT, handler: Callable[..., Any], state: _Running) -> None:
        self.request: _RequestT = request
        self.handler = handler
        self.state = state


#: what a session's queue holds: a call or a notification, to be run by a worker
_Work = _Invocation[Call] | _Invocation[Notify]


def _is_call(work: _Work) -> TypeIs[_Invocation[Call]]:
    """Whether ``work`` is a call, not a notification (the type checker learns
    it too)."""
    return isinstance(work.request, Call)


class _Session:
    """The server's side of one connection: its calls, those that wait in its
    queue, and the worker tasks (at most ``max_calls_per_connection``, made as
    needed and kept while the connection lives) that run them one after
    another, so that a call costs no task of its own; its outbox of replies and
    its account of the receive budget."""

    __slots__ = (
        "allowance",
        "budget_min",
        "cancel_scope",
        "clock",
        "comm",
        "dropped",
        "ended",
        "expiries",
        "expiry_at",
        "expiry_wakeup",
        "finished",
        "granted",
        "holders",
        "idle_workers",
        "keeper",
        "outbox",
        "queue",
        "quiet_since",
        "running",
        "sequence",
        "status",
        "tasks",
        "workers",
    )

    def __init__(self, comm: Comm, max_queued: int) -> None:
        self.comm = comm
        #: the account of the receive budget that queued calls are charged to
        #: (``None``: no budget), and the cost from which the comm reserved a
        #: message (it hands that reservation over: see the module)
        self.keeper: BudgetAccount | None = None
        self.budget_min = math.inf
        #: what is left of the connection's allowance for small calls
        self.allowance = UNCHARGED_PER_CONNECTION
        #: set when the reader may stop waiting for the budget
        self.granted: anyio.Event | None = None
        #: calls and notifications that ended (the budget's stall check sees it)
        self.finished = 0
        #: the queued calls with a deadline, earliest first (with started ones
        #: among them, skipped), and when the timer task wakes up next
        self.expiries: list[tuple[float, int, _Invocation[Call]]] = []
        self.expiry_at = math.inf
        self.expiry_wakeup: anyio.Event | None = None
        self.sequence = 0
        self.outbox = Outbox(comm, max_queued)
        # a cancel scope per call, and the clock of its deadline: the event
        # loop's own, without AnyIO's lookup of the backend on every call
        backend = current_backend()
        self.cancel_scope = backend.cancel_scope
        self.clock = backend.current_time
        #: the calls that wait or run, by id
        self.running: dict[int, _Running] = {}
        #: the calls and notifications that wait or run
        self.tasks = 0
        #: when the last of them ended (the connection's idle_timeout counts
        #: from then: one with calls in flight is not idle)
        self.quiet_since = -math.inf
        self.queue: collections.deque[_Work] = collections.deque()
        self.workers = 0
        self.idle_workers: list[anyio.Event] = []
        #: the calls holding a slot of the server's (given back when they end, or,
        #: for one never started, when the connection ends)
        self.holders: set[_Running] = set()
        #: the connection ended: queued calls are not run
        self.ended = False
        #: notifications dropped (logged when this reaches a power of two)
        self.dropped = 0
        #: the client announced that it understands an ERROR's status
        self.status = False

    def working_until(self) -> float:
        """``math.inf`` while calls or notifications wait or run, else when the
        last ended (see :func:`~anyio_comm._comm.count_work`)."""
        return math.inf if self.tasks else self.quiet_since

    def task_ended(self) -> None:
        """Count one call or notification less (it ended, or left the queue)."""
        self.tasks -= 1
        if not self.tasks:
            self.quiet_since = self.clock()


@final
class Server:
    """A running RPC server (see :func:`serve`)."""

    def __init__(
        self,
        methods: dict[str, Callable[..., Any]],
        *,
        max_calls_per_connection: int,
        max_calls: int,
        max_waiting_per_connection: int,
        overload: Literal["wait", "reject"],
        max_queued: int,
        interceptors: tuple[ServerInterceptor, ...] = (),
        input_window: int = DEFAULT_INPUT_WINDOW,
        detailed_statistics: bool = False,
    ) -> None:
        self._methods = methods
        self._detailed = detailed_statistics
        self._counters = {name: MethodCounters(detailed_statistics) for name in methods}
        self._refused: collections.Counter[str] = collections.Counter()
        self._dropped = 0
        self._interceptors = interceptors
        self._input_window = input_window
        self._max_per_connection = max_calls_per_connection
        self._max_waiting = max_waiting_per_connection
        self._slots = _Slots(max_calls)
        self._overload = overload
        self._max_queued = max_queued
        self._listener: Listener | None = None
        self._sessions: set[_Session] = set()
        self._stopping = False
        self._idle = anyio.Event()  # set while no task runs, once stopping
        #: what the health service says of the server ("") and of named services
        self._serving: dict[str, bool] = {"": True}

    @property
    def listener(self) -> Listener:
        """The listener the server runs on."""
        assert self._listener is not None
        return self._listener

    @property
    def address(self) -> str:
        """The address clients connect to (the listener's first)."""
        return self.listener.address

    @property
    def calls_running(self) -> int:
        """The calls and notifications whose handler runs now, on all connections."""
        return self._slots.total - self._slots.free

    def statistics(self) -> ServerStatistics:
        """What the server has done so far, per method (see
        :class:`ServerStatistics`); also after it stopped."""
        return ServerStatistics(
            methods={name: counters.snapshot() for name, counters in self._counters.items()},
            refused=dict(self._refused),
            notifications_dropped=self._dropped,
            calls_running=self.calls_running,
        )

    def set_serving(self, serving: bool, service: str = "") -> None:
        """What the health service answers (:meth:`Client.check_health
        <anyio_comm.rpc.Client.check_health>`) for ``service``: serving or not;
        ``""``, the default, is the server as a whole, serving from the start.
        A name set here becomes known to the service (others are
        ``UNKNOWN``). Once :meth:`shutdown` began, every answer is
        ``NOT_SERVING``. Calls are taken either way: this only says what the
        health service answers.

        Raises:
            TypeError: ``service`` is not a str.
        """
        if not isinstance(service, str):
            raise TypeError(f"a service's name is a str, not {type(service).__name__}")
        self._serving[service] = bool(serving)

    def _health(self, call: Call) -> Result | ErrorReply:
        """The health service's answer to ``call`` (see :mod:`._health`)."""
        args = call.args
        if call.stream:
            return _refusal(call, ErrorCode.BAD_CALL, f"{HEALTH_METHOD} does not stream")
        if call.kwargs or len(args) > 1 or (args and type(args[0]) is not str):
            text = f"{HEALTH_METHOD} takes one optional str, a service's name"
            return ErrorReply(call.id, ErrorCode.INVALID_ARGUMENTS, "TypeError", text)
        serving = self._serving.get(args[0] if args else "")
        if serving is None:
            status = HealthStatus.UNKNOWN
        elif serving and not self._stopping:
            status = HealthStatus.SERVING
        else:
            status = HealthStatus.NOT_SERVING
        return Result(call.id, status.value)

    async def shutdown(self, grace_period: float = 0.0) -> None:
        """Stop: accept no more connections, answer new calls with
        :exc:`UnavailableError`, let the calls that run finish for at most
        ``grace_period`` seconds, then close every connection (calls still
        running are cancelled). Use it rather than ``listener.shutdown()``,
        which sees every RPC connection as idle between messages and stops its
        calls at once.

        Raises:
            ValueError: ``grace_period`` is negative.
        """
        if not grace_period >= 0:
            raise ValueError(f"grace_period must not be negative, not {grace_period!r}")
        self._stopping = True
        self.listener.stop_accepting()
        self._check_idle()
        with anyio.move_on_after(grace_period):
            await self._idle.wait()
            for session in list(self._sessions):
                await session.outbox.drain()  # the last replies
        await self.listener.shutdown(0)

    def _check_idle(self) -> None:
        if self._stopping and not any(session.tasks for session in self._sessions):
            self._idle.set()

    async def handle(self, comm: Comm) -> None:
        """Serve the calls of one connection until it ends (the listener's handler).

        The connection is read all the time, so that cancels and credits are
        seen whatever runs, except while its replies wait to be sent (a client
        that does not read what it asked for is not read either) and while its
        next call waits for the receive budget (see the module).
        """
        session = _Session(comm, self._max_queued)
        count_work(comm, session.working_until)
        kept = keep_taken(comm)
        if kept is not None:
            keeper, session.budget_min = kept
            session.keeper = keeper
            keeper.progress = lambda: session.finished
            stall = keeper.on_stall
            assert stall is not None

            def stalled(reason: str) -> None:
                stall(reason)  # closes the comm ...
                if session.granted is not None:
                    session.granted.set()  # ... and the reader sees it

            keeper.on_stall = stalled
        self._sessions.add(session)
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(session.outbox.run)
                try:
                    await self._read(session, task_group)
                finally:
                    session.ended = True
                    session.outbox.close()
                    task_group.cancel_scope.cancel()  # the caller went away
        finally:
            for running in session.running.values():  # (the calls not answered)
                self._count_end(running, "lost")
            for work in session.queue:  # (and the notifications not run)
                self._count_end(work.state, "lost")
            for running in list(session.holders):
                self._release(session, running)
            if session.keeper is not None:
                session.keeper.close()  # the queued calls' charges
            session.queue.clear()
            session.expiries.clear()
            self._sessions.discard(session)
            self._check_idle()

    async def _read(self, session: _Session, task_group: TaskGroup) -> None:
        comm = session.comm
        outbox = session.outbox
        while True:
            try:
                await outbox.wait_for_room()
                message, cost = await receive_with_cost(comm)
            except Exception:
                return  # the connection ended
            # the bytes of the budget the comm handed over with it (see the module)
            held = cost if cost >= session.budget_min else 0
            try:
                request = decode(message)
                if type(request) is Call or type(request) is Notify:
                    taken, held = held, 0  # the call holds it now, or gives it back
                    work: _Work | None = (
                        self._start(session, request, taken)
                        if isinstance(request, Call)
                        else self._start_notify(session, request, taken)
                    )
                    if work is not None:
                        state = work.state
                        if not self._charge(session, state, cost, taken):
                            # Not read until the budget has room (see the module).
                            await self._wait_for_budget(session)
                            state.charge = cost
                        self._enqueue(session, task_group, work)
                elif type(request) is Cancel:
                    running = session.running.get(request.id)
                    if running is not None:
                        running.cancelled_by_client = True
                        if running.started:
                            running.cancel()
                        else:
                            self._withdraw(session, request.id, running)
                elif type(request) is Credit:
                    running = session.running.get(request.id)
                    if running is not None:
                        running.add_credit(request.count)
                elif type(request) is Ping:  # answered at once, whatever runs
                    outbox.put_now(Pong(request.token).encode())
                elif type(request) is Item or type(request) is End:
                    running = session.running.get(request.id)
                    if running is not None:  # (else the call ended: dropped)
                        items = running.input
                        if items is None:
                            raise ProtocolViolation("a client sent items to a call without input")
                        if type(request) is Item:
                            items.add(request.value, held)
                            held = 0  # the item holds it until the handler takes it
                        else:
                            items.end()
                else:
                    raise ProtocolViolation(f"a client sent a {type(request).__name__} message")
            except ProtocolViolation as exc:
                await comm.aclose(CloseReason(CloseCode.PROTOCOL_ERROR, "rpc", _text(exc)))
                return
            except (LocalProtocolError, SerializationError):  # a refusal that cannot go
                logger.warning("rpc: a refusal could not be sent", exc_info=True)
            finally:
                if held:  # not a call (a cancel, a credit, a malformed message)
                    session.keeper.release(held)  # type: ignore[union-attr]

    def _start(self, session: _Session, call: Call, held: int) -> _Invocation[Call] | None:
        """Refuse ``call`` (giving back the ``held`` bytes of the budget its
        message came with), answer it at once (the health service), or return
        it, to be charged and queued."""
        method = self._methods.get(call.method)
        if method is None and call.method == HEALTH_METHOD:
            if held:
                session.keeper.release(held)  # type: ignore[union-attr]
            session.outbox.put_now(self._health(call).encode())
            return None
        refusal: tuple[ErrorCode, str] | None = None
        if method is None:
            refusal = ErrorCode.METHOD_NOT_FOUND, f"no method {_name(call.method)}"
        elif call.id in session.running:
            refusal = ErrorCode.BAD_CALL, f"call id {call.id} is in use"
        elif call.stream != inspect.isasyncgenfunction(method):
            name = _name(call.method)
            text = (
                f"{name} does not stream its results: use call() or upload(),"
                " not stream() or channel()"
                if call.stream
                else f"{name} streams its results: use stream() or channel(),"
                " not call() or upload()"
            )
            refusal = ErrorCode.BAD_CALL, text
        elif self._stopping:
            refusal = ErrorCode.UNAVAILABLE, "the server is shutting down"
        else:
            deadline = math.inf if call.timeout is None else session.clock() + call.timeout
            running = _Running(deadline)
            if self._admit(session, running):
                session.running[call.id] = running
                self._count_arrival(session, running, call.method)
                assert method is not None
                if call.input:
                    self._open_input(session, call, running)
                return _Invocation(call, method, running)
            refusal = ErrorCode.OVERLOADED, "the server is at its call limit"
        if held:
            session.keeper.release(held)  # type: ignore[union-attr]
        self._refuse(session, call, *refusal)
        return None

    def _open_input(self, session: _Session, call: Call, running: _Running) -> None:
        """Give an upload or a channel its input stream, the handler's first
        argument."""
        keeper = session.keeper
        items = InputStream(
            call.id,
            self._input_window,
            session.outbox.put_now,
            _no_release if keeper is None else keeper.release,
        )
        running.input = items
        call.args.insert(0, items)  # (its credit comes when the handler starts)

    def _start_notify(
        self, session: _Session, notify: Notify, held: int
    ) -> _Invocation[Notify] | None:
        """:meth:`_start` for a notification (dropped, not refused), or the
        client's announcement of what it understands."""
        method = self._methods.get(notify.method)
        if method is None and notify.method == HELLO_METHOD:
            if held:
                session.keeper.release(held)  # type: ignore[union-attr]
            features = notify.args[0] if notify.args else ()
            session.status = isinstance(features, list) and "status" in features
            return None
        running = _Running()
        if method is None:
            why = "no such method"
        elif inspect.isasyncgenfunction(method):
            why = "it streams its results"
        elif self._stopping:
            why = "the server is shutting down"
        elif not self._admit(session, running):
            why = "the server is at its limit"
        else:
            self._count_arrival(session, running, notify.method)
            return _Invocation(notify, method, running)
        if held:
            session.keeper.release(held)  # type: ignore[union-attr]
        self._dropped += 1
        session.dropped += 1
        if session.dropped & (session.dropped - 1) == 0:  # 1, 2, 4, 8, ...: the log stays small
            logger.warning(
                "notification of %s dropped (%d on this connection): %s",
                _name(notify.method),
                session.dropped,
                why,
            )
        return None

    def _count_arrival(self, session: _Session, running: _Running, method: str) -> None:
        """Count an admitted call (or notification) of ``method``."""
        counters = running.counters = self._counters[method]
        counters.calls += 1
        if self._detailed:
            running.arrived = session.clock()

    @staticmethod
    def _count_start(session: _Session, running: _Running) -> None:
        """Count how long a call waited before its handler started."""
        counters = running.counters
        if counters is not None and counters.queue_wait is not None:
            counters.queue_wait.add(session.clock() - running.arrived)

    @staticmethod
    def _count_reply(session: _Session, running: _Running) -> None:
        """Count how long a call took, from its arrival to its reply."""
        counters = running.counters
        if counters is not None and counters.latency is not None:
            counters.latency.add(session.clock() - running.arrived)

    @staticmethod
    def _count_end(running: _Running, error: str | None = None) -> None:
        """Count the end of an admitted call: ``error`` says why it failed
        (``"cancelled"``: the caller cancelled it)."""
        counters = running.counters
        if counters is None:
            return
        running.counters = None  # (counted once)
        counters.ended += 1
        if error == "cancelled":
            counters.cancelled += 1
        elif error is not None:
            counters.errors[error] += 1

    def _charge(self, session: _Session, running: _Running, cost: int, held: int) -> bool:
        """Charge a call about to be queued for its message, of ``cost`` bytes, of
        which ``held`` came reserved from the comm; return False if it must wait
        for the budget first (see the module)."""
        keeper = session.keeper
        if held or keeper is None or self._overload == "reject":
            running.charge = held
            return True
        if cost <= session.allowance:
            session.allowance -= cost
            running.allowance = cost
            return True
        if keeper.reserve(cost):
            running.charge = cost
            return True
        return False

    async def _wait_for_budget(self, session: _Session) -> None:
        """Wait until the reservation the connection's account waits for is
        granted (or the account was closed for stalling), running the budget's
        stall check from time to time as a waiting comm does."""
        keeper = session.keeper
        assert keeper is not None
        budget = keeper.budget
        try:
            while keeper.wanted:
                granted = session.granted = anyio.Event()
                keeper.on_grant = granted.set
                with anyio.move_on_after(budget.check_interval):
                    await granted.wait()
                if keeper.wanted:
                    budget.close_stalled(anyio.current_time())
        except BaseException:
            keeper.cancel()
            raise
        finally:
            session.granted = None
            keeper.on_grant = None

    def _uncharge(self, session: _Session, running: _Running) -> None:
        """Give back what a call's message was charged (its handler starts, or it
        left the queue)."""
        if running.charge:
            session.keeper.release(running.charge)  # type: ignore[union-attr]
            running.charge = 0
        if running.allowance:
            session.allowance += running.allowance
            running.allowance = 0

    def _admit(self, session: _Session, running: _Running) -> bool:
        """Whether a call may be queued. With ``overload="reject"``, only if it can
        run now: fewer than ``max_calls_per_connection`` calls of the connection
        run, and a slot of the server's is free (taken for it now). Otherwise,
        only if fewer than ``max_waiting_per_connection`` calls wait on the
        connection."""
        if self._overload == "reject":
            if session.tasks >= self._max_per_connection or not self._slots.try_take():
                return False
            running.holds_slot = True
            session.holders.add(running)
            return True
        if session.tasks >= self._max_per_connection + self._max_waiting:
            self._sweep(session)  # calls whose deadline passed while they waited
        return session.tasks < self._max_per_connection + self._max_waiting

    def _sweep(self, session: _Session) -> None:
        """Answer and take out the queued calls whose deadline has passed (and
        forget the started ones at the head of the deadlines)."""
        now = anyio.current_time()
        expiries = session.expiries
        while expiries:
            deadline, _, work = expiries[0]
            running = work.state
            if running.started or running.withdrawn:
                heapq.heappop(expiries)
            elif deadline <= now:
                heapq.heappop(expiries)
                call = work.request
                self._withdraw(session, call.id, running)
                self._refuse(
                    session,
                    call,
                    ErrorCode.DEADLINE_EXCEEDED,
                    _WAITED_PAST_DEADLINE.format(_name(call.method)),
                )
            else:
                break

    async def _expire(self, session: _Session) -> None:
        """The connection's timer: answer each queued call when its deadline
        passes, which gives its charge back (see the module)."""
        while True:
            try:
                self._sweep(session)
            except (LocalProtocolError, SerializationError):  # a refusal that cannot go
                logger.warning("rpc: a refusal could not be sent", exc_info=True)
                continue  # (that call is out of the queue: on with the others)
            wakeup = session.expiry_wakeup = anyio.Event()
            session.expiry_at = session.expiries[0][0] if session.expiries else math.inf
            with anyio.CancelScope(deadline=session.expiry_at):
                await wakeup.wait()

    def _withdraw(self, session: _Session, call_id: int, running: _Running) -> None:
        """Take a call out of the queue before it started (a worker skips it):
        the caller cancelled it, or its deadline passed."""
        self._count_end(
            running,
            "cancelled" if running.cancelled_by_client else ErrorCode.DEADLINE_EXCEEDED.value,
        )
        running.withdrawn = True
        del session.running[call_id]
        if running.input is not None:
            running.input.discard()
        self._release(session, running)
        self._uncharge(session, running)
        session.task_ended()
        self._check_idle()

    def _enqueue(self, session: _Session, task_group: TaskGroup, work: _Work) -> None:
        session.queue.append(work)
        session.tasks += 1
        if session.idle_workers:
            session.idle_workers.pop().set()
        elif session.workers < self._max_per_connection:
            session.workers += 1
            task_group.start_soon(self._worker, session)
        else:
            self._watch_deadline(session, task_group, work)

    def _watch_deadline(self, session: _Session, task_group: TaskGroup, work: _Work) -> None:
        """Give the timer the deadline of a call that waits for a worker. (A worker
        is on its way to the others; its deadline scope covers what comes next.)"""
        running = work.state
        if running.deadline == math.inf or not _is_call(work):
            return
        expiries = session.expiries
        if len(expiries) > 2 * len(session.queue) + 64:  # mostly started ones: compact
            expiries[:] = [e for e in expiries if not (e[2].state.started or e[2].state.withdrawn)]
            heapq.heapify(expiries)
        session.sequence += 1
        heapq.heappush(expiries, (running.deadline, session.sequence, work))
        if session.expiry_wakeup is None:  # the first: make the timer
            session.expiry_wakeup = anyio.Event()  # (which replaces it)
            task_group.start_soon(self._expire, session)
        elif running.deadline < session.expiry_at:
            session.expiry_wakeup.set()

    def _refuse(self, session: _Session, call: Call, code: ErrorCode, text: str) -> None:
        """Answer ``call`` with an error now (the connection is not read while its
        outbox is full, so these stay bounded)."""
        self._refused[code.value] += 1
        session.outbox.put_now(_refusal(call, code, text).encode())

    async def _worker(self, session: _Session) -> None:
        """Run the connection's calls, first come, first served, until it ends;
        each in a copy of the context this worker started with."""
        queue = session.queue
        base = contextvars.copy_context()
        since_yield = 0
        outbox = session.outbox
        try:
            while outbox.open and not session.ended:  # (the writer may see the end first)
                if not queue:
                    wakeup = anyio.Event()
                    session.idle_workers.append(wakeup)
                    await wakeup.wait()
                    since_yield = 0
                    continue
                work = queue.popleft()
                running = work.state
                if running.withdrawn:
                    continue
                running.started = True
                try:
                    if _is_call(work):
                        await self._run_call(session, work, base.copy())
                    else:
                        await self._run_notify(session, work, base.copy())
                finally:
                    self._release(session, running)
                    self._uncharge(session, running)
                    session.finished += 1
                    session.task_ended()
                    self._check_idle()
                since_yield += 1
                if since_yield >= YIELD_EVERY:
                    # plain functions never yield: let the rest of the loop run
                    since_yield = 0
                    await checkpoint()
        finally:
            session.workers -= 1

    async def _take_slot(self, session: _Session, running: _Running) -> None:
        if not running.holds_slot:
            await self._slots.take()
            running.holds_slot = True
            session.holders.add(running)

    def _release(self, session: _Session, running: _Running) -> None:
        if running.holds_slot:
            running.holds_slot = False
            session.holders.discard(running)
            self._slots.give()

    async def _run_call(
        self, session: _Session, work: _Invocation[Call], context: contextvars.Context
    ) -> None:
        call = work.request
        running = work.state
        reply: Result | ErrorReply | None = None
        try:
            if _withdrawn(running):
                self._count_end(running, "cancelled")
                return  # cancelled while it waited in the queue
            about = CallContext(
                call.method,
                call.id,
                session.comm,
                running.deadline,
                session.clock,
                call.metadata,
                _KINDS[call.stream, call.input],
            )
            context.run(CURRENT_CALL.set, about)
            handled = False  # (a deadline before the handler: it waited past it)
            with session.cancel_scope(deadline=running.deadline) as scope:
                running.scope = scope
                if running.deadline != math.inf and session.clock() >= running.deadline:
                    await checkpoint()  # its deadline passed in the queue: cancelled here
                await self._take_slot(session, running)
                self._uncharge(session, running)  # its arguments are the handler's now
                handled = True
                if self._detailed:
                    self._count_start(session, running)
                if running.input is not None:
                    running.input.open()
                if self._interceptors:
                    reply = await self._invoke_intercepted(session, work, context, about)
                elif call.stream:
                    reply = await self._invoke_stream(session, work, context)
                else:
                    reply = await self._invoke(work, context)
            running.scope = None
            self._release(session, running)
            if running.failure is not None:
                failure = running.failure
                reply = ErrorReply(call.id, ErrorCode.ERROR, _type_name(failure), _text(failure))
            elif reply is None:  # cancelled here
                if running.cancelled_by_client:
                    self._count_end(running, "cancelled")
                    return  # the caller is not waiting
                reply = _refusal(
                    call,
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"{_name(call.method)} did not finish within {call.timeout} seconds"
                    if handled
                    else _WAITED_PAST_DEADLINE.format(_name(call.method)),
                )
                if not handled:
                    self._refused[ErrorCode.DEADLINE_EXCEEDED.value] += 1
            if call.metadata is not None and about._trailers:
                reply = dataclasses.replace(reply, trailers=about._trailers)
            if type(reply) is ErrorReply:
                if reply.status is not None and not session.status:
                    reply.status = None  # a client that does not know it
                error: str | None = (
                    reply.type if reply.code is ErrorCode.ERROR else reply.code.value
                )
            else:
                error = None
            await self._reply(session, call, reply)
            if self._detailed:
                self._count_reply(session, running)
            self._count_end(running, error)
        finally:
            self._count_end(running, "lost")  # (not answered: the connection ended)
            del session.running[call.id]
            if running.input is not None:
                running.input.discard()

    async def _invoke(
        self, work: _Invocation[Call], context: contextvars.Context
    ) -> Result | ErrorReply:
        call = work.request
        try:
            result, refusal = context.run(_apply, call, work.handler)
            if refusal is not None:
                return refusal
            if inspect.iscoroutine(result):
                result = await InContext(result, context)
            elif inspect.isawaitable(result):
                result = await result
        except Exception as exc:
            return _failure(call, exc)
        return Result(call.id, result)

    async def _invoke_stream(
        self, session: _Session, work: _Invocation[Call], context: contextvars.Context
    ) -> Result | ErrorReply:
        call = work.request
        try:
            items, refusal = context.run(_apply, call, work.handler)
            if refusal is not None:
                return refusal
            await self._send_items(session, work, items, context)
        except Exception as exc:
            return _failure(call, exc)
        return Result(call.id, None)

    @staticmethod
    async def _send_items(
        session: _Session,
        work: _Invocation[Call],
        items: AsyncGenerator[Any, None],
        context: contextvars.Context | None,
    ) -> None:
        """Send what the generator ``items`` yields as the call's ITEMs, as the
        client's credit allows, and close it; each of its steps inside
        ``context`` (``None``: the running one).

        Raises:
            Exception: what the generator raised.
        """
        call = work.request
        running = work.state

        def refused(exc: LocalProtocolError) -> None:
            running.failure = exc  # the reply says so, once the generator is closed
            running.cancel()

        try:
            while True:
                step = items.__anext__()
                try:
                    item = await (step if context is None else InContext(step, context))
                except StopAsyncIteration:
                    break
                while running.credit < 1:
                    running.credited = anyio.Event()
                    await running.credited.wait()
                running.credit -= 1
                await session.outbox.put(Item(call.id, item).encode(), refused)
        finally:
            closing = items.aclose()
            await (closing if context is None else InContext(closing, context))

    async def _invoke_intercepted(
        self,
        session: _Session,
        work: _Invocation[Call],
        context: contextvars.Context,
        about: CallContext,
    ) -> Result | ErrorReply:
        """:meth:`_invoke` or :meth:`_invoke_stream` inside the interceptors, all
        of them in ``context``."""
        call = work.request
        # the server's own refusal of the arguments, raised through the
        # interceptors as the caller would see it
        refusal: ErrorReply | None = None
        refusal_error: Exception | None = None

        @_once
        async def proceed() -> Any:
            nonlocal refusal, refusal_error
            result, refusal = _apply(call, work.handler)
            if refusal is not None:
                refusal_error = error_for(call.method, refusal.code, refusal.type, refusal.message)
                raise refusal_error
            if call.stream:
                await self._send_items(session, work, result, None)
                return None
            if inspect.isawaitable(result):
                result = await result
            return result

        try:
            # (the first interceptor is called inside the context too)
            chain = context.run(intercepted, self._interceptors, about, proceed)
            value = await InContext(chain, context)
        except Exception as exc:
            if exc is refusal_error and refusal is not None:
                return refusal
            return _failure(call, exc)
        return Result(call.id, None if call.stream else value)

    @staticmethod
    async def _reply(session: _Session, call: Call, reply: Result | ErrorReply) -> None:
        def refused(exc: LocalProtocolError) -> None:
            session.outbox.put_now(
                ErrorReply(call.id, ErrorCode.ERROR, _type_name(exc), _text(exc)).encode()
            )

        try:
            await session.outbox.put(reply.encode(), refused)
        except (SerializationError, LocalProtocolError) as exc:
            error = ErrorReply(call.id, ErrorCode.ERROR, _type_name(exc), _text(exc))
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await session.outbox.put(error.encode())
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the connection ended: nobody to tell

    async def _run_notify(
        self, session: _Session, work: _Invocation[Notify], context: contextvars.Context
    ) -> None:
        notify = work.request
        running = work.state
        about = CallContext(
            notify.method,
            None,
            session.comm,
            math.inf,
            session.clock,
            notify.metadata,
            "notification",
        )
        context.run(CURRENT_CALL.set, about)
        error: str | None = "lost"  # (until it ends)
        try:
            await self._take_slot(session, running)
            self._uncharge(session, running)
            if self._detailed:
                self._count_start(session, running)
            error = await self._notify(work, context, about)
        finally:
            self._count_end(running, error)

    async def _notify(
        self, work: _Invocation[Notify], context: contextvars.Context, about: CallContext
    ) -> str | None:
        """Run a notification's handler (through the interceptors); return why
        it failed (the exception's class name), or ``None``."""
        notify = work.request
        try:
            if self._interceptors:

                @_once
                async def proceed() -> Any:
                    result = work.handler(*notify.args, **notify.kwargs)
                    return (await result) if inspect.isawaitable(result) else result

                chain = context.run(intercepted, self._interceptors, about, proceed)
                await InContext(chain, context)
                return None
            result = context.run(work.handler, *notify.args, **notify.kwargs)
            if inspect.iscoroutine(result):
                await InContext(result, context)
            elif inspect.isawaitable(result):
                await result
        except Exception as exc:
            logger.exception("notification of %s failed", _name(notify.method))
            return _type_name(exc)
        return None


@overload
def serve(
    address: str,
    handlers: Mapping[str, Callable[..., Any]] | object,
    *,
    task_status: TaskStatus[Server],
    max_calls_per_connection: int = ...,
    max_calls: int = ...,
    max_waiting_per_connection: int = ...,
    overload: Literal["wait", "reject"] = ...,
    max_queued: int = ...,
    interceptors: Sequence[ServerInterceptor] = ...,
    input_window: int = ...,
    detailed_statistics: bool = ...,
    options: Options | None = ...,
    max_connections: int | None = ...,
    receive_budget: ReceiveBudget | int | None = ...,
    backlog: int = ...,
    ssl_context: ssl.SSLContext | None = ...,
    handshake_threads: int = ...,
    **keywords: Unpack[OptionsKeywords],
) -> Coroutine[Any, Any, None]: ...
@overload
def serve(
    address: str,
    handlers: Mapping[str, Callable[..., Any]] | object,
    *,
    max_calls_per_connection: int = ...,
    max_calls: int = ...,
    max_waiting_per_connection: int = ...,
    overload: Literal["wait", "reject"] = ...,
    max_queued: int = ...,
    interceptors: Sequence[ServerInterceptor] = ...,
    input_window: int = ...,
    detailed_statistics: bool = ...,
    options: Options | None = ...,
    max_connections: int | None = ...,
    receive_budget: ReceiveBudget | int | None = ...,
    backlog: int = ...,
    ssl_context: ssl.SSLContext | None = ...,
    handshake_threads: int = ...,
    **keywords: Unpack[OptionsKeywords],
) -> AbstractAsyncContextManager[Server]: ...
def serve(
    address: str,
    handlers: Mapping[str, Callable[..., Any]] | object,
    *,
    task_status: TaskStatus[Server] | None = None,
    max_calls_per_connection: int = DEFAULT_MAX_CALLS_PER_CONNECTION,
    max_calls: int = DEFAULT_MAX_CALLS,
    max_waiting_per_connection: int = DEFAULT_MAX_WAITING,
    overload: Literal["wait", "reject"] = "wait",
    max_queued: int = DEFAULT_LIMIT,
    interceptors: Sequence[ServerInterceptor] = (),
    input_window: int = DEFAULT_INPUT_WINDOW,
    detailed_statistics: bool = False,
    options: Options | None = None,
    max_connections: int | None = None,
    receive_budget: ReceiveBudget | int | None = DEFAULT_RECEIVE_BUDGET,
    backlog: int = 1024,
    ssl_context: ssl.SSLContext | None = None,
    handshake_threads: int = DEFAULT_HANDSHAKE_THREADS,
    **keywords: Unpack[OptionsKeywords],
) -> AbstractAsyncContextManager[Server] | Coroutine[Any, Any, None]:
    """Serve the methods of ``handlers`` at ``address``, in either form of
    :func:`anyio_comm.listen` and :func:`anyio_comm.serve`:
    ``async with rpc.serve(address, handlers) as server:`` serves until the
    block ends, and ``server = await task_group.start(rpc.serve, address,
    handlers)`` returns the :class:`Server` once it listens, serving until
    cancelled or until ``await server.shutdown(grace_period)`` completes.

    Args:
        address: where to listen, as for :func:`anyio_comm.listen`.
        handlers: a mapping of method names to functions (coroutine functions,
            or plain functions, which run in the event loop), or an object
            whose public methods are served.
        max_calls_per_connection: calls (and notifications) of one connection
            that run at once.
        max_calls: calls that run at once, on all connections.
        max_waiting_per_connection: with ``overload="wait"``, calls of one
            connection that may wait for a slot; more fail at once with
            :exc:`OverloadedError` (notifications beyond it are dropped, with a
            warning in the log). 0: none waits for a worker of its connection
            (a call may still wait for a slot of the server's).
        overload: what happens to a call beyond a limit: ``"wait"`` (it waits
            for a slot, its deadline running) or ``"reject"`` (it fails at once
            with :exc:`OverloadedError`).
        max_queued: replies queued for sending per connection; while that many
            wait (the client does not read them), the connection is not read
            either (backpressure).
        interceptors: coroutine functions ``interceptor(call, proceed)`` that
            see every call, stream and notification, the first outermost:
            each gets the call's :class:`CallContext` and returns ``await
            proceed()``, which runs the next one and, after the last, the
            handler (a stream's items sent when it returns), or raises to
            refuse the call (the caller gets the error a handler's raising
            would give). They run in the call's context, within its deadline
            (see the RPC guide, "Interceptors").
        input_window: items of an upload's or a channel's input the client
            may send before the handler takes them.
        detailed_statistics: also keep, per method, histograms of the calls'
            latency and of their wait for a worker and a slot
            (:meth:`Server.statistics`); the counters are kept either way.
        options: as for :func:`anyio_comm.listen`, and so are
            ``max_connections``, ``receive_budget``, ``backlog``,
            ``ssl_context``, ``handshake_threads`` and the fields of
            :class:`~anyio_comm.Options` as keywords. The receive budget also
            counts the arguments of the calls that wait for a worker or a
            slot, until their handler starts; when it is spent, the connection
            whose call does not fit is not read until queued calls start or
            leave (backpressure, nothing is refused).
        task_status: given by :meth:`anyio.abc.TaskGroup.start` (the second form).

    Raises:
        TypeError: ``handlers`` has a method that is not callable, or a name
            that is not a str; an interceptor is not callable.
        ValueError: ``max_calls_per_connection``, ``max_calls``,
            ``max_queued`` or ``input_window`` is below 1,
            ``max_waiting_per_connection`` is negative, ``overload`` is
            neither value, or ``handlers`` has a
            method named ``rpc.health`` (the health service's: see
            :meth:`Server.set_serving`).
        OSError: as :func:`anyio_comm.listen` raises.
    """
    if (
        min(max_calls_per_connection, max_calls, max_queued, input_window) < 1
        or max_waiting_per_connection < 0
    ):
        raise ValueError(
            "max_calls_per_connection, max_calls, max_queued and input_window must be at"
            " least 1, max_waiting_per_connection at least 0"
        )
    if overload not in ("wait", "reject"):
        raise ValueError(f"overload must be 'wait' or 'reject', not {overload!r}")
    server = Server(
        _methods(handlers),
        max_calls_per_connection=max_calls_per_connection,
        max_calls=max_calls,
        max_waiting_per_connection=max_waiting_per_connection,
        overload=overload,
        max_queued=max_queued,
        interceptors=check_interceptors(interceptors),
        input_window=input_window,
        detailed_statistics=bool(detailed_statistics),
    )
    listening = listen(
        address,
        server.handle,
        options=resolve_options("rpc.serve", options, keywords),
        max_connections=max_connections,
        receive_budget=receive_budget,
        backlog=backlog,
        ssl_context=ssl_context,
        handshake_threads=handshake_threads,
    )
    if task_status is None:
        return _serving(server, listening)
    return _serve_until_stopped(server, listening, task_status)


@asynccontextmanager
async def _serving(
    server: Server, listening: AbstractAsyncContextManager[Listener]
) -> AsyncIterator[Server]:
    """:func:`serve`'s first form: the server until the block ends."""
    async with listening as listener:
        server._listener = listener
        yield server


async def _serve_until_stopped(
    server: Server,
    listening: AbstractAsyncContextManager[Listener],
    task_status: TaskStatus[Server],
) -> None:
    """:func:`serve`'s second form: the server, once it listens, to
    ``task_status``; until cancelled or shut down."""
    async with listening as listener:
        server._listener = listener
        task_status.started(server)
        await listener._server.stopped.wait()
