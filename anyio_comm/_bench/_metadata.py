"""What a benchmark run records about itself next to its figures: the command, the machine,
the pinning, the load and the versions; and the JSON file it is written to."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import sys
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping


def versions(*dists: str) -> dict[str, str | None]:
    """The installed version of each distribution (None: not installed)."""
    found: dict[str, str | None] = {}
    for dist in dists:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    return found


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def run_metadata(
    command: list[str],
    *,
    pinning: str,
    cpus: Mapping[str, int | None],
    load: tuple[Any, Any],
    versions: Mapping[str, str | None],
    executable: bool = False,
) -> dict[str, Any]:
    """The metadata of a run: the date, ``command``, Python (and its executable, with
    ``executable``), the platform, the CPUs, ``pinning`` and the CPU of each process
    (``cpus``: key -> CPU), the load averages before and after (``load``) and ``versions``."""
    metadata: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "python": sys.version,
    }
    if executable:
        metadata["executable"] = sys.executable
    return {
        **metadata,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "pinning": pinning,
        **cpus,
        "load_average_before": load[0],
        "load_average_after": load[1],
        "versions": dict(versions),
    }


def write_json(path: str, data: Mapping[str, Any]) -> None:
    """Write ``data`` to ``path`` as indented JSON.

    Raises:
        OSError: the file cannot be written.
    """
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")
