"""Pieces shared by the bench server, the client processes and the command line."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import signal
import ssl
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import anyio

if TYPE_CHECKING:
    from collections.abc import Iterator
    from multiprocessing.connection import Connection

#: key of the first message on every bench connection; it names the role of the connection
#: (``"echo"`` or ``"control"``), so payload messages are never mistaken for control requests
HELLO_KEY: Final = "anyio-comm-bench"
PROTOCOL: Final = 1
HELLO_TIMEOUT: Final = 10.0
OOB_THRESHOLD: Final = 4096  # bytes-like values this large travel out-of-band (the default)
BACKENDS: Final = ("asyncio", "uvloop", "trio")
MAX_SIZE: Final = 2**30
MAX_FRAMES: Final = 1000
MAX_MESSAGE: Final = 2**31 - 2**20


class UsageError(Exception):
    """A bad command line: reported in one line, exit status 2."""


class RunError(Exception):
    """The run failed (refused address, a process died, ...): one line, exit status 1."""


def run_on(backend: str, func: Any, *args: Any) -> Any:
    """Run ``await func(*args)`` on ``backend`` (``asyncio``, ``uvloop`` or ``trio``)."""
    if backend == "uvloop":
        return anyio.run(func, *args, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(func, *args, backend=backend)


def install_hint(*extras: str) -> str:
    """The command that installs ``extras``: the package is installed from a clone of its
    repository (it is not on a package index)."""
    return f'pip install ".[{",".join(extras)}]" from a clone of the repository'


def check_backend(backend: str) -> None:
    """Raise :exc:`UsageError` when ``backend`` is not installed."""
    if backend in ("uvloop", "trio") and importlib.util.find_spec(backend) is None:
        raise UsageError(
            f"--backend {backend} needs the {backend} package: {install_hint('bench')} "
            "installs trio, uvloop and trustme"
        )


_UNITS: Final = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
}
_SIZE: Final = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str) -> int:
    """Bytes from ``1000``, ``1e6``, ``1MB``, ``10 MB``, ``1KiB``, ``2.5kB`` (k, M, G: powers of
    1000; Ki, Mi, Gi: powers of 1024; case-insensitive).

    Raises:
        ValueError: not a size, not a whole number of bytes, below 1 or above 1 GiB.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r} (examples: 1000, 1e6, 1MB, 64KiB)")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    if not 1 <= value <= MAX_SIZE:
        raise ValueError(f"size {text!r} must be between 1 byte and 1 GiB")
    return int(value)


def format_size(n: int) -> str:
    """``1000`` -> ``1 kB``, ``1048576`` -> ``1 MiB``, ``1500`` -> ``1500 B``."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def pin(cpu: int | None) -> None:
    """Run this process on ``cpu`` only (no-op for ``None``)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on, or ``[]`` where affinity is not available."""
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


@dataclass(frozen=True)
class ClientTLS:
    """What a client process needs to build its SSL context (picklable)."""

    cadata: str | None = None  # PEM of the CA to trust (local run: the trustme CA)
    cafile: str | None = None  # file of CAs to trust; neither: the system's default CAs
    certfile: str | None = None  # client certificate, for servers that require one
    keyfile: str | None = None
    server_hostname: str | None = None

    def context(self) -> ssl.SSLContext:
        """A client SSL context that verifies the server."""
        context = ssl.create_default_context(cafile=self.cafile, cadata=self.cadata)
        if self.certfile is not None:
            context.load_cert_chain(self.certfile, self.keyfile)
        return context


@dataclass(frozen=True)
class ServerTLS:
    """What the server needs to build its SSL context (picklable)."""

    certfile: str
    keyfile: str | None = None
    cafile: str | None = None  # given: client certificates are required and checked

    def context(self) -> ssl.SSLContext:
        """The server SSL context."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.certfile, self.keyfile)
        if self.cafile is not None:
            context.load_verify_locations(self.cafile)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


@contextlib.contextmanager
def child_process(conn: Connection, cpu: int | None) -> Iterator[None]:
    """The frame of a child process's entry point: Ctrl-C ignored (the parent stops the
    children), pinned to ``cpu``; a failure is sent on ``conn`` as ``("error", one_line)``
    and exits with status 1; ``conn`` is closed at the end."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pin(cpu)
        yield
    except BaseException as exc:
        with contextlib.suppress(OSError):
            conn.send(("error", one_line(exc)))
        sys.exit(1)
    finally:
        conn.close()


def one_line(exc: BaseException) -> str:
    """``exc`` as one line of text (the innermost of an exception group)."""
    inner: tuple[BaseException, ...] = getattr(exc, "exceptions", ())
    while len(inner) == 1:  # an exception group of one: report what it holds
        exc = inner[0]
        inner = getattr(exc, "exceptions", ())
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
