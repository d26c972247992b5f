"""Which form of the package was imported: pure Python, or with modules compiled by mypyc
(built with ``ANYIO_COMM_MYPYC=1``, see ``setup.py``)."""

from __future__ import annotations

import importlib
from importlib.machinery import EXTENSION_SUFFIXES

__all__ = ["COMPILABLE", "compiled_modules", "describe"]

#: the modules a compiled build compiles (``setup.py``'s list, as module names)
COMPILABLE = (
    "anyio_comm._sansio.decoder",
    "anyio_comm._sansio.serialization",
    "anyio_comm._sansio.connection",
    "anyio_comm._sansio.wire",
)


def compiled_modules() -> tuple[str, ...]:
    """The modules of :data:`COMPILABLE` that were imported from a C extension (none for
    the pure-Python build)."""
    return tuple(
        name
        for name in COMPILABLE
        if (importlib.import_module(name).__file__ or "").endswith(tuple(EXTENSION_SUFFIXES))
    )


def describe() -> str:
    """One line for ``anyio-comm --version``: the build's form."""
    names = compiled_modules()
    if not names:
        return "pure Python"
    return "compiled with mypyc: " + ", ".join(name.rpartition(".")[2] for name in names)
