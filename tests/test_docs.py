"""The docs' generated parts match their sources; no install line needs a package index."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import pytest

from benchmarks.render import render

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"


def test_performance_tables_are_generated_from_the_committed_run() -> None:
    data = json.loads((DOCS / "_generated" / "echo.json").read_text())
    assert (DOCS / "_generated" / "echo.md").read_text() == render(data)


@pytest.mark.parametrize("name", ["compare", "compare-gil"])
def test_comparison_report_is_generated_from_the_committed_run(name: str) -> None:
    from benchmarks.render_compare import render as render_compare

    data = json.loads((DOCS / "_generated" / f"{name}.json").read_text())
    assert (DOCS / "_generated" / f"{name}.md").read_text() == render_compare(data)


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height in pixels, from the PNG's header."""
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", path
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def _performance_figures() -> dict[str, Any]:
    """The figures of the performance page, drawn from the committed runs, by PNG name."""
    pytest.importorskip("matplotlib")
    from benchmarks import render as render_echo
    from benchmarks import render_compare

    echo = json.loads((DOCS / "_generated" / "echo.json").read_text())
    compare = json.loads((DOCS / "_generated" / "compare.json").read_text())
    paths = render_compare.plot_paths(str(DOCS / "_generated" / "compare.png"))
    return {
        "echo.png": render_echo.figure(echo),
        **{Path(paths[b]).name: fig for b, fig in render_compare.figures(compare).items()},
    }


def test_performance_plots_are_readable_at_the_page_width() -> None:
    """Every text of every plot is at least MIN_PAGE_PX high once the PNG is scaled to the
    page's content column, every legend has at most six entries, and the committed PNGs
    have the size the render scripts draw (they were redrawn after the scripts changed).
    Needs matplotlib (the docs extra: ``nox -s docs`` runs it)."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from benchmarks import _plots

    figures = _performance_figures()
    page = (DOCS / "performance.md").read_text()
    for name, fig in figures.items():
        fig.canvas.draw()  # tick labels exist once drawn
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        assert texts, name
        for text in texts:
            size = _plots.page_px(text.get_fontsize(), fig.get_figwidth())
            assert size >= _plots.MIN_PAGE_PX, (name, text.get_text(), size)
        legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
        assert legends, name
        assert all(len(legend.get_texts()) <= 6 for legend in legends), name
        assert fig.get_figwidth() == _plots.WIDTH, name
        size = (round(fig.get_figwidth() * _plots.DPI), round(fig.get_figheight() * _plots.DPI))
        assert _png_size(DOCS / "_generated" / name) == size, name
        plt.close(fig)
        # shown on the page, with a link to the full-size image
        assert f"```{{figure}} _generated/{name}\n" in page, name
        assert f"[full-size image](_generated/{name})" in page, name
    shown = set(re.findall(r"_generated/([\w-]+\.png)", page))
    assert shown == set(figures), shown


#: the backends of the testing guide's conftest.py: the ids the guide's tests run under
GUIDE_BACKENDS = ("asyncio", "asyncio+uvloop", "trio")


@pytest.mark.timeout(180)
def test_testing_guide_runs_as_written(tmp_path: Path) -> None:
    """The testing guide's Python blocks, copied into a fresh project, pass under pytest
    with an empty configuration (no ``anyio_mode = "auto"``: each async test needs its
    ``@pytest.mark.anyio``). A block that starts with ``# conftest.py`` is the conftest,
    a block with tests a test module; any other block is a fragment that must parse
    (``await`` allowed at its top level, as in a test body)."""
    for package in ("trio", "uvloop", "trustme"):
        pytest.importorskip(package)
    page = (DOCS / "guides" / "testing.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", page, flags=re.MULTILINE | re.DOTALL)
    tests: list[str] = []
    for i, block in enumerate(blocks):
        if block.startswith("# conftest.py\n"):
            (tmp_path / "conftest.py").write_text(block)
        elif re.search(r"^(async )?def test_", block, flags=re.MULTILINE):
            (tmp_path / f"test_guide_{i}.py").write_text(block)
            tests += re.findall(r"^(?:async )?def (test_\w+)", block, flags=re.MULTILINE)
        else:
            compile(block, f"testing.md block {i}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    assert (tmp_path / "conftest.py").exists()
    assert "test_rejects_a_peer_speaking_http" in tests
    assert "test_echo_over_tls" in tests
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(DOCS.parent), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "pytest", "-c", "pytest.ini", "--rootdir", "."]
    command += ["-p", "anyio", "-p", "no:cacheprovider", "-W", "error", "-q"]
    command += ["--junitxml", "report.xml"]
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    cases = list(ElementTree.parse(tmp_path / "report.xml").iter("testcase"))
    assert not [c.get("name") for c in cases if len(c)], result.stdout  # failed or skipped
    expected = {f"{test}[{backend}]" for test in tests for backend in GUIDE_BACKENDS}
    assert {c.get("name") for c in cases} == expected


def _case(system: str, backend: str, size: int, concurrency: int, **figures: object) -> dict:
    return {
        "system": system,
        "backend": backend,
        "size": size,
        "concurrency": concurrency,
        "frames": 1,
        "tls": None,
        "server_cpu_us_per_rt": None,
        **figures,
    }


def _metadata(**options: object) -> dict:
    """The metadata of a comparison run with ``options`` beside the usual ones."""
    return {
        "date": "today",
        "command": ["python", "-m", "benchmarks.compare"],
        "cpu_count": 2,
        "pinning": "none",
        "python": "3.11.7 (main)",
        "versions": {},
        "load_average_before": "0",
        "load_average_after": "0",
        "options": {"seconds": 1, "warmup": 0.3, "repeat": 1, **options},
    }


def test_comparison_report_shows_the_many_connections_workload() -> None:
    from benchmarks.render_compare import render as render_compare

    many = {"rps": 1_000.0, "p50_ms": 10.0}
    data = {
        "metadata": _metadata(many=[8000, 200]),
        "results": [
            _case("anyio-comm", "uvloop", 8000, 200, **many, p99_ms=30.0),
            _case("anyio-streams", "uvloop", 8000, 200, **{**many, "rps": 500.0}, p99_ms=20.0),
            _case("anyio-comm", "uvloop", 8000, 200, **many, p99_ms=50.0, tls="1.3"),
            _case("anyio-streams", "uvloop", 8000, 200, **many, p99_ms=60.0, tls="1.3"),
            _case("anyio-comm", "uvloop", 10_000, 4, **many, p99_ms=1.0, server_cpu_us_per_rt=60),
            _case("floor", "uvloop", 10_000, 4, **many, p99_ms=1.0, server_cpu_us_per_rt=50),
            _case("anyio-comm", "trio", 10_000, 4, **many, p99_ms=1.0, server_cpu_us_per_rt=60),
        ],
    }
    report = render_compare(data)
    assert "| anyio-comm | uvloop | 1,000 | 10.00 | 30.00 ✗ | 1,000 | 10.00 | 50.00 ✓ |" in report
    assert "| 10 KB, c=4 | uvloop | 60.0 | 50.0 | 1.20 ✓ |" in report
    assert "| 10 KB, c=4 | trio | 60.0 | - | - |" in report  # no floor case: no target
    misses = report.partition("## Targets missed")[2].strip().splitlines()
    assert [line.split(":")[0] for line in misses] == ["- TLS 8 KB, c=200", "- plain 8 KB, c=200"]
    assert "anyio-comm uvloop / anyio-streams uvloop = 1.00x (target > 1x" in misses[0]
    assert "anyio-comm uvloop p99 30.00 ms, above anyio-streams uvloop's 20.00 ms" in misses[1]


def test_comparison_report_shows_what_tls_costs_each_system() -> None:
    """Server CPU per message over TLS minus plain TCP, per system and backend; a system
    without both cases shows a dash, and the ratio is anyio-comm's over the floor's."""
    from benchmarks.render_compare import render as render_compare

    figures = {"rps": 1_000.0, "p50_ms": 1.0, "p99_ms": 2.0}

    def case(system: str, backend: str, cpu: float, tls: str | None = None) -> dict:
        return _case(system, backend, 1000, 4, **figures, server_cpu_us_per_rt=cpu, tls=tls)

    data = {
        "metadata": _metadata(),
        "results": [
            case("anyio-comm", "uvloop", 40.0),
            case("anyio-comm", "uvloop", 70.0, "1.3"),
            case("floor", "uvloop", 20.0),
            case("floor", "uvloop", 35.0, "1.3"),
            case("anyio-streams", "uvloop", 50.0, "1.3"),  # no plain case
            case("floor-blocking", "threads", 25.0),
            case("floor-blocking", "threads", 55.0, "1.3"),
        ],
    }
    report = render_compare(data)
    assert "| 1 KB, c=4 | uvloop | 30.0 | 15.0 | - | - | 2.00 |" in report
    assert "| 1 KB, c=4 | threads | - | - | - | 30.0 | - |" in report


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
    import anyio_comm.bench
    import anyio_comm.testing

    reference = (DOCS / "reference.md").read_text()
    for module in (anyio_comm, anyio_comm.testing, anyio_comm.bench):
        for name in module.__all__:
            if name != "__version__":
                assert f"{module.__name__}.{name}" in reference, name


#: ``pip install`` of the distribution by name, which only a package index could serve
#: (``pip install anyio-comm``, ``pip install 'anyio-comm[dask]'``); the package is
#: installed from a clone (``pip install ".[dask]"``) or from a wheel file, whose name
#: goes on with the version (``anyio_comm-0.1.0-py3-none-any.whl``)
INDEX_INSTALL = re.compile(r"""pip3? install (?:-\S+ )*["']?anyio[-_]comm\b(?!-[\d*])""")
#: every text that may tell a user how to install: docs sources, README, code and examples
TEXTS = sorted(
    path.relative_to(ROOT).as_posix()
    for pattern in ("README.md", "docs/**/*.md", "anyio_comm/**/*.py", "examples/*.py")
    for path in ROOT.glob(pattern)
    if "_build" not in path.parts
)


@pytest.mark.parametrize("name", TEXTS)
def test_no_install_line_needs_a_package_index(name: str) -> None:
    text = (ROOT / name).read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if INDEX_INSTALL.search(line)]
    assert not lines, f"{name}: the package is on no index; say pip install . from a clone"
