"""The RPC messages: ordinary anyio-comm messages, each a MessagePack array
whose first item says its kind (docs/guides/rpc.md, "Wire format").

========== ===================================================================== =========
kind       items                                                                 sent by
========== ===================================================================== =========
0 CALL     ``0, id, method, args, kwargs, timeout, stream[, metadata[, input]]`` client
1 RESULT   ``1, id, value[, trailers]``                                          server
2 ERROR    ``2, id, code, type, message[, trailers[, status]]``              server
3 CANCEL   ``3, id``                                                             client
4 NOTIFY   ``4, method, args, kwargs[, metadata]``                               client
5 ITEM     ``5, id, value``                                                      either
6 CREDIT   ``6, id, count``                                                      either
7 END      ``7, id``                                                             client
8 PING     ``8, token``                                                          client
9 PONG     ``9, token``                                                          server
========== ===================================================================== =========

``id`` is the client's number for the call (an unsigned 64-bit integer, never
reused on one connection while the call runs); ``args`` an array, ``kwargs`` a
map with str keys; ``timeout`` the seconds the call may still take when it is
sent (a float or int, at least 0), or nil for none; ``stream`` true when the
client wants the results as a stream. A streaming call's results come as ITEM
messages, each allowed by a CREDIT (its CALL grants none: the client sends
CREDIT as it wants items), and it ends with a RESULT (nil) or an ERROR. Every
CALL gets exactly one RESULT or ERROR, unless the client cancelled it (CANCEL):
then it may get one or none. ``input`` true makes the call take a stream of
items from the client too: the client's ITEMs, each allowed by the server's
CREDIT, ended by END. A server answers each PING at once with a PONG of the
same ``token`` (an unsigned 64-bit integer). ``metadata`` and ``trailers`` are maps of str keys
to str or bytes values (:func:`check_metadata` bounds them); a CALL's
``metadata`` may be nil (none) when ``input`` follows; a reply carries
trailers only if its CALL carried metadata. Items beyond those of a message's
kind are ignored, so that later additions reach older peers harmlessly. A
client announces what it understands of these additions with a NOTIFY of
:data:`HELLO_METHOD` (its first message); an ERROR's ``status`` (an
application's status and details) goes only to a client that announced
``"status"``. Nothing here does I/O.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "FEATURES",
    "HELLO_METHOD",
    "MAX_ID",
    "MAX_METADATA_BYTES",
    "MAX_METADATA_ENTRIES",
    "MAX_METADATA_KEY",
    "PING_TIMEOUT_CODE",
    "Call",
    "Cancel",
    "Credit",
    "End",
    "ErrorCode",
    "ErrorReply",
    "Item",
    "Notify",
    "Ping",
    "Pong",
    "ProtocolViolation",
    "Result",
    "check_metadata",
    "decode",
]

MAX_ID: Final = 2**64 - 1
#: the method of the NOTIFY in which a client announces the features it
#: understands (a list of str: its only argument); no handler may take it
HELLO_METHOD: Final = "rpc.hello"
#: the features a client of this version announces
FEATURES: Final = ("status",)
#: the close code of a client whose ping went unanswered (one of the error
#: codes the wire format leaves to applications)
PING_TIMEOUT_CODE: Final = 0xC000
#: metadata (or trailers) of one call: at most this many entries ...
MAX_METADATA_ENTRIES: Final = 64
#: ... keys of at most this many characters ...
MAX_METADATA_KEY: Final = 128
#: ... and this many bytes of keys (UTF-8) and values in all
MAX_METADATA_BYTES: Final = 16 * 1024

#: metadata and trailers as they travel
Metadata = dict[str, str | bytes]


def check_metadata(metadata: object, what: str = "metadata") -> Metadata:
    """``metadata`` as a dict, if it is a map of str keys (non-empty, at most
    :data:`MAX_METADATA_KEY` characters) to str or bytes values, within
    :data:`MAX_METADATA_ENTRIES` entries and :data:`MAX_METADATA_BYTES` bytes.

    Raises:
        ValueError: it is not, saying why (``what`` names it).
    """
    if not isinstance(metadata, dict):
        if not isinstance(metadata, Mapping):
            raise ValueError(f"{what} must be a map, not {type(metadata).__name__}")
        metadata = dict(metadata)
    if len(metadata) > MAX_METADATA_ENTRIES:
        raise ValueError(f"{what} has {len(metadata)} entries, more than {MAX_METADATA_ENTRIES}")
    size = 0
    for key, value in metadata.items():
        if type(key) is not str or not 0 < len(key) <= MAX_METADATA_KEY:
            raise ValueError(
                f"{what} keys must be non-empty strs of at most {MAX_METADATA_KEY} characters,"
                f" not {key!r:.40}"
            )
        if type(value) is str:
            size += len(value.encode("utf-8", "surrogatepass"))
        elif type(value) is bytes:
            size += len(value)
        else:
            raise ValueError(
                f"{what} values must be str or bytes, not {type(value).__name__} (key {key!r})"
            )
        size += len(key.encode("utf-8", "surrogatepass"))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"{what} holds {size} bytes, more than {MAX_METADATA_BYTES}")
    return metadata


class Kind(enum.IntEnum):
    CALL = 0
    RESULT = 1
    ERROR = 2
    CANCEL = 3
    NOTIFY = 4
    ITEM = 5
    CREDIT = 6
    END = 7
    PING = 8
    PONG = 9


class ErrorCode(str, enum.Enum):
    """Why a call failed, as an ERROR message says it."""

    #: the handler raised an exception: ``type`` and ``message`` are its class's
    #: name and its ``str()``
    ERROR = "error"
    #: the server has no method of that name
    METHOD_NOT_FOUND = "method-not-found"
    #: the arguments do not match the method's signature
    INVALID_ARGUMENTS = "invalid-arguments"
    #: the server is at its limit of concurrent calls and rejects more
    OVERLOADED = "overloaded"
    #: the call's timeout passed on the server, which cancelled its handler
    DEADLINE_EXCEEDED = "deadline-exceeded"
    #: the server is shutting down and takes no new calls
    UNAVAILABLE = "unavailable"
    #: the call itself was malformed (for example a streaming method called
    #: without streaming)
    BAD_CALL = "bad-call"


class ProtocolViolation(ValueError):
    """A message that is not a valid RPC message."""


@dataclass(slots=True)
class Call:
    id: int
    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    timeout: float | None
    stream: bool = False
    #: ``None``: the CALL has no metadata item (a client that sends none), or a
    #: nil one before ``input``
    metadata: Metadata | None = None
    #: the client sends the call a stream of items (ITEM ... END)
    input: bool = False

    def encode(self) -> list[Any]:
        message: list[Any] = [
            Kind.CALL,
            self.id,
            self.method,
            self.args,
            self.kwargs,
            self.timeout,
            self.stream,
        ]
        if self.input:
            message += (self.metadata, True)
        elif self.metadata is not None:
            message.append(self.metadata)
        return message


@dataclass(slots=True)
class Result:
    id: int
    value: Any
    trailers: Metadata | None = None

    def encode(self) -> list[Any]:
        if self.trailers is None:
            return [Kind.RESULT, self.id, self.value]
        return [Kind.RESULT, self.id, self.value, self.trailers]


@dataclass(slots=True)
class ErrorReply:
    id: int
    code: ErrorCode
    type: str
    message: str
    trailers: Metadata | None = None
    #: an application's status and details (``ApplicationError``), sent only
    #: to a client that announced the ``status`` feature
    status: tuple[int | str, Any] | None = None

    def encode(self) -> list[Any]:
        message: list[Any] = [Kind.ERROR, self.id, self.code.value, self.type, self.message]
        if self.status is not None:
            trailers = {} if self.trailers is None else self.trailers
            message += (trailers, list(self.status))
        elif self.trailers is not None:
            message.append(self.trailers)
        return message


@dataclass(slots=True)
class Cancel:
    id: int

    def encode(self) -> list[Any]:
        return [Kind.CANCEL, self.id]


@dataclass(slots=True)
class Notify:
    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    metadata: Metadata | None = None

    def encode(self) -> list[Any]:
        if self.metadata is None:
            return [Kind.NOTIFY, self.method, self.args, self.kwargs]
        return [Kind.NOTIFY, self.method, self.args, self.kwargs, self.metadata]


@dataclass(slots=True)
class Item:
    id: int
    value: Any

    def encode(self) -> list[Any]:
        return [Kind.ITEM, self.id, self.value]


@dataclass(slots=True)
class Credit:
    id: int
    count: int

    def encode(self) -> list[Any]:
        return [Kind.CREDIT, self.id, self.count]


@dataclass(slots=True)
class End:
    id: int

    def encode(self) -> list[Any]:
        return [Kind.END, self.id]


@dataclass(slots=True)
class Ping:
    token: int

    def encode(self) -> list[Any]:
        return [Kind.PING, self.token]


@dataclass(slots=True)
class Pong:
    token: int

    def encode(self) -> list[Any]:
        return [Kind.PONG, self.token]


Message = Call | Result | ErrorReply | Cancel | Notify | Item | Credit | End | Ping | Pong

_LENGTHS: Final[dict[int, int]] = {
    Kind.CALL: 7,
    Kind.RESULT: 3,
    Kind.ERROR: 5,
    Kind.CANCEL: 2,
    Kind.NOTIFY: 4,
    Kind.ITEM: 3,
    Kind.CREDIT: 3,
    Kind.END: 2,
    Kind.PING: 2,
    Kind.PONG: 2,
}
_CODES: Final = {code.value: code for code in ErrorCode}


def _id(value: object, what: str = "a call id") -> int:
    if type(value) is not int or not 0 <= value <= MAX_ID:
        raise ProtocolViolation(f"{what} must be an integer from 0 to 2**64-1, not {value!r}")
    return value


def _str(value: object, what: str) -> str:
    if type(value) is not str:
        raise ProtocolViolation(f"{what} must be a string, not {type(value).__name__}")
    return value


def _metadata(value: object, what: str) -> Metadata:
    """A message's metadata or trailers item, checked."""
    try:
        return check_metadata(value, what)
    except ValueError as exc:
        raise ProtocolViolation(str(exc)) from None


def _arguments(args: object, kwargs: object) -> tuple[list[Any], dict[str, Any]]:
    if type(args) is not list:
        raise ProtocolViolation(f"args must be an array, not {type(args).__name__}")
    if type(kwargs) is not dict or not all(type(key) is str for key in kwargs):
        raise ProtocolViolation("kwargs must be a map with string keys")
    return args, kwargs


def _status(value: object) -> tuple[int | str, Any] | None:
    """An ERROR's status item: ``[status, details]``, the status an integer or
    a str; nil for none."""
    if value is None:
        return None
    if type(value) is not list or len(value) != 2:
        raise ProtocolViolation("a status must be an array of a status and its details")
    status, details = value
    if type(status) is not str and (type(status) is not int or isinstance(status, bool)):
        raise ProtocolViolation(f"a status must be an integer or a string, not {status!r:.40}")
    return status, details


def _call_extras(message: list[Any]) -> tuple[Metadata | None, bool]:
    """A CALL's optional items: its metadata (nil: none, allowed when ``input``
    follows) and ``input``."""
    if len(message) == 7:
        return None, False
    metadata = message[7]
    if len(message) == 8:
        return _metadata(metadata, "metadata"), False
    wants_input = message[8]
    if type(wants_input) is not bool:
        raise ProtocolViolation(f"input must be true or false, not {wants_input!r}")
    return (None if metadata is None else _metadata(metadata, "metadata")), wants_input


def decode(message: object) -> Message:
    """The RPC message ``message`` (a received anyio-comm message) stands for.

    Raises:
        ProtocolViolation: it is not an array of one of the kinds above, with
            items of the types they must have.
    """
    try:
        return _decode(message)
    except ProtocolViolation:
        raise
    except (TypeError, ValueError, OverflowError) as exc:  # a value nothing expected
        raise ProtocolViolation(f"malformed RPC message: {exc}") from exc


def _decode(message: object) -> Message:
    if type(message) is not list or not message:
        raise ProtocolViolation("an RPC message is a non-empty array")
    kind = message[0]
    if type(kind) is not int or kind not in _LENGTHS:
        raise ProtocolViolation(f"unknown RPC message kind {kind!r}")
    if len(message) < _LENGTHS[kind]:
        raise ProtocolViolation(
            f"an RPC message of kind {kind} has at least {_LENGTHS[kind]} items,"
            f" not {len(message)}"
        )
    if kind == Kind.CALL:
        args, kwargs = _arguments(message[3], message[4])
        timeout = message[5]
        if timeout is not None and (
            type(timeout) not in (int, float) or not timeout >= 0 or math.isinf(timeout)
        ):
            raise ProtocolViolation(f"a timeout must be a finite number >= 0, not {timeout!r}")
        stream = message[6]
        if type(stream) is not bool:
            raise ProtocolViolation(f"stream must be true or false, not {stream!r}")
        return Call(
            _id(message[1]),
            _str(message[2], "a method name"),
            args,
            kwargs,
            timeout,
            stream,
            *_call_extras(message),
        )
    if kind == Kind.RESULT:
        if len(message) == 3:
            return Result(_id(message[1]), message[2])
        return Result(_id(message[1]), message[2], _metadata(message[3], "trailers"))
    if kind == Kind.ERROR:
        code = message[2]
        if type(code) is not str or code not in _CODES:
            raise ProtocolViolation(f"unknown error code {code!r}")
        return ErrorReply(
            _id(message[1]),
            _CODES[code],
            _str(message[3], "a type"),
            _str(message[4], "a message"),
            _metadata(message[5], "trailers") if len(message) > 5 else None,
            _status(message[6]) if len(message) > 6 else None,
        )
    if kind == Kind.CANCEL:
        return Cancel(_id(message[1]))
    if kind == Kind.NOTIFY:
        args, kwargs = _arguments(message[2], message[3])
        return Notify(
            _str(message[1], "a method name"),
            args,
            kwargs,
            _metadata(message[4], "metadata") if len(message) > 4 else None,
        )
    if kind == Kind.ITEM:
        return Item(_id(message[1]), message[2])
    if kind == Kind.END:
        return End(_id(message[1]))
    if kind == Kind.PING:
        return Ping(_id(message[1], "a ping token"))
    if kind == Kind.PONG:
        return Pong(_id(message[1], "a ping token"))
    count = message[2]
    if type(count) is not int or not 1 <= count <= MAX_ID:
        raise ProtocolViolation(f"a credit must be an integer from 1 to 2**64-1, not {count!r}")
    return Credit(_id(message[1]), count)
