"""Values on a benchmark's command line: sizes in bytes and whole numbers, with the
argparse types that read them."""

from __future__ import annotations

import argparse
import math
import re
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from collections.abc import Callable

_UNITS: Final = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE: Final = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str, top: int | None = None) -> int:
    """Bytes from ``1000``, ``1e6``, ``1MB``, ``10 MB``, ``1KiB``, ``2.5kB`` (k, M, G, T:
    powers of 1000; Ki, Mi, Gi, Ti: powers of 1024; case-insensitive).

    Raises:
        ValueError: not a size, not a whole number of bytes, below 1 or above ``top``.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r} (examples: 1000, 1e6, 1MB, 64KiB)")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    if value < 1 or (top is not None and value > top):
        bounds = "at least 1 byte" if top is None else f"between 1 byte and {format_size(top)}"
        raise ValueError(f"size {text!r} must be {bounds}")
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


def byte_size(top: int | None = None) -> Callable[[str], int]:
    """An argparse type: a size in bytes as :func:`parse_size` reads it, at most ``top``."""

    def parse(text: str) -> int:
        try:
            return parse_size(text, top)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def whole_number(top: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number from 1 to ``top`` (None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < 1 or (top is not None and value > top):
            expected = "1 or more" if top is None else f"1 to {top}"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse
