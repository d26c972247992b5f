"""The ``anyio-comm`` command line as a newcomer meets it: ``--version``, the help texts and
``demo`` on an install without the optional backends (run in a subprocess in which trio
and uvloop cannot be imported)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import anyio_comm
from anyio_comm.__main__ import main, parser
from anyio_comm._build import describe

ROOT = Path(__file__).parents[1]
TIMEOUT = 60  # seconds for any one command
#: runs the command line as if trio and uvloop were not installed
WITHOUT_EXTRAS = (
    "import sys; sys.modules['trio'] = sys.modules['uvloop'] = None; "
    "from anyio_comm.__main__ import main; sys.exit(main())"
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=TIMEOUT,
    )


def test_version_is_the_one_in_pyproject() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^version = "([^"]+)"$', pyproject, re.MULTILINE)
    assert match
    assert anyio_comm.__version__ == match.group(1)


def test_version_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main(["--version"])
    assert exc_info.value.code == 0
    form = describe()  # pure Python, or which modules are compiled (tests/test_build.py)
    assert capsys.readouterr().out == f"anyio-comm {anyio_comm.__version__} ({form})\n"


@pytest.mark.parametrize("command", [[], ["demo"], ["bench"], ["serve"]])
def test_help_is_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main([*command, "--help"])
    assert exc_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: anyio-comm {' '.join(command)}".rstrip())
    assert "``" not in text
    assert not re.search(r":[a-z]+:`", text), text


def test_every_demo_option_has_help() -> None:
    (commands,) = (a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    demo = commands.choices["demo"]
    options = [a for a in demo._actions if a.dest != "help"]
    assert {a.dest for a in options} == {"backend", "address", "rounds", "megabytes"}
    for action in options:
        assert action.help and action.help != argparse.SUPPRESS, action.dest


@pytest.mark.parametrize("option", ["--rounds", "--megabytes"])
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_demo_refuses_counts_below_one(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A usage error (exit status 2) instead of a division by zero in the report."""
    with pytest.raises(SystemExit) as info:
        main(["demo", option, value])
    assert info.value.code == 2
    assert f"argument {option}: expected" in capsys.readouterr().err


def test_demo_runs_the_installed_backends_and_names_the_others() -> None:
    done = _run("demo", "--rounds", "10", "--megabytes", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == ""
    lines = done.stdout.splitlines()
    assert lines[0] == (
        'anyio-comm demo: skipping uvloop and trio (not installed; pip install ".[uvloop,trio]" '
        "from a clone of the repository)"
    )
    assert [line for line in lines if line.startswith("anyio-comm demo on")] == [
        "anyio-comm demo on asyncio"
    ]
    assert "echo equal: True" in done.stdout and "intact: True" in done.stdout


@pytest.mark.parametrize("backend", ["trio", "uvloop"])
def test_demo_on_a_backend_that_is_not_installed(backend: str) -> None:
    done = _run("demo", "--backend", backend, "--rounds", "10", "--megabytes", "1")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == (
        f"anyio-comm demo: error: --backend {backend} needs the {backend} package: "
        f'pip install ".[{backend}]" from a clone of the repository\n'
    )
