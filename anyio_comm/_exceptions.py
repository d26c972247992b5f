"""Exceptions raised by anyio-comm.

Lifecycle errors reuse AnyIO's exceptions, so code written against any AnyIO
``ObjectStream`` handles a :class:`~anyio_comm.Comm` unchanged:

* :exc:`anyio.EndOfStream`: the peer closed (or sent EOF) cleanly at a message
  boundary;
* :exc:`anyio.ClosedResourceError`: this side already closed the comm;
* :exc:`anyio.BrokenResourceError`: the connection died (reset, EOF in the
  middle of a message, a send cancelled half-way, a protocol error earlier);
* :exc:`anyio.BusyResourceError`: two tasks tried to receive (or send) at once.

The package's own errors form this tree::

    CommError
     ├── ProtocolError                (abstract: never raised itself)
     │    ├── LocalProtocolError      we were asked to send something the peer
     │    │                           would reject (e.g. over its limits);
     │    │                           nothing was sent, the comm stays usable
     │    └── RemoteProtocolError     the peer sent bytes that break the wire
     │                                format or the message encoding; the
     │                                connection has been closed
     ├── PeerClosed                   the peer closed the connection and said why
     │    │                           in a close record (its ``reason``)
     │    ├── PeerClosedOK            (also an anyio.EndOfStream) ... cleanly:
     │    │                           NORMAL, GOING_AWAY, IDLE_TIMEOUT or an
     │    │                           application's clean code
     │    └── PeerClosedError         (also an anyio.BrokenResourceError) ...
     │                                because of an error: a message may
     │                                have been lost
     ├── SerializationError           (also a TypeError) a message cannot be
     │                                encoded; nothing was sent
     ├── IdleTimeoutError             (also an anyio.BrokenResourceError and a
     │                                TimeoutError) nothing arrived for the
     │                                comm's idle_timeout; the connection has
     │                                been closed
     ├── MessageTimeoutError          (also an anyio.BrokenResourceError and a
     │                                TimeoutError) a message that had begun to
     │                                arrive did not complete in time (the
     │                                message_timeout and min_receive_rate
     │                                options); the connection has been closed
     └── ReceiveBudgetError           (also an anyio.BrokenResourceError) the
                                      connection held receive budget without
                                      progress while other connections waited
                                      for it; the connection has been closed
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from anyio import BrokenResourceError, EndOfStream

from ._sansio.errors import (
    CommError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    SerializationError,
    set_public_module,
)

if TYPE_CHECKING:
    from ._sansio.close import CloseReason

__all__ = [
    "CommError",
    "IdleTimeoutError",
    "LocalProtocolError",
    "MessageTimeoutError",
    "PeerClosed",
    "PeerClosedError",
    "PeerClosedOK",
    "ProtocolError",
    "ReceiveBudgetError",
    "RemoteProtocolError",
    "SerializationError",
]


class IdleTimeoutError(CommError, BrokenResourceError, TimeoutError):
    """No byte arrived for the comm's ``idle_timeout`` while it waited in ``receive()``.

    The connection has been closed when this is raised: the comm is broken, so
    code that treats :exc:`anyio.BrokenResourceError` as "the connection ended"
    handles it unchanged, and ``except TimeoutError`` catches it too.
    """


class MessageTimeoutError(CommError, BrokenResourceError, TimeoutError):
    """A message that had begun to arrive did not complete in time.

    Once part of a message arrived, ``receive()`` gives the rest
    ``message_timeout`` seconds of waiting, plus one second for every
    ``min_receive_rate`` bytes of it that arrived (see
    :class:`~anyio_comm.Options`): a peer that trickles a message, or stops in
    the middle of one, cannot hold the connection and the memory reserved for
    the message for ever. The connection has been closed when this is raised.
    """


class ReceiveBudgetError(CommError, BrokenResourceError):
    """The connection was closed to free the receive budget it held.

    A listener's :class:`~anyio_comm.ReceiveBudget` closes a connection that
    holds budget (a message that is being received, or received messages the
    application has not taken) without any progress for the budget's
    ``stall_timeout`` while other connections wait for budget. The message says
    how much it held and for how long.
    """


class PeerClosed(CommError):
    """The peer closed the connection and said why, in a close record.

    Raised by :meth:`Comm.receive <anyio_comm.Comm.receive>` once every message
    the peer sent before the record was received (as :exc:`PeerClosedOK` or
    :exc:`PeerClosedError`, never as this class itself), and by later sends.
    Peers that do not announce the ``CLOSE_REASONS`` capability (every
    version-1 peer) send no close records: their close is an end of stream.

    The message shows the reason with the peer's control characters escaped;
    :attr:`reason` keeps its exact text.

    Attributes:
        reason: what the record said (:class:`~anyio_comm.CloseReason`).
    """

    def __init__(self, reason: CloseReason) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return f"the peer closed the connection: {self.reason}"

    @staticmethod
    def of(reason: CloseReason) -> PeerClosedOK | PeerClosedError:
        """The exception a receive raises for ``reason``."""
        return PeerClosedOK(reason) if reason.clean else PeerClosedError(reason)


class PeerClosedOK(PeerClosed, EndOfStream):
    """The peer closed the connection cleanly and said why (``reason.clean``):
    every message it sent was received, and it dropped nothing we sent that it
    had received. An :exc:`anyio.EndOfStream`, so ``async for`` over the comm
    ends quietly (:attr:`Comm.peer_close_reason <anyio_comm.Comm.peer_close_reason>`
    keeps the reason).
    """


class PeerClosedError(PeerClosed, BrokenResourceError):
    """The peer closed the connection because of an error, and said which
    (a protocol error on our side, a limit, a timeout, its handler's failure):
    a message may have been lost. Also raised by a send after the peer closed
    (whatever its reason: nothing more can be delivered).
    """


set_public_module(
    "anyio_comm",
    IdleTimeoutError,
    MessageTimeoutError,
    ReceiveBudgetError,
    PeerClosed,
    PeerClosedOK,
    PeerClosedError,
)
