"""``anyio-comm bench`` and ``anyio-comm serve``: tiny runs in subprocesses, checked via --json.

The bench command spawns its own server and client processes, so these tests run it as a
subprocess per backend (not through the ``anyio_backend`` fixture), start the runs of one
fixture together to share the process start-up time, and check only that the figures are
present and consistent with each other (never how fast anything is).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from anyio_comm._bench._cli import Progress
from anyio_comm.bench import Child, RunError, format_size, parse_size

from .conftest import needs

ROOT = Path(__file__).parents[1]
TIMEOUT = 60  # seconds for any one command
TINY = ["--seconds", "0.3", "--warmup", "0.1"]
BACKENDS = ["asyncio", needs("uvloop", "uvloop"), needs("trio", "trio")]
# (size, frames, processes, extra options): one run of each per backend
WORKLOADS = {
    "small": ("1000", 1, 1, ["--raw-frames"]),
    "large": ("100kB", 3, 2, []),
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "anyio_comm", *args]


def _popen(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        _command(*args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {TIMEOUT} s:\n{out}\n{err}")
    return proc.returncode, out, err


def _run(*args: str) -> tuple[int, str, str]:
    return _finish(_popen(*args))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    """Every backend x workload, started together; the parsed --json of each."""
    directory = tmp_path_factory.mktemp("bench")
    started = {}
    for backend in ("asyncio", "uvloop", "trio"):
        if importlib.util.find_spec(backend) is None:
            continue
        for name, (size, frames, processes, extra) in WORKLOADS.items():
            path = directory / f"{backend}-{name}.json"
            args = ["bench", *TINY, "--backend", backend, "-c", "2", "-s", size]
            args += ["-f", str(frames), "-p", str(processes), "--json", str(path), *extra]
            started[backend, name] = (_popen(*args), path)
    results = {}
    for key, (proc, path) in started.items():
        code, out, err = _finish(proc)
        assert code == 0, f"{key}: exit {code}\n{out}\n{err}"
        assert "requests/s" in out and "server CPU / request" in out
        results[key] = json.loads(path.read_text())
    return results


def _check_consistent(document: dict, size: int, frames: int, processes: int) -> None:
    result, options, metadata = document["result"], document["options"], document["metadata"]
    assert options["size"] == size and options["frames"] == frames
    assert result["requests"] > 0
    assert result["rps"] == pytest.approx(result["requests"] / result["window_s"])
    assert result["us_per_request"] == pytest.approx(1e6 / result["rps"])
    assert result["mb_per_s"] == pytest.approx(result["rps"] * frames * size / 1e6)
    assert 0 < result["p50_us"] <= result["p99_us"] <= result["max_us"]
    assert result["client_cpu_us_per_request"] > 0
    assert result["server_cpu_us_per_request"] > 0
    assert result["server_loop_cpu_us_per_request"] > 0
    assert result["server_requests"] > 0
    assert len(result["per_process"]) == processes
    assert sum(p["requests"] for p in result["per_process"]) == result["requests"]
    assert result["server"]["local"] and result["server"]["exit_code"] == 0
    assert metadata["versions"]["anyio-comm"]
    assert metadata["command"][:2] == ["anyio-comm", "bench"]
    assert metadata["pinning"] and metadata["load_average_before"] is not None


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_bench_local(runs: dict, backend: str, workload: str) -> None:
    size, frames, processes, extra = WORKLOADS[workload]
    document = runs[backend, workload]
    _check_consistent(document, parse_size(size), frames, processes)
    assert document["options"]["backend"] == backend
    assert document["result"]["server"]["backend"] == backend
    assert document["options"]["raw_frames"] == ("--raw-frames" in extra)
    assert document["options"]["concurrency"] == 2


def test_serve_and_bench_address_then_sigterm_and_sigint(tmp_path: Path) -> None:
    # the second server runs on trio where it is installed
    other = "trio" if importlib.util.find_spec("trio") is not None else "asyncio"
    servers = {
        signal.SIGTERM: _popen("serve", "tcp://127.0.0.1:0", "--grace", "1"),
        signal.SIGINT: _popen("serve", "tcp://127.0.0.1:0", "--backend", other, "--gil-hold"),
    }
    try:
        addresses = {}
        for signum, server in servers.items():
            assert server.stdout is not None
            line = server.stdout.readline()  # bounded: the server prints it or exits
            match = re.search(r"listening on (tcp://\S+)", line)
            assert match, line + server.stderr.read() if server.stderr else line
            addresses[signum] = match.group(1)
        path = tmp_path / "remote.json"
        code, out, err = _run(
            "bench", addresses[signal.SIGTERM], *TINY, "-c", "2", "-s", "10KB", "--json", str(path)
        )
        assert code == 0, out + err
        document = json.loads(path.read_text())
        result = document["result"]
        assert result["requests"] > 0 and result["server_requests"] > 0
        assert 0 < result["p50_us"] <= result["p99_us"] <= result["max_us"]
        assert result["server_cpu_us_per_request"] > 0
        assert result["server"]["local"] is False
        assert "(server: remote)" in document["metadata"]["pinning"]
        code, out, err = _run("bench", addresses[signal.SIGINT], *TINY)
        assert code == 0, out + err
        assert "GIL-holding thread" in out
        for signum, server in servers.items():
            server.send_signal(signum)
            code, out, err = _finish(server)
            assert code == 0, f"{signum!r}: {out}\n{err}"
            assert "server stopped" in out
            assert "Traceback" not in err
    finally:
        for server in servers.values():
            if server.poll() is None:
                server.kill()
                server.wait(10)
            for pipe in (server.stdout, server.stderr):
                if pipe is not None:
                    pipe.close()


def test_local_gil_hold_and_tls(tmp_path: Path) -> None:
    pytest.importorskip("trustme")
    path = tmp_path / "gil.json"
    code, out, err = _run(
        "bench", *TINY, "--gil-hold", "--tls", "-s", "1e4", "-f", "2", "--json", str(path)
    )
    assert code == 0, out + err
    assert "GIL-holding thread" in out and "tls://127.0.0.1:" in out
    document = json.loads(path.read_text())
    _check_consistent(document, 10_000, 2, 1)
    assert document["result"]["server"]["gil_hold"] is True


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["bench", "-s", "1XB"], 2, "invalid size '1XB'"),
        (["bench", "-s", "0"], 2, "between 1 byte and 1 GiB"),
        (["bench", "-c", "0"], 2, "expected 1 to 1000"),
        (["bench", "--seconds", "0"], 2, "expected 0 to 600 seconds"),
        (["bench", "bogus"], 2, "malformed address"),
        (["bench", "inproc://x"], 2, "do not cross processes"),
        (["bench", "tcp://127.0.0.1:9", "--gil-hold"], 2, "anyio-comm serve --gil-hold"),
        (["bench", "tcp://127.0.0.1:9", "--tls"], 2, "tls:// address"),
        (["bench", "--cafile", "ca.pem"], 2, "remote tls:// ADDRESS"),
        (["serve", "tls://127.0.0.1:0"], 2, "needs --certfile"),
        (["bench", "tcp://127.0.0.1:9", "--connect-timeout", "5"], 1, "cannot reach"),
    ],
)
def test_errors_are_one_line(args: list[str], code: int, message: str) -> None:
    returncode, out, err = _run(*args)
    assert returncode == code, out + err
    assert message in err
    assert len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err


def test_serve_address_in_use() -> None:
    server = _popen("serve", "tcp://127.0.0.1:0")
    try:
        assert server.stdout is not None
        address = re.search(r"(tcp://\S+)", server.stdout.readline())
        assert address
        code, _, err = _run("serve", address.group(1))
        assert code == 1 and "error:" in err and "Traceback" not in err
    finally:
        server.send_signal(signal.SIGTERM)
        assert _finish(server)[0] == 0


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1000", 1000),
        ("1e6", 10**6),
        ("1MB", 10**6),
        ("10 MB", 10**7),
        ("10mb", 10**7),
        ("1KiB", 1024),
        ("2.5kB", 2500),
        ("1GiB", 2**30),
        ("64k", 64_000),
    ],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size
    assert parse_size(text, 2**30) == size


@pytest.mark.parametrize("text", ["", "MB", "1.5", "1 XB", "-1", "0", "2GiB", "1e400", "nan"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text, 2**30)


def test_parse_size_without_a_top() -> None:
    assert parse_size("2GiB") == 2**31
    assert parse_size("10 TB") == 10**13
    with pytest.raises(ValueError, match="at least 1 byte"):
        parse_size("0")


def test_format_size() -> None:
    assert [format_size(n) for n in (1000, 10**6, 1024, 1500, 2**30, 10**9)] == [
        "1 kB",
        "1 MB",
        "1 KiB",
        "1500 B",
        "1 GiB",
        "1 GB",
    ]


def test_demo_still_works() -> None:
    code, out, err = _run("demo", "--backend", "asyncio", "--rounds", "10", "--megabytes", "1")
    assert code == 0, out + err
    assert "echo equal: True" in out


def test_missing_packages_are_usage_errors(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from anyio_comm.__main__ import main

    real = importlib.util.find_spec
    missing = {"trustme", "uvloop"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    assert main(["bench", "--tls"]) == 2
    err = capsys.readouterr().err
    assert "trustme" in err and 'pip install ".[bench]"' in err and len(err.splitlines()) == 1
    assert main(["bench", "--backend", "uvloop"]) == 2
    assert "needs the uvloop package" in capsys.readouterr().err


def _die(conn: object) -> None:
    os._exit(3)


def test_a_process_that_dies_is_named() -> None:
    import multiprocessing

    child = Child(multiprocessing.get_context("spawn"), "test process", _die)
    try:
        with pytest.raises(RunError, match=r"test process \(pid \d+\) exited with code 3"):
            child.receive(time.monotonic() + TIMEOUT)
    finally:
        child.stop(terminate=True)


def _fail(conn: object, text: str) -> None:
    raise ValueError(text)


def _answer(conn: object, value: int) -> int:
    return value * 2


def test_a_child_reports_its_result_or_its_failure() -> None:
    """A result comes back as ``("result", value)``; a failure is raised in the parent as a
    :exc:`RunError` of one line, with the child's traceback in its ``details``."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    good = Child(ctx, "good child", _answer, (21,))
    bad = Child(ctx, "bad child", _fail, ("no\ngood",))
    try:
        assert good.receive(time.monotonic() + TIMEOUT) == ("result", 42)
        with pytest.raises(RunError) as caught:
            bad.receive(time.monotonic() + TIMEOUT)
        assert str(caught.value) == "bad child: ValueError: no good"
        assert caught.value.details.startswith("Traceback")
        assert "ValueError: no\ngood" in caught.value.details
    finally:
        assert good.stop() == 0
        assert bad.stop() == 1


def _run_on_terminal(*args: str) -> tuple[int, str]:
    """Run the command with its output on a pseudo-terminal; its exit status and output."""
    pty = pytest.importorskip("pty")
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        _command(*args),
        stdin=subprocess.DEVNULL,
        stdout=terminal,
        stderr=terminal,
        env=_env(),
        cwd=ROOT,
    )
    os.close(terminal)
    chunks = []
    deadline = time.monotonic() + TIMEOUT
    try:
        while True:
            ready, _, _ = select.select([controller], [], [], deadline - time.monotonic())
            if not ready:
                pytest.fail(f"{proc.args} did not finish within {TIMEOUT} s: {chunks}")
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: every process holding the terminal exited
                break
            if not chunk:
                break
            chunks.append(chunk)
        return proc.wait(TIMEOUT), b"".join(chunks).decode()
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_bench_shows_the_address_and_its_progress() -> None:
    code, out = _run_on_terminal("bench", "--seconds", "1.5", "--warmup", "0.3", "-c", "2")
    assert code == 0, out
    address = r"^anyio-comm bench: server tcp://127\.0\.0\.1:\d+ \(local process, asyncio\)\r$"
    assert re.search(address, out, re.MULTILINE), out
    # one line rewritten in place (the terminal shows "\n" as "\r\n"), then cleared
    updates = re.findall(r"\r(anyio-comm bench: +[\d.]+ of 1\.[89] s, [^\r\n]*?) *(?=\r)", out)
    rate = r", ([\d,]+) requests, [\d,]+ requests/s so far$"
    assert all(u.endswith(", warming up") or re.search(rate, u) for u in updates), updates
    counts = [int(m.group(1).replace(",", "")) for u in updates if (m := re.search(rate, u))]
    assert counts and max(counts) > 0, updates
    assert re.search(r"\r +\rserver: ", out), out
    assert "requests/s" in out.partition("\rserver: ")[2]


def test_progress_lines_when_not_on_a_terminal() -> None:
    out = io.StringIO()
    now = [100.0]
    live = [0.0, 0.0, 0.0, 0.0]  # two processes: count, then seconds of window
    progress = Progress(out, live, 100.0, (101.0, 121.0), tty=False, clock=lambda: now[0])
    for t, published in [
        (100.5, [0, 0, 0, 0]),
        (105.0, [4000, 4.0, 2000, 4.0]),  # both published at 4 s into the window
        (107.0, [6000, 6.0, 3000, 6.0]),
        (110.2, [9000, 9.2, 4000, 8.0]),  # the second is one publication behind
        (121.5, [20000, 20.0, 10000, 20.0]),
    ]:
        now[0] = t
        live[:] = published
        progress.update()
    progress.close()
    assert out.getvalue().splitlines() == [
        "anyio-comm bench:   5.0 of 21.0 s, 6,000 requests, 1,500 requests/s so far",
        "anyio-comm bench:  10.2 of 21.0 s, 13,000 requests, 1,478 requests/s so far",
        "anyio-comm bench:  21.0 of 21.0 s, 30,000 requests, 1,500 requests/s so far",
    ]


def test_progress_line_on_a_terminal() -> None:
    out = io.StringIO()
    now = [100.0]
    live = [0.0, 0.0]
    progress = Progress(out, live, 100.0, (100.5, 101.5), tty=True, clock=lambda: now[0])
    for t, published in [
        (100.0, [0, 0]),
        (100.2, [0, 0]),
        (100.6, [900, 0.1]),
        (101.1, [5000, 0.5]),
    ]:
        now[0] = t
        live[:] = published
        progress.update()
    progress.close()
    first = "anyio-comm bench:   0.0 of 1.5 s, warming up"
    second = "anyio-comm bench:   0.6 of 1.5 s, 900 requests, 9,000 requests/s so far"
    third = "anyio-comm bench:   1.1 of 1.5 s, 5,000 requests, 10,000 requests/s so far"
    assert out.getvalue() == (f"\r{first}\r{second}\r{third}\r{' ' * len(third)}\r")


def test_serve_prints_statistics() -> None:
    """``serve --stats SECONDS`` prints the listener's and its connections'
    figures every SECONDS, and once more when it stops: a bench client's hello
    and three echoes are four messages each way."""
    import anyio

    import anyio_comm

    server = _popen("serve", "tcp://127.0.0.1:0", "--stats", "0.1")
    try:
        assert server.stdout is not None
        address = re.search(r"(tcp://\S+)", server.stdout.readline())
        assert address

        async def echo_three() -> None:
            async with await anyio_comm.connect(address.group(1), timeout=10) as comm:
                await comm.send({"anyio-comm-bench": 1, "role": "echo"})
                await comm.receive()
                for _ in range(3):
                    await comm.send(b"x" * 1000)
                    await comm.receive()

        anyio.run(echo_three)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:  # (a line every 0.1 s: readline returns)
            line = server.stdout.readline()
            if "messages 4 in, 4 out" in line and "connections 0 open, 1 accepted" in line:
                break
        else:
            pytest.fail("no statistics line with the four messages")
        assert re.search(r"bytes 3\.\d kB in, 3\.\d kB out", line), line
        assert "send waits 0" in line and "budget 0 B in use, 0 waiting" in line
        server.send_signal(signal.SIGTERM)
        code, out, _ = _finish(server)
        assert code == 0
        last = [line for line in out.splitlines() if line.startswith("stats: ")][-1]
        assert "messages 4 in, 4 out" in last
        assert out.endswith("server stopped\n")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
