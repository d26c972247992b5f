"""What each side announces in its preamble: its receive limits and the capabilities it
accepts, and the handshake a peer's preamble makes of them (``docs/wire-format.md``,
sections 4 and 5). A module of its own, which the compiled build leaves in Python (see
``setup.py``): these are public types, and a compiled class would lose its docstring.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

from .errors import LocalProtocolError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["Capability", "Handshake", "Limits"]

_U32_MAX: Final = 2**32 - 1
_U64_MAX: Final = 2**64 - 1


@dataclass(frozen=True, slots=True)
class Limits:
    """Receive limits, checked on every message header before anything is allocated.

    Each side announces its limits in the preamble; a sender refuses (with
    :exc:`~anyio_comm.LocalProtocolError`) to send a message over the peer's
    limits, and a receiver closes the connection with
    :exc:`~anyio_comm.RemoteProtocolError` when a header exceeds its own.

    Attributes:
        max_frames: most frames in one message (the header alone is
            ``4 + 8 * max_frames`` bytes).
        max_frame_size: largest single frame, in bytes.
        max_message_size: largest sum of all frame lengths of one message.

    Raises:
        ValueError: a limit is negative or does not fit its wire field
            (u32 for ``max_frames``, u64 for the sizes).
    """

    max_frames: int = 16_384
    max_frame_size: int = 2**30
    max_message_size: int = 2**31

    def __post_init__(self) -> None:
        for name, value, top in (
            ("max_frames", self.max_frames, _U32_MAX),
            ("max_frame_size", self.max_frame_size, _U64_MAX),
            ("max_message_size", self.max_message_size, _U64_MAX),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
            if not 0 <= value <= top:
                raise ValueError(f"{name} must be between 0 and {top}, got {value}")

    def check_send(self, lengths: Sequence[int]) -> None:
        """Check a message about to be sent against these (the peer's) limits.

        Raises:
            LocalProtocolError: the message has too many frames, a frame that
                is too large, or a total size over ``max_message_size``.
        """
        if (
            len(lengths) <= self.max_frames
            and max(lengths, default=0) <= self.max_frame_size
            and sum(lengths) <= self.max_message_size
        ):
            return
        if len(lengths) > self.max_frames:
            raise LocalProtocolError(
                f"message has {len(lengths)} frames; the peer accepts at most {self.max_frames}"
            )
        total = 0
        for length in lengths:
            if length > self.max_frame_size:
                raise LocalProtocolError(
                    f"frame of {length} bytes exceeds the peer's limit of "
                    f"{self.max_frame_size} bytes per frame"
                )
            total += length
        if total > self.max_message_size:
            raise LocalProtocolError(
                f"message of {total} bytes exceeds the peer's limit of "
                f"{self.max_message_size} bytes per message"
            )


class Capability(enum.IntEnum):
    """What a side announces in its preamble that it accepts (protocol version 2;
    ``docs/wire-format.md``, section 4.10). A feature is used on a connection only
    towards a peer that announced it."""

    #: the side accepts close records (it learns why the peer closed)
    CLOSE_REASONS = 1
    #: the side accepts pickled objects (its ``allow_pickle`` is on)
    PICKLE = 2
    #: the side accepts compressed frames, of the codecs it lists
    #: (:attr:`Handshake.compression`)
    COMPRESSION = 3


@dataclass(frozen=True, slots=True)
class Handshake:
    """What a peer announced in its preamble.

    Attributes:
        version: the connection's protocol version: the lower of the highest
            version the peer speaks and ours.
        limits: the peer's receive limits.
        capabilities: what the peer accepts (always empty on a version-1
            connection; capabilities this implementation does not know are
            left out).
        compression: the codecs the peer decompresses (``"lz4"``,
            ``"zstd"``), in its order of preference; empty unless
            ``capabilities`` has ``COMPRESSION``.
    """

    version: int
    limits: Limits
    capabilities: frozenset[Capability] = field(default_factory=frozenset)
    compression: tuple[str, ...] = ()
