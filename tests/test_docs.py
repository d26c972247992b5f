"""The docs' generated parts match their sources."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.render import render

DOCS = Path(__file__).parents[1] / "docs"


def test_performance_tables_are_generated_from_the_committed_run() -> None:
    data = json.loads((DOCS / "_generated" / "echo.json").read_text())
    assert (DOCS / "_generated" / "echo.md").read_text() == render(data)


@pytest.mark.parametrize("name", ["compare", "compare-gil"])
def test_comparison_report_is_generated_from_the_committed_run(name: str) -> None:
    from benchmarks.render_compare import render as render_compare

    data = json.loads((DOCS / "_generated" / f"{name}.json").read_text())
    assert (DOCS / "_generated" / f"{name}.md").read_text() == render_compare(data)


@pytest.mark.parametrize("name", ["memory-tcp", "memory-tls"])
def test_memory_table_is_generated_from_the_committed_run(name: str) -> None:
    from benchmarks.memory import render as render_memory

    data = json.loads((DOCS / "_generated" / f"{name}.json").read_text())
    assert (DOCS / "_generated" / f"{name}.md").read_text() == render_memory(data)


def test_every_page_is_in_the_toctree() -> None:
    index = (DOCS / "index.md").read_text()
    pages = {p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.rglob("*.md")}
    pages -= {"index"}
    pages = {p for p in pages if not p.startswith("_")}
    assert all(f"\n{page}\n" in index for page in pages), pages


def test_every_public_name_is_in_the_reference() -> None:
    import anyio_comm
    import anyio_comm.testing

    reference = (DOCS / "reference.md").read_text()
    for module in (anyio_comm, anyio_comm.testing):
        for name in module.__all__:
            if name != "__version__":
                assert f"{module.__name__}.{name}" in reference, name
