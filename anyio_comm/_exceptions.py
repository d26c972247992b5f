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

from typing import Any

from anyio import BrokenResourceError

__all__ = [
    "CommError",
    "IdleTimeoutError",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "SerializationError",
]


class CommError(Exception):
    """Base class of every exception defined by anyio-comm."""


class ProtocolError(CommError):
    """A violation of the anyio-comm wire protocol.

    Abstract: only :exc:`LocalProtocolError` and :exc:`RemoteProtocolError` are
    ever raised, and instantiating this class directly raises :exc:`TypeError`.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> ProtocolError:  # noqa: ARG004
        if cls is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise a subclass")
        return super().__new__(cls)


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol (or the peer's limits) forbids.

    Raised before any byte of the offending message is written, so the comm is
    still usable.
    """


class RemoteProtocolError(ProtocolError):
    """The peer sent data that violates the wire format or message encoding.

    The connection is closed when this is raised; further operations on the
    comm raise :exc:`anyio.BrokenResourceError`.
    """


class SerializationError(CommError, TypeError):
    """A message could not be serialized (unsupported type, too deep, ...).

    Raised before anything is sent; the comm stays usable.
    """


class IdleTimeoutError(CommError, BrokenResourceError, TimeoutError):
    """No byte arrived for the comm's ``idle_timeout`` while it waited in ``receive()``.

    The connection has been closed when this is raised: the comm is broken, so
    code that treats :exc:`anyio.BrokenResourceError` as "the connection ended"
    handles it unchanged, and ``except TimeoutError`` catches it too.
    """
