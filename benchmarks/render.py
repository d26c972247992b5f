"""Render an echo-benchmark JSON file as the Markdown tables of the docs' performance page.

Usage (from the repository root)::

    python -m benchmarks.echo --sizes 1000,1000000,10000000 --tls both --repeat 2 \\
        --json docs/_generated/echo.json
    python -m benchmarks.render docs/_generated/echo.json docs/_generated/echo.md \
        --plot docs/_generated/echo.png

The tables and the plot are derived from the JSON only, so the page always shows one
real run. The plot needs matplotlib (the ``bench`` extra).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

BACKENDS = ("asyncio", "uvloop", "trio")


def _size(nbytes: int) -> str:
    for unit, scale in (("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def _label(result: dict[str, Any]) -> str:
    return result["system"] + ("+tls" if result.get("tls") else "")


def render(data: dict[str, Any]) -> str:
    """Return the Markdown for one benchmark run."""
    meta = data["metadata"]
    results = data["results"]
    tls = meta.get("tls") or {}
    lines = [
        f"Run of {meta['date']}: `{' '.join(meta['command'])}` "
        f"on {meta['cpu_count']} CPUs ({meta['pinning']}), Python {meta['python'].split()[0]}"
        + (f", {tls.get('openssl', '')}" if tls.get("mode") not in (None, "off") else "")
        + ". Each figure is the best of the repeats; see the method above for the noise.",
        "",
        (
            "| system | backend | size | round trips/s | MB/s each way | p50 ms | p99 ms "
            "| client CPU µs/rt | server CPU µs/rt |"
        ),
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {_label(r)} | {r['backend']} | {_size(r['size'])} | failed |||||")
            continue
        lines.append(
            f"| {_label(r)} | {r['backend']} | {_size(r['size'])} | {r['rps']:,.0f} "
            f"| {r['mb_per_s']:,.1f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} "
            f"| {r['client_cpu_us_per_rt']:.0f} | {r['server_cpu_us_per_rt']:.0f} |"
        )
    by_key = {(_label(r), r["backend"], r["size"]): r for r in results if "error" not in r}
    sizes = sorted({r["size"] for r in results})
    pairs = [("anyio-comm", "anyio-streams"), ("anyio-comm+tls", "anyio-streams+tls")]
    lines += [
        "",
        (
            "Round trips per second of anyio-comm divided by those of plain AnyIO streams "
            "(TLS: AnyIO's `TLSStream`) in the same run; above 1 means anyio-comm is faster."
        ),
        "",
        "| size | " + " | ".join(f"{b} plain | {b} TLS" for b in BACKENDS) + " |",
        "|---|" + "---:|" * (2 * len(BACKENDS)),
    ]
    for size in sizes:
        cells = []
        for backend in BACKENDS:
            for ours, theirs in pairs:
                a, b = by_key.get((ours, backend, size)), by_key.get((theirs, backend, size))
                cells.append(f"{a['rps'] / b['rps']:.2f}x" if a and b else "-")
        lines.append(f"| {_size(size)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


#: colour, marker and line of each series; TLS series are dashed, with hollow markers
STYLES: dict[str, tuple[str, str]] = {
    "anyio-comm": ("tab:blue", "o"),
    "anyio-streams": ("tab:orange", "s"),
}
#: colours and markers of systems without a style of their own
OTHER_STYLES = (("tab:green", "^"), ("tab:red", "D"), ("tab:purple", "v"), ("tab:brown", "P"))


def _style(label: str, others: list[str]) -> dict[str, Any]:
    system, tls = label.removesuffix("+tls"), label.endswith("+tls")
    if system not in STYLES and system not in others:
        others.append(system)
    color, marker = STYLES.get(system) or OTHER_STYLES[others.index(system) % len(OTHER_STYLES)]
    return {
        "color": color,
        "marker": marker,
        "linestyle": "--" if tls else "-",
        "markerfacecolor": "white" if tls else color,
    }


def figure(data: dict[str, Any]) -> Figure:
    """The plot of one run: MB/s each way against message size on each backend, and the
    round-trip latency of the smallest messages (p50 and p99) of every series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks import _plots

    results = [r for r in data["results"] if "error" not in r]
    labels = sorted({_label(r) for r in results})
    others: list[str] = []
    styles = {label: _style(label, others) for label in labels}
    with plt.rc_context(_plots.RC):
        fig, grid = plt.subplots(2, 2, figsize=(_plots.WIDTH, 6.6), layout="constrained")
        axes = list(grid.flat)
        for ax, backend in zip(axes, BACKENDS, strict=False):
            for label in labels:
                points = sorted(
                    (r["size"], r["mb_per_s"])
                    for r in results
                    if _label(r) == label and r["backend"] == backend
                )
                if points:
                    ax.plot(*zip(*points, strict=True), label=label, **styles[label])
            ax.set(xscale="log", yscale="log", title=f"{backend}: throughput")
            ax.set(xlabel="message size (bytes)", ylabel="MB/s each way")
            ax.grid(True, which="both", alpha=0.3)
        small = min(r["size"] for r in results)
        ax = axes[-1]
        width = 0.8 / len(labels)
        for i, label in enumerate(labels):
            rows = {r["backend"]: r for r in results if r["size"] == small and _label(r) == label}
            xs = [b + (i - (len(labels) - 1) / 2) * width for b in range(len(BACKENDS))]
            p50 = [rows[b]["p50_ms"] * 1000 if b in rows else 0 for b in BACKENDS]
            p99 = [rows[b]["p99_ms"] * 1000 if b in rows else 0 for b in BACKENDS]
            style = styles[label]
            ax.bar(
                xs,
                p50,
                width,
                color=style["markerfacecolor"],
                edgecolor=style["color"],
                hatch="//" if label.endswith("+tls") else None,
                yerr=[[0] * len(xs), [hi - lo for lo, hi in zip(p50, p99, strict=True)]],
                error_kw={"ecolor": "black", "capsize": 3, "elinewidth": 1.2},
            )
        ax.set_xticks(range(len(BACKENDS)), BACKENDS)
        ax.set(ylabel="round trip (µs)", title=f"{_size(small)} latency: p50, whisker p99")
        ax.grid(True, axis="y", alpha=0.3)
        fig.legend(
            *axes[0].get_legend_handles_labels(),
            loc="outside lower center",
            ncols=len(labels),
            handlelength=2.6,
            columnspacing=1.2,
        )
        meta = data["metadata"]
        fig.suptitle(f"Echo benchmark, one connection, run of {meta['date'][:10]}")
    return fig


def plot(data: dict[str, Any], path: Path) -> None:
    """Write :func:`figure` as a PNG at ``path``."""
    from benchmarks import _plots

    _plots.save(figure(data), path)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks.render IN.json OUT.md [--plot OUT.png]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("markdown", type=Path)
    parser.add_argument("--plot", type=Path, help="also write a PNG plot here")
    args = parser.parse_args(argv)
    data = json.loads(args.json.read_text())
    args.markdown.write_text(render(data))
    if args.plot:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
