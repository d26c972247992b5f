"""Wire-format constants and encoders (see ``docs/wire-format.md``).

Everything on the wire is big-endian ("network order").

Connection preamble, sent by each side as soon as the connection is up::

    magic      8 bytes   89 41 43 4F 4D 4D 0D 0A  ("\\x89ACOMM\\r\\n")
    version    u16       highest protocol version the sender speaks (2)
    length     u16       length L of the body that follows, 20 <= L <= 1024
    body       L bytes   max_frames u32, max_frame_size u64, max_message_size
                         u64 (the sender's receive limits); from version 2,
                         capability entries to the end of the body, each
                         id u16, length u16, value (unknown ids are ignored);
                         in version 1, bytes past the limits are ignored

Each message after the preamble::

    count      u32       number of frames N
    lengths    N x u64   length of each frame
    frames               the N frames' bytes, back to back
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Final

from .compression import CODEC_NAMES, codec_ids
from .errors import RemoteProtocolError
from .handshake import Capability, Handshake, Limits

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    from ._buffer import Buffer

__all__ = [
    "COALESCE_THRESHOLD",
    "MAGIC",
    "PREAMBLE_FIXED_SIZE",
    "PROTOCOL_VERSION",
    "Capability",
    "Handshake",
    "Limits",
    "encode_header",
    "encode_message",
    "encode_preamble",
    "frames_to_iov",
    "parse_capabilities",
    "read_preamble",
]

MAGIC: Final = b"\x89ACOMM\r\n"
#: the highest protocol version this implementation speaks
PROTOCOL_VERSION: Final = 2
#: the first version whose preamble body has capability entries
CAPABILITIES_VERSION: Final = 2
#: magic + version + body length
PREAMBLE_FIXED_SIZE: Final = len(MAGIC) + 4
#: largest preamble body a reader accepts
MAX_PREAMBLE_BODY: Final = 1024

_PREAMBLE_HEAD = struct.Struct("!8sHH")
_PREAMBLE_BODY_V1 = struct.Struct("!IQQ")
PREAMBLE_BODY_V1_SIZE: Final = _PREAMBLE_BODY_V1.size
_ENTRY_HEAD = struct.Struct("!HH")
_COUNT = struct.Struct("!I")
_COUNT_AND_LENGTH = struct.Struct("!IQ")

#: buffers shorter than this are copied together into one piece before sending
COALESCE_THRESHOLD: Final = 2048

#: messages of up to this many frames have their header (un)packed by a prepared Struct
SMALL_COUNT: Final = 32
#: ``HEADERS[n]``: the whole header of an ``n``-frame message (count and lengths)
HEADERS: Final = tuple(struct.Struct(f"!I{n}Q") for n in range(SMALL_COUNT + 1))
#: ``LENGTHS[n]``: the lengths table of an ``n``-frame message
LENGTHS: Final = tuple(struct.Struct(f"!{n}Q") for n in range(SMALL_COUNT + 1))


def encode_preamble(
    limits: Limits,
    capabilities: Iterable[Capability] = (),
    version: int = PROTOCOL_VERSION,
    compression: Sequence[str] = (),
) -> bytes:
    """Return the connection preamble announcing ``limits`` and ``capabilities``
    (in increasing order of id; a version-1 preamble has none), and, with
    ``compression``, the ``COMPRESSION`` capability listing those codecs.

    Raises:
        ValueError: capabilities in a version-1 preamble, ``COMPRESSION`` without
            codecs, or an unknown codec.
    """
    body = _PREAMBLE_BODY_V1.pack(
        limits.max_frames, limits.max_frame_size, limits.max_message_size
    )
    wanted = set(capabilities)
    if compression:
        wanted.add(Capability.COMPRESSION)
    elif Capability.COMPRESSION in wanted:
        raise ValueError("the COMPRESSION capability needs codecs")
    if wanted:
        if version < CAPABILITIES_VERSION:
            raise ValueError("a version-1 preamble has no capabilities")
        for capability in sorted(wanted):
            value = codec_ids(compression) if capability is Capability.COMPRESSION else b""
            body += _ENTRY_HEAD.pack(capability, len(value)) + value
    return _PREAMBLE_HEAD.pack(MAGIC, version, len(body)) + body


def parse_preamble_head(data: Buffer) -> tuple[int, int]:
    """Unpack the fixed part of a preamble; return ``(version, body_length)``.

    ``data`` must hold :data:`PREAMBLE_FIXED_SIZE` bytes whose magic was checked.
    """
    _, version, length = _PREAMBLE_HEAD.unpack_from(data)
    return version, length


def parse_preamble_body(data: Buffer) -> Limits:
    """Unpack the limits at the start of a preamble body (what follows is left)."""
    max_frames, max_frame_size, max_message_size = _PREAMBLE_BODY_V1.unpack_from(data)
    return Limits(max_frames, max_frame_size, max_message_size)


def read_preamble(data: memoryview, version: int) -> tuple[Handshake, int] | None:
    """The preamble at the start of ``data``, as a side that speaks up to
    ``version`` reads it, and its length; ``None`` until it is whole.

    Raises:
        RemoteProtocolError: wrong magic (with a hint when it is a TLS record),
            an unsupported version, an invalid body length or a malformed body,
            as soon as the first wrong byte is in ``data``.
    """
    avail = data.nbytes
    head = data[: min(avail, len(MAGIC))]
    if head != MAGIC[: head.nbytes]:
        hint = ""
        # A TLS alert (21) or handshake (22) record, version 3.x: a TLS peer's
        # ClientHello, or a TLS server's answer to our plain-text preamble.
        if head.nbytes >= 2 and head[0] in (0x15, 0x16) and head[1] == 0x03:
            hint = (
                ": the peer sent a TLS record, it speaks TLS: "
                "use a tls:// address and an ssl_context"
            )
        shown = repr(bytes(data[:16])) + ("..." if avail > 16 else "")
        raise RemoteProtocolError(
            f"peer does not speak the anyio-comm protocol (bad magic: {shown}){hint}",
            rule="preamble",
        )
    if avail < PREAMBLE_FIXED_SIZE:
        return None
    peer_version, length = parse_preamble_head(data)
    if peer_version < 1:
        raise RemoteProtocolError(f"unsupported protocol version {peer_version}", rule="preamble")
    if not PREAMBLE_BODY_V1_SIZE <= length <= MAX_PREAMBLE_BODY:
        raise RemoteProtocolError(f"invalid preamble body length {length}", rule="preamble")
    end = PREAMBLE_FIXED_SIZE + length
    if avail < end:
        return None
    limits = parse_preamble_body(data[PREAMBLE_FIXED_SIZE:])
    version = min(peer_version, version)
    capabilities: frozenset[Capability] = frozenset()
    compression: tuple[str, ...] = ()
    if version >= CAPABILITIES_VERSION:
        capabilities, compression = parse_capabilities(
            data[PREAMBLE_FIXED_SIZE + PREAMBLE_BODY_V1_SIZE : end]
        )
    return Handshake(version, limits, capabilities, compression), end


def parse_capabilities(entries: Buffer) -> tuple[frozenset[Capability], tuple[str, ...]]:
    """Parse the capability entries of a version-2 preamble body (the bytes after
    its limits, to the end of the body); ids this implementation does not know
    are skipped, and so are value bytes it does not know. Return the
    capabilities, and the codecs of ``COMPRESSION`` that this implementation
    knows, in the peer's order (``COMPRESSION`` is left out when there are
    none).

    Raises:
        RemoteProtocolError: an entry runs past the end of the body, or an id
            appears twice.
    """
    view = memoryview(entries)
    seen: set[int] = set()
    known: set[Capability] = set()
    codecs: tuple[str, ...] = ()
    position = 0
    end = view.nbytes
    while position < end:
        if end - position < _ENTRY_HEAD.size:
            raise RemoteProtocolError(
                f"preamble capability entry cut off: {end - position} bytes left of "
                "its 4-byte head",
                rule="preamble",
            )
        ident, length = _ENTRY_HEAD.unpack_from(view, position)
        position += _ENTRY_HEAD.size + length
        if position > end:
            raise RemoteProtocolError(
                f"preamble capability {ident} of {length} bytes runs past the end of the body",
                rule="preamble",
            )
        if ident in seen:
            raise RemoteProtocolError(
                f"preamble capability {ident} appears twice", rule="preamble"
            )
        seen.add(ident)
        if ident == Capability.COMPRESSION:
            value = bytes(view[position - length : position])
            codecs = tuple(dict.fromkeys(CODEC_NAMES[i] for i in value if i in CODEC_NAMES))
            if codecs:
                known.add(Capability.COMPRESSION)
        elif ident in _KNOWN_CAPABILITIES:
            known.add(Capability(ident))
    return frozenset(known), codecs


_KNOWN_CAPABILITIES: Final = frozenset(int(capability) for capability in Capability)


def encode_header(lengths: Sequence[int]) -> bytes:
    """Return the header of a message whose frames have these lengths."""
    n = len(lengths)
    if n <= SMALL_COUNT:
        return HEADERS[n].pack(n, *lengths)
    return struct.pack(f"!I{n}Q", n, *lengths)


def unpack_count(data: Buffer, offset: int) -> int:
    """Unpack a frame count at ``offset``."""
    count: int = _COUNT.unpack_from(data, offset)[0]
    return count


#: ``unpack_count_and_length(data, offset) -> (count, first_length)``: the 12
#: bytes of a frame count and the first frame length (bound, to save a call)
unpack_count_and_length: Final = _COUNT_AND_LENGTH.unpack_from


def unpack_lengths(data: Buffer, offset: int, count: int) -> tuple[int, ...]:
    """Unpack ``count`` frame lengths starting at ``offset``."""
    if count <= SMALL_COUNT:
        return LENGTHS[count].unpack_from(data, offset)
    return struct.unpack_from(f"!{count}Q", data, offset)


def encode_message(frames: Sequence[memoryview]) -> list[Buffer]:
    """Return the buffers of one gather write sending the message ``frames``.

    The same bytes as ``frames_to_iov(encode_header(lengths), frames)``, with a
    shortcut for the common one-frame message: below
    :data:`COALESCE_THRESHOLD` it is a single ``bytes`` (header and frame
    joined), else the header and the caller's view.
    """
    if len(frames) == 1:
        frame = frames[0]
        size = frame.nbytes
        if size < COALESCE_THRESHOLD:
            return [_COUNT_AND_LENGTH.pack(1, size) + frame]
        return [_COUNT_AND_LENGTH.pack(1, size), frame]
    return frames_to_iov(encode_header([frame.nbytes for frame in frames]), frames)


def encode_frames(frames: Sequence[memoryview], lengths: Sequence[int]) -> list[Buffer]:
    """:func:`encode_message` for a caller that has the frames' ``lengths`` already."""
    count = len(frames)
    if count == 1:
        return encode_message(frames)
    if count == 2 and lengths[0] < COALESCE_THRESHOLD <= lengths[1]:
        # (the usual out-of-band message: a short body, then one large frame)
        return [HEADERS[2].pack(2, *lengths) + frames[0], frames[1]]
    return frames_to_iov(encode_header(lengths), frames)


def frames_to_iov(header: bytes, frames: Sequence[memoryview]) -> list[Buffer]:
    """Lay out ``header`` and ``frames`` as the buffers of one gather write.

    Runs of neighbouring buffers shorter than :data:`COALESCE_THRESHOLD` are
    copied together into one ``bytes`` (a memcpy of a few KiB is cheaper than
    an extra iovec and a kernel copy setup); larger frames are passed through
    as the caller's views, never copied. Empty frames are dropped.
    """
    iov: list[Buffer] = []
    pending: list[Buffer] = [header]
    for frame in frames:
        size = frame.nbytes
        if size < COALESCE_THRESHOLD:
            if size:
                pending.append(frame)
            continue
        if pending:
            iov.append(pending[0] if len(pending) == 1 else b"".join(pending))
            pending = []
        iov.append(frame)
    if pending:
        iov.append(pending[0] if len(pending) == 1 else b"".join(pending))
    return iov
