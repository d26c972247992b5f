"""Close records: why a side closes the connection, told to the peer in-band.

A close record (``docs/wire-format.md``, section 7.2) stands where a message
header would, once both sides speak protocol version 2 and the receiving side
announced the ``CLOSE_REASONS`` capability::

    marker       u32   FF FF FF FF (a frame count no message has)
    code         u16   a CloseCode, or an application's own code
    name_length  u8    0 to 255
    name         UTF-8 which rule, limit or exception class (may be empty)
    text_length  u16   0 to 1024
    text         UTF-8 a short human-readable explanation (may be empty)

Codes without bit 15 (``0x0000`` to ``0x7FFF``) say that the side closed
cleanly: nothing it received was dropped. Codes with bit 15 say it closed
because of an error, so a message may have been lost.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from .errors import RemoteProtocolError, printable

if TYPE_CHECKING:
    from ._buffer import Buffer

__all__ = [
    "CLOSE_MARKER",
    "MAX_CLOSE_NAME",
    "MAX_CLOSE_TEXT",
    "CloseCode",
    "CloseReason",
    "encode_close_record",
    "parse_close_record",
    "reason_for_protocol_error",
]

#: the 4 bytes where a frame count would be that begin a close record
CLOSE_MARKER: Final = 0xFFFF_FFFF
#: longest name of a close record, in bytes of UTF-8
MAX_CLOSE_NAME: Final = 255
#: longest text of a close record, in bytes of UTF-8
MAX_CLOSE_TEXT: Final = 1024
#: a code with this bit closes because of an error
ERROR_BIT: Final = 0x8000

_HEAD = struct.Struct("!IHB")  # marker, code, name length
_TEXT_LENGTH = struct.Struct("!H")


class CloseCode(enum.IntEnum):
    """The close codes this protocol defines (wire-format section 7.2).

    Codes ``0x4000`` to ``0x7FFF`` (clean) and ``0xC000`` to ``0xFFFF`` (error)
    are left to applications.
    """

    #: the application closed the connection; nothing was lost
    NORMAL = 0x0000
    #: the side is shutting down (a listener's shutdown)
    GOING_AWAY = 0x0001
    #: nothing arrived for the side's idle timeout, between messages
    IDLE_TIMEOUT = 0x0002
    #: the peer broke the wire format or the message encoding; ``name`` says which rule
    PROTOCOL_ERROR = 0x8000
    #: a message header was over the side's receive limits; ``name`` says which limit
    LIMIT_EXCEEDED = 0x8001
    #: a message that had begun did not complete in time
    MESSAGE_TIMEOUT = 0x8002
    #: the application failed while handling the connection; ``name`` is the
    #: exception's class name, ``text`` its message
    HANDLER_ERROR = 0x8003
    #: the side stopped while it was handling a message (a shutdown's grace
    #: period ran out, or it was cancelled): its reply may be lost
    INTERRUPTED = 0x8004


@dataclass(frozen=True, slots=True)
class CloseReason:
    """Why a side closed the connection, as its close record says.

    ``name`` and ``text`` hold exactly what the peer sent, control characters
    and all (NUL, terminal escape sequences, line breaks, bidirectional
    overrides), for a program that wants the text itself: escape them before
    showing them. ``str()`` of a reason, and so every exception message and
    log line of the package that shows one, has them escaped as Python escapes
    them in a string's ``repr()`` (``\\x1b``, ``\\u202e``), so a peer's reason
    cannot clear a terminal, retitle it or forge a log line.

    Attributes:
        code: a :class:`CloseCode`, or an application's own code (an ``int``
            from 0 to 65535).
        name: which rule, limit or exception class (at most 255 bytes of UTF-8),
            as sent.
        text: a short explanation (at most 1024 bytes of UTF-8), as sent.

    Raises:
        ValueError: ``code`` is out of range, ``name`` or ``text`` is too long,
            or not encodable as UTF-8 (a lone surrogate).
        TypeError: a field has the wrong type.
    """

    code: int
    name: str = ""
    text: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.code, bool) or not isinstance(self.code, int):
            raise TypeError(f"code must be an int, not {type(self.code).__name__}")
        if not 0 <= self.code <= 0xFFFF:
            raise ValueError(f"code must be between 0 and 65535, got {self.code}")
        for field, limit in (("name", MAX_CLOSE_NAME), ("text", MAX_CLOSE_TEXT)):
            value = getattr(self, field)
            if not isinstance(value, str):
                raise TypeError(f"{field} must be a str, not {type(value).__name__}")
            try:
                size = len(value.encode("utf-8"))
            except UnicodeEncodeError as exc:
                raise ValueError(f"{field} is not encodable as UTF-8: {exc}") from None
            if size > limit:
                raise ValueError(f"{field} is {size} bytes of UTF-8; at most {limit} fit")
        if isinstance(self.code, int) and not isinstance(self.code, CloseCode):
            try:
                object.__setattr__(self, "code", CloseCode(self.code))
            except ValueError:
                pass

    @classmethod
    def shortened(cls, code: int, name: str = "", text: str = "") -> CloseReason:
        """A reason whose ``name`` and ``text`` are cut to what fits (at a
        character boundary, marked with ``...``), what UTF-8 cannot encode (a
        lone surrogate) replaced by ``?``."""
        return cls(code, _cut(name, MAX_CLOSE_NAME), _cut(text, MAX_CLOSE_TEXT))

    @property
    def clean(self) -> bool:
        """True when the code says the side closed without losing anything."""
        return not self.code & ERROR_BIT

    def __str__(self) -> str:
        """The code's name, then the name and text with every character that is
        not printable escaped (see the class)."""
        code = self.code
        label = code.name if isinstance(code, CloseCode) else f"code {code:#06x}"
        detail = ": ".join(printable(part) for part in (self.name, self.text) if part)
        return f"{label} ({detail})" if detail else label


def _cut(value: str, limit: int) -> str:
    data = value.encode("utf-8", "replace")
    if len(data) <= limit:
        return data.decode("utf-8")
    return data[: limit - 3].decode("utf-8", "ignore") + "..."


#: the rules of a RemoteProtocolError that are our receive limits
_LIMIT_RULES: Final = frozenset({"max_frames", "max_frame_size", "max_message_size"})


def reason_for_protocol_error(error: RemoteProtocolError) -> CloseReason:
    """The reason to tell a peer that broke the protocol with ``error``."""
    code = CloseCode.LIMIT_EXCEEDED if error.rule in _LIMIT_RULES else CloseCode.PROTOCOL_ERROR
    return CloseReason.shortened(code, error.rule, str(error))


def encode_close_record(reason: CloseReason) -> bytes:
    """Return the close record saying ``reason``."""
    name = reason.name.encode("utf-8")
    text = reason.text.encode("utf-8")
    return (
        _HEAD.pack(CLOSE_MARKER, reason.code, len(name))
        + name
        + _TEXT_LENGTH.pack(len(text))
        + text
    )


def parse_close_record(data: Buffer, start: int, end: int) -> tuple[CloseReason, int] | None:
    """Parse the close record at ``data[start:end]`` (its marker checked already).

    Returns:
        The reason and the offset just after the record, or ``None`` when the
        record is not complete yet (it is at most 1288 bytes long).

    Raises:
        RemoteProtocolError: the text is longer than 1024 bytes, or the name or
            the text is not valid UTF-8.
    """
    view = memoryview(data)
    if end - start < _HEAD.size:
        return None
    _, code, name_length = _HEAD.unpack_from(view, start)
    position = start + _HEAD.size + name_length
    if end - position < _TEXT_LENGTH.size:
        return None
    (text_length,) = _TEXT_LENGTH.unpack_from(view, position)
    if text_length > MAX_CLOSE_TEXT:
        raise RemoteProtocolError(
            f"close record text of {text_length} bytes (at most {MAX_CLOSE_TEXT})",
            rule="wire-format",
        )
    text_start = position + _TEXT_LENGTH.size
    stop = text_start + text_length
    if end < stop:
        return None
    try:
        name = bytes(view[start + _HEAD.size : position]).decode("utf-8")
        text = bytes(view[text_start:stop]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(
            f"close record that is not UTF-8: {exc}", rule="wire-format"
        ) from None
    return CloseReason(code, name, text), stop
