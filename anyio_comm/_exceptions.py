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
     └── IdleTimeoutError             (also an anyio.BrokenResourceError and a
                                      TimeoutError) nothing arrived for the
                                      comm's idle_timeout; the connection has
                                      been closed
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
    "ProtocolError",
    "RemoteProtocolError",
    "SerializationError",
]


class IdleTimeoutError(CommError, BrokenResourceError, TimeoutError):
    """No byte arrived for the comm's ``idle_timeout`` while it waited in ``receive()``.

    The connection has been closed when this is raised: the comm is broken, so
    code that treats :exc:`anyio.BrokenResourceError` as "the connection ended"
    handles it unchanged, and ``except TimeoutError`` catches it too.
    """
