"""The comparison's measurement window (``benchmarks.compare._Window``): its warm-up
lasts a time and a number of round trips, and only what follows it is measured; and
a short run of a diagnostic system end to end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compare
from benchmarks.compare import WARMUP_EXTRA, _Window
from benchmarks.render_compare import render as render_compare


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    clock = _Clock()
    monkeypatch.setattr(compare.time, "perf_counter", clock)
    return clock


def _window(clock: _Clock, warm_round_trips: int) -> _Window:
    window = _Window(start=0.3, end=1.0, max_count=1000, warm_round_trips=warm_round_trips)
    window.begin()
    assert (window.start, window.end) == (100.3, 101.3)
    return window


def test_the_warm_up_lasts_until_its_round_trips(clock: _Clock) -> None:
    window = _window(clock, warm_round_trips=3)
    clock.now = 100.5
    assert window.record(100.0, 100.5)  # past the start, but warming up: not measured
    assert not window.warmed()
    clock.now = 101.5  # past the original end: the window still goes on
    assert window.record(100.5, 101.5)
    assert not window.warmed()
    assert window.record(101.5, 101.5)
    assert window.warmed()
    assert window.latencies == []
    window.restart()
    assert (window.start, window.end) == (101.5, 102.5)
    assert window.record(101.5, 101.7)
    assert window.latencies == pytest.approx([0.2])
    clock.now = 102.6
    assert not window.record(101.7, 102.6)  # past the end: the window is over
    assert window.latencies == pytest.approx([0.2])


def test_the_warm_up_lasts_its_time_when_the_round_trips_come_first(clock: _Clock) -> None:
    window = _window(clock, warm_round_trips=1)
    clock.now = 100.1
    assert window.record(100.0, 100.1)
    assert not window.warmed()
    clock.now = 100.3
    assert window.warmed()
    window.restart()
    assert (window.start, window.end) == (100.3, 101.3)


def test_the_warm_up_ends_after_its_extra_time_without_its_round_trips(clock: _Clock) -> None:
    window = _window(clock, warm_round_trips=10)
    clock.now = 100.3 + WARMUP_EXTRA - 0.01
    assert not window.warmed()
    clock.now = 100.3 + WARMUP_EXTRA
    assert window.warmed()
    window.restart()
    assert window.start == pytest.approx(100.3 + WARMUP_EXTRA)
    assert window.end - window.start == pytest.approx(1.0)


def test_the_report_says_how_long_the_warm_up_lasted() -> None:
    data = json.loads((Path(__file__).parents[1] / "docs/_generated/compare.json").read_text())
    # (a run from before the warm-up counted round trips has no such option)
    data["metadata"]["options"].pop("warmup_round_trips", None)
    assert "after 0.3 s warm-up, best of" in render_compare(data)
    data["metadata"]["options"]["warmup_round_trips"] = 8
    report = render_compare(data)
    assert "after a warm-up of 0.3 s and 8 round trips per connection, best of" in report


def _run_compare(tmp_path: Path, args: str, timeout: float) -> list[dict[str, Any]]:
    """Run ``python -m benchmarks.compare`` with ``args`` (a short run, in its own
    processes) and return its results from the JSON report."""
    out = tmp_path / "compare.json"
    args += " --repeat 1 --seconds 0.2 --warmup 0.1 --json"
    subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", *args.split(), str(out)],
        cwd=Path(__file__).parents[1],
        check=True,
        capture_output=True,
        timeout=timeout,
    )
    results: list[dict[str, Any]] = json.loads(out.read_text())["results"]
    return results


def test_the_floors_reusing_buffers_echo_on_every_backend(tmp_path: Path) -> None:
    # A short run of the diagnostic system in its own processes: every backend's
    # server and client complete round trips of several large frames (the sizes of
    # the replies are checked by the system itself, a failing check fails the case).
    args = "--sizes 2e5 --frames 3 --concurrency 2 --tls off --no-many --systems floor-reuse"
    results = _run_compare(tmp_path, args, timeout=120)
    # (a backend whose package is not installed is skipped with a note)
    installed = [b for b in ("uvloop", "trio") if importlib.util.find_spec(b) is not None]
    assert {r["backend"]: r["round_trips"] > 0 for r in results} == dict.fromkeys(
        ["asyncio", *installed], True
    )


def test_the_plain_anyio_echo_echoes_on_every_backend(tmp_path: Path) -> None:
    # The plainest hand-written AnyIO echo, small and large messages, over TCP and
    # TLS: its replies are checked by the system itself (a failing check fails the case).
    args = "--sizes 1e3,2e5 --frames 1,3 --concurrency 2 --tls both --tls-sizes 1e3"
    args += " --tls-frames 1 --no-many --systems anyio-echo"
    results = _run_compare(tmp_path, args, timeout=180)
    installed = [b for b in ("uvloop", "trio") if importlib.util.find_spec(b) is not None]
    assert all("error" not in r and r["round_trips"] > 0 for r in results), results
    plain = {(r["backend"], r["size"], r["frames"]) for r in results if r["tls"] is None}
    assert plain == {
        (b, size, frames)
        for b in ["asyncio", *installed]
        for size in (1000, 200_000)
        for frames in (1, 3)
    }
    assert {r["backend"] for r in results if r["tls"] is not None} == {"asyncio", *installed}


def test_the_task_floor_echoes_over_tcp_and_tls(tmp_path: Path) -> None:
    # The diagnostic task floor in its own processes, on asyncio and uvloop, small and
    # large messages, plain and TLS: the replies are checked by the floor's client.
    args = "--sizes 1e3,2e5 --frames 1,3 --concurrency 2 --tls both --tls-sizes 1e3"
    args += " --tls-frames 1 --no-many --systems floor-task"
    results = _run_compare(tmp_path, args, timeout=180)
    installed = ["uvloop"] if importlib.util.find_spec("uvloop") is not None else []
    assert all("error" not in r and r["round_trips"] > 0 for r in results), results
    assert {(r["backend"], r["size"], r["frames"], r["tls"] is None) for r in results} == {
        *(
            (b, size, frames, True)
            for b in ["asyncio", *installed]
            for size in (1000, 200_000)
            for frames in (1, 3)
        ),
        *((b, 1000, 1, False) for b in ["asyncio", *installed]),
    }


def test_the_task_floor_answers_messages_that_arrived_together_in_order() -> None:
    # Messages parsed in one callback wake the connection's task once, and it answers
    # them all, in order; a message arriving while it waits wakes it again.
    import asyncio

    from benchmarks.systems.floor_task import _TaskEchoProtocol
    from benchmarks.systems.framing import pack_header

    class Transport:
        def __init__(self) -> None:
            self.written: list[bytes] = []

        def write(self, data: bytes) -> None:
            self.written.append(bytes(data))

    class Counter:
        n = 0

    def message(tag: int) -> bytes:
        frames = [bytes([tag]) * 10, bytes([tag + 1]) * 20]
        return pack_header(frames) + b"".join(frames)

    def feed(protocol: _TaskEchoProtocol, data: bytes) -> None:
        buffer = protocol.get_buffer(-1)
        buffer[: len(data)] = data
        protocol.buffer_updated(len(data))

    async def main() -> None:
        counter = Counter()
        protocol = _TaskEchoProtocol(counter)
        transport = Transport()
        protocol.connection_made(transport)  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the task starts and waits
        feed(protocol, message(1) + message(3) + message(5))
        await asyncio.sleep(0)
        assert transport.written == [message(1), message(3), message(5)]
        feed(protocol, message(7))
        await asyncio.sleep(0)
        assert transport.written[3:] == [message(7)]
        assert counter.n == 4
        protocol.connection_lost(None)
        await asyncio.sleep(0)
        assert protocol.task is not None and protocol.task.cancelled()

    asyncio.run(main())
