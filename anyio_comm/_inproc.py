"""``inproc://`` addresses: connections inside one process and event loop.

They run the full codec (preamble, framing, serialization) over a bounded
in-memory byte stream; no object is ever passed by reference.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Final

from ._comm import Comm, establish
from ._transports.memory import MemoryByteStream, memory_byte_stream_pair
from ._transports.stream import StreamTransport

if TYPE_CHECKING:
    from collections.abc import Callable

    from ._options import Options

__all__ = ["connect_inproc", "register", "unregister"]

#: name -> callable starting the server side of a new connection
_listeners: Final[dict[str, Callable[[MemoryByteStream, str], None]]] = {}
_ids = itertools.count(1)


def register(name: str, spawn: Callable[[MemoryByteStream, str], None]) -> str:
    """Register a listener under ``name`` (a fresh name if empty); return the name.

    Raises:
        OSError: the name is already in use.
    """
    if not name:
        name = f"listener-{next(_ids)}"
        while name in _listeners:  # pragma: no cover
            name = f"listener-{next(_ids)}"
    if name in _listeners:
        raise OSError(f"inproc address 'inproc://{name}' is already in use")
    _listeners[name] = spawn
    return name


def unregister(name: str, spawn: Callable[[MemoryByteStream, str], None]) -> None:
    """Forget the listener name ``name`` if ``spawn`` still owns it (after a listener
    stopped accepting, another one may have taken the name)."""
    if _listeners.get(name) == spawn:
        del _listeners[name]


async def connect_inproc(name: str, options: Options, *, early_data: bool = False) -> Comm:
    """Connect to the in-process listener ``name``.

    Raises:
        ConnectionRefusedError: no listener is registered under ``name``, or
            it is shutting down.
    """
    spawn = _listeners.get(name)
    if spawn is None:
        raise ConnectionRefusedError(f"no listener at 'inproc://{name}'")
    client_stream, server_stream = memory_byte_stream_pair()
    client_address = f"inproc://{name}/client-{next(_ids)}"
    try:
        spawn(server_stream, client_address)
    except RuntimeError:  # the listener's task group is no longer active
        raise ConnectionRefusedError(f"listener at 'inproc://{name}' is closing") from None
    transport = StreamTransport(client_stream)
    try:
        return await establish(
            transport,
            options,
            local_address=client_address,
            peer_address=f"inproc://{name}",
            early_data=early_data,
        )
    except BaseException:
        transport.abort()
        raise
