"""anyio-comm: fast, structured-concurrency message transport on asyncio, uvloop and trio."""

from __future__ import annotations

from ._comm import Comm as Comm
from ._connect import connect as connect
from ._connect import from_stream as from_stream
from ._exceptions import CommError as CommError
from ._exceptions import IdleTimeoutError as IdleTimeoutError
from ._exceptions import LocalProtocolError as LocalProtocolError
from ._exceptions import ProtocolError as ProtocolError
from ._exceptions import RemoteProtocolError as RemoteProtocolError
from ._exceptions import SerializationError as SerializationError
from ._listener import Handler as Handler
from ._listener import Listener as Listener
from ._listener import listen as listen
from ._listener import serve as serve
from ._sansio.buffers import Allocator as Allocator
from ._sansio.wire import Handshake as Handshake
from ._sansio.wire import Limits as Limits

__version__ = "0.1.0"

__all__ = [
    "Allocator",
    "Comm",
    "CommError",
    "Handler",
    "Handshake",
    "IdleTimeoutError",
    "Limits",
    "Listener",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "SerializationError",
    "__version__",
    "connect",
    "from_stream",
    "listen",
    "serve",
]
