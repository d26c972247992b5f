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
from typing import Any

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


def plot(data: dict[str, Any], path: Path) -> None:
    """Write a PNG: MB/s each way against message size, and 1 kB latency, per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [r for r in data["results"] if "error" not in r]
    labels = sorted({_label(r) for r in results})
    styles = {
        "anyio-comm": ("tab:blue", "-"),
        "anyio-comm+tls": ("tab:blue", "--"),
        "anyio-streams": ("tab:orange", "-"),
        "anyio-streams+tls": ("tab:orange", "--"),
    }
    fig, axes = plt.subplots(1, len(BACKENDS) + 1, figsize=(16, 4.2))
    for ax, backend in zip(axes, BACKENDS, strict=False):
        for label in labels:
            points = sorted(
                (r["size"], r["mb_per_s"])
                for r in results
                if _label(r) == label and r["backend"] == backend
            )
            if points:
                color, line = styles.get(label, ("gray", ":"))
                ax.plot(
                    *zip(*points, strict=True),
                    marker="o",
                    color=color,
                    linestyle=line,
                    label=label,
                )
        ax.set(xscale="log", yscale="log", title=backend, xlabel="message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("MB/s each way")
    axes[0].legend(fontsize="small")
    small = min(r["size"] for r in results)
    ax = axes[-1]
    rows = [r for r in results if r["size"] == small]
    names = [f"{_label(r)}\n{r['backend']}" for r in rows]
    ax.barh(names, [r["p99_ms"] * 1000 for r in rows], color="lightgray", label="p99")
    ax.barh(names, [r["p50_ms"] * 1000 for r in rows], color="tab:blue", label="p50")
    ax.set(xlabel="round-trip latency (µs)", title=f"latency, {_size(small)} messages")
    ax.tick_params(axis="y", labelsize=6)
    ax.legend(fontsize="small")
    fig.suptitle(
        f"echo benchmark, {data['metadata']['date'][:10]} ({data['metadata']['pinning']})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)


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
