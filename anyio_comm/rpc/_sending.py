"""The caller's side of calls that take a stream of items: an :class:`Upload`
(items in, one result out) and a :class:`Channel` (items both ways), made by
``Client.upload`` and ``Client.channel``.

The server gives credit for the items (CREDIT messages, a window when it takes
the call and more as its handler takes them); :meth:`Upload.send` waits for it,
so a slow handler slows the sender and nothing piles up on either side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio

from .._compat import final
from ._protocol import End, Item, Result

if TYPE_CHECKING:
    from ._client import Client, Stream, _Pending

__all__ = ["Channel", "InputCredit", "Upload"]


class InputCredit:
    """The items a call's server is ready for, and the task waiting for more."""

    __slots__ = ("available", "waiter")

    def __init__(self) -> None:
        self.available = 0
        self.waiter: anyio.Event | None = None

    def add(self, count: int) -> None:
        self.available += count
        self.wake()

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            waiter.set()


class _Sender:
    """What :class:`Upload` and :class:`Channel` share: sending the items and
    the end of the input."""

    __slots__ = ("_call_id", "_client", "_closed", "_ended", "_method", "_pending", "_sending")

    def __init__(self, client: Client, method: str, call_id: int, pending: _Pending) -> None:
        self._client = client
        self._method = method
        self._call_id = call_id
        self._pending = pending
        #: the input was ended (END sent, or about to be)
        self._ended = False
        #: the block that opened the call was left
        self._closed = False
        self._sending = False

    async def send(self, item: Any) -> None:
        """Send ``item`` to the call, once the server is ready for it.

        Raises:
            anyio.ClosedResourceError: the input was ended, or the block left
                (before or while this waited: the item is not sent).
            anyio.BusyResourceError: another task is sending to this call.
            anyio.BrokenResourceError: the call returned (or its stream
                ended) before taking more items.
            SerializationError: the item cannot be serialized (nothing is sent).
            RPCError: the call failed (as :meth:`Client.call` raises).
        """
        if self._ended or self._closed:
            raise anyio.ClosedResourceError
        if self._sending:
            raise anyio.BusyResourceError("sending to")
        self._sending = True
        try:
            pending = self._pending
            credit = pending.input
            assert credit is not None
            while credit.available < 1 and pending.outcome is None:
                waiter = credit.waiter = anyio.Event()
                await waiter.wait()
            if self._ended or self._closed:  # meanwhile, from another task
                raise anyio.ClosedResourceError
            outcome = pending.outcome
            if outcome is not None:
                if type(outcome) is Result:
                    raise anyio.BrokenResourceError(
                        f"{self._method} returned before taking more items"
                    )
                await self._client._own_deadline_first(outcome)
                self._client._raise_outcome(self._method, outcome)
            credit.available -= 1
            try:
                await self._client._send_input(
                    self._method, self._call_id, Item(self._call_id, item).encode()
                )
            except BaseException:
                credit.available += 1  # nothing was queued: the credit is still ours
                raise
        finally:
            self._sending = False

    async def end(self) -> None:
        """Tell the call that no more items come (again, or once the call
        ended: nothing happens). A send waiting for credit in another task
        raises ClosedResourceError, its item not sent.

        Raises:
            anyio.ClosedResourceError: the block was left.
            UnavailableError: the connection ended while the call ran.
        """
        if self._closed:
            raise anyio.ClosedResourceError
        if self._ended:
            return
        self._ended = True
        if self._pending.outcome is None:
            await self._client._send_input(
                self._method, self._call_id, End(self._call_id).encode()
            )


@final
class Upload:
    """A call that takes a stream of items and returns one result (see
    :meth:`Client.upload`): :meth:`send` the items, then :meth:`finish`."""

    __slots__ = ("_sender",)

    def __init__(self, client: Client, method: str, call_id: int, pending: _Pending) -> None:
        self._sender = _Sender(client, method, call_id, pending)

    async def send(self, item: Any) -> None:
        """Send ``item`` to the handler, once the server is ready for it (flow
        control: at most ``input_window`` items wait there).

        Raises:
            anyio.ClosedResourceError: :meth:`finish` was called, or the block
                left (before or while this waited: the item is not sent).
            anyio.BusyResourceError: another task is sending to this upload.
            anyio.BrokenResourceError: the handler returned before taking
                more items (:meth:`finish` returns its result).
            SerializationError: the item cannot be serialized (nothing is sent).
            RPCError: the call failed (as :meth:`Client.call` raises).
        """
        await self._sender.send(item)

    async def finish(self) -> Any:
        """End the items and return the handler's result.

        Raises:
            RPCError: the call failed (as :meth:`Client.call` raises).
            anyio.ClosedResourceError: the block was left.
        """
        sender = self._sender
        await sender.end()
        pending = sender._pending
        await pending.event.wait()
        outcome = pending.outcome
        if type(outcome) is Result:
            return outcome.value
        assert outcome is not None
        await sender._client._own_deadline_first(outcome)
        sender._client._raise_outcome(sender._method, outcome)

    def __repr__(self) -> str:
        return f"Upload(method={self._sender._method!r}, id={self._sender._call_id})"


@final
class Channel:
    """A call with items both ways (see :meth:`Client.channel`): :meth:`send`
    items to the handler, :meth:`end` them, and iterate over (or
    :meth:`receive`) what it yields."""

    __slots__ = ("_results", "_sender")

    def __init__(
        self, client: Client, method: str, call_id: int, pending: _Pending, results: Stream
    ) -> None:
        self._sender = _Sender(client, method, call_id, pending)
        self._results = results

    async def send(self, item: Any) -> None:
        """Send ``item`` to the handler, once the server is ready for it (flow
        control: at most ``input_window`` items wait there).

        Raises:
            anyio.ClosedResourceError: :meth:`end` was called, or the block left
                (before or while this waited: the item is not sent).
            anyio.BusyResourceError: another task is sending to this channel.
            anyio.BrokenResourceError: the handler's stream ended before it
                took more items.
            SerializationError: the item cannot be serialized (nothing is sent).
            RPCError: the call failed (as :meth:`Client.call` raises).
        """
        await self._sender.send(item)

    async def end(self) -> None:
        """Tell the handler that no more items come (its input stream ends);
        what it yields can still be received. Calling it again, or once the
        call ended, does nothing; a :meth:`send` waiting in another task raises
        ClosedResourceError, its item not sent.

        Raises:
            anyio.ClosedResourceError: the block was left.
            UnavailableError: the connection ended while the call ran.
        """
        await self._sender.end()

    async def receive(self) -> Any:
        """The next item the handler yields.

        Raises:
            anyio.EndOfStream: the handler's stream ended.
            anyio.BusyResourceError: another task is receiving from it.
            anyio.ClosedResourceError: the block was left.
            RPCError: the call failed (as :meth:`Client.call` raises).
        """
        try:
            return await self._results.__anext__()
        except StopAsyncIteration:
            raise anyio.EndOfStream from None

    def __aiter__(self) -> Channel:
        return self

    async def __anext__(self) -> Any:
        """The next item the handler yields.

        Raises:
            StopAsyncIteration: the handler's stream ended.
            RPCError: the call failed (as :meth:`Client.call` raises).
        """
        return await self._results.__anext__()

    def __repr__(self) -> str:
        return f"Channel(method={self._sender._method!r}, id={self._sender._call_id})"
