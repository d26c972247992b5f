"""The ``Buffer`` type (PEP 688) for every Python version we support."""

from __future__ import annotations

import sys

if sys.version_info >= (3, 12):
    from collections.abc import Buffer as Buffer
else:
    from typing_extensions import Buffer as Buffer

__all__ = ["Buffer"]
