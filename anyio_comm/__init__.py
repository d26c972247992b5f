"""anyio-comm: fast, structured-concurrency message transport on asyncio, uvloop and trio.

The public names are imported on first use (PEP 562), so that importing the
sans-IO core (``anyio_comm._sansio``) loads no event loop, socket or ssl module.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from ._comm import Comm as Comm
    from ._comm import CommAttribute as CommAttribute
    from ._comm import current_buffer_pool as current_buffer_pool
    from ._connect import connect as connect
    from ._connect import from_stream as from_stream
    from ._exceptions import CommError as CommError
    from ._exceptions import IdleTimeoutError as IdleTimeoutError
    from ._exceptions import LocalProtocolError as LocalProtocolError
    from ._exceptions import MessageTimeoutError as MessageTimeoutError
    from ._exceptions import PeerClosed as PeerClosed
    from ._exceptions import PeerClosedError as PeerClosedError
    from ._exceptions import PeerClosedOK as PeerClosedOK
    from ._exceptions import ProtocolError as ProtocolError
    from ._exceptions import ReceiveBudgetError as ReceiveBudgetError
    from ._exceptions import RemoteProtocolError as RemoteProtocolError
    from ._exceptions import SerializationError as SerializationError
    from ._listener import Handler as Handler
    from ._listener import Listener as Listener
    from ._listener import listen as listen
    from ._listener import serve as serve
    from ._options import Options as Options
    from ._sansio.budget import BudgetStatistics as BudgetStatistics
    from ._sansio.budget import ReceiveBudget as ReceiveBudget
    from ._sansio.buffers import Allocator as Allocator
    from ._sansio.close import CloseCode as CloseCode
    from ._sansio.close import CloseReason as CloseReason
    from ._sansio.frames import PackedFrames as PackedFrames
    from ._sansio.handshake import Capability as Capability
    from ._sansio.handshake import Handshake as Handshake
    from ._sansio.handshake import Limits as Limits
    from ._sansio.pool import BufferPool as BufferPool
    from ._sansio.pool import PoolStatistics as PoolStatistics
    from ._statistics import CommStatistics as CommStatistics
    from ._statistics import ListenerStatistics as ListenerStatistics

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "Allocator": "._sansio.buffers",
    "BudgetStatistics": "._sansio.budget",
    "BufferPool": "._sansio.pool",
    "Capability": "._sansio.handshake",
    "CloseCode": "._sansio.close",
    "CloseReason": "._sansio.close",
    "Comm": "._comm",
    "CommAttribute": "._comm",
    "CommError": "._exceptions",
    "CommStatistics": "._statistics",
    "Handler": "._listener",
    "Handshake": "._sansio.handshake",
    "IdleTimeoutError": "._exceptions",
    "Limits": "._sansio.handshake",
    "Listener": "._listener",
    "ListenerStatistics": "._statistics",
    "LocalProtocolError": "._exceptions",
    "MessageTimeoutError": "._exceptions",
    "Options": "._options",
    "PackedFrames": "._sansio.frames",
    "PeerClosed": "._exceptions",
    "PeerClosedError": "._exceptions",
    "PeerClosedOK": "._exceptions",
    "PoolStatistics": "._sansio.pool",
    "ProtocolError": "._exceptions",
    "ReceiveBudget": "._sansio.budget",
    "ReceiveBudgetError": "._exceptions",
    "RemoteProtocolError": "._exceptions",
    "SerializationError": "._exceptions",
    "connect": "._connect",
    "current_buffer_pool": "._comm",
    "from_stream": "._connect",
    "listen": "._listener",
    "serve": "._listener",
}

__all__ = [
    "Allocator",
    "BudgetStatistics",
    "BufferPool",
    "Capability",
    "CloseCode",
    "CloseReason",
    "Comm",
    "CommAttribute",
    "CommError",
    "CommStatistics",
    "Handler",
    "Handshake",
    "IdleTimeoutError",
    "Limits",
    "Listener",
    "ListenerStatistics",
    "LocalProtocolError",
    "MessageTimeoutError",
    "Options",
    "PackedFrames",
    "PeerClosed",
    "PeerClosedError",
    "PeerClosedOK",
    "PoolStatistics",
    "ProtocolError",
    "ReceiveBudget",
    "ReceiveBudgetError",
    "RemoteProtocolError",
    "SerializationError",
    "__version__",
    "connect",
    "current_buffer_pool",
    "from_stream",
    "listen",
    "serve",
]


def __getattr__(name: str) -> _typing.Any:
    """Import a public name from its module on first use.

    Raises:
        AttributeError: ``name`` is not a public name of the package.
    """
    if name == "rpc":  # the subpackage, imported on first use
        value = _importlib.import_module(".rpc", __name__)
        globals()[name] = value
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
