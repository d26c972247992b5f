"""``python -m benchmarks.rpc_load``: a short run in subprocesses, its figures consistent
with each other (never how fast anything is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
TIMEOUT = 180  # seconds for the whole command


def test_a_short_run_measures_every_system(tmp_path: Path) -> None:
    out = tmp_path / "rpc.json"
    command = [
        sys.executable,
        "-m",
        "benchmarks.rpc_load",
        "--systems",
        "rpc,rpc-pool,rpc-channel,comms",
    ]
    command += ["--callers", "20", "--rounds", "2", "--warmup", "0.1", "--seconds", "0.3"]
    command += ["--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rpc calls/s against the others:" in done.stdout
    data = json.loads(out.read_text())
    assert data["metadata"]["command"][:2] == ["python", "-m"]
    results = data["results"]
    assert {r["backend"] for r in results} >= {"asyncio"}
    for r in results:
        assert set(r["summary"]) == {"rpc", "rpc-pool", "rpc-channel", "comms"}
        for figures in r["summary"].values():
            assert figures["errors"] == 0
            low, high = figures["calls_per_second_range"]
            assert 0 < low <= figures["calls_per_second"] <= high
            assert 0 < figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]
            assert figures["pooled_p99_over_p50"] >= 1
