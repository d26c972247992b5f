"""What a comm and a listener have done, as plain objects
(:meth:`anyio_comm.Comm.statistics`, :meth:`anyio_comm.Listener.statistics`).

The counters behind it are kept by the sans-IO core as the bytes go by (a few
integer updates per message: see docs/guides/observability.md for their cost);
a snapshot is assembled only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, final

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ._sansio.budget import BudgetStatistics
    from ._sansio.close import CloseReason


@final
@dataclass(frozen=True, slots=True)
class CommStatistics:
    """What a :class:`~anyio_comm.Comm` has sent and received
    (:meth:`~anyio_comm.Comm.statistics`).

    Bytes are those of the connection's byte stream: every message's header
    and frames, the preamble and a close record included; over ``tls://``,
    before encryption. A message counts as sent once it was handed to the
    transport (written, or queued to be written behind), and as received once
    it was decoded whole (taken by a receive, or waiting in :attr:`queued_messages`).

    Attributes:
        messages_sent: messages sent.
        frames_sent: their frames.
        bytes_sent: bytes sent.
        largest_message_sent: the payload bytes (sum of the frames) of the
            largest message sent.
        messages_received: messages received.
        frames_received: their frames.
        bytes_received: bytes received.
        largest_message_received: the payload bytes of the largest message
            received.
        compressed_bytes_sent: the bytes of the frames sent compressed (see
            ``compression`` in :class:`~anyio_comm.Options`), before compression.
        compressed_wire_bytes_sent: what those frames took on the wire.
        compressed_bytes_received: the bytes of the frames received
            compressed, decompressed.
        compressed_wire_bytes_received: what those frames took on the wire.
        queued_messages: messages received that no receive has taken yet (the
            event loop's reader queues them over sockets on asyncio and
            uvloop; those left when the comm closed stay counted).
        queued_bytes: what they hold, as the receive budget counts it (their
            frames' bytes and a small overhead per frame).
        send_waits: sends that waited for the peer to take what was sent
            before (its backpressure: the socket's send buffer was full).
            Counted over sockets (``tcp://``, ``unix://``, ``tls://``); 0 over
            ``inproc://`` and :func:`~anyio_comm.from_stream` streams.
        send_wait_seconds: how long they waited, in all.
        budget_waits: messages that waited for the receive budget before
            they could be received (a listener's comms: see ``receive_budget``
            in :func:`~anyio_comm.listen`; 0 for others, which have none).
        budget_wait_seconds: how long they waited, in all, the current wait
            included.
        connect_seconds: how long opening the connection took, name
            resolution and every address tried included: for a comm from
            :func:`~anyio_comm.connect` over a socket, else ``None``.
        handshake_seconds: how long the handshakes took (TLS's, then the
            exchange of preambles), until the comm was ready (with early
            data, until our preamble was written).
        close_reason: the reason this side closed the comm with
            (``aclose(reason)``, or a failure it closed for), whether or not the
            peer could be told, or ``None``.
        peer_close_reason: the reason the peer's close record gave, once a
            receive reached it, or ``None``.
    """

    messages_sent: int
    frames_sent: int
    bytes_sent: int
    largest_message_sent: int
    messages_received: int
    frames_received: int
    bytes_received: int
    largest_message_received: int
    compressed_bytes_sent: int
    compressed_wire_bytes_sent: int
    compressed_bytes_received: int
    compressed_wire_bytes_received: int
    queued_messages: int
    queued_bytes: int
    send_waits: int
    send_wait_seconds: float
    budget_waits: int
    budget_wait_seconds: float
    connect_seconds: float | None
    handshake_seconds: float
    close_reason: CloseReason | None
    peer_close_reason: CloseReason | None

    @property
    def compression_ratio_sent(self) -> float | None:
        """How many times smaller compression made the frames it compressed on
        their way out (``compressed_bytes_sent / compressed_wire_bytes_sent``),
        or ``None`` when none was compressed."""
        if not self.compressed_wire_bytes_sent:
            return None
        return self.compressed_bytes_sent / self.compressed_wire_bytes_sent

    @property
    def compression_ratio_received(self) -> float | None:
        """The same for the frames received compressed, or ``None``."""
        if not self.compressed_wire_bytes_received:
            return None
        return self.compressed_bytes_received / self.compressed_wire_bytes_received


@final
@dataclass(frozen=True, slots=True)
class ListenerStatistics:
    """What a :class:`~anyio_comm.Listener` has done
    (:meth:`~anyio_comm.Listener.statistics`).

    Attributes:
        accepted: connections accepted.
        handshaking: connections in their handshake now (TLS's, then the
            preambles').
        active: connections whose handler runs now
            (:attr:`~anyio_comm.Listener.active_connections`).
        refused: connections and accepts that never reached a handler, by
            why: ``"reset"`` (closed by the peer before it was taken),
            ``"aborted"`` (an accept the system aborted), ``"out-of-resources"``
            (an accept that failed for lack of file descriptors or memory:
            the listener retries after 0.1 s), ``"shutdown"`` (the listener
            stopped before or during the handshake: its :meth:`shutdown
            <anyio_comm.Listener.shutdown>`, or the end of its block).
        handshake_failures: handshakes that failed, by why: ``"timeout"``
            (``handshake_timeout``), ``"tls"`` (TLS refused: a certificate, a
            client that does not speak TLS), ``"protocol"`` (the peer does not
            speak this protocol), ``"closed"`` (the peer closed or reset the
            connection).
        handlers: handlers that ended, by how: ``"returned"``,
            ``"connection-ended"`` (the peer closed the connection, or it
            broke, and the handler let that through), ``"raised"`` (another
            exception: the peer was told ``HANDLER_ERROR``), ``"cancelled"``
            (a shutdown, or the listener's scope).
        budget: the receive budget's figures, ``None`` without one.
    """

    accepted: int
    handshaking: int
    active: int
    refused: Mapping[str, int]
    handshake_failures: Mapping[str, int]
    handlers: Mapping[str, int]
    budget: BudgetStatistics | None
