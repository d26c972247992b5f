"""The errors a remote call raises.

::

    CommError
     └── RPCError                     a call failed on the server, or its reply
          │                           could not be had
          ├── RemoteError             the handler raised: ``remote_type`` and
          │                           ``remote_message`` are its exception's class
          │                           name and message
          │    └── ApplicationError   ... an error of the application's, with its
          │                           own ``status`` and ``details``
          ├── MethodNotFoundError     the server has no method of that name
          ├── InvalidArgumentsError   (also a TypeError) the arguments do not
          │                           match the method's signature
          ├── OverloadedError         the server was at its limit of concurrent
          │                           calls and rejected the call
          ├── DeadlineExceededError   (also a TimeoutError) the call's timeout
          │                           passed on the server, which cancelled it
          ├── UnavailableError        the server shut down, or the connection was
          │                           lost, before the call's reply came
          └── BadCallError            the server refused the call as malformed
"""

from __future__ import annotations

from typing import Any, Final

from .._sansio.errors import CommError, set_public_module
from ._protocol import ErrorCode

__all__ = [
    "ApplicationError",
    "BadCallError",
    "DeadlineExceededError",
    "InvalidArgumentsError",
    "MethodNotFoundError",
    "OverloadedError",
    "RPCError",
    "RemoteError",
    "UnavailableError",
    "error_for",
]


class RPCError(CommError):
    """A remote call failed.

    Attributes:
        method: the method called.
        remote_type: the server's name for what went wrong (for
            :exc:`RemoteError`, the class name of the handler's exception).
        remote_message: the server's message.
        trailers: what the handler sent back with the error, for a call made
            with metadata (``Client.with_metadata``); empty otherwise.
    """

    # (not annotated: typing.get_type_hints() would look ErrorCode up in
    # anyio_comm.rpc, the module the class says it comes from)
    code = ErrorCode.ERROR

    def __init__(self, method: str, remote_type: str, remote_message: str) -> None:
        self.method = method
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.trailers: dict[str, str | bytes] = {}
        super().__init__(self._describe())

    def _describe(self) -> str:
        return f"{self.method}(): {self.remote_type}: {self.remote_message}"

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.method, self.remote_type, self.remote_message),
            {"trailers": self.trailers},
        )


class RemoteError(RPCError):
    """The handler raised an exception (its class name and message are here; its
    traceback stays on the server)."""


class ApplicationError(RemoteError):
    """An error of the application's own, with a ``status`` it defines and
    structured ``details``: a handler (or a server interceptor) raises
    ``rpc.ApplicationError("not-found", "no such key", details={"key": key})``,
    and the caller gets an ApplicationError with the same status, message and
    details, typed, without pickle (a caller from before it gets a
    :exc:`RemoteError` with the message).

    Args:
        status: an int or a str, which the application defines.
        message: what went wrong, for people.
        details: any value a message can carry (maps, lists, str, bytes,
            numbers): what a program needs to act on the error.

    Raises:
        TypeError: ``status`` is neither an int nor a str.

    Attributes:
        status: the status the handler gave.
        details: the details the handler gave (``None`` for none).
    """

    def __init__(self, status: int | str, message: str, details: Any = None) -> None:
        if type(status) is not str and (type(status) is not int or isinstance(status, bool)):
            raise TypeError(f"status must be an int or a str, not {type(status).__name__}")
        self.status = status
        self.details = details
        super().__init__("", type(self).__name__, message)

    def _describe(self) -> str:
        where = f"{self.method}(): " if self.method else ""
        return f"{where}{self.remote_type} [{self.status!r}]: {self.remote_message}"

    @classmethod
    def received(
        cls, method: str, remote_type: str, message: str, status: int | str, details: Any
    ) -> ApplicationError:
        """The error a caller raises for an ERROR reply with a status."""
        error = cls(status, message, details)
        error.method = method
        error.remote_type = remote_type
        error.args = (error._describe(),)
        return error

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.status, self.remote_message, self.details),
            {"method": self.method, "remote_type": self.remote_type, "trailers": self.trailers},
        )

    def __setstate__(self, state: dict[str, Any] | None) -> None:
        self.__dict__.update(state or {})
        self.args = (self._describe(),)


class MethodNotFoundError(RPCError):
    """The server has no method of that name."""

    code = ErrorCode.METHOD_NOT_FOUND


class InvalidArgumentsError(RPCError, TypeError):
    """The arguments do not match the method's signature."""

    code = ErrorCode.INVALID_ARGUMENTS


class OverloadedError(RPCError):
    """The server was at its limit of concurrent calls and rejected the call."""

    code = ErrorCode.OVERLOADED


class DeadlineExceededError(RPCError, TimeoutError):
    """The call's timeout passed on the server, which cancelled its handler."""

    code = ErrorCode.DEADLINE_EXCEEDED


class UnavailableError(RPCError):
    """The server shut down, or the connection to it was lost, before the reply
    came: the call may or may not have run."""

    code = ErrorCode.UNAVAILABLE


class BadCallError(RPCError):
    """The server refused the call as malformed."""

    code = ErrorCode.BAD_CALL


_CLASSES: Final = {
    cls.code: cls
    for cls in (
        RemoteError,
        MethodNotFoundError,
        InvalidArgumentsError,
        OverloadedError,
        DeadlineExceededError,
        UnavailableError,
        BadCallError,
    )
}

set_public_module("anyio_comm.rpc", RPCError, ApplicationError, *_CLASSES.values())


def error_for(method: str, code: ErrorCode, remote_type: str, remote_message: str) -> RPCError:
    """The exception an ERROR reply with this code stands for."""
    return _CLASSES[code](method, remote_type, remote_message)
