"""Render an echo-benchmark JSON file as the Markdown tables of the docs' performance page.

Usage (from the repository root)::

    python -m benchmarks.echo --sizes 1000,1000000,10000000 --tls both --repeat 2 \\
        --json docs/_generated/echo.json
    python -m benchmarks.render docs/_generated/echo.json docs/_generated/echo.md

The tables are derived from the JSON only, so the page always shows one real run.
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


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m benchmarks.render IN.json OUT.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("markdown", type=Path)
    args = parser.parse_args(argv)
    args.markdown.write_text(render(json.loads(args.json.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
