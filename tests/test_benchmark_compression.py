"""``python -m benchmarks.compression``: a short run in subprocesses, its figures
consistent with each other (never how fast anything is)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compression import KINDS, MODES, payload

ROOT = Path(__file__).parents[1]
TIMEOUT = 120  # seconds for the whole command

pytest.importorskip("cramjam")


def test_payloads_are_what_their_kind_says() -> None:
    from anyio_comm._sansio.compression import Compressor

    assert len(payload("compressible", 300_000)) == 300_000
    assert payload("compressible", 300_000) == payload("compressible", 300_000)
    lz4 = Compressor("lz4")
    assert lz4.compress(memoryview(payload("compressible", 300_000))) is not None
    assert lz4.compress(memoryview(payload("incompressible", 300_000))) is None


@pytest.mark.parametrize("transport", ["tcp", "tls"])
def test_a_short_run_measures_every_mode(tmp_path: Path, transport: str) -> None:
    out = tmp_path / "compression.json"
    command = [sys.executable, "-m", "benchmarks.compression", "--sizes", "100KB,200KB"]
    command += ["--seconds", "0.05", "--repeat", "2", "--transport", transport]
    command += ["--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    (result,) = json.loads(out.read_text())["results"]
    assert result["transport"] == transport
    rows = result["rows"]
    assert [(row["size"], row["kind"]) for row in rows] == [
        (size, kind) for size in (100_000, 200_000) for kind in KINDS
    ]
    for row in rows:
        for mode in MODES:
            low, high = row["range"][mode]
            assert len(row["mb_per_s"][mode]) == 2
            assert 0 < low <= row["median"][mode] <= high
        assert row["ratio"]["none"] == 1
