"""Import rules between layers, checked on the source (no import side effects)."""

from __future__ import annotations

import ast
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
        assert "create_task(" not in text, path
        assert "ensure_future" not in text, path
        # The bench server's --gil-hold mode runs a GIL-holding thread on purpose: that
        # thread is what it measures (the GIL convoy effect on the event loop).
        if path != PACKAGE / "_bench" / "_server.py":
            assert "threading" not in text, path
