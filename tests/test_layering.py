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


def decoder_uses(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` reaches the frame decoder: imports of its module or class,
    and ``.decoder`` / ``._decoder`` attributes (on a connection, say)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.split(".")[-1] == "decoder" or any(
                alias.name in ("decoder", "FrameDecoder") for alias in node.names
            ):
                found.append(f"{filename}:{line}: from {'.' * node.level}{module} import")
        elif isinstance(node, ast.Import):
            found += [
                f"{filename}:{line}: import {alias.name}"
                for alias in node.names
                if alias.name.split(".")[-1] == "decoder"
            ]
        elif isinstance(node, ast.Attribute) and node.attr in ("decoder", "_decoder"):
            found.append(f"{filename}:{line}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id == "FrameDecoder":
            found.append(f"{filename}:{line}: FrameDecoder")
    return sorted(found, key=lambda use: int(use.split(":")[1]))


def test_decoder_uses_finds_each_way_in() -> None:
    source = (
        "from ._sansio.decoder import EndOfData\n"
        "from anyio_comm._sansio import decoder\n"
        "import anyio_comm._sansio.decoder\n"
        "x = conn.decoder.status\n"
        "y = self._decoder\n"
        "z: FrameDecoder\n"
        "ok = conn.receiving.status\n"
    )
    assert [use.split(": ", 1)[1] for use in decoder_uses(source)] == [
        "from ._sansio.decoder import",
        "from anyio_comm._sansio import",
        "import anyio_comm._sansio.decoder",
        ".decoder",
        "._decoder",
        "FrameDecoder",
    ]


def test_only_the_sansio_core_reaches_the_decoder() -> None:
    """The frame decoder is the sans-IO connection's own: the receive engines, the
    comm and everything else ask the ``Connection`` (its receive status and mode,
    its budget calls), so that a receive feature lands in one place."""
    uses = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent != PACKAGE / "_sansio":
            uses += decoder_uses(path.read_text(), str(path.relative_to(PACKAGE)))
    assert uses == []
