"""A call's input stream, on the server: the items a client sends to an upload or
a channel (``Client.upload``, ``Client.channel``), handed to the handler as its
first argument, an async iterator.

The server gives the client credit for ``window`` items when the handler
starts (a call that waits for a worker or a slot gets none: its items are not
sent yet), and more, half a window at a time, as the handler takes them; an item
beyond the credit, or after the END, breaks the protocol. So at most ``window``
items wait per running handler; each keeps the bytes of the receive budget its
message came with (a large one: see :func:`~anyio_comm._comm.keep_taken`) until
the handler takes it or the call ends.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import anyio

from .._compat import final
from ._protocol import Credit, ProtocolViolation

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["DEFAULT_INPUT_WINDOW", "InputStream"]

#: items of a call's input the client may send before the handler takes them
DEFAULT_INPUT_WINDOW = 16


@final
class InputStream:
    """The items the caller sends to an upload or a channel, in order, as an
    async iterator: ``async for item in items:``, which ends when the caller
    ended its input (``finish()`` or ``end()``). One task at a time reads it."""

    __slots__ = (
        "_call_id",
        "_ended",
        "_give_credit",
        "_granted",
        "_items",
        "_reading",
        "_received",
        "_release",
        "_taken",
        "_waiter",
        "_window",
    )

    def __init__(
        self,
        call_id: int,
        window: int,
        give_credit: Callable[[list[Any]], None],
        release: Callable[[int], None],
    ) -> None:
        self._call_id = call_id
        self._window = window
        #: sends a message to the client (the session's ``outbox.put_now``)
        self._give_credit = give_credit
        #: gives back bytes of the receive budget
        self._release = release
        #: the items not taken yet, with the budget bytes each holds
        self._items: collections.deque[tuple[Any, int]] = collections.deque()
        self._ended = False
        self._waiter: anyio.Event | None = None
        self._reading = False
        self._granted = 0  # (see open())
        self._received = 0
        self._taken = 0

    def open(self) -> None:
        """The handler starts: give the client credit for a window of items."""
        self._granted = self._window
        self._give_credit(Credit(self._call_id, self._window).encode())

    def __aiter__(self) -> InputStream:
        return self

    async def __anext__(self) -> Any:
        """The next item.

        Raises:
            StopAsyncIteration: the caller ended its input.
            anyio.BusyResourceError: another task is waiting for an item.
        """
        if self._reading:
            raise anyio.BusyResourceError("reading from")
        self._reading = True
        try:
            while not self._items:
                if self._ended:
                    raise StopAsyncIteration
                waiter = self._waiter = anyio.Event()
                await waiter.wait()
        finally:
            self._reading = False
        item, held = self._items.popleft()
        if held:
            self._release(held)
        self._taken += 1
        if self._taken >= max(self._window // 2, 1) and not self._ended:
            # more credit, half a window at a time
            self._granted += self._taken
            self._give_credit(Credit(self._call_id, self._taken).encode())
            self._taken = 0
        return item

    def add(self, item: Any, held: int) -> None:
        """An ITEM for the call arrived, its message holding ``held`` bytes of the
        budget (given back when the handler takes it, or the call ends).

        Raises:
            ProtocolViolation: beyond the credit given, or after the END.
        """
        if self._ended:
            raise ProtocolViolation("a client sent an input item after its end")
        self._received += 1
        if self._received > self._granted:
            raise ProtocolViolation("a client sent more input items than it was allowed")
        self._items.append((item, held))
        self._wake()

    def end(self) -> None:
        """The END for the call arrived.

        Raises:
            ProtocolViolation: it had arrived before.
        """
        if self._ended:
            raise ProtocolViolation("a client ended a call's input twice")
        self._ended = True
        self._wake()

    def discard(self) -> None:
        """The call ended: give back what the items not taken hold."""
        self._ended = True
        items = self._items
        while items:
            _, held = items.popleft()
            if held:
                self._release(held)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()

    def __repr__(self) -> str:
        return f"InputStream(call={self._call_id}, waiting={len(self._items)})"
