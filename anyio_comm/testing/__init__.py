"""Helpers for testing code that uses anyio-comm.

* :func:`memory_byte_stream_pair`: two connected in-memory
  :class:`anyio.abc.ByteStream` objects with bounded buffering.
* :func:`comm_pair`: two connected :class:`~anyio_comm.Comm` objects over such
  a pair, running the full codec (no network, no pass-by-reference).
"""

from __future__ import annotations

from .._transports.memory import MemoryByteStream as MemoryByteStream
from .._transports.memory import memory_byte_stream_pair as memory_byte_stream_pair
from ._pair import comm_pair as comm_pair

__all__ = ["MemoryByteStream", "comm_pair", "memory_byte_stream_pair"]
