"""One writer per comm: the messages of every call on a connection go out in
order through a single task, so that a call cancelled while its message is
being written never leaves half a message on the shared connection.

Messages are serialized by the task that queues them (so a message that cannot
be serialized fails there, and its buffers are sent without a copy: they must
not change until the call returns). The queue is bounded: :meth:`Outbox.put`
waits for room. Cancels, credits and refusals skip the bound
(:meth:`Outbox.put_now`): a client sends at most one cancel per call and credit
only for items it received, and a server stops reading a connection whose
outbox is full (the peer does not read), so its refusals stay bounded too.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Final

import anyio

if TYPE_CHECKING:
    from collections.abc import Callable

    from .._comm import Comm
    from .._sansio.errors import LocalProtocolError

__all__ = ["Entry", "Outbox"]

#: messages an outbox holds before :meth:`Outbox.put` waits, by default
DEFAULT_LIMIT: Final = 256
#: most messages sent with one gather write
MAX_BATCH: Final = 64


class Entry:
    """A queued message: its frames, until the writer takes it (then ``None``
    once withdrawn before that)."""

    __slots__ = ("frames", "on_refused", "taken")

    def __init__(
        self, frames: list[memoryview], on_refused: Callable[[LocalProtocolError], None] | None
    ) -> None:
        self.frames: list[memoryview] | None = frames
        self.on_refused = on_refused
        self.taken = False


class Outbox:
    """The messages waiting to be sent on one comm, and the task that sends them.

    Args:
        comm: the comm (only :meth:`run` sends on it).
        limit: messages queued with :meth:`put` before it waits.
    """

    def __init__(self, comm: Comm, limit: int = DEFAULT_LIMIT) -> None:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._comm = comm
        self._dumps = comm._serializer.dumps
        self._check_send = comm._conn.check_send
        self._limit = limit
        self._queue: collections.deque[Entry] = collections.deque()
        self._wakeup: anyio.Event | None = None
        self._room: anyio.Event | None = None
        self._sending = False
        self._drained: anyio.Event | None = None
        #: why the writer stopped (the connection failed), once it did
        self.error: BaseException | None = None
        self._closed = False

    @property
    def open(self) -> bool:
        """False once the outbox was closed or its connection failed."""
        return self.error is None and not self._closed

    def encode(self, message: Any) -> list[memoryview]:
        """The frames of ``message``, checked against the peer's limits.

        Raises:
            SerializationError: it cannot be serialized.
            LocalProtocolError: it is over the peer's limits.
        """
        frames = self._dumps(message)
        self._check_send(frames)
        return frames

    async def put(
        self,
        message: Any,
        on_refused: Callable[[LocalProtocolError], None] | None = None,
    ) -> Entry:
        """Queue ``message`` once there is room; ``on_refused`` is called if the
        comm refuses it (over the peer's limits: nothing of it was sent).

        Cancelled while it waits for room, nothing is queued.

        Raises:
            SerializationError: it cannot be serialized.
            LocalProtocolError: it is over the peer's limits.
            anyio.BrokenResourceError: the connection failed (:attr:`error`).
            anyio.ClosedResourceError: the outbox was closed.
        """
        entry = Entry(self.encode(message), on_refused)
        await self.wait_for_room()
        self._queue.append(entry)
        self._wake()
        return entry

    async def wait_for_room(self) -> None:
        """Return once the queue is below its bound.

        Raises:
            anyio.BrokenResourceError: the connection failed (:attr:`error`).
            anyio.ClosedResourceError: the outbox was closed.
        """
        while len(self._queue) >= self._limit:
            self._check()
            if self._room is None:
                self._room = anyio.Event()
            await self._room.wait()
        self._check()

    def put_now(
        self,
        message: Any,
        on_refused: Callable[[LocalProtocolError], None] | None = None,
    ) -> None:
        """Queue ``message`` now, beyond the bound (see the module); nothing
        happens once the connection failed or the outbox was closed.

        Raises:
            SerializationError: it cannot be serialized.
            LocalProtocolError: it is over the peer's limits.
        """
        if self.error is None and not self._closed:
            self._queue.append(Entry(self.encode(message), on_refused))
            self._wake()

    @staticmethod
    def withdraw(entry: Entry) -> bool:
        """Take back a queued message: True if it will not be sent (the writer
        had not taken it), False if it is sent or being sent."""
        if entry.taken:
            return False
        entry.frames = None
        return True

    async def drain(self) -> None:
        """Return once every queued message was sent (or the outbox stopped)."""
        while (self._queue or self._sending) and self.error is None and not self._closed:
            if self._drained is None:
                self._drained = anyio.Event()
            await self._drained.wait()

    def close(self) -> None:
        """Stop: :meth:`run` returns once its current send is done; later
        :meth:`put` calls raise ClosedResourceError."""
        self._closed = True
        self._wake()
        for event in (self._room, self._drained):
            if event is not None:
                event.set()

    async def run(self) -> None:
        """Send the queued messages in order until :meth:`close`, or until the
        connection fails (then :attr:`error` says how, and :meth:`run` returns)."""
        send_messages = self._comm._send_messages
        queue = self._queue
        try:
            while not self._closed:
                if not queue:
                    self._wakeup = anyio.Event()
                    await self._wakeup.wait()
                    self._wakeup = None
                    continue
                # what is queued goes in one gather write (a withdrawn one not at all)
                entries: list[Entry] = []
                batch: list[list[memoryview]] = []
                while queue and len(batch) < MAX_BATCH:
                    entry = queue.popleft()
                    frames = entry.frames
                    if frames is not None:
                        entry.taken = True
                        entry.frames = None
                        entries.append(entry)
                        batch.append(frames)
                if self._room is not None and len(queue) < self._limit:
                    self._room.set()
                    self._room = None
                self._sending = True
                try:
                    if batch:
                        for index, error in await send_messages(batch):
                            _refused(entries[index], error)
                finally:
                    self._sending = False
                if not queue and self._drained is not None:
                    self._drained.set()
                    self._drained = None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            self.error = exc
            for event in (self._room, self._drained):
                if event is not None:
                    event.set()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _check(self) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        if self.error is not None:
            raise anyio.BrokenResourceError from self.error


def _refused(entry: Entry, error: LocalProtocolError) -> None:
    if entry.on_refused is not None:
        entry.on_refused(error)
