"""Per-connection options: one object, accepted by every function that opens a comm."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, TypedDict

from ._compat import final
from ._sansio.compression import check_codecs
from ._sansio.connection import DEFAULT_READ_BUFFER_SIZE, check_read_buffer_size
from ._sansio.serialization import DEFAULT_OOB_THRESHOLD, Serializer
from ._sansio.wire import Limits

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ._sansio.buffers import Allocator

__all__ = [
    "Options",
    "OptionsKeywords",
    "PooledOptionsKeywords",
    "check_seconds",
    "resolve_options",
]

#: a new connection's TLS handshake and preamble exchange must complete within this
DEFAULT_HANDSHAKE_TIMEOUT: Final = 10.0
#: seconds of waiting a message that has begun to arrive gets to complete ...
DEFAULT_MESSAGE_TIMEOUT: Final = 60.0
#: ... plus one second per this many bytes of it that arrived
DEFAULT_MIN_RECEIVE_RATE: Final = 64 * 1024
#: the values of ``Options.receive_engine``
RECEIVE_ENGINES: Final = ("auto", "pull")


def check_seconds(name: str, value: float | None, minimum: float = 0.0) -> None:
    """Check an optional duration option: ``None`` or a number above ``minimum``.

    Raises:
        TypeError: ``value`` is not a number.
        ValueError: ``value`` is not above ``minimum`` (or is NaN).
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds or None, not {value!r}")
    if not value > minimum:  # also rejects NaN
        raise ValueError(f"{name} must be greater than {minimum:g} seconds, not {value!r}")


@final
@dataclass(frozen=True, slots=True)
class Options:
    """Per-connection options, for :func:`~anyio_comm.connect`,
    :func:`~anyio_comm.listen`, :func:`~anyio_comm.serve`,
    :func:`~anyio_comm.from_stream` and :func:`~anyio_comm.testing.comm_pair`.

    Pass one as ``options=``, or any field as a keyword of the same name; a
    keyword overrides the field of ``options``. ``Options`` is immutable:
    ``dataclasses.replace(options, idle_timeout=30)`` makes a variant.

    Attributes:
        limits: our receive limits, announced to the peer and enforced on what
            it sends (see :class:`~anyio_comm.Limits`).
        read_buffer_size: size of the read-ahead buffer (at least 4096).
        allocator: allocates the buffer each received frame goes into,
            ``allocator(n)`` returning a writable buffer of ``n`` bytes
            (``None``: a ``bytearray`` up to 64 KiB, larger frames from the
            event loop's :func:`~anyio_comm.current_buffer_pool`, which reuses
            the memory of frames nothing holds any more). The frames shorter
            than 64 bytes of a message of more than 32 frames are not
            allocated one by one: they share a ``bytearray``.
        oob_threshold: bytes-like values of at least this size travel as
            out-of-band frames (16384 by default); smaller ones are copied
            into the msgpack body.
        allow_pickle: pickle what msgpack cannot encode and accept pickled data
            from the peer. Trusted peers only. Announced to the peer (the
            ``PICKLE`` capability): towards a peer that did not announce it in
            turn, nothing is pickled (such a message raises
            :exc:`~anyio_comm.SerializationError`); a version-1 peer announces
            nothing, so towards it pickle is used as configured.
        handshake_timeout: seconds for the TLS handshake and the preamble
            exchange of a new connection (``None``: no limit). A listener drops
            a connection that takes longer; :func:`~anyio_comm.connect` fails
            that attempt with :exc:`TimeoutError`.
        idle_timeout: :meth:`Comm.receive <anyio_comm.Comm.receive>` fails
            with :exc:`~anyio_comm.IdleTimeoutError` (and the connection is
            closed) when no byte arrives for this many seconds while it waits
            (``None``: it waits forever). On an ``anyio_comm.rpc``
            connection, time with calls in flight does not count.
        message_timeout: once part of a message arrived, :meth:`Comm.receive
            <anyio_comm.Comm.receive>` waits at most this many seconds for the
            rest, plus one second for every ``min_receive_rate`` bytes of the
            message that arrived; then it fails with
            :exc:`~anyio_comm.MessageTimeoutError` (and the connection is
            closed). Only time spent waiting for the peer counts. ``None``: no
            limit.
        min_receive_rate: bytes per second a message must arrive at, on
            average, to extend its ``message_timeout`` (0: no extension).
        compression: compress large frames with these codecs (``"lz4"``,
            ``"zstd"``; a name or a tuple, in order of preference) towards a
            peer that accepts one of them, and accept them from the peer (the
            ``COMPRESSION`` capability). Off by default; both sides must turn
            it on. Frames of 64 KiB and more whose sample compresses to 90 % or
            less are sent compressed and decompressed straight into their
            buffer; the receiver's limits apply to their decompressed size.
            Needs the ``cramjam`` package (the ``lz4`` or ``zstd`` extra).
        keepalive: for TCP (and TLS) connections, turn on TCP keepalive so that
            a peer that vanished without a word (host down, network cut) is
            detected in about this many seconds of silence; on Linux, also
            unacknowledged sent data fails the connection after this long.
            ``None`` keeps the system's default (off). Applied to the sockets
            anyio-comm opens and accepts, and to the socket under a
            :func:`~anyio_comm.from_stream` stream when it has one.
        receive_engine: who reads the socket. ``"auto"``: on asyncio and
            uvloop, over TCP, Unix sockets and TLS, the event loop's readiness
            callback reads and decodes, and wakes the receiving task with whole
            messages; elsewhere (trio, ``from_stream``, ``inproc://``) the
            receiving task reads. ``"pull"``: the receiving task reads
            everywhere (to compare the two; the messages, limits and errors are
            the same).

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field is out of range (``read_buffer_size`` below 4096,
            a negative ``oob_threshold`` or ``min_receive_rate``, a duration
            that is not positive, an unknown codec, a ``receive_engine`` other
            than ``"auto"`` and ``"pull"``).
        ImportError: ``compression`` is set and ``cramjam`` is not installed.
    """

    limits: Limits = field(default_factory=Limits)
    read_buffer_size: int = DEFAULT_READ_BUFFER_SIZE
    allocator: Allocator | None = None
    oob_threshold: int = DEFAULT_OOB_THRESHOLD
    allow_pickle: bool = False
    handshake_timeout: float | None = DEFAULT_HANDSHAKE_TIMEOUT
    idle_timeout: float | None = None
    message_timeout: float | None = DEFAULT_MESSAGE_TIMEOUT
    min_receive_rate: int = DEFAULT_MIN_RECEIVE_RATE
    keepalive: float | None = None
    compression: tuple[str, ...] | str = ()
    receive_engine: str = "auto"

    def __post_init__(self) -> None:
        # Fail where the options are made, not at the first connection.
        if not isinstance(self.limits, Limits):
            raise TypeError(f"limits must be a Limits, not {type(self.limits).__name__}")
        for name in ("read_buffer_size", "oob_threshold", "min_receive_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        check_read_buffer_size(self.read_buffer_size)
        if self.min_receive_rate < 0:
            raise ValueError(f"min_receive_rate must not be negative, got {self.min_receive_rate}")
        if self.allocator is not None and not callable(self.allocator):
            raise TypeError("allocator must be callable (allocator(n) -> buffer) or None")
        if not isinstance(self.allow_pickle, bool):
            raise TypeError(f"allow_pickle must be a bool, not {type(self.allow_pickle).__name__}")
        self.serializer()  # checks oob_threshold
        check_seconds("handshake_timeout", self.handshake_timeout)
        check_seconds("idle_timeout", self.idle_timeout)
        check_seconds("message_timeout", self.message_timeout)
        check_seconds("keepalive", self.keepalive)
        compression = self.compression
        if isinstance(compression, str):
            compression = (compression,)
        elif not isinstance(compression, tuple) or not all(
            isinstance(name, str) for name in compression
        ):
            raise TypeError(
                f"compression must be a codec name or a tuple of them, not {compression!r}"
            )
        object.__setattr__(self, "compression", check_codecs(compression))
        if not isinstance(self.receive_engine, str):
            raise TypeError(
                f"receive_engine must be a str, not {type(self.receive_engine).__name__}"
            )
        if self.receive_engine not in RECEIVE_ENGINES:
            raise ValueError(
                f"receive_engine must be one of {', '.join(map(repr, RECEIVE_ENGINES))}, "
                f"not {self.receive_engine!r}"
            )

    def serializer(self, *, peer_accepts_pickle: bool = True) -> Serializer:
        """A serializer with these options' ``oob_threshold`` and ``allow_pickle``
        (pickling nothing when not ``peer_accepts_pickle``)."""
        return Serializer(
            oob_threshold=self.oob_threshold,
            allow_pickle=self.allow_pickle,
            peer_accepts_pickle=peer_accepts_pickle,
        )


class PooledOptionsKeywords(TypedDict, total=False):
    """The fields of :class:`Options` but ``idle_timeout``, as keyword
    arguments: what ``rpc.Pool`` takes, whose own ``idle_timeout`` is how long
    an unused connection is kept (its connections' comes from ``options=``)."""

    limits: Limits
    read_buffer_size: int
    allocator: Allocator | None
    oob_threshold: int
    allow_pickle: bool
    handshake_timeout: float | None
    message_timeout: float | None
    min_receive_rate: int
    keepalive: float | None
    compression: tuple[str, ...] | str
    receive_engine: str


class OptionsKeywords(PooledOptionsKeywords, total=False):
    """The fields of :class:`Options`, as keyword arguments."""

    idle_timeout: float | None


_DEFAULT: Final = Options()
_FIELDS: Final = frozenset(f.name for f in dataclasses.fields(Options))


def resolve_options(
    function: str, options: Options | None, keywords: Mapping[str, Any]
) -> Options:
    """``options`` (or the defaults) with ``keywords`` replacing its fields.

    Raises:
        TypeError: ``options`` is not an :class:`Options`, a keyword is not an
            option of ``function``, or a value has the wrong type.
        ValueError: a value is out of range.
    """
    if options is None:
        options = _DEFAULT
    elif not isinstance(options, Options):
        raise TypeError(f"options must be an anyio_comm.Options, not {type(options).__name__}")
    unknown = keywords.keys() - _FIELDS
    if unknown:
        raise TypeError(
            f"{function}() got unexpected keyword arguments: {', '.join(sorted(unknown))}"
        )
    return dataclasses.replace(options, **keywords) if keywords else options
