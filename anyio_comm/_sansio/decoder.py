"""Incremental decoder for the anyio-comm byte stream.

Theory of operation
-------------------
The decoder follows asyncio's ``BufferedProtocol`` shape: it never receives
bytes as arguments. Instead the I/O layer asks it where the next bytes should
go (:meth:`FrameDecoder.get_buffer`), reads straight into that buffer
(``sock.recv_into``, ``SSLObject.read(n, buffer)``) and reports how much it
wrote (:meth:`FrameDecoder.buffer_updated`). Then it calls
:meth:`FrameDecoder.next_message` until that returns ``None`` ("need data").

There are two places bytes can land:

* the **read-ahead buffer**, a fixed ``bytearray`` reused for the whole
  connection. Headers and small frames arrive here; one ``recv`` may carry many
  small messages, which are then served without further system calls. A small
  frame is copied out into a buffer of its own, or, in a many-frame message
  (below), into one buffer with the message's other short frames (a memcpy of a few KiB is far
  cheaper than a syscall).
  Until the peer's preamble has been parsed it is only
  :data:`PREAMBLE_BUFFER_SIZE` bytes (1,036), which the longest valid preamble
  fills: a peer that connects and sends nothing, or a bad preamble, never makes
  the decoder allocate ``read_buffer_size`` bytes. Once the preamble is parsed,
  it is replaced by one of ``read_buffer_size`` bytes (64 KiB by default), and
  whatever followed the preamble in the same reads (early data) moves there.
  The small buffer is replaced, not resized, so a view of it that the I/O
  layer still holds stays valid (it is simply no longer the one handed out).
* the **frame's own buffer**. Each frame gets one exact-size allocation when it
  starts (never before its header passed the limits). A frame that is not
  whole in the read-ahead buffer and would be read directly (see below) gets
  its buffer only at the next :meth:`get_buffer`, when the I/O layer is about
  to read into it (:attr:`~FrameDecoder.state` TASK_READS_FRAME says so beforehand: a
  callback-driven reader can leave that read to the task that consumes the
  message, so that a large buffer is allocated when it is wanted).
  When the read-ahead buffer is empty and at least ``direct_threshold`` bytes of the current frame
  are missing, :meth:`get_buffer` returns the unfilled tail of the frame buffer
  itself, so the kernel copies those bytes exactly once, into their final
  place. At most one read-ahead buffer's worth of a large frame is ever copied.
  A :class:`~anyio_comm._sansio.pool.BufferPool` places such a buffer at the
  phase of the frame's offset in its message (modulo 64 bytes), where the
  kernel's copy runs fastest (see the pool's module).

Limits are checked on the header, before anything is allocated for the
message: the frame count before the length table is read, and every frame
length and their sum before the first frame buffer exists. The only
allocations driven by the peer are the length table (``8 * max_frames`` bytes
at most), the frame buffers (``max_frame_size`` each, ``max_message_size``
together) and the bookkeeping of the frames (see "Many frames" below).

Compressed frames (protocol version 2, when we announced codecs): the length
table holds each frame's uncompressed length, so the checks above, and the
budget's reservation, use the decompressed sizes. A compressed frame's bytes
(its u64 compressed length, then the codec's output) are read into a buffer of
their own, at most the frame's length less one, then decompressed into the
frame's buffer; while it is read, that buffer adds at most as much again as
the frame. What a message of compressed frames holds is bounded by the limits,
not by the bytes that arrived (``received_in_message`` counts the latter).
A frame of ``offload_min`` bytes or more (see :mod:`~anyio_comm._sansio.inflate`)
is not decompressed by :meth:`~FrameDecoder.next_message`: it stops there with
status DECOMPRESS, and the I/O layer runs
:meth:`~FrameDecoder.decompress`, in a worker thread say (the decoder is not
touched meanwhile), then calls :meth:`~FrameDecoder.next_message` again.

Many frames: a frame object per frame (a buffer object and a memoryview, about
380 bytes beside the frame's bytes, as Python allocates them) would let a peer
make the receiver hold about 50 times what it sent (16384 empty frames are
128 KiB on the wire and 6.4 MB as frame objects). So a *many-frame message*,
one of more than ``SMALL_COUNT`` (32) frames of which some are shorter than
:data:`~anyio_comm._sansio.frames.PACK_BELOW` (64) bytes, is received in state
PACKED: those short frames go back to back into one buffer, where they stay:
the message is delivered as a :class:`~anyio_comm._sansio.frames.PackedFrames`
(16 bytes of bookkeeping per frame; a short frame's view is made when it is
indexed). Its frames of 64 bytes and more get frame objects of their own, less
than 8 times what they take on the wire (6.1 times at 64 bytes). In
mode CALLBACK (the push engine's callback) the frames
of such a message are not read before the task that takes the message asks for
it. So, without compressed frames, what a message holds from its first header
byte until it is delivered and after (its frames as ``receive_frames()``
returns them) stays under 8 times its bytes that arrived, plus at most 32 frame
objects (13 KiB: a message of up to 32 frames has one per frame), plus the
read-ahead buffer (``tests/sansio/test_frames.py`` measures it for hostile
shapes).

The decoder completes at most one message per :meth:`next_message` call and
keeps no queue of decoded messages, so the bytes it holds are bounded by the
read-ahead buffer plus the message being filled: a consumer that stops
calling it stops the reads from the socket.

All state lives in the decoder, so an I/O operation that is cancelled between
``get_buffer`` and ``buffer_updated`` (nothing was written) loses nothing: the
next call resumes where it stopped.

The end is sticky: once :meth:`FrameDecoder.next_message` (or
:meth:`FrameDecoder.next_handshake`) has raised :exc:`RemoteProtocolError` or
:exc:`EndOfData`, every later call raises the same error again (a new
exception object with the same message), and the decoder accepts no more
bytes. Bytes after a bad header are never parsed as a header of their own.
"""

from __future__ import annotations

import enum
from itertools import accumulate
from typing import TYPE_CHECKING, Final, NoReturn

from .budget import BudgetAccount, Reservations, message_cost
from .buffers import Allocator, allocate, default_allocator
from .close import CLOSE_MARKER, parse_close_record
from .compression import CODECS, LENGTH_MASK
from .errors import EndOfData, RemoteProtocolError
from .frames import PACK_BELOW, Frames, PackedFrames, Packer
from .inflate import Inflater
from .pool import SMALL_MIN, BufferPool
from .wire import (
    CAPABILITIES_VERSION,
    LENGTHS,
    MAX_PREAMBLE_BODY,
    PREAMBLE_FIXED_SIZE,
    PROTOCOL_VERSION,
    SMALL_COUNT,
    Capability,
    Handshake,
    Limits,
    read_preamble,
    unpack_count,
    unpack_count_and_length,
    unpack_lengths,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    #: ``copy(source, start, end) -> a frame's own flat view of source[start:end]``
    Copier = Callable[[memoryview, int, int], memoryview]

__all__ = [
    "CALLBACK",
    "DECOMPRESS",
    "DEFAULT_READ_BUFFER_SIZE",
    "NEED_DATA",
    "PREAMBLE_BUFFER_SIZE",
    "PULL",
    "TASK",
    "TASK_READS_FRAME",
    "TASK_READS_MANY",
    "WAIT_BUDGET",
    "EndOfData",
    "FrameDecoder",
    "ReceiveMode",
    "ReceiveState",
    "ReceiveStatus",
]

DEFAULT_READ_BUFFER_SIZE: Final = 64 * 1024
MIN_READ_BUFFER_SIZE: Final = 4096
#: a frame is read straight into its own buffer when at least the read-ahead
#: buffer's size divided by this is still to come (see get_buffer)
DIRECT_READ_SHARE: Final = 4
#: that size with the default read-ahead buffer: 16 KiB
DEFAULT_DIRECT_THRESHOLD: Final = DEFAULT_READ_BUFFER_SIZE // DIRECT_READ_SHARE
#: the read-ahead buffer's size until the peer's preamble was parsed: the longest
#: valid preamble fills it, so a caller that parses between reads (the contract of
#: get_buffer) is never handed an empty buffer
PREAMBLE_BUFFER_SIZE: Final = PREAMBLE_FIXED_SIZE + MAX_PREAMBLE_BODY


def check_read_buffer_size(read_buffer_size: int) -> None:
    """Raise ValueError unless ``read_buffer_size`` is at least 4096."""
    if read_buffer_size < MIN_READ_BUFFER_SIZE:
        raise ValueError(
            f"read_buffer_size must be at least {MIN_READ_BUFFER_SIZE}, got {read_buffer_size}"
        )


class _State(enum.Enum):
    PREAMBLE = "preamble"
    COUNT = "frame count"
    LENGTHS = "frame lengths"
    FRAME = "frame"
    PACKED = "frames of a many-frame message"
    ENDED = "ended"  # an error or the end of the stream was raised: see _stop


# The states as module constants: a global lookup costs a fraction of an enum
# member's (about 165 ns on CPython 3.11), and next_message() tests one per call.
_PREAMBLE: Final = _State.PREAMBLE
_COUNT: Final = _State.COUNT
_LENGTHS: Final = _State.LENGTHS
_FRAME: Final = _State.FRAME
_PACKED: Final = _State.PACKED
_ENDED: Final = _State.ENDED


class ReceiveStatus(enum.Enum):
    """What the receive side waits for once :meth:`FrameDecoder.next_message`
    returned ``None`` (:attr:`FrameDecoder.state`)."""

    #: bytes: read into :meth:`~FrameDecoder.get_buffer`
    NEED_DATA = "need data"
    #: the message's reservation waits in the receive budget's line: read nothing
    #: until the account grants it (its ``on_grant``)
    WAIT_BUDGET = "waiting for the receive budget"
    #: a frame whose rest is read directly into its own buffer: the next
    #: :meth:`~FrameDecoder.get_buffer` allocates that buffer and hands it out (a
    #: callback-driven reader leaves that read to the task that takes the message)
    TASK_READS_FRAME = "a large frame to read"
    #: (mode CALLBACK) the frames of a many-frame message wait for a
    #: :meth:`~FrameDecoder.next_message` in mode TASK (the read-ahead buffer may
    #: be full of them: call nothing else before)
    TASK_READS_MANY = "the frames of a many-frame message to read"
    #: a compressed frame waits for :meth:`~FrameDecoder.decompress` (after
    #: the inflater's ``prepare()``): call nothing else before
    DECOMPRESS = "a frame to decompress"
    #: the stream ended: every call raises what ended it again
    ENDED = "ended"


class ReceiveMode(enum.Enum):
    """Who reads (:attr:`ReceiveState.mode`), and so what the decoder leaves to
    whom."""

    #: a task reads and takes each message as it completes: the message's
    #: reservation of the budget is given back then (or to the keeper)
    PULL = "pull"
    #: an event-loop callback reads into a queue: a many-frame message's frames
    #: are left to the task (TASK_READS_MANY), and a reservation stays until the
    #: message is taken (its account's ``taken``)
    CALLBACK = "callback"
    #: the task of a callback-driven reader reads a message left to it: every
    #: frame is read; reservations stay until taken, as in CALLBACK
    TASK = "task"


class ReceiveState:
    """The receive side's state, shared by a connection, its decoder and the
    receive engine that drives them: plain attributes, which the engine reads on
    the per-message path (a property would cost a call each time).

    Attributes:
        status: what :meth:`FrameDecoder.next_message` waits for once it
            returned ``None`` (the decoder sets it; read it).
        mode: who reads (the engine sets it; the decoder reads it).
    """

    __slots__ = ("mode", "status")

    def __init__(self) -> None:
        self.status = ReceiveStatus.NEED_DATA
        self.mode = ReceiveMode.PULL


# The statuses and modes as module constants, as the states below (the receive
# engines import them too, through the connection's module).
NEED_DATA: Final = ReceiveStatus.NEED_DATA
WAIT_BUDGET: Final = ReceiveStatus.WAIT_BUDGET
TASK_READS_FRAME: Final = ReceiveStatus.TASK_READS_FRAME
TASK_READS_MANY: Final = ReceiveStatus.TASK_READS_MANY
DECOMPRESS: Final = ReceiveStatus.DECOMPRESS
PULL: Final = ReceiveMode.PULL
CALLBACK: Final = ReceiveMode.CALLBACK
TASK: Final = ReceiveMode.TASK


def _fast_paths(
    allocator: Allocator, limits: Limits, read_buffer_size: int
) -> tuple[bool, int, int]:
    """What the fast paths of :meth:`FrameDecoder.next_message` may take on their
    own: whether frames that fit in the read-ahead buffer are plain bytearrays
    whoever allocates (the fast paths copy them out of it themselves); the
    largest one-frame message they take without the general limit checks (-1:
    never); the most frames of a whole message in the read-ahead buffer they
    take (0: never)."""
    plain = allocator is default_allocator or (
        isinstance(allocator, BufferPool)
        and allocator.small_frames_are_bytearrays
        and allocator.min_size > read_buffer_size
    )
    if not plain:
        return False, -1, 0
    largest = min(limits.max_frame_size, limits.max_message_size) if limits.max_frames else -1
    return True, largest, min(limits.max_frames, SMALL_COUNT)


def copy_out(source: memoryview, start: int, end: int) -> memoryview:
    """A frame of its own with the bytes ``source[start:end]``: a ``bytearray``'s
    flat view (what the fast paths make of a frame without a buffer pool)."""
    return memoryview(bytearray(source[start:end]))


class FrameDecoder:
    """Turns the incoming byte stream into a preamble, then lists of frames.

    Args:
        limits: our receive limits, enforced on every header.
        read_buffer_size: size of the read-ahead buffer (at least 4096), from
            the moment the peer's preamble has been parsed (before,
            :data:`PREAMBLE_BUFFER_SIZE` bytes).
        allocator: allocates each frame's buffer (see
            :mod:`anyio_comm._sansio.buffers`).
        account: the receive budget's account: a message costing at least
            :attr:`budget_min` is reserved from it when its header arrives,
            before anything is allocated for it (see
            :mod:`anyio_comm._sansio.budget`); ``None``: no budget.
        version: the highest protocol version we speak.
        capabilities: what we announce that we accept (close records are
            parsed if it has ``CLOSE_REASONS`` and the connection's version
            has them).
        compression: the codecs we announce that we decompress (compressed
            frames are parsed on a version-2 connection).
        state: the receive state to keep up to date (shared with a
            connection); ``None``: one of its own.

    Raises:
        ValueError: ``read_buffer_size`` is below 4096.
    """

    __slots__ = (
        "_account",
        "_allocator",
        "_buf",
        "_cap_next_read",
        "_capabilities",
        "_close_records",
        "_copy",
        "_direct",
        "_direct_threshold",
        "_end",
        "_end_error",
        "_eof",
        "_fast_alloc",
        "_fast_count",
        "_fast_frame_max",
        "_fast_max",
        "_filled",
        "_frames",
        "_lengths",
        "_limits",
        "_packer",
        "_pool",
        "_positions",
        "_read_buffer_size",
        "_reservations",
        "_start",
        "_state",
        "_target",
        "_version",
        "_view",
        "budget_min",
        "inflater",
        "largest_received",
        "on_handshake",
        "received_bytes",
        "received_extra_frames",
        "received_messages",
        "state",
    )

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        read_buffer_size: int = DEFAULT_READ_BUFFER_SIZE,
        allocator: Allocator | None = None,
        account: BudgetAccount | None = None,
        version: int = PROTOCOL_VERSION,
        capabilities: frozenset[Capability] = frozenset(),
        compression: tuple[str, ...] = (),
        state: ReceiveState | None = None,
    ) -> None:
        check_read_buffer_size(read_buffer_size)
        self._limits = limits if limits is not None else Limits()
        self._version = version
        self._capabilities = capabilities
        # a frame count of CLOSE_MARKER begins a close record (set by the preamble)
        self._close_records = False
        self._allocator: Allocator = allocator or default_allocator
        #: the compressed frames of the message being received (see its module)
        self.inflater = Inflater(frozenset(CODECS[name] for name in compression), self._allocator)
        #: its status (what :meth:`next_message` waits for when it returns
        #: ``None``) and mode (who reads: see :class:`ReceiveMode`)
        self.state = state if state is not None else ReceiveState()
        self._fast_alloc, self._fast_max, self._fast_count = _fast_paths(
            self._allocator, self._limits, read_buffer_size
        )
        # (an entry above LENGTH_MASK is a compressed frame's: the general path's)
        self._fast_frame_max = min(self._fast_max, LENGTH_MASK)
        # A pool places the buffers of frames read directly at the phase of their
        # offset in the message (see _start_frame).
        self._pool = allocator if isinstance(allocator, BufferPool) else None
        # The fast paths copy frames out of the read-ahead buffer themselves (a
        # pool reuses the bytearrays of those nothing holds any more).
        self._copy: Copier = copy_out if self._pool is None else self._pool.copy_out
        # Small until the peer's preamble is parsed (see _grow).
        self._read_buffer_size = read_buffer_size
        self._buf = bytearray(PREAMBLE_BUFFER_SIZE)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._direct = False
        self._cap_next_read = False
        self._direct_threshold = read_buffer_size // DIRECT_READ_SHARE
        self._eof = False
        self._state = _PREAMBLE
        # what ended the stream (raised again by every later call), once ENDED
        self._end_error: RemoteProtocolError | EndOfData | None = None
        self._target: memoryview | None = None
        self._filled = 0
        self._lengths: tuple[int, ...] = ()
        # the offset of each frame in its message (and its end), once wanted
        self._positions: list[int] | None = None
        self._frames: list[memoryview] = []
        # the frames of a many-frame message (state PACKED: see the module)
        self._packer: Packer | None = None
        #: what was received: bytes of the stream (the preamble and a close
        #: record included), messages returned by :meth:`next_message`, their
        #: frames beyond one each (so a message of none counts -1), and the
        #: payload bytes of the largest
        self.received_bytes = 0
        self.received_messages = 0
        self.received_extra_frames = 0
        self.largest_received = 0
        self._account = account
        if account is not None:
            # the budget's stall check: bytes of the message being received
            account.progress = lambda: self.received_in_message
        #: messages costing at least this are reserved from the budget (none
        #: without one); no message the fast paths of next_message() take (whole
        #: in the read-ahead buffer, at most SMALL_COUNT frames) costs that much
        self.budget_min = message_cost(read_buffer_size, SMALL_COUNT) if account else 1 << 64
        self._reservations = Reservations(account, self.budget_min) if account else None
        #: ``None``: :meth:`next_message` wants :meth:`next_handshake` called
        #: first; else :meth:`next_message` parses the preamble itself and calls
        #: this with the peer's handshake (a side that sent messages before the
        #: peer's preamble arrived reads it where it reads messages)
        self.on_handshake: Callable[[Handshake], object] | None = None

    @property
    def limits(self) -> Limits:
        """Our receive limits."""
        return self._limits

    @property
    def at_message_boundary(self) -> bool:
        """True when no part of a message has been received."""
        return self._state is _COUNT and self._start == self._end

    @property
    def packing(self) -> bool:
        """True while a many-frame message is received (its short frames packed:
        see the module)."""
        return self._state is _PACKED

    @property
    def account(self) -> BudgetAccount | None:
        """The budget account messages are reserved from (``None``: no budget)."""
        return self._account

    @property
    def received_in_message(self) -> int:
        """Bytes of the message being received that arrived (0 between messages)."""
        state = self._state
        if state is _COUNT or state is _PREAMBLE or state is _ENDED:
            return self._end - self._start
        received = self._end - self._start
        if state is _PACKED:
            assert self._packer is not None
            received += 4 + 8 * len(self._lengths) + self._packer.nbytes + self.inflater.adjust
            return received + (self._filled if self._target is not None else 0)
        received += self._filled + self.inflater.adjust  # (the frame being filled)
        if state is _FRAME:
            received += 4 + 8 * len(self._lengths) + sum(map(len, self._frames))
        else:  # LENGTHS: the count came before the table
            received += 4
        return received

    @property
    def end_error(self) -> RemoteProtocolError | EndOfData | None:
        """What ended the stream (a protocol error or the end of data), or ``None``."""
        return self._end_error

    def decompress(self) -> None:
        """Run the decompression status DECOMPRESS announced (after the
        inflater's :meth:`~anyio_comm._sansio.inflate.Inflater.prepare`).

        It may run in another thread, provided nothing else calls this
        decoder meanwhile. It raises nothing: bytes that do not decompress
        make the next :meth:`next_message` raise :exc:`RemoteProtocolError`.

        Raises:
            RuntimeError: no decompression is due.
        """
        frame = self.inflater.run()
        if frame is not None and self._state is not _ENDED:
            self._target = frame
            self._filled = frame.nbytes
        if self.state.status is DECOMPRESS:
            self.state.status = NEED_DATA

    # -- feeding -----------------------------------------------------------

    def get_buffer(self) -> memoryview:
        """Return the writable buffer the next received bytes must go into.

        Call it only after :meth:`next_handshake` / :meth:`next_message`
        returned ``None``. Write up to ``len(buffer)`` bytes into it, then call
        :meth:`buffer_updated` with the number written (or nothing, if the
        read was abandoned: nothing is lost). Before the peer's preamble has been
        parsed the buffer is small (:data:`PREAMBLE_BUFFER_SIZE` bytes in all);
        the next call after the preamble was parsed hands out the larger one.
        When the last read went straight into a frame's buffer, the read-ahead
        buffer handed out at the start of the next message is
        :data:`MIN_READ_BUFFER_SIZE` bytes long: the header of a large message, and
        little of its frame to copy.
        """
        if self._state is _ENDED:
            self._start = self._end = 0  # after the end nothing is parsed: discard
            return self._view
        target = self._target
        if self.state.status is TASK_READS_FRAME:
            target = self._start_frame()
        if target is not None and self._start == self._end:
            missing = target.nbytes - self._filled
            if missing >= self._direct_threshold:
                self._direct = True
                self._cap_next_read = True
                return target[self._filled :]
        self._direct = False
        start = self._start
        end = self._end
        if start:
            # Only a partial fixed-size header (< 12 bytes), a partial close
            # record (< 1288 bytes) or a partial preamble can be left here, so
            # this move is small.
            if start != end:
                self._buf[: end - start] = self._view[start:end]
            self._start = 0
            end = self._end = end - start
        if end:
            return self._view[end:]
        if self._cap_next_read and self._state is _COUNT:
            # The read after one straight into a frame's buffer, at the start of a
            # message: the next message is likely large too, and what a full
            # read-ahead buffer took of its frame would be copied into that
            # frame's buffer. Its header and a little more, then.
            return self._view[:MIN_READ_BUFFER_SIZE]
        return self._view

    def buffer_updated(self, nbytes: int) -> None:
        """Record that ``nbytes`` bytes were written into the last buffer from
        :meth:`get_buffer`. Then call :meth:`next_message` (or
        :meth:`next_handshake`).
        """
        self.received_bytes += nbytes
        if self._direct:
            self._filled += nbytes
        else:
            self._end += nbytes
            self._cap_next_read = False

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` in through :meth:`get_buffer` / :meth:`buffer_updated`.

        A convenience for tests and for transports that only deliver ``bytes``;
        after it returns, drain with :meth:`next_message`. It may call
        :meth:`next_message` internally to make room, so do not feed more than
        one message's worth of data without draining.
        """
        view = memoryview(data).cast("B")
        while view:
            buf = self.get_buffer()
            n = min(buf.nbytes, view.nbytes)
            buf[:n] = view[:n]
            self.buffer_updated(n)
            view = view[n:]
            if view and not self._direct and self._end == len(self._buf):
                if self._state is not _PREAMBLE or len(self._buf) == self._read_buffer_size:
                    raise BufferError("read-ahead buffer full: drain with next_message()")
                # The caller holds the bytes already: take the preamble and what
                # follows it in one go, as before the preamble's small buffer.
                self._grow()

    def receive_eof(self) -> None:
        """Record that the peer will send nothing more. Then keep calling
        :meth:`next_message` until it raises :exc:`EndOfData`.
        """
        self._eof = True

    # -- decoding ----------------------------------------------------------

    def next_handshake(self) -> Handshake | None:
        """Parse the peer's preamble.

        Returns:
            The peer's :class:`Handshake`, or ``None`` when more bytes are needed.

        Raises:
            RemoteProtocolError: wrong magic, unsupported version or malformed
                preamble (raised as soon as the first wrong byte arrives; every
                later call raises it again).
            EndOfData: the stream ended before the preamble was complete.
            RuntimeError: the preamble was already parsed.
        """
        if self._state is not _PREAMBLE:
            if self._state is _ENDED:
                self._raise_again()
            raise RuntimeError("the preamble has already been received")
        try:
            return self._parse_preamble()
        except (RemoteProtocolError, EndOfData) as exc:
            self._stop(exc)
        self._raise_again()  # (outside the handler: see _stop)

    def _parse_preamble(self) -> Handshake | None:
        start = self._start
        parsed = read_preamble(self._view[start : self._end], self._version)
        if parsed is None:
            self._check_eof("the connection preamble")
            return None
        handshake, length = parsed
        if handshake.version >= CAPABILITIES_VERSION:
            self._close_records = Capability.CLOSE_REASONS in self._capabilities
        else:
            self.inflater.forget_codecs()
        self._start = start + length
        if len(self._buf) != self._read_buffer_size:
            self._grow()
        self._state = _COUNT
        return handshake

    def _grow(self) -> None:
        """Replace the preamble's small read-ahead buffer by one of
        ``read_buffer_size`` bytes, what it holds from ``_start`` on (early data)
        moved to its start. A new buffer, not a resize: a view of the old one may
        still be held by the I/O layer (a resize would raise BufferError)."""
        start = self._start
        end = self._end
        buf = bytearray(self._read_buffer_size)
        buf[: end - start] = self._view[start:end]
        self._buf = buf
        self._view = memoryview(buf)
        self._start = 0
        self._end = end - start

    def next_message(self) -> Frames | None:
        """Return the next complete message's frames, or ``None`` if more
        bytes are needed (then call :meth:`get_buffer`).

        Each frame is a ``memoryview`` over its own exact-size buffer, in a
        ``list``; a many-frame message (see the module) comes as a
        :class:`~anyio_comm._sansio.frames.PackedFrames`, whose short frames
        share one buffer.

        Raises:
            RemoteProtocolError: a header violates our limits (and so does
                every later call: the error is sticky).
            EndOfData: the stream ended (``truncated`` tells whether a message
                was cut off); every later call raises it again.
            RemoteProtocolError, EndOfData: also for the peer's preamble, when
                :attr:`on_handshake` is set and it has not arrived yet.
            RuntimeError: the preamble was not parsed yet (and
                :attr:`on_handshake` is not set).
        """
        state = self._state
        if state is _COUNT:
            # Fast path: a whole one-frame message already in the read-ahead
            # buffer (the common small message) is parsed with one unpack and
            # copied out with one slice; the limits were folded into _fast_max.
            start = self._start
            avail = self._end - start
            if avail >= 12:
                count, length = unpack_count_and_length(self._buf, start)
                if count == 1:
                    if length <= self._fast_max and avail - 12 >= length:
                        start += 12
                        self._start = start + length
                        self.received_messages += 1
                        if length > self.largest_received:
                            self.largest_received = length
                        if length < SMALL_MIN:
                            return [memoryview(self._buf[start : start + length])]
                        return [self._copy(self._view, start, start + length)]
                elif 1 < count <= self._fast_count:
                    return self._several(start, avail, count)
            elif not avail and not self._eof:
                return None  # between messages, nothing buffered: need data
        elif state is _FRAME:
            # Fast path: the last frame was read into its own buffer and is full
            # (a message whose large frame was read directly: see
            # _several), with no compressed frame to account for.
            target = self._target
            if target is None:
                if self.state.status is TASK_READS_FRAME and not self._eof:
                    return None  # (its buffer comes with the next get_buffer())
            elif (
                self._filled == target.nbytes
                and self.inflater.codecs is None
                and len(self._frames) + 1 == len(self._lengths)
            ):
                self._target = None
                self._filled = 0
                self._frames.append(target)
                return self._finish_message()
        elif state is _PREAMBLE:
            on_handshake = self.on_handshake
            if on_handshake is None:
                raise RuntimeError("call next_handshake() before next_message()")
            handshake = self.next_handshake()
            if handshake is None:
                return None
            on_handshake(handshake)
            return self.next_message()
        elif state is _ENDED:
            self._raise_again()
        return self._general()

    def _general(self) -> Frames | None:
        """:meth:`next_message` past its fast paths (which raise nothing)."""
        try:
            return self._next_message()
        except (RemoteProtocolError, EndOfData) as exc:
            self._stop(exc)
        self._raise_again()  # (outside the handler: see _stop)

    def _next_message(self) -> Frames | None:
        """The general path of :meth:`next_message`: any state, any message shape."""
        receiving = self.state
        status = receiving.status
        if status is not NEED_DATA:
            if status is DECOMPRESS:
                return None  # the I/O layer runs decompress() first
            reservations = self._reservations
            if status is WAIT_BUDGET and reservations is not None and reservations.waiting:
                self._check_eof("a message")
                return None  # still in the budget's line
            receiving.status = NEED_DATA  # (what still holds is found again below)
        state = self._state
        if self.inflater.error is not None:
            raise self.inflater.error
        view = self._view
        while True:
            if state is _COUNT:
                start = self._start
                avail = self._end - start
                if avail < 4:
                    self._check_eof("a message header")
                    return None
                count = unpack_count(view, start)
                if count == CLOSE_MARKER and self._close_records:
                    # the stream ends there: what follows is never parsed
                    parsed = parse_close_record(self._buf, start, self._end)
                    if parsed is None:
                        self._check_eof("a close record")
                        return None
                    reason = parsed[0]
                    raise EndOfData(
                        f"the peer closed the connection: {reason}", truncated=False, reason=reason
                    )
                if count > self._limits.max_frames:
                    raise RemoteProtocolError(
                        f"message has {count} frames; the limit is {self._limits.max_frames}",
                        rule="max_frames",
                    )
                if count == 0:
                    self._start = start + 4
                    self.received_messages += 1
                    self.received_extra_frames -= 1
                    return []
                need = 8 * count
                if avail - 4 >= need:
                    self._start = start + 4 + need
                    self._begin_frames(unpack_lengths(view, start + 4, count))
                    if self.state.status is WAIT_BUDGET:
                        return None
                else:
                    self._start = start + 4
                    self._target = memoryview(bytearray(need))
                    self._filled = 0
                    self._state = _LENGTHS
                state = self._state
                continue
            if state is _PACKED:
                return self._fill_packed()

            if self._target is not None:
                target = self._close_frame(len(self._frames))
                if target is None:
                    return None
                if state is _LENGTHS:
                    self._begin_frames(unpack_lengths(target, 0, target.nbytes // 8))
                    if self.state.status is WAIT_BUDGET:
                        return None
                    state = self._state
                    continue
            else:  # FRAME, the next frame not begun
                index = len(self._frames)
                target = self._open_frame(index, self._lengths[index])
                if target is None:
                    if self.state.status is TASK_READS_FRAME:
                        return None  # its rest is read directly into its buffer
                    continue  # (its buffer, or a compressed frame's prefix, is the target)
            self._frames.append(target)
            if len(self._frames) == len(self._lengths):
                return self._finish_message()

    def _several(self, start: int, avail: int, count: int) -> Frames | None:
        """The fast paths of a message of ``count`` frames (more than one, at most
        the fast paths' limit) at ``start`` (``avail`` bytes there), when its
        header is in the read-ahead buffer and within the limits: the message is
        whole there (its frames, each copied into a buffer of its own); or all
        of it but a part of its last frame large enough to read straight into
        that frame's buffer (a body and a large out-of-band frame): the message
        is reserved from the budget, its other frames taken and its last frame
        announced (status TASK_READS_FRAME), as the general path does. Any other
        case (a compressed frame, a broken limit, the stream's end) is the
        general path's."""
        head = 4 + 8 * count
        if avail >= head:
            lengths = LENGTHS[count].unpack_from(self._buf, start + 4)
            total = sum(lengths)
            missing = total - (avail - head)
            if max(lengths) <= self._fast_frame_max and total <= self._limits.max_message_size:
                if missing <= 0:
                    frames, self._start = self._copy_frames(lengths, start + head)
                    self._count_message(count, total)
                    return frames
                if self._direct_threshold <= missing <= lengths[-1] and not self._eof:
                    self._begin_last_frame(lengths, start + head, total)
                    return None
        return self._general()

    def _copy_frames(self, lengths: Sequence[int], position: int) -> tuple[list[memoryview], int]:
        """The frames of these ``lengths`` from ``position`` in the read-ahead
        buffer, each copied into a buffer of its own (by ``copy`` from
        ``SMALL_MIN`` bytes), and where they end."""
        buf = self._buf
        frames = []
        for length in lengths:
            end = position + length
            if length < SMALL_MIN:  # (a message's header, say: no call)
                frames.append(memoryview(buf[position:end]))
            else:
                frames.append(self._copy(self._view, position, end))
            position = end
        return frames, position

    def _begin_last_frame(self, lengths: tuple[int, ...], position: int, total: int) -> None:
        """:meth:`_several` for a message whose last frame is to be read straight
        into its buffer and whose other frames start at ``position``."""
        self._start = position
        self._enter_message(lengths, total)
        if self.state.status is WAIT_BUDGET:
            return  # (the general path takes the frames once the budget grants them)
        self._frames, self._start = self._copy_frames(lengths[:-1], position)
        self.state.status = TASK_READS_FRAME

    def _open_frame(self, index: int, length: int) -> memoryview | None:
        """Begin frame ``index`` of the message (``length`` bytes), the one way every
        frame begins; return it if it is complete already.

        A compressed frame's prefix becomes the target. A frame whole in the
        read-ahead buffer is copied out (the fast paths' buffers). A frame whose
        rest will be read directly into its buffer gets that buffer at the next
        :meth:`get_buffer`, when the bytes are wanted (status TASK_READS_FRAME; no
        target). Any other frame's buffer becomes the target.

        Raises:
            EndOfData: a frame is left to be read, and the stream ended.
        """
        inflater = self.inflater
        codecs = inflater.codecs
        self._filled = 0
        if codecs is not None and index in codecs:
            self._target = inflater.prefix()
            return None
        start = self._start
        avail = self._end - start
        if self._fast_alloc and avail >= length:
            self._start = start + length
            return self._copy(self._view, start, start + length)
        if length - avail >= self._direct_threshold:
            self._check_eof("a message")
            self.state.status = TASK_READS_FRAME
            return None
        self._target = allocate(self._allocator, length)
        return None

    def _close_frame(self, index: int) -> memoryview | None:
        """Fill the target (the length table, or a part of frame ``index``) from the
        read-ahead buffer, the one way every target completes; return the table or
        the frame once it is whole, else ``None``: more bytes are needed, or the
        frame's decompression is left to the I/O layer (status DECOMPRESS).

        Raises:
            EndOfData: the target is not full, and the stream ended.
            RemoteProtocolError: a compressed frame that breaks the rules (see
                :mod:`~anyio_comm._sansio.inflate`).
        """
        inflater = self.inflater
        while True:
            target = self._target
            assert target is not None
            if target.nbytes != self._filled and not self._fill(target):
                return None
            self._target = None
            self._filled = 0
            phase = inflater.phase
            if not phase:
                return target
            length = self._lengths[index]
            if phase == 1:
                self._target = inflater.prefix_read(target, index, length)
                continue
            if phase == 3:
                inflater.phase = 0
                return target  # decompressed by decompress()
            frame = inflater.compressed_read(target, index, length)
            if frame is None:
                self.state.status = DECOMPRESS
            return frame

    def _fill(self, target: memoryview) -> bool:
        """Move what the read-ahead buffer holds of ``target`` (the length table or a
        frame, partly filled) into it; return whether it is full.

        Raises:
            EndOfData: it is not, and the stream ended.
        """
        start = self._start
        filled = self._filled
        missing = target.nbytes - filled
        take = min(self._end - start, missing)
        if take:
            target[filled : filled + take] = self._view[start : start + take]
            self._filled = filled + take
            self._start = start + take
        if take < missing:
            self._check_eof("a message")
            return False
        return True

    def _start_frame(self) -> memoryview:
        """Allocate the buffer of the frame status TASK_READS_FRAME announced and
        move the part of it in the read-ahead buffer there (all of that buffer's
        bytes: they are this frame's, and more of it is missing)."""
        packer = self._packer
        index = len(self._frames) if packer is None else packer.index
        length = self._lengths[index]
        pool = self._pool
        if pool is None:
            target = allocate(self._allocator, length)
        else:
            if self._positions is None:  # (the offset of each frame in its message)
                self._positions = list(
                    accumulate(self._lengths, initial=4 + 8 * len(self._lengths))
                )
            target = pool.frame_buffer(length, self._positions[index])
        self._target = target
        self.state.status = NEED_DATA
        start = self._start
        taken = self._end - start
        if taken:
            target[:taken] = self._view[start : self._end]
        self._filled = taken
        self._start = self._end = 0
        return target

    def _begin_frames(self, lengths: tuple[int, ...]) -> None:
        limits = self._limits
        lengths = self.inflater.begin(lengths)
        total = 0
        for length in lengths:
            if length > limits.max_frame_size:
                raise RemoteProtocolError(
                    f"frame of {length} bytes exceeds the limit of "
                    f"{limits.max_frame_size} bytes per frame",
                    rule="max_frame_size",
                )
            total += length
        if total > limits.max_message_size:
            raise RemoteProtocolError(
                f"message of {total} bytes exceeds the limit of "
                f"{limits.max_message_size} bytes per message",
                rule="max_message_size",
            )
        self._enter_message(lengths, total)

    def _enter_message(self, lengths: tuple[int, ...], total: int) -> None:
        """Receive the frames of a message whose length table (``lengths``, of
        ``total`` bytes) passed the limits: its state, and its reservation of the
        budget (status WAIT_BUDGET while that waits)."""
        self._lengths = lengths
        self._positions = None
        self._frames = []
        self._target = None
        self._filled = 0
        # (a frame of PACK_BELOW bytes or more holds less than 8 times what it takes
        # on the wire: a message of none but such frames needs no packing; a short
        # compressed frame is read and decompressed on its own, then packed)
        if len(lengths) > SMALL_COUNT and min(lengths) < PACK_BELOW:
            self._packer = Packer(lengths)
            self._state = _PACKED
        else:
            self._state = _FRAME
        reservations = self._reservations
        if reservations is not None and not reservations.reserve(total, len(lengths)):
            self.state.status = WAIT_BUDGET

    def _fill_packed(self) -> PackedFrames | None:
        """Take the frames of a many-frame message (state PACKED) into its
        :class:`~anyio_comm._sansio.frames.Packer`."""
        if self.state.mode is CALLBACK:
            self.state.status = TASK_READS_MANY
            return None
        packer = self._packer
        assert packer is not None
        lengths = self._lengths
        codecs = self.inflater.codecs
        while True:
            if self._target is not None:
                frame = self._close_frame(packer.index)
                if frame is None:
                    return None
                packer.add(frame)
                continue
            index = packer.index
            if index == len(lengths):
                self._packer = None
                self._finish_message()
                return packer.finish()
            length = lengths[index]
            if length < PACK_BELOW and (codecs is None or index not in codecs):
                start = self._start
                self._start = start + packer.take_short(self._view[start : self._end], codecs)
                if packer.index == index:  # (it is not whole)
                    self._check_eof("a message")
                    return None
                continue
            frame = self._open_frame(index, length)
            if frame is None:
                if self.state.status is TASK_READS_FRAME:
                    return None  # its rest is read directly into its buffer
                continue
            packer.add(frame)

    def _count_message(self, count: int, total: int) -> None:
        """Count a message of ``count`` frames, ``total`` bytes, as received."""
        self.received_messages += 1
        self.received_extra_frames += count - 1
        if total > self.largest_received:
            self.largest_received = total

    def _finish_message(self) -> list[memoryview]:
        """End the message (its frames are complete) and return ``_frames``."""
        lengths = self._lengths
        self._count_message(len(lengths), sum(lengths))
        reservations = self._reservations
        if reservations is not None and reservations.held:
            # (mode PULL: no queue, the message is taken now; else the I/O layer
            # reports it taken)
            reservations.complete(self.state.mode is PULL)
        frames = self._frames
        self._frames = []
        self._lengths = ()
        self._positions = None
        self.inflater.end()
        self._state = _COUNT
        return frames

    def _stop(self, error: RemoteProtocolError | EndOfData) -> None:
        """Enter the final state: every later call raises ``error`` again (as a
        new exception: kept without its traceback and context, whose frames may
        hold a message's buffers, and raised outside the handler that caught it)."""
        self._state = _ENDED
        error.__traceback__ = error.__context__ = error.__cause__ = None
        self._end_error = error
        if self._reservations is not None:
            self._reservations.abandon()
        self.state.status = ReceiveStatus.ENDED
        self._target = None
        self.inflater.end()
        self._frames = []
        self._packer = None
        self._start = self._end = 0

    def _raise_again(self) -> NoReturn:
        error = self._end_error
        if isinstance(error, EndOfData):
            raise EndOfData(str(error), truncated=error.truncated, reason=error.reason)
        assert error is not None
        raise RemoteProtocolError(str(error), rule=error.rule)

    def _check_eof(self, what: str) -> None:
        """Raise EndOfData if no more data will come; else return (need data)."""
        if not self._eof:
            return
        if self.at_message_boundary:
            raise EndOfData("the peer closed the connection", truncated=False)
        raise EndOfData(f"the connection closed in the middle of {what}", truncated=True)
