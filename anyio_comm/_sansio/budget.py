"""The receive budget: how much memory peers may make a listener hold.

Theory of operation
-------------------
A :class:`ReceiveBudget` counts the bytes of received messages that are in
flight: declared by a header but not yet returned by ``receive()``, whether
their bytes arrived (then they sit in frame buffers or in a push engine's
queue) or not yet. Each connection has a :class:`BudgetAccount`. When a
header declares a message whose cost (:func:`message_cost`: its bytes plus
:data:`FRAME_COST` per frame) is at least the connection's read-ahead buffer,
the decoder reserves that cost before it allocates anything for the message,
and the cost is released when the message is handed to the application.
Smaller messages are not counted: the read-ahead buffer and the small push
queue already bound what they hold per connection.

Admission: a reservation is granted if it fits (the bytes reserved plus it
stay within ``max_bytes``); otherwise the account waits and its connection is
not read (backpressure: nothing is dropped, the peer's sends block). Releases
grant the waiting accounts that fit, in the order they came, skipping those
that do not fit yet, until one has waited ``stall_timeout``: from then on nobody
overtakes it (no starvation of large messages). A message larger than the
whole budget has a lane of its own: one such message at a time, beside the
others, so that every message under the limits can be received and a peer
declaring a huge message blocks only the next huge one, not everybody.

A connection that holds budget and makes no progress (no byte of its
reserved message arrives, none of its received messages is taken) while
others wait keeps them waiting: :meth:`ReceiveBudget.check_stalls` finds those
stalled for ``stall_timeout`` seconds, largest holders first, and the I/O
layer closes them (the comms of waiting connections call it while they wait).

An owner that keeps messages after it received them can keep them charged:
:meth:`BudgetAccount.transfer` hands a taken message's reservation to an
account of its own instead of giving it back (an RPC server's waiting calls,
see :mod:`anyio_comm.rpc._server`), which may also reserve for smaller
messages itself. Its releases grant waiters as any others do.

So the memory a listener's peers can make it hold in messages not yet taken
(for an RPC server: calls not yet started) is at most ``max_bytes`` plus one
larger message. With the default allocator
only the bytes that arrived are committed for frames of 32 MiB and more (see
:mod:`~anyio_comm._sansio.buffers`), smaller frames are committed whole when
they start.

Everything here runs in one event loop's thread: share a budget between the
listeners of one event loop (a process-wide budget), not between threads.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, final

from .frames import PackedFrames

if TYPE_CHECKING:
    from collections.abc import Callable

    from .frames import Frames

__all__ = [
    "DEFAULT_RECEIVE_BUDGET",
    "DEFAULT_STALL_TIMEOUT",
    "FRAME_COST",
    "BudgetAccount",
    "ReceiveBudget",
    "Reservations",
    "frames_cost",
    "message_cost",
]

#: the bytes a listener lets its connections hold in messages not yet taken, by default
DEFAULT_RECEIVE_BUDGET: Final = 256 * 1024 * 1024
#: seconds a connection may hold budget without progress while others wait, by default
DEFAULT_STALL_TIMEOUT: Final = 30.0
#: what a frame counts for beside its bytes, so that messages of many empty frames
#: count: the short frames of a message of more than 32 frames take their bytes and
#: 16 more each, other frames a frame object each (a buffer and a memoryview, about
#: 380 bytes: with its bytes, less than 8 times what a frame of 64 bytes or more takes
#: on the wire: see the decoder)
FRAME_COST: Final = 256


def message_cost(nbytes: int, frames: int) -> int:
    """What a message of ``frames`` frames of ``nbytes`` bytes in all holds in
    memory, as budgeted (and as a push receiver's queue counts it)."""
    return nbytes + FRAME_COST * frames


def frames_cost(frames: Frames) -> int:
    """:func:`message_cost` of a decoded message."""
    # (called for every message a push receiver queues: the one-frame list needs
    # no call of message_cost, at a third of the general path's cost)
    if type(frames) is PackedFrames:  # (exact: isinstance() of an ABC costs more)
        return message_cost(frames.nbytes, len(frames))
    if len(frames) == 1:
        return len(frames[0]) + FRAME_COST  # flat views: len() is the size
    return sum(map(len, frames)) + FRAME_COST * len(frames)


@final
@dataclass(frozen=True, slots=True)
class BudgetStatistics:
    """What a :class:`ReceiveBudget` holds and has done
    (:meth:`ReceiveBudget.statistics`, also a listener's in
    :class:`~anyio_comm.ListenerStatistics`).

    Attributes:
        max_bytes: the bytes in flight beyond which new messages wait.
        in_use: the bytes reserved now.
        waiting: connections that wait for budget now.
        waits: the reservations that waited for budget, in all: messages, and
            an RPC server's calls waiting for a worker.
        wait_seconds: how long they waited, in all, the current waits included.
        stalls_closed: holders closed for holding budget without progress
            while others waited: connections, and an RPC server's calls
            waiting for a worker (a connection and its calls may both be).
    """

    max_bytes: int
    in_use: int
    waiting: int
    waits: int
    wait_seconds: float
    stalls_closed: int


@final
class ReceiveBudget:
    """A budget of receive memory shared by the connections of a listener (or of
    several listeners: a process-wide budget).

    It counts the bytes of messages that are in flight (declared by their
    header but not yet returned by ``receive()``; for :func:`anyio_comm.rpc.serve`,
    until the call's handler starts), for messages larger than the read-ahead
    buffer (64 KiB by default): their bytes plus 256 per frame (an RPC server
    also charges a connection's smaller waiting calls beyond 1 MiB).
    Beyond ``max_bytes``, a new message waits, and its connection is not read,
    until earlier ones are taken. Messages larger than ``max_bytes`` are
    admitted one at a time, beside the others. While connections wait, one
    that holds budget without progress for ``stall_timeout`` seconds is closed
    (its comm raises :exc:`~anyio_comm.ReceiveBudgetError`), largest holder
    first; a message that waited that long is overtaken by no other.

    Pass it as ``receive_budget=`` to :func:`~anyio_comm.listen` or
    :func:`~anyio_comm.serve` (an ``int`` there makes a budget of its own for
    that listener). Use one budget within one event loop only.

    Args:
        max_bytes: the bytes in flight beyond which new messages wait.
        stall_timeout: seconds a connection may hold budget without progress
            while others wait (``None``: never closed for that).

    Raises:
        TypeError: ``max_bytes`` is not an int, or ``stall_timeout`` not a number.
        ValueError: ``max_bytes`` is negative, or ``stall_timeout`` not positive.
    """

    __slots__ = (
        "_accounts",
        "_in_use",
        "_large",
        "_max_bytes",
        "_stall_timeout",
        "_stalls_closed",
        "_wait_seconds",
        "_waiters",
        "_waits",
    )

    def __init__(
        self, max_bytes: int, *, stall_timeout: float | None = DEFAULT_STALL_TIMEOUT
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise TypeError(f"max_bytes must be an int, not {type(max_bytes).__name__}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must not be negative, got {max_bytes}")
        if stall_timeout is not None:
            if isinstance(stall_timeout, bool) or not isinstance(stall_timeout, (int, float)):
                raise TypeError(
                    f"stall_timeout must be a number of seconds or None, not {stall_timeout!r}"
                )
            if not stall_timeout > 0:
                raise ValueError(f"stall_timeout must be greater than 0, not {stall_timeout!r}")
        self._max_bytes = max_bytes
        self._stall_timeout = stall_timeout
        self._in_use = 0  # reserved by messages of at most max_bytes
        self._large = 0  # reserved by the one larger message in flight (0: none)
        self._waiters: list[BudgetAccount] = []
        self._accounts: set[BudgetAccount] = set()
        # the reservations that waited, the seconds of those that ended, and the
        # connections closed for stalling
        self._waits = 0
        self._wait_seconds = 0.0
        self._stalls_closed = 0

    def __repr__(self) -> str:
        return (
            f"<ReceiveBudget {self.in_use} of {self._max_bytes} bytes in use, "
            f"{len(self._waiters)} waiting>"
        )

    @property
    def max_bytes(self) -> int:
        """The bytes in flight beyond which new messages wait."""
        return self._max_bytes

    @property
    def stall_timeout(self) -> float | None:
        """Seconds a connection may hold budget without progress while others wait."""
        return self._stall_timeout

    @property
    def in_use(self) -> int:
        """The bytes reserved now (beyond ``max_bytes`` while a message larger than
        the budget is in flight)."""
        return self._in_use + self._large

    @property
    def waiting(self) -> int:
        """How many connections wait for budget now."""
        return len(self._waiters)

    def statistics(self) -> BudgetStatistics:
        """What the budget holds and has done (see :class:`BudgetStatistics`)."""
        now = time.monotonic()
        return BudgetStatistics(
            max_bytes=self._max_bytes,
            in_use=self.in_use,
            waiting=len(self._waiters),
            waits=self._waits,
            wait_seconds=self._wait_seconds
            + sum(now - account._waiting_since for account in self._waiters),
            stalls_closed=self._stalls_closed,
        )

    def account(self) -> BudgetAccount:
        """A new connection's account (set its ``on_stall`` to close the connection)."""
        account = BudgetAccount(self)
        self._accounts.add(account)
        return account

    @property
    def check_interval(self) -> float:
        """The seconds between stall checks while a connection waits for budget,
        a quarter of ``stall_timeout`` and at most one second (``math.inf``
        without a ``stall_timeout``)."""
        timeout = self._stall_timeout
        return math.inf if timeout is None else min(timeout / 4, 1.0)

    def close_stalled(self, now: float) -> None:
        """Run the stall check (``check_stalls``) and close the connections
        it picks (``BudgetAccount.stall``), saying why. Called every
        :attr:`check_interval` seconds by whoever waits for budget."""
        for victim in self.check_stalls(now):
            self._stalls_closed += 1
            victim.stall(
                f"held {victim.held} bytes of the receive budget ({self._max_bytes} "
                f"bytes) without progress for {self._stall_timeout:g} s while "
                f"{len(self._waiters)} connections waited for it"
            )

    def check_stalls(self, now: float) -> list[BudgetAccount]:
        """Return the accounts to close because they stalled while others wait.

        Call it from time to time while connections wait (``now`` is a
        monotonic clock in seconds). An account has stalled when it holds
        budget and showed no progress since the first call that saw it so,
        ``stall_timeout`` seconds ago or more. Returns the largest stalled
        holders first, as many as it takes to admit the first waiter of each
        lane (none if nobody waits or ``stall_timeout`` is ``None``); the caller
        closes them with ``BudgetAccount.stall``. Also marks the waiters
        that waited ``stall_timeout``: nobody overtakes them any more.
        """
        timeout = self._stall_timeout
        if not self._waiters or timeout is None:
            for account in self._accounts:
                account._stalled_since = None
            return []
        stalled = []
        for account in self._accounts:
            if not account.held and not account.wanted:
                account._stalled_since = None
                continue
            seen = (account.released, account.progress())
            if account._stalled_since is None or seen != account._seen:
                account._seen = seen
                account._stalled_since = now
            elif now - account._stalled_since >= timeout:
                if account.wanted:
                    account._starving = True
                if account.held:
                    stalled.append(account)
        stalled.sort(key=lambda account: account.held, reverse=True)
        victims: list[BudgetAccount] = []
        maximum = self._max_bytes
        large_waiter = next((a for a in self._waiters if a.wanted > maximum), None)
        if large_waiter is not None and self._large:
            victims.extend(a for a in stalled if a._large)
        waiter = next((a for a in self._waiters if a.wanted <= maximum), None)
        if waiter is not None:
            remaining = self._in_use
            for account in stalled:
                if remaining + waiter.wanted <= maximum:
                    break
                if account not in victims:
                    victims.append(account)
                remaining -= account.held - account._large
        return victims

    # -- used by the accounts ------------------------------------------------

    def _take(self, account: BudgetAccount, nbytes: int) -> bool:
        """Reserve ``nbytes`` for ``account`` if it fits its lane."""
        if nbytes > self._max_bytes:
            if self._large:
                return False
            self._large = account._large = nbytes
        elif self._in_use + nbytes <= self._max_bytes:
            self._in_use += nbytes
        else:
            return False
        account.held += nbytes
        return True

    def _give_back(self, account: BudgetAccount, nbytes: int) -> None:
        account.held -= nbytes
        if nbytes > self._max_bytes:
            self._large = account._large = 0
        else:
            self._in_use -= nbytes

    def _grant_waiters(self) -> None:
        """Grant the waiters that fit, in order; nobody overtakes a starving one."""
        waiters = self._waiters
        index = 0
        while index < len(waiters):
            account = waiters[index]
            if self._take(account, account.wanted):
                del waiters[index]
                account._stop_waiting()
                account._stalled_since = None  # its clock starts when it is granted
                account._starving = False
                if account.on_grant is not None:
                    account.on_grant()
            elif account._starving:
                return
            else:
                index += 1


def _no_progress() -> None:
    """The progress of an account whose connection set none (or closed)."""


@final
class BudgetAccount:
    """One connection's share of a :class:`ReceiveBudget`.

    Attributes:
        held: the bytes this connection holds now.
        wanted: the bytes it waits for (0: it does not wait).
        on_grant: called (from another connection's release) when the
            reservation this account waited for was granted.
        progress: returns a value that changes whenever the connection makes
            progress (set by the I/O layer); the stall check compares it.
        on_stall: ``on_stall(reason)`` closes the connection (set by the I/O
            layer; called by :meth:`stall`).
        keeper: the account that the reservations of taken messages go to
            (:meth:`taken`); ``None``: they are given back.
        waits: the reservations that waited in line (:meth:`reserve`
            returned False).
    """

    __slots__ = (
        "_budget",
        "_closed",
        "_large",
        "_seen",
        "_stalled_since",
        "_starving",
        "_wait_seconds",
        "_waiting_since",
        "held",
        "keeper",
        "on_grant",
        "on_stall",
        "progress",
        "released",
        "waits",
        "wanted",
    )

    def __init__(self, budget: ReceiveBudget) -> None:
        self._budget = budget
        self.on_stall: Callable[[str], object] | None = None
        self._closed = False
        self.held = 0
        self.wanted = 0
        self.released = 0
        self.on_grant: Callable[[], object] | None = None
        self.progress: Callable[[], object] = _no_progress
        self._seen: object = None
        self._stalled_since: float | None = None
        self._starving = False
        self._large = 0  # the part of held that is in the budget's own lane
        self.keeper: BudgetAccount | None = None
        self.waits = 0
        # the seconds the waits that ended took, and when the current one began
        self._wait_seconds = 0.0
        self._waiting_since = 0.0

    @property
    def budget(self) -> ReceiveBudget:
        """The budget this account draws on."""
        return self._budget

    @property
    def wait_seconds(self) -> float:
        """The seconds this account has waited in line, the current wait included."""
        if self.wanted:
            return self._wait_seconds + time.monotonic() - self._waiting_since
        return self._wait_seconds

    def _stop_waiting(self) -> None:
        """Leave the line (granted or not): the wait's time is counted."""
        self.wanted = 0
        waited = time.monotonic() - self._waiting_since
        self._wait_seconds += waited
        self._budget._wait_seconds += waited

    def reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes``: True if granted now; False if the account now
        waits in line (:attr:`on_grant` is called once it is granted).

        Raises:
            RuntimeError: the account already waits.
        """
        if self.wanted:
            raise RuntimeError("this account already waits for budget")
        budget = self._budget
        if self._closed:
            return True  # the connection is closing: nothing to account for
        if not any(waiter._starving for waiter in budget._waiters) and budget._take(self, nbytes):
            return True
        self.wanted = nbytes
        self.waits += 1
        budget._waits += 1
        self._waiting_since = time.monotonic()
        budget._waiters.append(self)
        return False

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` of what this account holds (a message was taken)."""
        if self._closed:
            return
        self.released += 1
        budget = self._budget
        budget._give_back(self, nbytes)
        if budget._waiters:
            budget._grant_waiters()

    def transfer(self, nbytes: int, to: BudgetAccount) -> None:
        """Hand ``nbytes`` of what this account holds to ``to``, an account of the
        same budget, which holds them from now on: they stay reserved, nobody is
        granted anything (a message was taken by an owner that keeps it charged,
        the queue of an RPC server say). Counts as a release for this account's
        stall check. A closed ``to`` gives them back instead.

        Raises:
            ValueError: ``to`` draws on another budget.
        """
        budget = self._budget
        if to._budget is not budget:
            raise ValueError("accounts of different budgets")
        if self._closed:
            return  # it holds nothing any more
        if to._closed:
            self.release(nbytes)
            return
        self.released += 1
        self.held -= nbytes
        to.held += nbytes
        if nbytes > budget._max_bytes:  # the large lane's one message: its holder changes
            self._large = 0
            to._large = nbytes

    def taken(self, nbytes: int) -> None:
        """A message that held ``nbytes`` was taken by the application: give them
        back, or hand them to :attr:`keeper`."""
        keeper = self.keeper
        if keeper is None:
            self.release(nbytes)
        else:
            self.transfer(nbytes, keeper)

    def abandon(self, nbytes: int) -> None:
        """The message that reserved ``nbytes``, or waits for them, will not be
        delivered (its stream ended): leave the line, or give them back."""
        if self.wanted:
            self.cancel()
        else:
            self.release(nbytes)

    def cancel(self) -> None:
        """Leave the line without the reservation waited for (if waiting)."""
        if self.wanted:
            self._stop_waiting()
            budget = self._budget
            budget._waiters.remove(self)
            if budget._waiters:
                budget._grant_waiters()  # the next in line may fit now

    def stall(self, reason: str) -> None:
        """Close this account's connection for stalling (calls its ``on_stall``;
        without one, the account just leaves the budget)."""
        if self.on_stall is not None:
            self.on_stall(reason)
        self.close()

    def close(self) -> None:
        """Release everything held and leave the line (the connection closed).
        Drops the callbacks, which refer to the connection (so that a closed
        connection leaves no reference cycle through its account)."""
        if self._closed:
            return
        self._closed = True
        self.on_grant = self.on_stall = self.keeper = None
        self.progress = _no_progress
        budget = self._budget
        budget._accounts.discard(self)
        if self.wanted:
            self._stop_waiting()
            budget._waiters.remove(self)
        if self._large:
            budget._give_back(self, self._large)
        budget._in_use -= self.held
        self.held = 0
        if budget._waiters:
            budget._grant_waiters()


@final
class Reservations:
    """The receive budget as a connection's frame decoder draws on it: a message
    costing at least :attr:`minimum` is reserved from :attr:`account` when its
    header arrives (:meth:`reserve`), before anything is allocated for it, and
    given back as it completes (:meth:`complete`), or when the I/O layer reports
    it taken (the account's :meth:`~BudgetAccount.taken`), or when the stream
    ends (:meth:`abandon`).

    Args:
        account: the connection's account.
        minimum: the least cost reserved (smaller messages never are).
    """

    __slots__ = ("account", "held", "minimum")

    def __init__(self, account: BudgetAccount, minimum: int) -> None:
        self.account = account
        self.minimum = minimum
        #: what the message being received reserved (0: nothing)
        self.held = 0

    def reserve(self, nbytes: int, frames: int) -> bool:
        """The header of a message of ``frames`` frames and ``nbytes`` bytes
        arrived: reserve it if it costs :attr:`minimum` or more; return False if
        it waits in the budget's line (see :attr:`waiting`)."""
        cost = message_cost(nbytes, frames)
        if cost < self.minimum:
            return True
        self.held = cost
        return self.account.reserve(cost)

    @property
    def waiting(self) -> bool:
        """True while the message's reservation waits in the budget's line."""
        return bool(self.account.wanted)

    def complete(self, give_back: bool) -> None:
        """The message is complete: give its reservation back now if
        ``give_back`` (no queue between the decoder and the application), else
        the I/O layer does when it is taken."""
        if give_back:
            self.account.taken(self.held)
        self.held = 0

    def abandon(self) -> None:
        """The stream ended: the message being received, if any, never will be."""
        if self.held:
            self.account.abandon(self.held)
            self.held = 0
