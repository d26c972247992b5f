"""``python -m benchmarks.buffer_pool``: a short run per backend in subprocesses, its
targets met and its figures consistent with each other (never how fast anything is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.buffer_pool import Case, message_sizes

ROOT = Path(__file__).parents[1]
TIMEOUT = 120  # seconds for the whole command


def test_message_sizes_are_reproducible_and_in_range() -> None:
    case = Case("asyncio", messages=50, max_frame=4 * 2**20, hold=3)
    sizes = message_sizes(case)
    assert sizes == message_sizes(case)
    assert len(sizes) == 50
    assert all(1 <= len(frames) <= 8 for frames in sizes)
    assert all(64 * 1024 < n <= 4 * 2**20 for frames in sizes for n in frames)


def test_a_short_run_meets_its_targets(tmp_path: Path) -> None:
    out = tmp_path / "pool.json"
    command = [sys.executable, "-m", "benchmarks.buffer_pool", "--messages", "40"]
    command += ["--max-frame", "4MiB", "--hold", "3", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())["results"]
    assert {r["backend"] for r in results} >= {"asyncio"}
    for r in results:
        case = Case(r["backend"], r["messages"], r["max_frame"], r["hold"])
        frames = sum(len(m) for m in message_sizes(case))
        assert r["bytes"] == sum(map(sum, message_sizes(case)))
        assert r["reused"] + r["created"] == frames
        assert r["reused"] > 0
        assert 0 <= r["peak_free"] <= r["max_free_bytes"]
        assert r["trimmed"] == r["kept"]
        assert r["free_met"] and r["held_met"] and r["trim_met"]
