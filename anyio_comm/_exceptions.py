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

from anyio import BrokenResourceError

from ._sansio.errors import (
    CommError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    SerializationError,
)

__all__ = [
    "CommError",
    "IdleTimeoutError",
    "LocalProtocolError",
    "MessageTimeoutError",
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
