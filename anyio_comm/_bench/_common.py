"""Pieces shared by the bench server, the client processes and the command line: the bench
protocol, the errors of a run, and the event loops a run can use."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any, Final, TypeVar

import anyio

from .._sansio.errors import set_public_module

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

T = TypeVar("T")

#: key of the first message on every bench connection; it names the role of the connection
#: (``"echo"`` or ``"control"``), so payload messages are never mistaken for control requests
HELLO_KEY: Final = "anyio-comm-bench"
PROTOCOL: Final = 1
HELLO_TIMEOUT: Final = 10.0
MAX_SIZE: Final = 2**30
MAX_FRAMES: Final = 1000
MAX_MESSAGE: Final = 2**31 - 2**20

#: the event loops a benchmark runs on: name -> (AnyIO backend, its backend options)
_LOOPS: Final[dict[str, tuple[str, dict[str, Any]]]] = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}
BACKENDS: Final = tuple(_LOOPS)


class UsageError(Exception):
    """A bad command line: reported in one line, exit status 2."""


class RunError(Exception):
    """The run failed (refused address, a process died, ...): one line, exit status 1.

    ``details`` says more where there is more to say (the traceback of a child process
    that failed), else it is empty.
    """

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


set_public_module("anyio_comm.bench", RunError)


def run_backend(backend: str, func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await func(*args)`` on ``backend``: ``asyncio``, ``uvloop`` (asyncio with uvloop)
    or ``trio``."""
    name, options = _LOOPS[backend]
    return anyio.run(func, *args, backend=name, backend_options=options)


def backend_installed(backend: str) -> bool:
    """Whether the package ``backend`` needs is installed (uvloop and trio are optional)."""
    return backend == "asyncio" or importlib.util.find_spec(backend) is not None


def install_hint(*extras: str) -> str:
    """The command that installs ``extras``: the package is installed from a clone of its
    repository (it is not on a package index)."""
    return f'pip install ".[{",".join(extras)}]" from a clone of the repository'


def check_backend(backend: str) -> None:
    """Raise :exc:`UsageError` when ``backend`` is not installed."""
    if not backend_installed(backend):
        raise UsageError(
            f"--backend {backend} needs the {backend} package: {install_hint('bench')} "
            "installs trio, uvloop and trustme"
        )


def one_line(exc: BaseException) -> str:
    """``exc`` as one line of text (the innermost of an exception group)."""
    inner: tuple[BaseException, ...] = getattr(exc, "exceptions", ())
    while len(inner) == 1:  # an exception group of one: report what it holds
        exc = inner[0]
        inner = getattr(exc, "exceptions", ())
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
