"""The calling side: many concurrent calls multiplexed over one comm."""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, NoReturn

import anyio

from .._backend import current_backend
from .._comm import count_work
from .._compat import final
from .._sansio.close import CloseCode, CloseReason
from .._sansio.errors import LocalProtocolError
from ._errors import ApplicationError, RPCError, UnavailableError, error_for
from ._health import HEALTH_METHOD, HealthStatus
from ._interceptors import OutgoingCall, check_interceptors, intercepted
from ._outbox import DEFAULT_LIMIT, Entry, Outbox
from ._protocol import (
    FEATURES,
    HELLO_METHOD,
    MAX_ID,
    PING_TIMEOUT_CODE,
    Call,
    Cancel,
    Credit,
    ErrorCode,
    ErrorReply,
    Item,
    Metadata,
    Notify,
    Ping,
    Pong,
    ProtocolViolation,
    Result,
    check_metadata,
    decode,
)
from ._sending import Channel, InputCredit, Upload

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from .._backend import Backend
    from .._comm import Comm
    from ._context import CallKind
    from ._interceptors import ClientInterceptor

__all__ = [
    "DEFAULT_PING_TIMEOUT",
    "DEFAULT_STREAM_WINDOW",
    "Client",
    "Stream",
    "WithMetadata",
    "check_ping",
    "open_client",
]

#: items of a stream the server may send before the client takes them, by default
DEFAULT_STREAM_WINDOW = 16
#: the most replies the reader takes from its comm in one call
READ_BATCH = 64
#: seconds a client waits for an answer to a ping, by default
DEFAULT_PING_TIMEOUT = 20.0


def check_ping(ping_interval: float | None, ping_timeout: float) -> None:
    """Raises:
    ValueError: ``ping_interval`` (unless None) or ``ping_timeout`` is not
        a positive number.
    """
    if (ping_interval is not None and not ping_interval > 0) or not ping_timeout > 0:
        raise ValueError("ping_interval and ping_timeout must be positive")


class _Pending:
    """A call waiting for its reply."""

    __slots__ = ("event", "input", "outcome", "trailers")

    def __init__(self, trailers: Metadata | None = None) -> None:
        self.event = anyio.Event()
        #: the reply, the refusal of the call's message, or the connection's end
        self.outcome: Result | ErrorReply | BaseException | None = None
        #: where the reply's trailers go (the caller's dict), if anywhere
        self.trailers = trailers
        #: the server's credit for the items of an upload or a channel
        self.input: InputCredit | None = None

    def finish(self, outcome: Result | ErrorReply | BaseException) -> None:
        self.outcome = outcome
        self.event.set()
        if self.input is not None:
            self.input.wake()  # a sender waiting for credit learns the end


class _StreamPending(_Pending):
    """A streaming call: its items not taken yet, and the credit it gave."""

    __slots__ = ("granted", "items", "received")

    def __init__(self, window: int, trailers: Metadata | None = None) -> None:
        super().__init__(trailers)
        self.items: collections.deque[Any] = collections.deque()
        self.granted = window
        self.received = 0

    def add(self, item: Any) -> None:
        self.items.append(item)
        self.received += 1
        if self.received > self.granted:
            raise ProtocolViolation("a server sent more stream items than it was allowed")
        self.event.set()


@final
class Stream:
    """The results of a streaming call, as an async iterator (see
    :meth:`Client.stream`); one task at a time reads it."""

    __slots__ = (
        "_call_id",
        "_client",
        "_ended",
        "_method",
        "_pending",
        "_reading",
        "_taken",
        "_window",
    )

    def __init__(
        self, client: Client, method: str, call_id: int, pending: _StreamPending, window: int
    ) -> None:
        self._client = client
        self._method = method
        self._call_id = call_id
        self._pending = pending
        self._window = window
        self._taken = 0
        self._reading = False
        #: the ``stream()`` block was left
        self._ended = False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        """The next item.

        Raises:
            StopAsyncIteration: the stream ended.
            anyio.BusyResourceError: another task is waiting for an item of it.
            anyio.ClosedResourceError: the ``stream()`` block was left.
            the errors of :meth:`Client.call`.
        """
        pending = self._pending
        if self._ended:
            raise anyio.ClosedResourceError
        if self._reading:
            raise anyio.BusyResourceError("reading from")
        self._reading = True
        try:
            while not pending.items:
                outcome = pending.outcome
                if outcome is not None:
                    if type(outcome) is Result:
                        raise StopAsyncIteration
                    await self._client._own_deadline_first(outcome)
                    self._client._raise_outcome(self._method, outcome)
                pending.event = anyio.Event()
                await pending.event.wait()
        finally:
            self._reading = False
        item = pending.items.popleft()
        self._taken += 1
        if self._taken >= max(self._window // 2, 1) and pending.outcome is None:
            # give the credit back in batches, half a window at a time
            pending.granted += self._taken
            self._client._outbox.put_now(Credit(self._call_id, self._taken).encode())
            self._taken = 0
        return item


@final
class Client:
    """Calls the methods of one RPC server, many calls at once over one comm.

    Made by :func:`anyio_comm.rpc.connect` (or :func:`open_client` over a comm
    you have): it runs a task that reads the replies and one that sends the
    calls' messages in order (a call cancelled while its message is written
    never breaks the connection for the others).
    """

    def __init__(
        self,
        comm: Comm,
        *,
        max_queued: int = DEFAULT_LIMIT,
        stream_window: int = DEFAULT_STREAM_WINDOW,
        interceptors: Sequence[ClientInterceptor] = (),
        ping_interval: float | None = None,
        ping_timeout: float = DEFAULT_PING_TIMEOUT,
    ) -> None:
        if stream_window < 1:
            raise ValueError("stream_window must be at least 1")
        check_ping(ping_interval, ping_timeout)
        self._ping_interval = ping_interval
        self._ping_timeout = ping_timeout
        #: when the last message arrived (kept only when pinging)
        self._last_heard = -math.inf
        #: set when a message arrives, for the keepalive task waiting for one
        self._heard: anyio.Event | None = None
        #: why the keepalive task closed the connection, if it did
        self._unanswered: BaseException | None = None
        self._interceptors = check_interceptors(interceptors)
        self._window = stream_window
        self._comm = comm
        self._outbox = Outbox(comm, max_queued)
        # (its first message: what this client understands of the later additions)
        self._outbox.put_now(Notify(HELLO_METHOD, [list(FEATURES)], {}).encode())
        self._calls: dict[int, _Pending] = {}
        #: when the last call in flight ended (the comm's idle_timeout counts
        #: from then: a connection with calls in flight is not idle)
        self._quiet_since = -math.inf
        count_work(comm, self._working_until)
        self._next_id = 0
        #: why no more calls can be made (the connection ended), once it did
        self._ended: BaseException | None = None
        self._closed = False
        #: the event loop's primitives, looked up by the first call
        self._backend: Backend | None = None

    def _working_until(self) -> float:
        """``math.inf`` while calls are in flight, else when the last ended (see
        :func:`~anyio_comm._comm.count_work`)."""
        return math.inf if self._calls else self._quiet_since

    def _forget(self, call_id: int) -> _Pending | None:
        """Take a call out of those in flight (its reply came, or it was
        cancelled or refused); None if it was not."""
        calls = self._calls
        pending = calls.pop(call_id, None)
        if pending is not None and not calls:
            self._quiet_since = self._current_backend().current_time()
        return pending

    @property
    def comm(self) -> Comm:
        """The comm the calls go over."""
        return self._comm

    @property
    def calls_in_flight(self) -> int:
        """The calls waiting for their reply."""
        return len(self._calls)

    @property
    def usable(self) -> bool:
        """False once the client was closed or its connection ended."""
        return not self._closed and self._ended is None

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Call ``method`` on the server with these arguments; return its result.

        The remaining time of the caller's deadline (``anyio.fail_after``,
        ``move_on_after``) travels with the call: the server cancels the
        handler when it passes. Cancelled (or timed out) here, the call is
        withdrawn if its message was not sent yet, and otherwise a cancel
        follows it, which cancels the handler on the server; its reply, if
        one comes, is dropped. The arguments' buffers are sent without a copy:
        do not change them until the call returns.

        Raises:
            RemoteError: the handler raised (its class name and message).
            MethodNotFoundError: the server has no such method.
            InvalidArgumentsError: the arguments do not fit the method.
            OverloadedError: the server rejected the call at its limit.
            DeadlineExceededError: the deadline passed on the server first.
            UnavailableError: the connection ended before the reply came.
            SerializationError: an argument cannot be serialized.
            LocalProtocolError: the call is over the server's limits (nothing
                was sent).
            anyio.ClosedResourceError: the client was closed.
        """
        return await self._call(method, args, kwargs, None, None)

    async def check_health(self, service: str = "") -> HealthStatus:
        """Ask the server's health service whether it serves (``service`` ``""``,
        the default: as a whole), as load balancers do. The server answers at
        once, whatever its calls do; the call's deadline and errors are
        :meth:`call`'s.

        Raises:
            MethodNotFoundError: the server has no health service (it predates
                it).
            ValueError: the server answered with a status this client does not
                know.
            RPCError: the other errors of :meth:`call`.
        """
        status = await self.call(HEALTH_METHOD, service)
        try:
            return HealthStatus(status)
        except ValueError:
            raise ValueError(f"the server's health service answered {status!r:.100}") from None

    def with_metadata(
        self,
        metadata: Mapping[str, str | bytes] | None = None,
        *,
        trailers: dict[str, str | bytes] | None = None,
    ) -> WithMetadata:
        """Calls, streams and notifications that carry ``metadata`` (a map of str
        keys to str or bytes values: credentials, a trace id), which the
        handler reads as ``rpc.current_call().metadata``:
        ``await client.with_metadata({"authorization": token}).call("m", 1)``.
        With ``trailers``, a dict, the trailers of each reply to those calls
        (what the handler set with ``current_call().set_trailer()``) are put in
        it; the errors they raise carry them too (``RPCError.trailers``).

        Raises:
            ValueError: ``metadata`` is not such a map, or has more than 64
                entries, a key that is empty or longer than 128 characters, or
                more than 16 KiB of keys and values.
        """
        checked = check_metadata({} if metadata is None else metadata)
        return WithMetadata(self, dict(checked), trailers)  # (a copy: the caller's may change)

    async def _call(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: Metadata | None,
        trailers: Metadata | None,
    ) -> Any:
        """:meth:`call`, with ``metadata`` sent and the reply's trailers put in
        ``trailers``, through the interceptors."""
        if self._interceptors:
            outgoing = OutgoingCall("call", method, args, kwargs, dict(metadata or {}))

            async def proceed() -> Any:
                sent = _metadata_to_send(outgoing.metadata, metadata)
                return await self._call_plain(
                    outgoing.method, outgoing.args, outgoing.kwargs, sent, trailers
                )

            return await intercepted(self._interceptors, outgoing, proceed)
        return await self._call_plain(method, args, kwargs, metadata, trailers)

    async def _call_plain(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: Metadata | None,
        trailers: Metadata | None,
    ) -> Any:
        """:meth:`_call` past the interceptors."""
        pending = _Pending(trailers)
        call_id, entry = await self._send_call(method, args, kwargs, metadata, pending)
        try:
            await pending.event.wait()
        except BaseException:
            self._withdraw(call_id, entry)
            raise
        outcome = pending.outcome
        if type(outcome) is Result:
            return outcome.value
        assert outcome is not None
        await self._own_deadline_first(outcome)
        self._raise_outcome(method, outcome)

    def stream(
        self, method: str, /, *args: Any, **kwargs: Any
    ) -> AbstractAsyncContextManager[AsyncIterator[Any]]:
        """Call ``method``, an async generator on the server, and iterate over
        the items it yields: ``async with client.stream("m") as items: async for
        item in items: ...``.

        The server yields at most ``stream_window`` items ahead of the ones
        taken here (flow control: a slow consumer slows the producer, and no
        other call waits for it). Leaving the block before the end, or being
        cancelled, cancels the generator on the server. Deadlines travel as
        with :meth:`call`.

        Raises:
            the errors of :meth:`call` (when the block is entered, or while
            iterating); BadCallError: ``method`` is not a generator.
        """
        return self._opened("stream", self._stream_plain, method, args, kwargs, None, None)

    def _opened(
        self,
        kind: CallKind,
        opener: Callable[..., AbstractAsyncContextManager[Any]],
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: Metadata | None,
        trailers: Metadata | None,
    ) -> AbstractAsyncContextManager[Any]:
        """A stream, an upload or a channel (``opener`` opens it past the
        interceptors), with ``metadata`` sent and the final reply's trailers
        put in ``trailers``, through the interceptors."""
        if self._interceptors:
            return self._opened_intercepted(kind, opener, method, args, kwargs, metadata, trailers)
        return opener(method, args, kwargs, metadata, trailers)

    @asynccontextmanager
    async def _opened_intercepted(
        self,
        kind: CallKind,
        opener: Callable[..., AbstractAsyncContextManager[Any]],
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: Metadata | None,
        trailers: Metadata | None,
    ) -> AsyncIterator[Any]:
        """A stream, an upload or a channel (``opener`` opens it past the
        interceptors) through the interceptors: their ``proceed()`` opens it,
        and what the first returns is what the block gets."""
        outgoing = OutgoingCall(kind, method, args, kwargs, dict(metadata or {}))
        async with contextlib.AsyncExitStack() as opened:

            async def proceed() -> Any:
                sent = _metadata_to_send(outgoing.metadata, metadata)
                return await opened.enter_async_context(
                    opener(outgoing.method, outgoing.args, outgoing.kwargs, sent, trailers)
                )

            given = await intercepted(self._interceptors, outgoing, proceed)
            if kind != "stream":
                yield given
                return
            if not isinstance(given, AsyncIterator):
                raise TypeError(
                    f"a stream's interceptor returned {type(given).__name__}, not the stream"
                    " proceed() returned or an async iterator"
                )
            try:
                yield given
            finally:
                close = getattr(given, "aclose", None)
                if type(given) is not Stream and close is not None:
                    await close()

    @asynccontextmanager
    async def _stream_plain(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: Metadata | None,
        trailers: Metadata | None,
        *,
        with_input: bool = False,
    ) -> AsyncIterator[Stream]:
        """:meth:`_stream` past the interceptors (a channel's results, if
        ``with_input``)."""
        pending = _StreamPending(self._window, trailers)
        if with_input:
            pending.input = InputCredit()
        call_id, entry = await self._send_call(method, args, kwargs, metadata, pending)
        self._outbox.put_now(Credit(call_id, self._window).encode())
        stream = Stream(self, method, call_id, pending, self._window)
        try:
            yield stream
        finally:
            stream._ended = True
            self._withdraw(call_id, entry)
            if pending.outcome is None:  # a task waiting for an item wakes up
                pending.finish(anyio.ClosedResourceError())

    def upload(
        self, method: str, /, *args: Any, **kwargs: Any
    ) -> AbstractAsyncContextManager[Upload]:
        """Call ``method``, which takes a stream of items, and send them:
        ``async with client.upload("m", *args) as upload: await
        upload.send(item); ...; result = await upload.finish()``.

        The handler gets the items as its first argument, an async iterator
        (:class:`rpc.InputStream <anyio_comm.rpc.InputStream>`), before
        ``args``; :meth:`Upload.send` waits while ``input_window`` items wait
        on the server (flow control). Leaving the block before :meth:`Upload.finish`
        returned, or being cancelled, cancels the call on the server.
        Deadlines travel as with :meth:`call`.

        Raises:
            the errors of :meth:`call` (when the block is entered, or from
            :meth:`Upload.send` and :meth:`Upload.finish`); BadCallError:
            ``method`` is a generator (use :meth:`channel`).
        """
        return self._opened("upload", self._upload_plain, method, args, kwargs, None, None)

    @asynccontextmanager
    async def _upload_plain(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: Metadata | None,
        trailers: Metadata | None,
    ) -> AsyncIterator[Upload]:
        """:meth:`_upload` past the interceptors."""
        pending = _Pending(trailers)
        pending.input = InputCredit()
        call_id, entry = await self._send_call(method, args, kwargs, metadata, pending)
        upload = Upload(self, method, call_id, pending)
        try:
            yield upload
        finally:
            upload._sender._closed = True
            self._withdraw(call_id, entry)
            if pending.outcome is None:
                pending.finish(anyio.ClosedResourceError())

    def channel(
        self, method: str, /, *args: Any, **kwargs: Any
    ) -> AbstractAsyncContextManager[Channel]:
        """Call ``method``, an async generator that takes a stream of items,
        with items both ways: ``async with client.channel("m", *args) as
        channel:``, then :meth:`Channel.send`, :meth:`Channel.end`, and
        ``async for result in channel`` (or :meth:`Channel.receive`), from one
        task or two.

        The handler gets the items as its first argument, an async iterator,
        before ``args``. Flow control holds both ways: ``send`` waits while
        ``input_window`` items wait on the server, and the handler waits while
        ``stream_window`` of its items wait here. Leaving the block before the
        handler's stream ended, or being cancelled, cancels the call on the
        server. Deadlines travel as with :meth:`call`.

        Raises:
            the errors of :meth:`call` (when the block is entered, or from the
            channel's methods); BadCallError: ``method`` is not a generator
            (use :meth:`upload`).
        """
        return self._opened("channel", self._channel_plain, method, args, kwargs, None, None)

    @asynccontextmanager
    async def _channel_plain(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: Metadata | None,
        trailers: Metadata | None,
    ) -> AsyncIterator[Channel]:
        """:meth:`_channel` past the interceptors."""
        async with self._stream_plain(
            method, args, kwargs, metadata, trailers, with_input=True
        ) as results:
            channel = Channel(self, method, results._call_id, results._pending, results)
            try:
                yield channel
            finally:
                channel._sender._closed = True

    async def _send_input(self, method: str, call_id: int, message: list[Any]) -> None:
        """Queue an ITEM or the END of a call's input; a refusal of it (over the
        server's limits) fails the call, and cancels it on the server.

        Raises:
            SerializationError: it cannot be serialized (nothing is queued).
            LocalProtocolError: it is over the server's limits.
            UnavailableError: the connection ended.
            anyio.ClosedResourceError: the client was closed.
        """
        try:
            await self._outbox.put(message, partial(self._input_refused, call_id))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise self._unavailable(method, self._ended or exc) from exc

    def _input_refused(self, call_id: int, error: LocalProtocolError) -> None:
        if call_id in self._calls:
            self._refused(call_id, error)
            self._outbox.put_now(Cancel(call_id).encode())

    async def _send_call(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: Metadata | None,
        pending: _Pending,
    ) -> tuple[int, Entry]:
        """Queue the CALL of a call (a stream if ``pending`` is a stream's),
        whose reply goes to ``pending``; return its id and its outbox entry.

        Raises:
            the errors of :meth:`call` raised before the call is sent.
        """
        self._check(method)
        call_id = self._next_id
        self._next_id = call_id + 1
        stream = type(pending) is _StreamPending
        message = Call(
            call_id,
            method,
            list(args),
            kwargs,
            self._timeout(),
            stream,
            metadata,
            pending.input is not None,
        ).encode()
        try:
            entry = await self._outbox.put(message, partial(self._refused, call_id))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise self._unavailable(method, self._ended or exc) from exc
        self._calls[call_id] = pending
        return call_id, entry

    def _withdraw(self, call_id: int, entry: Entry) -> None:
        """The caller left a call before its reply: forget it, and take its CALL
        back from the outbox, or else cancel it on the server."""
        if self._forget(call_id) is not None and not Outbox.withdraw(entry):
            self._outbox.put_now(Cancel(call_id).encode())

    async def _own_deadline_first(self, outcome: Result | ErrorReply | BaseException) -> None:
        """When the server reports the call's deadline and the caller's own deadline
        (the one sent with the call) has passed as well, let the caller's scope
        cancel it: the reply can reach the task before the event loop runs the
        scope's timer, and the caller's deadline is the earlier of the two (the
        server counts from the call's arrival). Waits at most a second for that
        cancellation, which is due at once."""
        if type(outcome) is not ErrorReply or outcome.code is not ErrorCode.DEADLINE_EXCEEDED:
            return
        backend = self._current_backend()
        if backend.effective_deadline() <= backend.current_time():
            with anyio.move_on_after(1.0):
                await anyio.sleep_forever()

    def _raise_outcome(
        self, method: str, outcome: Result | ErrorReply | BaseException
    ) -> NoReturn:
        assert type(outcome) is not Result
        if type(outcome) is ErrorReply:
            status = outcome.status
            error = (
                error_for(method, outcome.code, outcome.type, outcome.message)
                if status is None
                else ApplicationError.received(method, outcome.type, outcome.message, *status)
            )
            if outcome.trailers:
                error.trailers = dict(outcome.trailers)
            raise error
        if isinstance(outcome, LocalProtocolError):
            raise outcome
        assert isinstance(outcome, BaseException)
        raise self._unavailable(method, outcome) from outcome

    def _current_backend(self) -> Backend:
        """The event loop's backend, looked up at the first call that needs it."""
        backend = self._backend
        if backend is None:
            backend = self._backend = current_backend()
        return backend

    def _timeout(self) -> float | None:
        """What is left of the calling task's deadline (None: no deadline)."""
        backend = self._current_backend()
        deadline = backend.effective_deadline()
        return None if deadline == math.inf else max(deadline - backend.current_time(), 0.0)

    async def notify(self, method: str, /, *args: Any, **kwargs: Any) -> None:
        """Send a one-way call: the server runs ``method`` and sends nothing back
        (its errors are only logged there). Returns once the message is queued
        (it waits while the queue is full).

        Raises:
            SerializationError: an argument cannot be serialized.
            UnavailableError: the connection ended.
            anyio.ClosedResourceError: the client was closed.
        """
        await self._notify(method, args, kwargs, None)

    async def _notify(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: Metadata | None,
    ) -> None:
        """:meth:`notify`, with ``metadata`` sent, through the interceptors."""
        if self._interceptors:
            outgoing = OutgoingCall("notification", method, args, kwargs, dict(metadata or {}))

            async def proceed() -> None:
                sent = _metadata_to_send(outgoing.metadata, metadata)
                await self._notify_plain(outgoing.method, outgoing.args, outgoing.kwargs, sent)

            await intercepted(self._interceptors, outgoing, proceed)
            return
        await self._notify_plain(method, args, kwargs, metadata)

    async def _notify_plain(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        metadata: Metadata | None,
    ) -> None:
        """:meth:`_notify` past the interceptors."""
        self._check(method)
        try:
            await self._outbox.put(Notify(method, list(args), kwargs, metadata).encode())
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise self._unavailable(method, self._ended or exc) from exc

    async def aclose(self) -> None:
        """Close the client and its comm. Calls in flight raise
        :exc:`anyio.ClosedResourceError`."""
        self._closed = True
        self._outbox.close()
        await self._comm.aclose()

    async def run(self) -> None:
        """Send the calls' messages and read the replies until the connection
        ends or the client is closed (or this is cancelled); then every call in
        flight fails."""
        ended: BaseException = anyio.BrokenResourceError("the client stopped")
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(self._outbox.run)
                if self._ping_interval is not None:
                    self._last_heard = self._current_backend().current_time()
                    task_group.start_soon(self._keepalive, self._ping_interval)
                try:
                    ended = await self._read()
                finally:
                    self._outbox.close()
                    task_group.cancel_scope.cancel()  # the keepalive task
        finally:
            self._end(ended)

    async def _keepalive(self, interval: float) -> None:
        """While calls are in flight, send a PING once nothing arrived for
        ``interval`` seconds; when nothing arrives within ``ping_timeout`` of it
        either, close the connection (its calls fail with UnavailableError)."""
        clock = self._current_backend().current_time
        token = 0
        while True:
            quiet = clock() - self._last_heard
            if quiet < interval or not self._calls:
                await anyio.sleep(interval - quiet if quiet < interval else interval)
                continue
            sent_at = clock()
            self._outbox.put_now(Ping(token).encode())
            token = (token + 1) & MAX_ID
            with anyio.move_on_after(self._ping_timeout):
                while self._last_heard < sent_at:
                    heard = self._heard = anyio.Event()
                    await heard.wait()
                continue
            text = f"no answer to a ping within {self._ping_timeout:g} seconds"
            self._unanswered = anyio.BrokenResourceError(text)
            await self._comm.aclose(CloseReason(PING_TIMEOUT_CODE, "rpc.ping", text))
            return

    async def _read(self) -> BaseException:
        """Deliver the replies, those that arrived together in one pass (a batch)."""
        comm = self._comm
        calls = self._calls
        while True:
            try:
                batch = await comm.receive_batch(READ_BATCH)
            except Exception as exc:
                return self._unanswered or exc
            if self._ping_interval is not None:
                self._last_heard = self._current_backend().current_time()
                if self._heard is not None:
                    self._heard.set()
                    self._heard = None
            for message in batch:
                try:
                    reply = decode(message)
                except ProtocolViolation as exc:
                    await _refuse(comm, exc)
                    return exc
                if type(reply) is Result or type(reply) is ErrorReply:
                    pending = self._forget(reply.id)
                    if pending is not None:  # else: cancelled, or a stray reply
                        if reply.trailers is not None and pending.trailers is not None:
                            pending.trailers.update(reply.trailers)
                        pending.finish(reply)
                elif type(reply) is Item:
                    stream = calls.get(reply.id)
                    if type(stream) is _StreamPending:
                        try:
                            stream.add(reply.value)
                        except ProtocolViolation as exc:
                            await _refuse(comm, exc)
                            return exc
                    elif stream is not None:
                        error = ProtocolViolation("a server sent stream items for a call")
                        await _refuse(comm, error)
                        return error
                elif type(reply) is Pong:
                    pass  # (its arrival was noted above)
                elif type(reply) is Credit:
                    pending = calls.get(reply.id)
                    if pending is not None:  # (else the call ended)
                        if pending.input is None:
                            error = ProtocolViolation(
                                "a server gave credit to a call without input"
                            )
                            await _refuse(comm, error)
                            return error
                        pending.input.add(reply.count)
                else:
                    error = ProtocolViolation(f"a server sent a {type(reply).__name__} message")
                    await _refuse(comm, error)
                    return error

    def _end(self, error: BaseException) -> None:
        if self._closed:
            error = anyio.ClosedResourceError()  # we ended it
        self._ended = error
        calls = list(self._calls.values())
        self._calls.clear()
        for pending in calls:
            pending.finish(error)

    def _refused(self, call_id: int, error: LocalProtocolError) -> None:
        pending = self._forget(call_id)
        if pending is not None:
            pending.finish(error)

    def _check(self, method: str) -> None:
        if self._ended is not None:
            raise self._unavailable(method, self._ended) from self._ended
        if self._closed:
            raise anyio.ClosedResourceError

    def _unavailable(
        self, method: str, error: BaseException
    ) -> RPCError | anyio.ClosedResourceError:
        """What a call raises because the connection ended with ``error``: the
        end of a client this side closed is ClosedResourceError."""
        if self._closed and isinstance(error, anyio.ClosedResourceError):
            return anyio.ClosedResourceError()
        return UnavailableError(method, type(error).__name__, str(error) or "connection ended")


@final
class WithMetadata:
    """Calls through a :class:`Client` that carry metadata (see
    :meth:`Client.with_metadata`): :meth:`call`, :meth:`stream` and
    :meth:`notify` are the client's, raising the same errors."""

    __slots__ = ("_client", "_metadata", "_trailers")

    def __init__(self, client: Client, metadata: Metadata, trailers: Metadata | None) -> None:
        self._client = client
        self._metadata = metadata
        self._trailers = trailers

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """:meth:`Client.call`, with the metadata.

        Raises:
            the errors of :meth:`Client.call`.
        """
        return await self._client._call(method, args, kwargs, self._metadata, self._trailers)

    def stream(
        self, method: str, /, *args: Any, **kwargs: Any
    ) -> AbstractAsyncContextManager[AsyncIterator[Any]]:
        """:meth:`Client.stream`, with the metadata.

        Raises:
            the errors of :meth:`Client.stream`.
        """
        client = self._client
        return client._opened(
            "stream", client._stream_plain, method, args, kwargs, self._metadata, self._trailers
        )

    def upload(
        self, method: str, /, *args: Any, **kwargs: Any
    ) -> AbstractAsyncContextManager[Upload]:
        """:meth:`Client.upload`, with the metadata.

        Raises:
            the errors of :meth:`Client.upload`.
        """
        client = self._client
        return client._opened(
            "upload", client._upload_plain, method, args, kwargs, self._metadata, self._trailers
        )

    def channel(
        self, method: str, /, *args: Any, **kwargs: Any
    ) -> AbstractAsyncContextManager[Channel]:
        """:meth:`Client.channel`, with the metadata.

        Raises:
            the errors of :meth:`Client.channel`.
        """
        client = self._client
        return client._opened(
            "channel", client._channel_plain, method, args, kwargs, self._metadata, self._trailers
        )

    async def notify(self, method: str, /, *args: Any, **kwargs: Any) -> None:
        """:meth:`Client.notify`, with the metadata.

        Raises:
            the errors of :meth:`Client.notify`.
        """
        await self._client._notify(method, args, kwargs, self._metadata)


def _metadata_to_send(metadata: dict[str, str | bytes], given: Metadata | None) -> Metadata | None:
    """What an intercepted call sends as its metadata: ``metadata`` as its
    interceptors left it, checked; nothing if it is empty and the caller gave
    none (so that a call without metadata stays one, and gets no trailers).

    Raises:
        ValueError: the interceptors made it break the limits of metadata.
    """
    if not metadata and given is None:
        return None
    return check_metadata(metadata)


async def _refuse(comm: Comm, error: ProtocolViolation) -> None:
    """Close ``comm``, telling the peer which rule its message broke."""
    await comm.aclose(CloseReason(CloseCode.PROTOCOL_ERROR, "rpc", str(error)[:1024]))


@asynccontextmanager
async def open_client(
    comm: Comm,
    *,
    max_queued: int = DEFAULT_LIMIT,
    stream_window: int = DEFAULT_STREAM_WINDOW,
    interceptors: Sequence[ClientInterceptor] = (),
    ping_interval: float | None = None,
    ping_timeout: float = DEFAULT_PING_TIMEOUT,
) -> AsyncIterator[Client]:
    """A :class:`Client` over ``comm``, running until the block ends (then the
    comm is closed).

    Args:
        comm: a comm to an RPC server; the client owns it from now on.
        max_queued: messages queued for sending before calls wait for room.
        stream_window: items of a stream the server may send ahead.
        interceptors: coroutine functions ``interceptor(call, proceed)`` that
            see every call, stream and notification the client makes, the
            first outermost: each gets an :class:`OutgoingCall` (whose
            arguments and metadata it may change) and returns ``await
            proceed()``, which runs the next one and, after the last, sends the
            call and returns its result (for a stream: the opened
            :class:`Stream`; the interceptor returns it, or an async iterator
            over it, which the ``stream()`` block iterates), or raises (see
            the RPC guide, "Interceptors").
        ping_interval: while calls are in flight, send a ping once nothing
            arrived for this many seconds (None: never), and close the
            connection when nothing arrives within ``ping_timeout`` seconds
            of it either: a peer that vanished without closing (a half-open
            connection) is found, and its calls fail with
            :exc:`UnavailableError`, however long they may run (see the RPC
            guide, "Keepalive").
        ping_timeout: seconds to wait for an answer to a ping.

    Raises:
        ValueError: a limit is below 1, or ``ping_interval`` or
            ``ping_timeout`` is not positive.
        TypeError: an interceptor is not callable.
    """
    try:
        client = Client(
            comm,
            max_queued=max_queued,
            stream_window=stream_window,
            interceptors=interceptors,
            ping_interval=ping_interval,
            ping_timeout=ping_timeout,
        )
    except BaseException:
        await comm.aclose()  # it is ours
        raise
    body_error: Exception | None = None
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(client.run, name=f"rpc client {comm.peer_address}")
        try:
            yield client
        except Exception as exc:
            body_error = exc  # re-raised below, not in an ExceptionGroup
        finally:
            await client.aclose()
    if body_error is not None:
        raise body_error
