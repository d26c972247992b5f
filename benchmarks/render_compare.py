"""Render a ``benchmarks.compare`` JSON file as a markdown report and a PNG plot.

Usage (from the repository root)::

    python -m benchmarks.render_compare benchmarks/results/compare.json \\
        benchmarks/results/compare.md --plot benchmarks/results/compare.png

The report has the round trips per second of every workload and system, then
the ratios that the targets are about, each computed from cases of the same
run: anyio-comm over the floor of the same backend, over dask, pyzmq and AnyIO
streams, trio over asyncio, and server CPU per 1 KB request. A cell with a
target is marked ✓ (met) or ✗ (missed); the misses are listed at the end. A
``--gil-hold`` run (a GIL-holding thread in every server) has one ratio table
instead: anyio-comm on each backend over dask, whose requests per second it
must at least match, and over the other systems for reference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

Key = tuple[str, str, int, int, int, "str | None"]
Workload = tuple[int, int, int, "str | None"]  # size, concurrency, frames, tls
BACKENDS = ("asyncio", "uvloop", "trio")
FLOOR_SIZES = (1_000, 100_000, 1_000_000, 10_000_000)


def _size(nbytes: int) -> str:
    for unit, scale in (("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _workload_label(w: Workload) -> str:
    size, conc, frames, _ = w
    return f"{f'{frames} x ' if frames > 1 else ''}{_size(size)}, c={conc}"


def _index(data: dict[str, Any]) -> tuple[dict[Key, dict[str, Any]], list[Workload]]:
    ok: dict[Key, dict[str, Any]] = {}
    workloads: list[Workload] = []
    for r in data["results"]:
        w = (r["size"], r["concurrency"], r["frames"], r["tls"])
        if w not in workloads:
            workloads.append(w)
        if "error" not in r:
            ok[(r["system"], r["backend"], *w)] = r
    return ok, workloads


# A ratio column: title, numerator (system, backend), denominator (system, backend),
# and the target of a workload: (">=" | ">" | "<=", threshold) or None.
Column = tuple[str, tuple[str, str], tuple[str, str], Any]


def _floor_target(w: Workload) -> tuple[str, float] | None:
    size, _, frames, _ = w
    return (">=", 0.9) if frames == 1 and size in FLOOR_SIZES else None


def _dask_target(w: Workload) -> tuple[str, float] | None:
    size, _, frames, tls = w
    if tls:
        return None
    if size == 1_000 and frames == 1:
        return (">=", 3.0)
    if size == 1_000_000 and frames in (1, 5):
        return (">=", 2.0)
    return None


def _tls_floor_target(w: Workload) -> tuple[str, float] | None:
    size, conc, frames, _ = w
    if frames != 1:
        return None
    if size == 1_000_000:
        return (">=", 0.85)
    if size == 1_000 and conc == 4:
        return (">=", 0.8)
    return None


def _ahead(w: Workload) -> tuple[str, float]:  # noqa: ARG001
    return (">", 1.0)


def _trio(w: Workload) -> tuple[str, float]:  # noqa: ARG001
    return (">=", 0.85)


PLAIN_COLUMNS: list[Column] = [
    *((f"/ floor {b}", ("anyio-comm", b), ("floor", b), _floor_target) for b in BACKENDS),
    ("/ dask (asyncio)", ("anyio-comm", "asyncio"), ("dask", "asyncio"), _dask_target),
    ("/ zmq (asyncio)", ("anyio-comm", "asyncio"), ("zmq", "asyncio"), _ahead),
    *((f"/ streams {b}", ("anyio-comm", b), ("anyio-streams", b), _ahead) for b in BACKENDS),
    ("asyncio / floor-blocking", ("anyio-comm", "asyncio"), ("floor-blocking", "threads"), None),
    ("trio / asyncio", ("anyio-comm", "trio"), ("anyio-comm", "asyncio"), _trio),
]
TLS_COLUMNS: list[Column] = [
    *(
        (
            f"{b} / floor-blocking",
            ("anyio-comm", b),
            ("floor-blocking", "threads"),
            _tls_floor_target,
        )
        for b in BACKENDS
    ),
    *((f"/ floor {b}", ("anyio-comm", b), ("floor", b), None) for b in ("asyncio", "uvloop")),
    ("/ dask (asyncio)", ("anyio-comm", "asyncio"), ("dask", "asyncio"), None),
    *((f"/ streams {b}", ("anyio-comm", b), ("anyio-streams", b), _ahead) for b in BACKENDS),
    ("trio / asyncio", ("anyio-comm", "trio"), ("anyio-comm", "asyncio"), _trio),
]


def _at_least(w: Workload) -> tuple[str, float]:  # noqa: ARG001
    return (">=", 1.0)


GIL_COLUMNS: list[Column] = [
    *((f"{b} / dask", ("anyio-comm", b), ("dask", "asyncio"), _at_least) for b in BACKENDS),
    *((f"/ floor {b}", ("anyio-comm", b), ("floor", b), None) for b in BACKENDS),
    ("asyncio / zmq", ("anyio-comm", "asyncio"), ("zmq", "asyncio"), None),
]


def _meets(op: str, value: float, threshold: float) -> bool:
    if op == ">=":
        return value >= threshold
    if op == ">":
        return value > threshold
    return value <= threshold


def _ratio_table(
    ok: dict[Key, dict[str, Any]],
    workloads: list[Workload],
    columns: list[Column],
    misses: list[str],
    mode: str,
) -> list[str]:
    lines = [
        "| workload | " + " | ".join(title for title, *_ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for w in workloads:
        cells = []
        for title, num, den, target_of in columns:
            a, b = ok.get((*num, *w)), ok.get((*den, *w))  # type: ignore[arg-type]
            if a is None or b is None:
                cells.append("-")
                continue
            value = a["rps"] / b["rps"]
            target = target_of(w) if target_of is not None else None
            mark = ""
            if target is not None:
                op, threshold = target
                met = _meets(op, value, threshold)
                mark = " ✓" if met else " ✗"
                if not met:
                    misses.append(
                        f"{mode} {_workload_label(w)}: anyio-comm {num[1]} {title.strip('/ ')} = "
                        f"{value:.2f}x (target {op} {threshold:g}x; "
                        f"{a['rps']:,.0f} vs {b['rps']:,.0f} rt/s)"
                    )
            cells.append(f"{value:.2f}{mark}")
        lines.append(f"| {_workload_label(w)} | " + " | ".join(cells) + " |")
    return lines


def _columns(ok: dict[Key, dict[str, Any]], tls: bool) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    for system, backend, _, _, _, mode in ok:
        if bool(mode) == tls and (system, backend) not in seen:
            seen.append((system, backend))
    return seen


def _rps_table(ok: dict[Key, dict[str, Any]], workloads: list[Workload], tls: bool) -> list[str]:
    columns = _columns(ok, tls)
    lines = [
        "| workload | " + " | ".join(f"{s}<br>{b}" for s, b in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for w in workloads:
        if bool(w[3]) != tls:
            continue
        cells = []
        for system, backend in columns:
            r = ok.get((system, backend, *w))
            cells.append("-" if r is None else f"{r['rps']:,.0f}")
        lines.append(f"| {_workload_label(w)} | " + " | ".join(cells) + " |")
    return lines


def _cpu_table(
    ok: dict[Key, dict[str, Any]], workloads: list[Workload], misses: list[str]
) -> list[str]:
    lines = [
        "| workload | backend | anyio-comm µs | floor µs | ratio (target <= 2) |",
        "|---|---|---:|---:|---:|",
    ]
    for w in workloads:
        if w[0] != 1_000 or w[3]:
            continue
        for b in BACKENDS:
            comm, floor = ok.get(("anyio-comm", b, *w)), ok.get(("floor", b, *w))
            if comm is None or floor is None:
                continue
            c, f = comm["server_cpu_us_per_rt"], floor["server_cpu_us_per_rt"]
            if c is None or f is None:
                continue
            ratio = c / f
            met = ratio <= 2.0
            if not met:
                misses.append(
                    f"plain {_workload_label(w)}: anyio-comm {b} server CPU per request "
                    f"{c:.1f} µs = {ratio:.2f}x the floor's {f:.1f} µs (target <= 2x)"
                )
            lines.append(
                f"| {_workload_label(w)} | {b} | {c:.1f} | {f:.1f} | "
                f"{ratio:.2f} {'✓' if met else '✗'} |"
            )
    return lines


def _sections(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The ratio sections and the list of misses."""
    ok, workloads = _index(data)
    misses: list[str] = []
    plain = [w for w in workloads if not w[3]]
    tls = [w for w in workloads if w[3]]
    lines = []
    if data["metadata"]["options"].get("gil_hold"):
        lines += [
            "### Ratios with a GIL-holding thread in the server (round trips per second)",
            "",
            *_ratio_table(ok, workloads, GIL_COLUMNS, misses, "GIL-held"),
            "",
        ]
        return lines, misses
    if plain:
        lines += [
            "### Ratios over plain TCP (round trips per second, anyio-comm / other)",
            "",
            *_ratio_table(ok, plain, PLAIN_COLUMNS, misses, "plain"),
            "",
            "### Server CPU per 1 KB request (anyio-comm / floor of the same backend)",
            "",
            *_cpu_table(ok, plain, misses),
            "",
        ]
    if tls:
        lines += [
            "### Ratios over TLS (round trips per second, anyio-comm+tls / other+tls)",
            "",
            *_ratio_table(ok, tls, TLS_COLUMNS, misses, "TLS"),
            "",
        ]
    return lines, misses


def summary(data: dict[str, Any]) -> str:
    """The ratio tables and the misses, as text for the terminal."""
    lines, misses = _sections(data)
    lines += ["### Targets missed", ""] + ([f"- {m}" for m in misses] or ["none"])
    return "\n".join(lines)


def render(data: dict[str, Any]) -> str:
    """The markdown report of one comparison run."""
    meta = data["metadata"]
    ok, workloads = _index(data)
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    opts = meta["options"]
    lines = [
        "# anyio-comm comparison",
        "",
        (
            f"Run of {meta['date']}: `{' '.join(meta['command'])}`; {meta['cpu_count']} CPUs "
            f"({meta['pinning']}), Python {meta['python'].split()[0]}, {versions}. "
            f"{opts['seconds']:g} s per case after {opts['warmup']:g} s warm-up, best of "
            f"{opts['repeat']} interleaved repeats. Load average before/after: "
            f"{meta['load_average_before']} / {meta['load_average_after']}."
            + (
                " Every server process also ran a thread holding the GIL in a busy "
                "Python loop (`--gil-hold`)."
                if opts.get("gil_hold")
                else ""
            )
        ),
        "",
        (
            "Workloads: frames of the given size (`5 x`: five frames per message), c = "
            "concurrent connections in one client process. Systems:"
        ),
        "",
        *(f"- `{name}`: {text}" for name, text in meta.get("systems", {}).items()),
        "",
        "Targets (ratios of round trips per second in this run): ✓ met, ✗ missed.",
        "",
    ]
    failed = [r for r in data["results"] if "error" in r]
    for tls in (False, True):
        if any(bool(w[3]) == tls for w in workloads):
            lines += [
                f"## Round trips per second, {'TLS 1.3' if tls else 'plain TCP'}",
                "",
                *_rps_table(ok, workloads, tls),
                "",
            ]
    sections, misses = _sections(data)
    lines += ["## Ratios", "", *sections, "## Targets missed", ""]
    lines += [f"- {m}" for m in misses] or ["None."]
    if failed:
        lines += ["", "## Failed cases", ""]
        lines += [
            f"- {r['system']}/{r['backend']} {_size(r['size'])} c={r['concurrency']} "
            f"frames={r['frames']} tls={r['tls']}: {r['error']}"
            for r in failed
        ]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: str) -> None:
    """Throughput (MB/s each way) and p50/p99 latency against frame size; c=1, 1 frame, TCP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok, _ = _index(data)
    series: dict[str, list[dict[str, Any]]] = {}
    for (system, backend, _, conc, frames, tls), r in ok.items():
        if conc == 1 and frames == 1 and not tls:
            series.setdefault(f"{system} ({backend})", []).append(r)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    colors = plt.get_cmap("tab20").colors
    markers = "os^Dvp*hX<>P"
    for i, (label, rows) in enumerate(series.items()):
        rows.sort(key=lambda r: r["size"])
        sizes = [r["size"] for r in rows]
        style: dict[str, Any] = {"marker": markers[i % len(markers)], "color": colors[i % 20]}
        if label.startswith("anyio-comm"):
            style["linewidth"] = 2.5
        left.plot(sizes, [r["mb_per_s"] for r in rows], label=label, **style)
        right.plot(sizes, [r["p50_ms"] for r in rows], label=f"{label} p50", **style)
        right.plot(sizes, [r["p99_ms"] for r in rows], linestyle="--", alpha=0.6, **style)
    left.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="MB/s each way")
    left.set_title("Echo throughput, 1 connection, plain TCP")
    right.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="latency (ms)")
    right.set_title("Round-trip latency: p50 (solid), p99 (dashed)")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=7)
    right.legend(fontsize=6, ncol=2)
    fig.suptitle(f"anyio-comm comparison, {data['metadata']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """Read the JSON, write the markdown (and the plot)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.render_compare")
    parser.add_argument("json", help="a JSON file written by benchmarks.compare --json")
    parser.add_argument("markdown", help="where to write the markdown report")
    parser.add_argument("--plot", metavar="PATH", help="also write the PNG plot")
    args = parser.parse_args(argv)
    data = json.loads(Path(args.json).read_text(encoding="utf-8"))
    Path(args.markdown).write_text(render(data), encoding="utf-8")
    if args.plot:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
