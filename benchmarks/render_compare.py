"""Render a ``benchmarks.compare`` JSON file as a markdown report and PNG plots.

Usage (from the repository root)::

    python -m benchmarks.render_compare benchmarks/results/compare.json \\
        benchmarks/results/compare.md --plot 'benchmarks/results/compare-{backend}.png'

The report has the round trips per second of every workload and system, then
the ratios and figures that the targets are about, each computed from cases of
the same run: anyio-comm over the floor of the same backend, over AnyIO
streams, dask, pyzmq and the blocking floor, trio over asyncio; server CPU per
message at 1, 10 and 100 KB (with the diagnostic ``floor-reader``'s when it
ran); and, for the many-connections workload (``--many``), round trips per
second with p50 and p99 latency of every system; what TLS adds to each system's
server CPU per message (its TLS layer's cost). A cell with a target is
marked ✓ (met) or ✗ (missed), the targets are stated at the top of the report
and the misses listed at the end; figures without a mark are for reference. A
``--gil-hold`` run (a GIL-holding thread in every server) has one ratio table
instead: anyio-comm on each backend over dask, whose requests per second it
must at least match, and over the other systems for reference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Key = tuple[str, str, int, int, int, "str | None"]
Workload = tuple[int, int, int, "str | None"]  # size, concurrency, frames, tls
BACKENDS = ("asyncio", "uvloop", "trio")
SMALL_SIZES = (1_000, 10_000, 100_000)  # frame sizes of the floor and server CPU targets
TARGET_CONCURRENCY = (1, 4)  # concurrencies of the floor and server CPU targets
CPU_TARGET = 1.3  # most server CPU per message of anyio-comm, in floors of the same backend
FLOOR_TARGET = 0.9  # least rt/s of anyio-comm on asyncio and uvloop, in floors
TLS_FLOOR_TARGET = 0.8  # least rt/s of anyio-comm on uvloop over TLS, 1 KB c=4, in floor-blocking


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


def _many(data: dict[str, Any]) -> tuple[int, int] | None:
    """(frame size, connections) of the run's many-connections workload (``--many``), if any."""
    many = data["metadata"]["options"].get("many")
    return None if many is None else (many[0], many[1])


def _is_many(w: Workload, many: tuple[int, int] | None) -> bool:
    return many is not None and (w[0], w[1], w[2]) == (*many, 1)


# A ratio column: title, numerator (system, backend), denominator (system, backend),
# and the target of a workload: (">=" | ">" | "<=", threshold) or None.
Column = tuple[str, tuple[str, str], tuple[str, str], Any]


def _floor_target(w: Workload) -> tuple[str, float] | None:
    size, conc, frames, _ = w
    if frames == 1 and size in SMALL_SIZES and conc in TARGET_CONCURRENCY:
        return (">=", FLOOR_TARGET)
    return None


def _tls_floor_target(w: Workload) -> tuple[str, float] | None:
    size, conc, frames, _ = w
    return (">=", TLS_FLOOR_TARGET) if (size, conc, frames) == (1_000, 4, 1) else None


def _ahead(w: Workload) -> tuple[str, float]:  # noqa: ARG001
    return (">", 1.0)


def _ratio(title: str, num: tuple[str, str], den: tuple[str, str], target: Any = None) -> Column:
    return (title, num, den, target)


def _streams_columns() -> list[Column]:
    return [
        _ratio(f"/ streams {b}", ("anyio-comm", b), ("anyio-streams", b), _ahead) for b in BACKENDS
    ]


PLAIN_COLUMNS: list[Column] = [
    *(
        _ratio(
            f"/ floor {b}",
            ("anyio-comm", b),
            ("floor", b),
            _floor_target if b in ("asyncio", "uvloop") else None,
        )
        for b in BACKENDS
    ),
    *_streams_columns(),
    _ratio("/ dask (asyncio)", ("anyio-comm", "asyncio"), ("dask", "asyncio")),
    _ratio("/ zmq (asyncio)", ("anyio-comm", "asyncio"), ("zmq", "asyncio")),
    _ratio("asyncio / floor-blocking", ("anyio-comm", "asyncio"), ("floor-blocking", "threads")),
    _ratio("trio / asyncio", ("anyio-comm", "trio"), ("anyio-comm", "asyncio")),
]
TLS_COLUMNS: list[Column] = [
    *(
        _ratio(
            f"{b} / floor-blocking",
            ("anyio-comm", b),
            ("floor-blocking", "threads"),
            _tls_floor_target if b == "uvloop" else None,
        )
        for b in BACKENDS
    ),
    *_streams_columns(),
    *(_ratio(f"/ floor {b}", ("anyio-comm", b), ("floor", b)) for b in ("asyncio", "uvloop")),
    _ratio("/ dask (asyncio)", ("anyio-comm", "asyncio"), ("dask", "asyncio")),
    _ratio("trio / asyncio", ("anyio-comm", "trio"), ("anyio-comm", "asyncio")),
]


def _at_least(w: Workload) -> tuple[str, float]:  # noqa: ARG001
    return (">=", 1.0)


GIL_COLUMNS: list[Column] = [
    *(_ratio(f"{b} / dask", ("anyio-comm", b), ("dask", "asyncio"), _at_least) for b in BACKENDS),
    *(_ratio(f"/ floor {b}", ("anyio-comm", b), ("floor", b)) for b in BACKENDS),
    _ratio("asyncio / zmq", ("anyio-comm", "asyncio"), ("zmq", "asyncio")),
]


def _meets(op: str, value: float, threshold: float) -> bool:
    if op == ">=":
        return value >= threshold
    if op == ">":
        return value > threshold
    return value <= threshold


def _mark(met: bool) -> str:
    return " ✓" if met else " ✗"


def _ratio_table(
    ok: dict[Key, dict[str, Any]],
    workloads: list[Workload],
    columns: list[Column],
    misses: list[str],
    mode: str,
) -> list[str]:
    """One row per workload, one column per ratio that has both sides in some workload."""
    columns = [
        column
        for column in columns
        if any((*column[1], *w) in ok and (*column[2], *w) in ok for w in workloads)
    ] or columns
    lines = [
        "| workload | " + " | ".join(title for title, *_ in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for w in workloads:
        cells = []
        for _, num, den, target_of in columns:
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
                mark = _mark(met)
                if not met:
                    misses.append(
                        f"{mode} {_workload_label(w)}: anyio-comm {num[1]} / {den[0]} {den[1]} "
                        f"= {value:.2f}x (target {op} {threshold:g}x; "
                        f"{a['rps']:,.0f} vs {b['rps']:,.0f} rt/s)"
                    )
            cells.append(f"{value:.2f}{mark}")
        lines.append(f"| {_workload_label(w)} | " + " | ".join(cells) + " |")
    return lines


def _systems(ok: dict[Key, dict[str, Any]], keep: Any) -> list[tuple[str, str]]:
    """The (system, backend) pairs with a result for a workload that ``keep(w)`` accepts."""
    seen: list[tuple[str, str]] = []
    for system, backend, *w in ok:
        if keep(tuple(w)) and (system, backend) not in seen:
            seen.append((system, backend))
    return seen


def _rps_table(ok: dict[Key, dict[str, Any]], workloads: list[Workload], tls: bool) -> list[str]:
    columns = _systems(ok, lambda w: bool(w[3]) == tls)
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


def _cpu(ok: dict[Key, dict[str, Any]], system: str, backend: str, w: Workload) -> float | None:
    r = ok.get((system, backend, *w))
    return None if r is None else r.get("server_cpu_us_per_rt")


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _cpu_table(
    ok: dict[Key, dict[str, Any]], workloads: list[Workload], misses: list[str]
) -> list[str]:
    """Server CPU per message of anyio-comm and the floor (and floor-reader, when it ran)."""
    reader = any(key[0] == "floor-reader" for key in ok)
    lines = [
        f"| workload | backend | anyio-comm µs | floor µs | ratio (target <= {CPU_TARGET:g}) |"
        + (" floor-reader µs | floor-reader / floor |" if reader else ""),
        "|---|---|---:|---:|---:|" + ("---:|---:|" if reader else ""),
    ]
    for w in workloads:
        size, conc, frames, tls = w
        if tls or frames != 1 or size not in SMALL_SIZES:
            continue
        for b in BACKENDS:
            c, f, r = (
                _cpu(ok, system, b, w) for system in ("anyio-comm", "floor", "floor-reader")
            )
            if c is None and f is None and r is None:
                continue
            ratio = "-"
            if c is not None and f is not None:
                value = c / f
                ratio = f"{value:.2f}"
                if conc in TARGET_CONCURRENCY:
                    met = value <= CPU_TARGET
                    ratio += _mark(met)
                    if not met:
                        misses.append(
                            f"plain {_workload_label(w)}: anyio-comm {b} server CPU per message "
                            f"{c:.1f} µs = {value:.2f}x the floor's {f:.1f} µs "
                            f"(target <= {CPU_TARGET:g}x)"
                        )
            row = f"| {_workload_label(w)} | {b} | {_us(c)} | {_us(f)} | {ratio} |"
            if reader:
                share = "-" if r is None or f is None else f"{r / f:.2f}"
                row += f" {_us(r)} | {share} |"
            lines.append(row)
    return lines


#: the systems whose TLS layers the TLS cost table sets side by side
TLS_LAYERS = ("anyio-comm", "floor", "anyio-streams", "floor-blocking")


def _tls_cost_table(ok: dict[Key, dict[str, Any]], workloads: list[Workload]) -> list[str]:
    """What TLS adds to each system's server CPU per message (TLS minus plain TCP, same
    run, same workload): the TLS layers compared by what they cost, not by the rest of
    their systems. anyio-comm runs OpenSSL through ``ssl.SSLObject`` in the loop's
    thread; the floor through the event loop's own TLS (asyncio's SSL protocol,
    uvloop's in C) or ``trio.SSLStream``; AnyIO streams through ``TLSStream``
    (``SSLObject``); the blocking floor through ``ssl.SSLSocket`` (a thread each)."""
    lines = [
        "| workload | backend | " + " | ".join(f"{s} µs" for s in TLS_LAYERS) + " | "
        "anyio-comm / floor |",
        "|---|---|" + "---:|" * (len(TLS_LAYERS) + 1),
    ]
    for w in workloads:
        plain = (*w[:3], None)
        for b in (*BACKENDS, "threads"):
            costs: list[float | None] = []
            for system in TLS_LAYERS:
                t, p = _cpu(ok, system, b, w), _cpu(ok, system, b, plain)
                costs.append(None if t is None or p is None else t - p)
            if all(c is None for c in costs):
                continue
            comm, floor = costs[0], costs[1]
            ratio = "-" if comm is None or floor is None or floor <= 0 else f"{comm / floor:.2f}"
            cells = " | ".join(_us(c) for c in costs)
            lines.append(f"| {_workload_label(w)} | {b} | {cells} | {ratio} |")
    return lines


def _many_table(
    ok: dict[Key, dict[str, Any]],
    workloads: list[Workload],
    misses: list[str],
    p99_target: bool,
) -> list[str]:
    """Round trips per second, p50 and p99 of every system on the many-connections workloads
    (plain, then TLS); with ``p99_target``, anyio-comm's p99 is marked against the streams'."""
    modes = ["TLS" if w[3] else "plain" for w in workloads]
    head = " | ".join(f"{m} rt/s | {m} p50 ms | {m} p99 ms" for m in modes)
    lines = [f"| system | backend | {head} |", "|---|---|" + "---:|" * 3 * len(workloads)]
    for system, backend in _systems(ok, lambda w: w in workloads):
        cells = []
        for w, mode in zip(workloads, modes, strict=True):
            r = ok.get((system, backend, *w))
            if r is None:
                cells += ["-"] * 3
                continue
            p99 = f"{r['p99_ms']:.2f}"
            streams = ok.get(("anyio-streams", backend, *w))
            if p99_target and system == "anyio-comm" and streams is not None:
                met = r["p99_ms"] <= streams["p99_ms"]
                p99 += _mark(met)
                if not met:
                    misses.append(
                        f"{mode} {_workload_label(w)}: anyio-comm {backend} p99 "
                        f"{r['p99_ms']:.2f} ms, above anyio-streams {backend}'s "
                        f"{streams['p99_ms']:.2f} ms (target <= the streams' p99)"
                    )
            cells += [f"{r['rps']:,.0f}", f"{r['p50_ms']:.2f}", p99]
        lines.append(f"| {system} | {backend} | " + " | ".join(cells) + " |")
    return lines


def _sections(data: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The sections under "Ratios" (the many-connections table last) and the list of misses."""
    ok, workloads = _index(data)
    misses: list[str] = []
    plain = [w for w in workloads if not w[3]]
    tls = [w for w in workloads if w[3]]
    gil = bool(data["metadata"]["options"].get("gil_hold"))
    lines = []
    if gil:
        lines += [
            "### Ratios with a GIL-holding thread in the server (round trips per second)",
            "",
            *_ratio_table(ok, workloads, GIL_COLUMNS, misses, "GIL-held"),
            "",
        ]
    if plain and not gil:  # the ratio tables of an ordinary run
        lines += [
            "### Ratios over plain TCP (round trips per second, anyio-comm / other)",
            "",
            *_ratio_table(ok, plain, PLAIN_COLUMNS, misses, "plain"),
            "",
            "### Server CPU per message (anyio-comm / floor of the same backend)",
            "",
            *_cpu_table(ok, plain, misses),
            "",
        ]
    if tls and not gil:
        lines += [
            "### Ratios over TLS (round trips per second, anyio-comm+tls / other+tls)",
            "",
            *_ratio_table(ok, tls, TLS_COLUMNS, misses, "TLS"),
            "",
            "### What TLS costs (server CPU per message over TLS minus plain TCP, µs)",
            "",
            *_tls_cost_table(ok, tls),
            "",
        ]
    many = _many(data)
    if many_workloads := [w for w in workloads if _is_many(w, many)]:
        size, connections = many_workloads[0][:2]
        lines += [
            (
                f"### Many connections: {_size(size)} frames, {connections} connections "
                "(round trips per second, latency)"
            ),
            "",
            *_many_table(ok, many_workloads, misses, p99_target=not gil),
            "",
        ]
    return lines, misses


def _targets(data: dict[str, Any]) -> list[str]:
    """What the marks of the report stand for."""
    if data["metadata"]["options"].get("gil_hold"):
        return [
            (
                "Target: anyio-comm on each backend at least dask's round trips per second "
                "under the same load (ratio >= 1). ✓ met, ✗ missed; the other ratios are for "
                "reference."
            )
        ]
    *most, last = (_size(size) for size in SMALL_SIZES)
    sizes = f"{', '.join(most)} and {last}"
    return [
        (
            "Targets, each computed from cases of this run (✓ met, ✗ missed; figures without a "
            "mark are for reference, such as the 1 MB and 10 MB rows and the ratios to dask and "
            "pyzmq):"
        ),
        "",
        (
            f"- server CPU per message of anyio-comm at most {CPU_TARGET:g}x the floor's of the "
            f"same backend, for {sizes} single-frame messages, c=1 and c=4, plain TCP, on "
            "asyncio, uvloop and trio;"
        ),
        (
            "- anyio-comm ahead of AnyIO streams of the same backend (ratio of round trips per "
            "second above 1) on every row, plain and TLS, the many-connections row included; on "
            "that row also a p99 latency at most the streams' p99;"
        ),
        (
            f"- anyio-comm at least {FLOOR_TARGET:g}x the floor's round trips per second at "
            f"{sizes} (one frame, c=1 and c=4) on asyncio and uvloop;"
        ),
        (
            f"- over TLS, 1 KB with c=4: anyio-comm on uvloop at least {TLS_FLOOR_TARGET:g}x the "
            "blocking floor (`floor-blocking`, threads)."
        ),
    ]


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
    many = _many(data)
    many_note = ""
    if many is not None and any(_is_many(w, many) for w in workloads):
        many_note = (
            f"; `{_workload_label((*many, 1, None))}` is the many-connections workload "
            "(`--many`: one frame per message, latencies in its own table)"
        )
    lines = [
        "# anyio-comm comparison",
        "",
        (
            f"Run of {meta['date']}: `{' '.join(meta['command'])}`; {meta['cpu_count']} CPUs "
            f"({meta['pinning']}), Python {meta['python'].split()[0]}, {versions}. "
            f"{opts['seconds']:g} s per case after "
            + (
                f"a warm-up of {opts['warmup']:g} s and {opts['warmup_round_trips']} round "
                "trips per connection"
                if "warmup_round_trips" in opts
                else f"{opts['warmup']:g} s warm-up"
            )
            + f", best of "
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
            f"concurrent connections in one client process{many_note}. Systems:"
        ),
        "",
        *(f"- `{name}`: {text}" for name, text in meta.get("systems", {}).items()),
        "",
        *_targets(data),
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


#: colour, marker and line of each system in the plots, the same on every backend
PLOT_STYLES: dict[str, tuple[str, str, str]] = {
    "anyio-comm": ("tab:blue", "o", "-"),
    "anyio-streams": ("tab:orange", "^", "-"),
    "floor": ("tab:green", "s", "--"),
    "floor-blocking": ("tab:brown", "D", "-."),
    "dask": ("tab:red", "v", ":"),
    "zmq": ("tab:purple", "P", ":"),
}
#: colours, markers and lines of systems without a style of their own
OTHER_PLOT_STYLES = (("tab:gray", "X", "--"), ("tab:cyan", "h", "-."), ("tab:pink", "*", ":"))


def _plotted_systems(ok: dict[Key, dict[str, Any]]) -> list[str]:
    """The systems of the run in the order of ``PLOT_STYLES``, without the diagnostic ones
    (variants run to answer one question, which the tables show)."""
    from benchmarks.systems import SYSTEMS

    ran = {system for system, *_ in ok}
    order = [*PLOT_STYLES, *sorted(ran - set(PLOT_STYLES))]
    return [s for s in order if s in ran and not (s in SYSTEMS and SYSTEMS[s].diagnostic)]


def figures(data: dict[str, Any]) -> dict[str, Figure]:
    """One plot per backend: throughput (MB/s each way) and p99 latency against frame size,
    one connection, one frame per message, plain TCP. A system that runs on one backend
    only (the blocking floor on threads, dask and pyzmq on asyncio) is drawn on every
    backend's plot as a reference. The median latency is left out: with one connection it
    is close to the inverse of the round trips per second, which the throughput shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks import _plots

    ok, _ = _index(data)
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for (system, backend, _, conc, frames, tls), r in ok.items():
        if conc == 1 and frames == 1 and not tls:
            rows.setdefault((system, backend), []).append(r)
    systems = _plotted_systems({k: v for k, v in ok.items() if (k[0], k[1]) in rows})
    backends = [b for b in BACKENDS if any(backend == b for _, backend in rows)]
    others = [s for s in systems if s not in PLOT_STYLES]
    out: dict[str, Figure] = {}
    for backend in backends:
        with plt.rc_context(_plots.RC):
            fig, (left, right) = plt.subplots(
                1, 2, figsize=(_plots.WIDTH, 4.9), layout="constrained"
            )
            for system in systems:
                ran_on = [b for s, b in rows if s == system]
                if backend in ran_on:
                    key, label = (system, backend), system
                elif len(ran_on) == 1:  # a reference from its only backend
                    key, label = (system, ran_on[0]), f"{system} ({ran_on[0]})"
                else:
                    continue
                color, marker, line = (
                    PLOT_STYLES.get(system)
                    or OTHER_PLOT_STYLES[others.index(system) % len(OTHER_PLOT_STYLES)]
                )
                style: dict[str, Any] = {"color": color, "marker": marker, "linestyle": line}
                if system == "anyio-comm":
                    style["linewidth"] = 2.8
                points = sorted(rows[key], key=lambda r: r["size"])
                sizes = [r["size"] for r in points]
                left.plot(sizes, [r["mb_per_s"] for r in points], label=label, **style)
                right.plot(sizes, [r["p99_ms"] for r in points], **style)
            left.set(title="throughput", ylabel="MB/s each way")
            right.set(title="p99 round-trip latency", ylabel="latency (ms)")
            for ax in (left, right):
                ax.set(xscale="log", yscale="log", xlabel="message size (bytes)")
                ax.grid(True, which="both", alpha=0.3)
            fig.legend(
                *left.get_legend_handles_labels(),
                loc="outside lower center",
                ncols=3,
                handlelength=3,
            )
            fig.suptitle(
                f"{backend}: one connection, one frame per message, plain TCP "
                f"(run of {data['metadata']['date'][:10]})"
            )
        out[backend] = fig
    return out


def plot_paths(path: str) -> dict[str, str]:
    """Where :func:`plot` writes each backend's plot: ``path`` with ``{backend}`` replaced
    by the backend's name, or with ``-<backend>`` added before its suffix."""
    p = Path(path)
    if "{backend}" not in path:
        path = str(p.with_name(f"{p.stem}-{{backend}}{p.suffix or '.png'}"))
    return {backend: path.format(backend=backend) for backend in BACKENDS}


def plot(data: dict[str, Any], path: str) -> list[str]:
    """Write the plots of :func:`figures` as PNG files (see :func:`plot_paths`) and return
    their paths."""
    from benchmarks import _plots

    paths = plot_paths(path)
    written = []
    for backend, fig in figures(data).items():
        _plots.save(fig, paths[backend])
        written.append(paths[backend])
    return written


def main(argv: list[str] | None = None) -> int:
    """Read the JSON, write the markdown (and the plot)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.render_compare")
    parser.add_argument("json", help="a JSON file written by benchmarks.compare --json")
    parser.add_argument("markdown", help="where to write the markdown report")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="also write the PNG plots, one per backend: PATH with {backend} replaced by its "
        "name (without {backend}: -asyncio, -uvloop, -trio added before the suffix)",
    )
    args = parser.parse_args(argv)
    data = json.loads(Path(args.json).read_text(encoding="utf-8"))
    Path(args.markdown).write_text(render(data), encoding="utf-8")
    if args.plot:
        plot(data, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
