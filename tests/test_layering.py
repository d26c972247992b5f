"""Import rules between layers, checked on the source (no import side effects)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "anyio_comm"


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module.split(".")[0])
    return modules


@pytest.mark.parametrize("path", sorted((PACKAGE / "_sansio").glob("*.py")), ids=str)
def test_sansio_has_no_io_imports(path: Path) -> None:
    assert not imported_modules(path) & {"anyio", "socket", "ssl", "asyncio", "trio", "selectors"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "_transports").glob("*.py")), ids=str)
def test_transports_do_not_know_the_codec(path: Path) -> None:
    assert "msgpack" not in imported_modules(path)
    text = path.read_text()
    assert "_sansio.decoder" not in text and "_sansio.serialization" not in text


def test_no_orphan_tasks_anywhere() -> None:
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        # dask's listeners outlive the call that starts them: the dask backend's
        # listener runs anyio-comm's in a task of its own (see AnyioTCPListener).
        if path != PACKAGE / "dask.py":
            assert "create_task(" not in text, path
        assert "ensure_future" not in text, path
        # The bench server's --gil-hold mode runs a GIL-holding thread on purpose: that
        # thread is what it measures (the GIL convoy effect on the event loop).
        if path != PACKAGE / "_bench" / "_server.py":
            assert "threading" not in text, path


#: modules the sans-IO core must not load, directly or through anything it imports
IO_MODULES = ("anyio", "asyncio", "socket", "ssl", "trio", "selectors", "sniffio")


def test_importing_the_sansio_core_loads_no_io() -> None:
    """In a fresh interpreter: importing every sans-IO module (and with it the package's
    ``__init__``) loads none of the I/O modules; the public names still resolve after."""
    modules = sorted(f"anyio_comm._sansio.{p.stem}" for p in (PACKAGE / "_sansio").glob("*.py"))
    code = f"""
import importlib, sys
for name in {modules!r}:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {IO_MODULES!r})
print(",".join(loaded))
import anyio_comm
assert anyio_comm.Comm.__name__ == "Comm" and "anyio" in sys.modules
"""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_sansio_core_imports_only_within_itself() -> None:
    """The sans-IO modules import each other and the standard library/msgpack, never
    another part of the package (which would bring I/O with it)."""
    for path in sorted((PACKAGE / "_sansio").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1, f"{path.name}: from {'.' * node.level}{node.module}"
