"""Helpers for tests that run the sans-IO decoder on bytes they made or received."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from anyio_comm._sansio.connection import Connection
    from anyio_comm._sansio.decoder import FrameDecoder


def receive_into(decoder: FrameDecoder | Connection, data: memoryview) -> memoryview:
    """Copy the start of ``data`` into the buffer the decoder offers, as one ``recv_into``
    would, and report it; return the rest of ``data``."""
    buffer = decoder.get_buffer()
    n = min(buffer.nbytes, data.nbytes)
    buffer[:n] = data[:n]
    decoder.buffer_updated(n)
    return data[n:]


def normalize(value: Any) -> Any:
    """``value`` with memoryviews turned into bytes and tuples into lists, at any depth."""
    if isinstance(value, memoryview):
        return bytes(value)
    if isinstance(value, (list, tuple)):
        return [normalize(v) for v in value]
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items()}
    return value
