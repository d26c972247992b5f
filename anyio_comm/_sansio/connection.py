"""The sans-IO state of one anyio-comm connection, both directions.

Theory of operation
-------------------
:class:`Connection` is the protocol without I/O, in the shape of h11's
``Connection`` and websockets' ``Protocol``: the I/O layer moves bytes, the
connection says what they mean and what may be sent.

* **Starting.** Send :meth:`Connection.preamble` first. Feed the peer's bytes
  in; :meth:`Connection.next_handshake` returns the peer's
  :class:`~anyio_comm.Handshake` once its preamble is complete. From then on
  :attr:`Connection.peer` holds it and messages may be sent and received.
* **Receiving** follows ``asyncio.BufferedProtocol``: :meth:`get_buffer` says
  where the next bytes go (the read-ahead buffer, or a large frame's own
  buffer), the I/O layer writes there and reports :meth:`buffer_updated`; or it
  hands over bytes it already has with :meth:`receive_data` (one copy). Then
  :meth:`next_message` returns each complete message, ``None`` when more bytes
  are needed. :meth:`receive_eof` records the end of the peer's stream.
* **Sending**: :meth:`send_message` checks a message against the peer's limits
  and returns the buffers of one gather write, header first. It writes
  nothing and keeps no reference: if the I/O layer could not write all of
  them, it calls :meth:`send_failed`, since the byte stream is then unusable
  for framing. :meth:`send_eof` records that we send nothing more.
* **Closing with a reason**: when the peer announced ``CLOSE_REASONS``,
  :meth:`close_record` returns the bytes telling it why we close (our side
  becomes CLOSED); the peer's record ends its direction like an EOF whose
  :exc:`EndOfData` carries the reason.
* **Capabilities**: our preamble announces ``capabilities``; on a version-2
  connection, :attr:`peer` says what the peer announced, and
  :attr:`peer_accepts` tells whether it accepts one.
* **Compression**: with ``compression`` (codec names), our preamble announces
  that we decompress them; towards a peer that announced one of ours,
  :meth:`send_message` compresses the frames worth it with the first of ours
  it accepts (see :mod:`anyio_comm._sansio.compression`).
* **Early data**: after :meth:`send_early`, messages may be sent before the
  peer's preamble has arrived (unchecked: the peer's limits are not known
  yet), and :meth:`next_message` reads the peer's preamble itself, then calls
  :attr:`on_peer` with it.

States (:class:`ConnectionState`), one per direction, as in h11::

    their_state:  HANDSHAKE --preamble--> OPEN --EOF at a message boundary,--> CLOSED
                      |                    |      or a close record
                      +--------------------+--bad bytes, or EOF inside a message--> ERROR
    our_state:    OPEN --send_eof(), close_record()--> CLOSED
                    +---send_failed()--> ERROR

Errors are sticky: once :meth:`next_message` raised
:exc:`~anyio_comm.RemoteProtocolError` (or the end of the stream), every later
call raises it again; once our side is CLOSED or ERROR, :meth:`send_message`
raises :exc:`~anyio_comm.LocalProtocolError`.

The receive side, as the I/O layer's engines see it (the frame decoder behind
it is this module's alone): :meth:`start_receiving` says who reads
(:class:`ReceiveMode`: a task that takes each message as it completes, PULL;
an event-loop callback that queues them, CALLBACK; the task of such a reader
reading a message the callback left to it, TASK). When :attr:`next_message`
returns ``None``, ``receiving.status`` says what it waits for (``receiving``
is a plain object the engine reads on the per-message path)::

    NEED_DATA --a message over the budget's free bytes--> WAIT_BUDGET
    NEED_DATA --a frame read directly into its buffer---> TASK_READS_FRAME
    NEED_DATA --many-frame message, in mode CALLBACK----> TASK_READS_MANY
    NEED_DATA --a compressed frame left to the I/O layer> DECOMPRESS
    any       --the stream's end, a protocol error------> ENDED (for good)

    WAIT_BUDGET      --the budget grants it (on_budget_grant)--> NEED_DATA
    TASK_READS_FRAME --get_buffer() hands out its buffer-------> NEED_DATA
    TASK_READS_MANY  --next_message() in mode TASK-------------> NEED_DATA
    DECOMPRESS       --decompress()----------------------------> NEED_DATA

A message costing at least :attr:`budget_min` holds a reservation of the
receive budget from its header on: in mode PULL until it completes, else until
the I/O layer reports it taken (:attr:`message_taken`); :meth:`keep_taken`
hands those reservations to another account instead, and
:meth:`stop_receiving` leaves the budget.

The per-message methods (:attr:`get_buffer`, :attr:`buffer_updated`,
:attr:`next_message`; :attr:`message_taken`, the budget account's) are bound
methods of the objects that do the work: the connection adds no call on the
per-message path.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

from .close import CLOSE_MARKER, CloseReason, encode_close_record
from .compression import CODEC_SHIFT, LENGTH_MASK, Compressor, check_codecs
from .decoder import (
    CALLBACK,
    DECOMPRESS,
    DEFAULT_READ_BUFFER_SIZE,
    NEED_DATA,
    PULL,
    TASK,
    TASK_READS_FRAME,
    TASK_READS_MANY,
    WAIT_BUDGET,
    FrameDecoder,
    ReceiveMode,
    ReceiveState,
    ReceiveStatus,
    check_read_buffer_size,
)
from .errors import EndOfData, LocalProtocolError
from .wire import (
    PROTOCOL_VERSION,
    Capability,
    Handshake,
    Limits,
    encode_frames,
    encode_header,
    encode_message,
    encode_preamble,
    frames_to_iov,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from ._buffer import Buffer
    from .budget import BudgetAccount
    from .buffers import Allocator
    from .errors import RemoteProtocolError
    from .frames import Frames

__all__ = [
    "CALLBACK",
    "DECOMPRESS",
    "DEFAULT_READ_BUFFER_SIZE",
    "NEED_DATA",
    "PULL",
    "TASK",
    "TASK_READS_FRAME",
    "TASK_READS_MANY",
    "WAIT_BUDGET",
    "Connection",
    "ConnectionState",
    "EndOfData",
    "ReceiveMode",
    "ReceiveState",
    "ReceiveStatus",
    "check_read_buffer_size",
]


class ConnectionState(enum.Enum):
    """The state of one direction of a :class:`Connection`."""

    #: (their side only) the peer's preamble has not arrived yet
    HANDSHAKE = "handshake"
    #: messages flow
    OPEN = "open"
    #: the stream ended cleanly: the peer's EOF at a message boundary, or our send_eof()
    CLOSED = "closed"
    #: a protocol error, an EOF inside a message, or a failed send
    ERROR = "error"


_OPEN = ConnectionState.OPEN


def _nothing_reserved(_cost: int) -> None:
    raise RuntimeError("no message holds a reservation: the connection has no budget")


class Connection:
    """The protocol state of one connection, without I/O.

    Args:
        limits: our receive limits, announced in our preamble and enforced on
            every header the peer sends.
        read_buffer_size: size of the read-ahead buffer (at least 4096).
        allocator: allocates each received frame's buffer.
        account: the receive budget's account that large messages are reserved
            from (see :mod:`anyio_comm._sansio.budget`); ``None``: no budget.
        capabilities: what we announce that we accept (version 2 and later).
            ``None``: ``CLOSE_REASONS`` only.
        version: the highest protocol version we speak and announce (1 makes
            this connection a version-1 side: no capabilities, no close records).
        compression: the codecs we decompress and compress with (``"lz4"``,
            ``"zstd"``), in our order of preference; empty: no compression.

    Raises:
        ValueError: ``read_buffer_size`` is below 4096, ``version`` is not
            1 or 2, or an unknown codec.
        ImportError: a codec's package is not installed.
    """

    __slots__ = (
        "_capabilities",
        "_compressed_bytes",
        "_compressed_wire_bytes",
        "_compression",
        "_compressor",
        "_decoder",
        "_early",
        "_largest_before",
        "_largest_raised_by",
        "_last_counted",
        "_our_state",
        "_peer",
        "_send_limits",
        "_send_max",
        "_version",
        "buffer_updated",
        "get_buffer",
        "largest_sent",
        "message_taken",
        "next_message",
        "on_peer",
        "receiving",
        "sent_control_bytes",
        "sent_extra_frames",
        "sent_frame_bytes",
        "sent_messages",
    )

    #: ``get_buffer() -> memoryview``: the buffer the next received bytes must
    #: go into (see :meth:`FrameDecoder.get_buffer`)
    get_buffer: Callable[[], memoryview]
    #: ``buffer_updated(nbytes)``: that many bytes were written into the last
    #: buffer from :attr:`get_buffer`
    buffer_updated: Callable[[int], None]
    #: ``next_message() -> Frames | None``: the next complete message's frames
    #: (a list, or a many-frame message's PackedFrames), ``None`` if more bytes
    #: are needed. Raises
    #: RemoteProtocolError (a header over our limits) or EndOfData (the stream
    #: ended), again on every later call; RuntimeError before the handshake.
    next_message: Callable[[], Frames | None]
    #: ``message_taken(cost)``: a message holding ``cost`` bytes of the receive
    #: budget (at least :attr:`budget_min`) was taken from a queue (modes CALLBACK
    #: and TASK; in PULL the reservation ends as the message completes)
    message_taken: Callable[[int], None]
    #: the receive side's status (read it when :attr:`next_message` returned
    #: ``None``) and mode (who reads: set it to switch), shared with the decoder
    receiving: ReceiveState

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        read_buffer_size: int = DEFAULT_READ_BUFFER_SIZE,
        allocator: Allocator | None = None,
        account: BudgetAccount | None = None,
        capabilities: Iterable[Capability] | None = None,
        version: int = PROTOCOL_VERSION,
        compression: Sequence[str] = (),
    ) -> None:
        if version not in (1, PROTOCOL_VERSION):
            raise ValueError(f"version must be 1 or {PROTOCOL_VERSION}, got {version}")
        self._compression = check_codecs(compression) if version >= 2 else ()
        self._compressor: Compressor | None = None
        wanted = (
            frozenset({Capability.CLOSE_REASONS})
            if capabilities is None
            else frozenset(capabilities)
        )
        self._capabilities = wanted if version >= 2 else frozenset()
        self._version = version
        self.receiving = ReceiveState()
        decoder = FrameDecoder(
            limits,
            read_buffer_size=read_buffer_size,
            allocator=allocator,
            account=account,
            version=version,
            capabilities=self._capabilities,
            compression=self._compression,
            state=self.receiving,
        )
        self._decoder = decoder
        self.get_buffer = decoder.get_buffer
        self.buffer_updated = decoder.buffer_updated
        self.next_message = decoder.next_message
        self.message_taken = account.taken if account is not None else _nothing_reserved
        self._our_state = _OPEN
        #: what was sent (see :meth:`sent_counters`): the preamble and a close
        #: record, messages returned by :meth:`send_message`, their frames
        #: beyond one each (so a message of none counts -1), the bytes their
        #: frames took on the wire (compressed or not), and the payload bytes
        #: of the largest; their headers' bytes follow from the counts
        self.sent_control_bytes = 0
        self.sent_frame_bytes = 0
        self.sent_messages = 0
        self.sent_extra_frames = 0
        self.largest_sent = 0
        # the frames sent compressed: their own bytes, and on the wire
        self._compressed_bytes = 0
        self._compressed_wire_bytes = 0
        # to take back the last message's counts (unsend_last): the counts off
        # the one-frame path (message number, frame bytes, compressed bytes and
        # their wire bytes), and the largest message before the last that raised it
        self._last_counted = (0, 0, 0, 0)
        self._largest_before = 0
        self._largest_raised_by = 0
        self._peer: Handshake | None = None
        # messages may be sent before the peer's preamble arrived
        self._early = False
        #: called with the peer's handshake when :meth:`next_message` parsed it
        #: (after :meth:`send_early`)
        self.on_peer: Callable[[Handshake], object] | None = None
        # The largest one-frame message the peer's limits accept (-1: none yet),
        # so that a one-frame send skips the general limit check.
        self._send_max = -1
        # the peer's limits as sends are checked against them (see _set_peer)
        self._send_limits = Limits()

    def __repr__(self) -> str:
        return f"<Connection our_state={self._our_state.name} their_state={self.their_state.name}>"

    # -- state -------------------------------------------------------------

    @property
    def limits(self) -> Limits:
        """Our receive limits."""
        return self._decoder.limits

    @property
    def peer(self) -> Handshake | None:
        """What the peer announced in its preamble, or ``None`` before it arrived."""
        return self._peer

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What our preamble announces that we accept."""
        return self._capabilities

    def peer_accepts(self, capability: Capability) -> bool:
        """True once the peer's preamble announced ``capability``."""
        peer = self._peer
        return peer is not None and capability in peer.capabilities

    @property
    def our_state(self) -> ConnectionState:
        """The state of our sending direction: OPEN, CLOSED (after
        :meth:`send_eof`) or ERROR (after :meth:`send_failed`)."""
        return self._our_state

    @property
    def their_state(self) -> ConnectionState:
        """The state of the peer's direction: HANDSHAKE until its preamble was
        parsed, then OPEN; CLOSED once the end of its stream was reported at a
        message boundary; ERROR after a protocol error or a truncated stream."""
        end = self._decoder.end_error
        if end is not None:
            if isinstance(end, EndOfData) and not end.truncated:
                return ConnectionState.CLOSED
            return ConnectionState.ERROR
        return ConnectionState.HANDSHAKE if self._peer is None else _OPEN

    @property
    def at_message_boundary(self) -> bool:
        """True when no part of a message from the peer is buffered."""
        return self._decoder.at_message_boundary

    # -- receiving -----------------------------------------------------------

    def start_receiving(self, mode: ReceiveMode, *, offload_min: int, check_every: int) -> None:
        """Set who reads (see :class:`ReceiveMode`; switch it later through
        :attr:`receiving`) and which compressed frames are left to the I/O
        layer to decompress (status DECOMPRESS): those of ``offload_min`` bytes
        and more (decompressed), and the next one after ``check_every`` bytes were
        decompressed by :meth:`next_message` itself."""
        self.receiving.mode = mode
        inflater = self._decoder.inflater
        inflater.offload_min = offload_min
        inflater.check_every = check_every

    @property
    def received_in_message(self) -> int:
        """Bytes of the message being received that arrived (0 between messages)."""
        return self._decoder.received_in_message

    @property
    def packing(self) -> bool:
        """True while a many-frame message is received (its short frames packed)."""
        return self._decoder.packing

    @property
    def end_error(self) -> RemoteProtocolError | EndOfData | None:
        """What ended the peer's stream (what :attr:`next_message` raised), or ``None``."""
        return self._decoder.end_error

    @property
    def decompression_size(self) -> int:
        """The length of the frame status DECOMPRESS waits for (0: none)."""
        return self._decoder.inflater.job_size

    def prepare_decompression(self) -> None:
        """Allocate the buffer of the frame status DECOMPRESS waits for (in the
        event loop's thread, when the frame is wanted), before :meth:`decompress`.

        Raises:
            RuntimeError: no decompression is due.
            MemoryError: as the allocator raises it.
        """
        self._decoder.inflater.prepare()

    def decompress(self) -> None:
        """Run the decompression status DECOMPRESS waits for (in another thread if
        need be: nothing else may call this connection meanwhile). It raises
        nothing: bytes that do not decompress make the next :attr:`next_message`
        raise :exc:`~anyio_comm.RemoteProtocolError`.

        Raises:
            RuntimeError: no decompression is due.
        """
        self._decoder.decompress()

    # -- the receive budget ----------------------------------------------------

    @property
    def account(self) -> BudgetAccount | None:
        """The receive budget's account that messages are reserved from (``None``:
        no budget)."""
        return self._decoder.account

    @property
    def budget_min(self) -> int:
        """Messages costing at least this (their bytes and
        :data:`~anyio_comm._sansio.budget.FRAME_COST` per frame) hold a
        reservation of the receive budget from their header until taken; with no
        budget, no message does."""
        return self._decoder.budget_min

    def on_budget_grant(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` when the budget grants the message that waits for
        it (status WAIT_BUDGET). Only with a budget."""
        account = self._decoder.account
        assert account is not None
        account.on_grant = callback

    def keep_taken(self, keeper: BudgetAccount) -> None:
        """From now on, hand the reservation of each message taken to ``keeper``
        (an account of the same budget, whose owner releases it) instead of
        giving it back. Only with a budget."""
        account = self._decoder.account
        assert account is not None
        account.keeper = keeper

    def stop_receiving(self) -> None:
        """Leave the receive budget (its account drops every callback into this
        connection and the I/O layer): the last call of a closing receiver."""
        account = self._decoder.account
        if account is not None:
            account.close()

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` in (for I/O that hands out ``bytes``); then drain with
        :meth:`next_message`. Feed at most one message's worth at a time.

        Raises:
            BufferError: the read-ahead buffer is full: drain first.
        """
        self._decoder.feed(data)

    def receive_eof(self) -> None:
        """Record that the peer sends nothing more; :meth:`next_message` then
        returns what is buffered and raises :exc:`EndOfData`."""
        self._decoder.receive_eof()

    def next_handshake(self) -> Handshake | None:
        """Parse the peer's preamble.

        Returns:
            The peer's :class:`Handshake` (also kept in :attr:`peer`), or
            ``None`` when more bytes are needed.

        Raises:
            RemoteProtocolError: the peer does not speak this protocol (every
                later call raises it again).
            EndOfData: the stream ended before the preamble was complete.
            RuntimeError: the preamble was already parsed.
        """
        peer = self._decoder.next_handshake()
        if peer is not None:
            self._set_peer(peer)
        return peer

    def _set_peer(self, peer: Handshake) -> None:
        self._peer = peer
        limits = peer.limits
        if limits.max_frames >= CLOSE_MARKER and Capability.CLOSE_REASONS in peer.capabilities:
            # To a peer that accepts close records, a frame count of CLOSE_MARKER
            # begins one: no message may have that many frames.
            limits = dataclasses.replace(limits, max_frames=CLOSE_MARKER - 1)
        if peer.version >= 2 and limits.max_frame_size > LENGTH_MASK:
            # A version-2 peer that accepts compression reads a length's top byte
            # as its codec (spec 6.1), one that lists only codecs we do not know
            # included: no frame of 2**56 bytes or more to any version-2 peer.
            limits = dataclasses.replace(limits, max_frame_size=LENGTH_MASK)
        self._send_limits = limits
        for name in self._compression:
            if name in peer.compression:
                self._compressor = Compressor(name)
                break
        self._send_max = (
            min(limits.max_frame_size, limits.max_message_size) if limits.max_frames >= 1 else -1
        )
        if self._early and self.on_peer is not None:
            self.on_peer(peer)

    def send_early(self) -> None:
        """Allow messages before the peer's preamble arrives (early data).

        Until it arrives, :meth:`send_message` checks nothing against the
        peer's limits (it does not know them; the peer rejects a message over
        them as a protocol error), and :meth:`next_message` parses the preamble
        before the first message, then calls :attr:`on_peer`.

        Raises:
            RuntimeError: the peer's preamble was parsed already.
        """
        if self._peer is not None:
            raise RuntimeError("the peer's preamble has arrived already")
        self._early = True
        self._decoder.on_handshake = self._set_peer

    @property
    def early(self) -> bool:
        """True after :meth:`send_early`."""
        return self._early

    # -- sending -------------------------------------------------------------

    def preamble(self) -> bytes:
        """The bytes to send before anything else: our preamble, announcing our
        limits and capabilities."""
        preamble = encode_preamble(
            self._decoder.limits, self._capabilities, self._version, self._compression
        )
        self.sent_control_bytes += len(preamble)
        return preamble

    def check_send(self, frames: Sequence[memoryview]) -> None:
        """Check a message against the peer's limits, as :meth:`send_message`
        will (nothing is checked before the peer's preamble arrived).

        Raises:
            LocalProtocolError: the message is over the peer's limits.
        """
        if self._peer is None:
            return
        if len(frames) == 1:
            if frames[0].nbytes > self._send_max:
                self._send_limits.check_send([frames[0].nbytes])
            return
        self._send_limits.check_send(list(map(len, frames)))

    def send_message(self, frames: Sequence[memoryview]) -> list[Buffer]:
        """Return the buffers of one gather write sending the message ``frames``
        (flat byte views: one-dimensional, format ``"B"``).

        Small neighbouring buffers are joined, large frames are passed through
        as the caller's views (do not modify them until they are written).

        Raises:
            LocalProtocolError: the message is over the peer's limits (to a
                version-2 peer, or as early data on a connection that may be
                version 2, a frame of 2**56 bytes or more is over them), the
                peer's preamble has not arrived yet, or our side is CLOSED or
                ERROR. Nothing changes: the connection stays as it was.
        """
        if self._our_state is not _OPEN or self._peer is None:
            if self._our_state is _OPEN and self._early:
                # the peer's limits are not known yet; whether it reads a codec in
                # each length (spec 4.8) neither, if the connection may be version 2
                if self._version >= 2 and any(f.nbytes > LENGTH_MASK for f in frames):
                    raise LocalProtocolError(
                        f"early data carries frames of at most {LENGTH_MASK} bytes"
                    )
                self._count_sent(frames)
                return encode_message(frames)
            raise LocalProtocolError(self._why_not_sending())
        compressor = self._compressor
        if compressor is not None and any(f.nbytes >= compressor.min_size for f in frames):
            return self._send_compressed(frames, compressor)
        if len(frames) == 1:
            size = frames[0].nbytes
            if size > self._send_max:
                self._send_limits.check_send([size])
            self.sent_messages += 1
            self.sent_frame_bytes += size
            if size > self.largest_sent:
                self._raise_largest(size)
            return encode_message(frames)
        lengths = list(map(len, frames))  # flat byte views: len() is the size
        self._send_limits.check_send(lengths)
        self._count_sent(frames)
        return encode_frames(frames, lengths)

    def _send_compressed(
        self, frames: Sequence[memoryview], compressor: Compressor
    ) -> list[Buffer]:
        """:meth:`send_message` for a message with frames worth compressing."""
        assert self._peer is not None
        lengths = [frame.nbytes for frame in frames]
        self._send_limits.check_send(lengths)
        codec = compressor.codec << CODEC_SHIFT
        entries = []
        pieces: list[memoryview] = []
        packed = packed_wire = 0
        for frame, length in zip(frames, lengths, strict=True):
            wire = compressor.compress(frame) if length >= compressor.min_size else None
            if wire is None:
                entries.append(length)
                pieces.append(frame)
            else:
                entries.append(codec | length)
                pieces.append(wire)
                packed += length
                packed_wire += wire.nbytes
        self._count_sent(frames, packed, packed_wire)
        return frames_to_iov(encode_header(entries), pieces)

    def _count_sent(self, frames: Sequence[memoryview], packed: int = 0, wire: int = 0) -> None:
        """Count the message ``frames`` as sent (off the one-frame path), of
        which frames of ``packed`` bytes went compressed, in ``wire`` bytes."""
        size = sum(frame.nbytes for frame in frames)
        frame_bytes = size - packed + wire
        self.sent_messages += 1
        self.sent_extra_frames += len(frames) - 1
        self.sent_frame_bytes += frame_bytes
        self._compressed_bytes += packed
        self._compressed_wire_bytes += wire
        self._last_counted = (self.sent_messages, frame_bytes, packed, wire)
        if size > self.largest_sent:
            self._raise_largest(size)

    def _raise_largest(self, size: int) -> None:
        """``size`` is the largest message sent yet (the one just counted)."""
        self._largest_before = self.largest_sent
        self._largest_raised_by = self.sent_messages
        self.largest_sent = size

    def unsend_last(self, frames: Sequence[memoryview]) -> None:
        """Take back the counts of the last message :meth:`send_message`
        returned, ``frames``, whose write failed before any byte of it went."""
        messages = self.sent_messages
        last = self._last_counted
        if last[0] == messages:
            _, frame_bytes, packed, wire = last
            self._last_counted = (0, 0, 0, 0)
        else:  # (the one-frame path, which keeps no record)
            frame_bytes, packed, wire = frames[0].nbytes, 0, 0
        self.sent_messages = messages - 1
        self.sent_extra_frames -= len(frames) - 1
        self.sent_frame_bytes -= frame_bytes
        self._compressed_bytes -= packed
        self._compressed_wire_bytes -= wire
        if self._largest_raised_by == messages:
            self.largest_sent = self._largest_before
            self._largest_raised_by = 0

    def sent_counters(self) -> tuple[int, int, int, int, int, int]:
        """The send counters: bytes of the stream, messages, frames beyond one
        per message, the payload bytes of the largest message, and of the
        frames sent compressed their own bytes and their bytes on the wire."""
        frame_bytes, messages, extra, largest, packed, wire = self.send_mark()
        headers = 4 * messages + 8 * (messages + extra)
        return (
            self.sent_control_bytes + headers + frame_bytes,
            messages,
            extra,
            largest,
            packed,
            wire,
        )

    def send_mark(self) -> tuple[int, int, int, int, int, int]:
        """The send counters as they are, to put back with :meth:`send_undo`."""
        return (
            self.sent_frame_bytes,
            self.sent_messages,
            self.sent_extra_frames,
            self.largest_sent,
            self._compressed_bytes,
            self._compressed_wire_bytes,
        )

    def send_undo(self, mark: tuple[int, int, int, int, int, int]) -> None:
        """Put back the send counters of :meth:`send_mark`: the messages
        counted since were not sent after all (a batch left whole)."""
        (
            self.sent_frame_bytes,
            self.sent_messages,
            self.sent_extra_frames,
            self.largest_sent,
            self._compressed_bytes,
            self._compressed_wire_bytes,
        ) = mark
        self._last_counted = (0, 0, 0, 0)  # (the records of unsend_last: outdated)
        self._largest_raised_by = 0

    def received_counters(self) -> tuple[int, int, int, int, int, int]:
        """The receive counters, as :meth:`sent_counters` (the compressed
        frames' bytes decompressed): see :class:`FrameDecoder` and
        :class:`~anyio_comm._sansio.inflate.Inflater`."""
        decoder = self._decoder
        inflater = decoder.inflater
        return (
            decoder.received_bytes,
            decoder.received_messages,
            decoder.received_extra_frames,
            decoder.largest_received,
            inflater.compressed_bytes,
            inflater.compressed_wire_bytes,
        )

    def send_eof(self) -> None:
        """Record that we send nothing more (our side becomes CLOSED).

        Raises:
            LocalProtocolError: our side is in ERROR.
        """
        if self._our_state is ConnectionState.ERROR:
            raise LocalProtocolError(self._why_not_sending())
        self._our_state = ConnectionState.CLOSED

    def close_record(self, reason: CloseReason) -> bytes:
        """Return the close record telling the peer ``reason``, to send as the
        last bytes of our direction (our side becomes CLOSED).

        Raises:
            LocalProtocolError: the peer did not announce ``CLOSE_REASONS`` (or
                its preamble has not arrived), or our side is not OPEN.
        """
        if self._our_state is not _OPEN or self._peer is None:
            raise LocalProtocolError(self._why_not_sending())
        if not self.peer_accepts(Capability.CLOSE_REASONS):
            raise LocalProtocolError("the peer did not announce that it accepts close records")
        self._our_state = ConnectionState.CLOSED
        record = encode_close_record(reason)
        self.sent_control_bytes += len(record)
        return record

    def send_failed(self) -> None:
        """Record that the buffers of a message were not all written: our side
        becomes ERROR, for good."""
        self._our_state = ConnectionState.ERROR

    def _why_not_sending(self) -> str:
        if self._our_state is ConnectionState.CLOSED:
            return "cannot send after send_eof()"
        if self._our_state is ConnectionState.ERROR:
            return "cannot send: an earlier send failed part-way"
        return "cannot send before the peer's preamble has arrived"
