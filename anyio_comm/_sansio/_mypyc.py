"""What the modules that a build compiles with mypyc (``setup.py``) need."""

from __future__ import annotations

from typing import TypeVar

__all__ = ["python_class"]

_Class = TypeVar("_Class", bound=type)


def python_class(cls: _Class) -> _Class:
    """Keep ``cls`` a Python class in a module compiled with mypyc, which compiles no class
    that has a decorator it does not know. A compiled dataclass would store a bool given
    for an ``int`` field as 1, before ``__post_init__`` could refuse it, and would have no
    docstring."""
    return cls
