"""The protocol's own exceptions (no anyio: the sans-IO core raises them).

:mod:`anyio_comm._exceptions` re-exports them with the rest of the tree. Like
every exception the package exports, they carry the module users import them
from as their ``__module__`` (:func:`set_public_module`): a traceback reads
``anyio_comm.SerializationError``, and pickle finds them there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from .close import CloseReason

__all__ = [
    "CommError",
    "EndOfData",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "SerializationError",
    "describe",
    "printable",
    "set_public_module",
]

#: the longest description of a foreign exception that :func:`describe` returns
MAX_DESCRIPTION: Final = 300


def printable(text: str, limit: int | None = None) -> str:
    """``text`` fit to show in a message or a log line: every character that is
    not printable (control characters, line breaks, bidirectional overrides and
    other format characters) as its escape (``\\x1b``, ``\\u202e``), and cut
    to ``limit`` characters (ending in ``...``) if it is longer.

    For text that comes from a peer: it cannot clear a terminal, forge a log
    line or hide what follows it.
    """
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 3, 0)] + "..."
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception raised by a library on a peer's data,
    :func:`printable` and at most :data:`MAX_DESCRIPTION` characters (an
    exception's message may quote the data: never its ``repr()``)."""
    return printable(f"{type(exc).__name__}: {exc}", MAX_DESCRIPTION)


def set_public_module(module: str, *classes: type) -> None:
    """Make ``classes`` say that they come from ``module``, the public module that
    exports them (``anyio_comm``, ``anyio_comm.rpc``), not the private one that
    defines them: tracebacks, ``repr()`` and the docs show ``module.Name``, and
    pickle looks them up there. Their names must be attributes of ``module``
    (the package's are, imported on first use).
    """
    for cls in classes:
        cls.__module__ = module


class CommError(Exception):
    """Base class of every exception defined by anyio-comm."""


class ProtocolError(CommError):
    """A violation of the anyio-comm wire protocol.

    Abstract: only :exc:`LocalProtocolError` and :exc:`RemoteProtocolError` are
    ever raised, and instantiating this class directly raises :exc:`TypeError`.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> ProtocolError:  # noqa: ARG004
        if cls is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise a subclass")
        return super().__new__(cls)


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol (or the peer's limits) forbids.

    Raised before any byte of the offending message is written, so the comm is
    still usable.
    """


class RemoteProtocolError(ProtocolError):
    """The peer sent data that violates the wire format or message encoding.

    The connection is closed when this is raised; further operations on the
    comm raise :exc:`anyio.BrokenResourceError`.

    Attributes:
        rule: which rule the peer broke, as the close record sent to it names
            it (``docs/wire-format.md``, section 7.2): ``"max_frames"``,
            ``"max_frame_size"`` or ``"max_message_size"`` for a header over
            our limits, ``"preamble"`` for a bad preamble, ``"message-layer"``
            for a body that cannot be decoded, ``"wire-format"`` for any other
            violation.
    """

    def __init__(self, message: str = "", *, rule: str = "wire-format") -> None:
        super().__init__(message)
        self.rule = rule


class SerializationError(CommError, TypeError):
    """A message could not be serialized (unsupported type, too deep, ...).

    Raised before anything is sent; the comm stays usable.
    """


set_public_module(
    "anyio_comm",
    CommError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    SerializationError,
)


class EndOfData(Exception):
    """The byte stream ended (the I/O layer called ``receive_eof``), or the peer
    sent a close record.

    Attributes:
        truncated: ``False`` when the stream ended cleanly between messages (or
            at a close record); ``True`` when it ended inside a preamble, a
            message or a close record.
        reason: what the peer's close record said, if it sent one.
    """

    def __init__(
        self, message: str, *, truncated: bool, reason: CloseReason | None = None
    ) -> None:
        super().__init__(message)
        self.truncated = truncated
        self.reason = reason
