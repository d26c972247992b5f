"""``python -m benchmarks.oneway``: a short run in subprocesses, every system counted
with its messages checked, and the checks themselves (never how fast anything is)."""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.oneway_systems import SYSTEMS, Tally, _compact, _count, _cut, payloads

ROOT = Path(__file__).parents[1]
TIMEOUT = 240  # seconds for the whole command


def test_a_short_run_counts_every_system(tmp_path: Path) -> None:
    out = tmp_path / "oneway.json"
    systems = [
        name
        for name, system in SYSTEMS.items()
        if all(importlib.util.find_spec(p) is not None for p in system.requires)
    ]
    command = [sys.executable, "-m", "benchmarks.oneway", "--sizes", "100", "--connections", "2"]
    command += ["--systems", ",".join(systems), "--backends", "asyncio,trio"]
    command += ["--seconds", "0.2", "--warmup", "0", "--repeat", "1", "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "anyio-comm (and the task floor) against the references" in done.stdout
    results = json.loads(out.read_text())["results"]
    backends = {"asyncio", "threads"} | ({"trio"} if importlib.util.find_spec("trio") else set())
    expected = {
        (name, backend)
        for name in systems
        for backend in SYSTEMS[name].backends
        if backend in backends
    }
    assert {(r["system"], r["backend"]) for r in results} == expected
    for r in results:
        assert "error" not in r, r
        assert r["size"] == 100 and r["connections"] == 2
        assert r["messages"] > 0
        assert r["mps"] == pytest.approx(r["messages"] / r["window_s"])
        assert r["receiver_cpu_us_per_message"] > 0


def test_a_lost_or_reordered_message_is_an_error() -> None:
    """The tags the receivers check: a connection's index on top of its sequence."""
    first, second = payloads(0, 100), payloads(3, 100)
    assert len(first(0)) == len(second(7)) == 100
    assert first(1) != first(2) and first(5) != second(5)
    tally = Tally()
    tag = int.from_bytes(second(7)[:8], "little")
    tally.wrong(tag, tag + 2)
    assert tally.error == "connection 3: expected message 7, got 9"
    tally.wrong(0, 1)  # the first error is kept
    assert tally.error == "connection 3: expected message 7, got 9"


def test_the_task_floor_checks_what_it_receives() -> None:
    """The task floor's receivers count through the same check as the others."""
    first = payloads(2, 100)
    messages = iter([first(0), first(1), first(3)])

    async def receive() -> bytes:
        try:
            return next(messages)
        except StopIteration:
            raise EOFError from None

    tally = Tally()
    asyncio.run(_count(receive, tally))
    assert tally.n == 3
    assert tally.error == "connection 2: expected message 2, got 3"


def test_the_floors_cut_messages_and_make_room_in_their_buffer() -> None:
    """The read buffer of the floors' receivers: whole messages are cut out, a part
    stays, and the part moves to the start when the buffer's end is near."""
    buffer = bytearray(65536)
    message = (8).to_bytes(8, "little") + b"12345678"
    queue: collections.deque[bytes] = collections.deque()
    at = 62_000  # (less than 4 KiB left behind what the buffer holds)
    buffer[at : at + 16 * 3] = message * 3
    start = _cut(buffer, at, at + 16 * 2 + 5, queue)  # two whole, then a part of one
    assert list(queue) == [b"12345678"] * 2 and start == at + 32
    assert _compact(buffer, start, at + 37) == (0, 5)  # near the end: moved
    assert bytes(buffer[:5]) == message[:5]
    assert _compact(buffer, 100, 105) == (100, 105)  # room enough: left
    assert _compact(buffer, 7, 7) == (0, 0)  # empty: back to the start


def test_bad_options_are_refused() -> None:
    command = [sys.executable, "-m", "benchmarks.oneway", "--sizes", "4"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "at least 8 bytes" in done.stderr


def test_the_diagnostic_systems_run_only_when_named() -> None:
    command = [sys.executable, "-m", "benchmarks.oneway", "--help"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    text = "".join(done.stdout.split())  # (argparse wraps the help at hyphens)
    assert "diagnostic:anyio-comm-rx,anyio-comm-tx,floor-task" in text
    default = text.split("default:allbutthediagnosticones(")[1].split(")")[0]
    assert "anyio-comm-rx" not in default and "anyio-comm-batch" in default
