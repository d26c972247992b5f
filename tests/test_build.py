"""The package's two forms: pure Python (the default build) and the hot path compiled with
mypyc (built with ``ANYIO_COMM_MYPYC=1``, see ``setup.py``). ``nox -s tests_compiled`` runs
the whole suite on the compiled form; these tests check that each session imported the form
it installed, and how the build reads its option."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

import anyio_comm
from anyio_comm._build import COMPILABLE, compiled_modules, describe

#: set by the nox sessions: "1" where the compiled form was installed
EXPECT_COMPILED = os.environ.get("ANYIO_COMM_EXPECT_COMPILED", "0") == "1"
ROOT = Path(__file__).resolve().parents[1]


def test_the_form_installed_is_the_one_imported() -> None:
    if EXPECT_COMPILED:
        assert compiled_modules() == COMPILABLE
        for name in COMPILABLE:
            assert sys.modules[name].__file__.endswith(".so"), name  # type: ignore[union-attr]
    else:
        assert compiled_modules() == ()


def test_version_names_the_form() -> None:
    # a fresh interpreter, importing the package this test imported
    package_parent = Path(anyio_comm.__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "anyio_comm", "--version"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(package_parent)},
        cwd=package_parent,
        timeout=60,
        check=True,
    )
    if EXPECT_COMPILED:
        form = "compiled with mypyc: decoder, serialization, connection, wire"
    else:
        form = "pure Python"
    assert describe() == form
    assert result.stdout == f"anyio-comm {anyio_comm.__version__} ({form})\n"


@pytest.mark.parametrize(
    ("value", "compiled"),
    [("", False), ("0", False), ("false", False), ("1", True), ("true", True), ("TRUE", True)],
)
def test_the_values_the_build_takes(
    monkeypatch: pytest.MonkeyPatch, value: str, compiled: bool
) -> None:
    setup = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")
    monkeypatch.setenv("ANYIO_COMM_MYPYC", value)
    assert setup["compiling"]() is compiled


@pytest.mark.parametrize("value", ["yes", "2", "on "])
def test_the_build_refuses_an_option_it_does_not_know(value: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "setup.py"), "--name"],
        capture_output=True,
        text=True,
        env={**os.environ, "ANYIO_COMM_MYPYC": value},
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert f"ANYIO_COMM_MYPYC must be 0 or 1, not {value!r}" in result.stderr


def test_the_build_compiles_the_modules_the_package_names() -> None:
    if not (ROOT / "anyio_comm").is_dir():
        pytest.skip("the compiled form's tests run in a tree without the package's sources")
    setup = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")
    sources = setup["compiled_sources"]()
    assert sources == [name.replace(".", "/") + ".py" for name in COMPILABLE]
    for source in sources:
        assert (ROOT / source).is_file()
