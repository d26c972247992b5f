"""``python -m benchmarks.connect_latency``: a short run in subprocesses, over TCP and TLS,
its figures consistent with each other (never how fast anything is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
TIMEOUT = 120  # seconds for the whole command


@pytest.mark.parametrize("transport", ["tcp", "tls"])
def test_a_short_run_measures_both_modes(tmp_path: Path, transport: str) -> None:
    out = tmp_path / "latency.json"
    command = [sys.executable, "-m", "benchmarks.connect_latency", "--block", "3"]
    command += ["--rounds", "2", "--transport", transport, "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "waits/early, medians:" in done.stdout
    data = json.loads(out.read_text())
    assert data["metadata"]["command"][:2] == ["python", "-m"]
    results = data["results"]
    assert {r["backend"] for r in results} >= {"asyncio"}
    for r in results:
        assert r["transport"] == transport
        assert r["connections"] == 3 * 2 * (2 + 1)  # both modes, the rounds and the warm-up
        for mode in ("waits", "early"):
            connect, total = r["figures"][mode]["connect"], r["figures"][mode]["total"]
            assert 0 < connect["p50"] < total["p50"] <= total["p99"] <= total["max"]
        assert r["round_ratio_min"] <= r["round_ratio_max"]
