"""Plots of the benchmark results: PNGs next to the JSON they are drawn from.

Run: ``python bench/plots.py [--results DIR]`` (default ``bench/results``). Draws, from
``overhead.json``: ``overhead_latency.png`` (TTFT and end-to-end latency each proxy adds over
direct), ``overhead_throughput.png`` (requests/s at 64 and 256 streams) and
``overhead_rss.png`` (proxy memory at 1, 64 and 256 streams); from ``cache.json``:
``cache_gains.png`` (cached-token share, TTFT p50 and SLO met per workload, direct vs
prefixgate). A missing JSON file is skipped.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib
import orjson

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).resolve().parent / "results"
COLORS = {
    "direct": "#9e9e9e",
    "nginx": "#4caf50",
    "aiohttp-relay": "#ffb300",
    "litellm": "#e53935",
    "prefixgate": "#1e88e5",
    "prefixgate-redis": "#3949ab",
}


def _bars(ax: Any, groups: list[str], series: dict[str, list[float | None]]) -> None:
    """Grouped bars: one group per label, one bar per series."""
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        ys = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, ys, width, label=name, color=COLORS.get(name))
        for bar, v in zip(bars, values, strict=True):
            if v is not None:
                ax.annotate(
                    f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups)


def _save(fig: Any, path: Path) -> Path:
    """Lay ``fig`` out, write it to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bar_chart(
    path: Path,
    groups: list[str],
    series: dict[str, list[float | None]],
    *,
    ylabel: str,
    title: str,
) -> Path:
    """A chart of one panel of grouped bars, written to ``path``."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    _bars(ax, groups, series)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def overhead_plots(report: dict[str, Any], out: Path) -> list[Path]:
    table: dict[str, dict[str, Any]] = report["comparison"]
    proxies = [t for t in table if t != "direct"]
    other = [
        s["other_cpu_cores"]
        for r in report["results"].values()
        for s in r["phases"].values()
        if s.get("other_cpu_cores") is not None
    ]
    note = f"{report['machine']['cpus']} cores shared by load generator, backend and proxy"
    if other:
        note += f"; other work used {min(other):.1f}-{max(other):.1f} cores meanwhile"
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    phases = [("c1_8k", "1 stream, 8 KB"), ("c1_512k", "1 stream, 512 KB"), ("c64", "64 streams")]
    for ax, metric, title in (
        (axes[0], "ttft_ms", "Added TTFT p50 (ms, over direct)"),
        (axes[1], "e2e_ms", "Added end-to-end p50 (ms, over direct)"),
    ):
        series = {
            p: [table[p].get(f"{ph}.added_{metric}.p50") for ph, _ in phases] for p in proxies
        }
        _bars(ax, [label for _, label in phases], series)
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_title(title)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.legend(fontsize=8)
    fig.suptitle(f"What each proxy adds (fake backend, 16 tokens 2 ms apart). {note}", fontsize=9)
    written.append(_save(fig, out / "overhead_latency.png"))

    conc = [c for c in (64, 256) if any(f"c{c}.rps" in row for row in table.values())]
    levels = ["1", *(str(c) for c in conc)]
    one_panel: list[tuple[str, list[str], dict[str, list[float | None]], str, str]] = [
        (
            "overhead_throughput.png",
            [f"{c} streams" for c in conc],
            {t: [table[t].get(f"c{c}.rps") for c in conc] for t in table},
            "completed requests/s",
            "Sustained requests/s, closed loop",
        ),
        (
            "overhead_rss.png",
            [f"{lv} stream{'s' if lv != '1' else ''}" for lv in levels],
            {p: [table[p].get(f"rss_mb.{lv}") for lv in levels] for p in proxies},
            "peak RSS, MB (process tree)",
            "Proxy memory",
        ),
    ]
    for name, groups, series, ylabel, title in one_panel:
        written.append(_bar_chart(out / name, groups, series, ylabel=ylabel, title=title))
    return written


def cache_plot(report: dict[str, Any], out: Path) -> list[Path]:
    workloads: dict[str, dict[str, Any]] = report["workloads"]
    names = list(workloads)
    modes = ["direct", "prefixgate"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels: tuple[tuple[str, Callable[[dict[str, Any]], float | None]], ...] = (
        ("cached share of prompt tokens", lambda s: s["cached_share"]),
        ("TTFT p50, ms", lambda s: s["ttft_ms"]["p50"]),
        (f"SLO met (TTFT <= {report['slo']['ttft_ms']:.0f} ms)", lambda s: s["slo_met_share"]),
    )
    for ax, (title, get) in zip(axes, panels, strict=True):
        series = {
            m: [get(workloads[n][m]) if m in workloads[n] else None for n in names] for m in modes
        }
        _bars(ax, names, series)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
        ax.legend(fontsize=8)
    fig.suptitle(f"Cache gains: {report['backend']}", fontsize=9)
    return [_save(fig, out / "cache_gains.png")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args(argv)
    out = Path(args.results)
    written: list[Path] = []
    overhead = out / "overhead.json"
    if overhead.exists():
        written += overhead_plots(orjson.loads(overhead.read_bytes()), out)
    cache = out / "cache.json"
    if cache.exists():
        written += cache_plot(orjson.loads(cache.read_bytes()), out)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
