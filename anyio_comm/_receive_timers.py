"""The timers a comm's receive waits under, and what ends the comm when one runs out.

A :class:`~anyio_comm._comm.Comm` whose receive must wait asks
:meth:`ReceiveTimers.wait` to wait for its receiver, unless no timer applies
(no ``idle_timeout``, between messages, or a wait that is only a pass of the
event loop: the comm waits directly then, without a cancel scope). Which
timer applies depends on what the connection waits for:

* the peer's preamble (a comm opened with early data): the handshake deadline;
* the receive budget (our side holds the message back): no peer timer runs;
  every :attr:`~anyio_comm.ReceiveBudget.check_interval` the budget's stall
  check closes the connections that stalled holding it;
* a decompression in a worker thread (our side again): no timer;
* the peer, inside a message: ``message_timeout`` plus one second per
  ``min_receive_rate`` bytes received, counting only the time spent waiting
  for the peer, and ``idle_timeout``;
* the peer, between messages: ``idle_timeout``, from the later of the last
  arrival and the end of the owner's work on the connection, if the owner
  counts it (:attr:`ReceiveTimers.working_until`: an RPC connection with calls
  in flight is not idle, however long they take).

A timer that runs out raises :exc:`Expired`, which says how the comm closes
(gracefully or not, with which close record) and what its receive raises.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from anyio import current_time, move_on_after

from ._compat import final
from ._exceptions import IdleTimeoutError, MessageTimeoutError
from ._sansio.close import CloseCode, CloseReason
from ._sansio.connection import DECOMPRESS, WAIT_BUDGET

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._receivers import Receiver
    from ._sansio.connection import Connection

__all__ = ["Expired", "ReceiveTimers"]


@final
class Expired(Exception):
    """A receive timer ran out: the comm closes as this says, then raises ``error``."""

    def __init__(
        self, error: Exception, *, graceful: bool = False, reason: CloseReason | None = None
    ) -> None:
        super().__init__(error)
        #: what the receive raises once the comm is closed
        self.error = error
        #: close as aclose() does (the peer loses nothing), rather than abort
        self.graceful = graceful
        #: the close record to send first, if any
        self.reason = reason


@final
class ReceiveTimers:
    """The receive timers of one comm, and the time its current message waited."""

    __slots__ = (
        "handshake_deadline",
        "idle_timeout",
        "message_timeout",
        "message_waited",
        "min_receive_rate",
        "peer_address",
        "working_until",
    )

    def __init__(
        self,
        *,
        peer_address: str,
        idle_timeout: float | None,
        message_timeout: float | None,
        min_receive_rate: int,
        handshake_deadline: float,
    ) -> None:
        self.peer_address = peer_address
        self.idle_timeout = idle_timeout
        self.message_timeout = message_timeout
        self.min_receive_rate = min_receive_rate
        # (early data) when the peer's preamble must have arrived by
        self.handshake_deadline = handshake_deadline
        #: seconds waited for the peer since the message being received began
        #: (the comm sets it back to 0 when it returns a message)
        self.message_waited = 0.0
        #: the owner's work on the connection, which ``idle_timeout`` counts as
        #: activity: ``math.inf`` while some is under way, else when the last
        #: ended (``anyio.current_time()``); ``None``: the owner counts none
        self.working_until: Callable[[], float] | None = None

    async def wait(self, receiver: Receiver, conn: Connection) -> None:
        """``receiver.wait()`` under the timers that apply to it (see the module).

        Returns when the receiver may have something, or when the message's
        allowance ran out (the caller reads what arrived; the next wait fails
        unless that was enough).

        Raises:
            Expired: the handshake deadline, ``message_timeout`` or
                ``idle_timeout`` ran out.
            Exception: what ``receiver.wait()`` raises.
        """
        if conn.peer is None:
            await self._wait_for_preamble(receiver, conn)
            return
        status = conn.receiving.status
        if status is DECOMPRESS:
            await receiver.wait()
            return
        if status is WAIT_BUDGET:
            account = conn.account
            assert account is not None
            budget = account.budget
            with move_on_after(budget.check_interval):
                await receiver.wait()
                return
            budget.close_stalled(current_time())
            return
        idle_timeout = self.idle_timeout
        timeout = math.inf if idle_timeout is None else idle_timeout
        in_message = not receiver.at_message_boundary
        if in_message and self.message_timeout is not None:
            timeout = min(timeout, self._allowance(conn))
        started = current_time()
        with move_on_after(timeout) as scope:
            await receiver.wait()
        if in_message:
            self.message_waited += current_time() - started
        if scope.cancelled_caught and timeout == idle_timeout:
            if not in_message and await self._wait_out_work(receiver, idle_timeout):
                return  # (something arrived while the owner's work kept it open)
            # Between messages the peer loses nothing: close gracefully (it sees
            # the end of the stream); inside a message, break the connection.
            text = f"nothing received for {idle_timeout:g} s"
            boundary = receiver.at_message_boundary
            code = CloseCode.IDLE_TIMEOUT if boundary else CloseCode.MESSAGE_TIMEOUT
            raise Expired(
                IdleTimeoutError(text), graceful=boundary, reason=CloseReason(code, "", text)
            )

    async def _wait_out_work(self, receiver: Receiver, idle_timeout: float) -> bool:
        """Nothing arrived for ``idle_timeout``: wait on while the owner's work
        keeps the connection in use (:attr:`working_until`), and then until
        ``idle_timeout`` after that work ended. Return True if the receiver
        was woken meanwhile, False if the connection is idle.

        Raises:
            Exception: what ``receiver.wait()`` raises.
        """
        working_until = self.working_until
        if working_until is None:
            return False
        while True:
            until = working_until()  # (math.inf: at work now)
            remaining = idle_timeout
            if until != math.inf:
                remaining += until - current_time()
            if remaining <= 0:
                return False
            with move_on_after(remaining) as scope:
                await receiver.wait()
            if not scope.cancelled_caught:
                return True

    def _allowance(self, conn: Connection) -> float:
        """Seconds the message being received may still wait for the peer.

        Raises:
            Expired: none are left.
        """
        message_timeout = self.message_timeout
        assert message_timeout is not None
        received = conn.received_in_message
        allowance = message_timeout - self.message_waited
        if self.min_receive_rate:
            allowance += received / self.min_receive_rate
        if allowance > 0:
            return allowance
        error = MessageTimeoutError(
            f"a message did not complete in time: {received} bytes of it arrived "
            f"in {self.message_waited:.3g} s of waiting (message_timeout "
            f"{message_timeout:g} s, min_receive_rate {self.min_receive_rate} bytes/s)"
        )
        raise Expired(
            error, reason=CloseReason.shortened(CloseCode.MESSAGE_TIMEOUT, "", str(error))
        )

    async def _wait_for_preamble(self, receiver: Receiver, conn: Connection) -> None:
        """Early data: wait for the peer's preamble until the handshake deadline.

        Raises:
            Expired: the deadline passed.
        """
        remaining = self.handshake_deadline - current_time()
        if remaining > 0:
            with move_on_after(remaining):
                await receiver.wait()
                return
        if conn.peer is not None:
            # It came meanwhile (the event loop's reader parsed it without waking
            # the task: no message yet): the caller waits on, with the timers that
            # apply from now on.
            return
        raise Expired(
            TimeoutError(
                f"the preamble of {self.peer_address} did not arrive within handshake_timeout"
            )
        )
