"""The benchmark results as Markdown tables, as they appear in bench/README.md.

Run: ``python bench/tables.py [--results DIR]`` (default ``bench/results``); prints the tables of
``overhead.json`` and ``cache.json`` (whichever exist).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

RESULTS = Path(__file__).resolve().parent / "results"


def _n(x: Any, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if abs(x) >= 100:
            return f"{x:,.0f}"
        return f"{x:.{digits}f}"
    return str(x)


def _pair(row: dict[str, Any], key: str) -> str:
    return f"{_n(row.get(key + '.p50'))} / {_n(row.get(key + '.p99'))}"


def overhead_tables(report: dict[str, Any]) -> str:
    table: dict[str, dict[str, Any]] = report["comparison"]
    m = report["machine"]
    plan = report["plan"]
    lines = [
        f"Machine: {m['cpus']} cores, load average {m['loadavg_start'][0]:.2f} at the start and "
        f"{m['loadavg_end'][0]:.2f} at the end ({m['time']}); backend: fake, "
        f"{plan['tokens']} tokens {plan['itl_ms']:g} ms apart, first token at once.",
        "",
        "Latency each proxy adds over direct, ms, p50 / p99 (the direct row is absolute):",
        "",
        "| target | TTFT 1 stream 8 KB | e2e 1 stream 8 KB | TTFT 1 stream 512 KB "
        "| e2e 1 stream 512 KB | TTFT 64 streams | e2e 64 streams |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        key = "" if name == "direct" else "added_"
        cells = [
            _pair(row, f"{phase}.{key}{metric}")
            for phase in ("c1_8k", "c1_512k", "c64")
            for metric in ("ttft_ms", "e2e_ms")
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Throughput, memory and prefixgate's own time (`proxy_overhead_ms` from its records), "
        f"and an open-loop run at {plan['open_rate']:g} requests/s (goodput: TTFT ≤ "
        f"{plan['slo']['ttft_ms']:g} ms and TPOT ≤ {plan['slo']['tpot_ms']:g} ms):",
        "",
        "| target | req/s at 64 | req/s at 256 | RSS MB at 1 / 64 / 256 | proxy_overhead_ms 8 KB "
        "p50 / p99 | 512 KB p50 / p99 | open loop TTFT p50 / p99 | goodput req/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        rss = " / ".join(_n(row.get(f"rss_mb.{lv}"), 1) for lv in ("1", "64", "256"))
        lines.append(
            f"| {name} | {_n(row.get('c64.rps'), 0)} | {_n(row.get('c256.rps'), 0)} | {rss} | "
            f"{_pair(row, 'c1_8k.proxy_overhead_ms')} | {_pair(row, 'c1_512k.proxy_overhead_ms')} "
            f"| {_pair(row, 'open.ttft_ms')} | {_n(row.get('open.goodput_rps'), 1)} |"
        )
    for proxy, checks in report.get("targets", {}).items():
        lines += ["", f"Targets, {proxy}:", "", "| target | measured | limit | result |"]
        lines.append("|---|---|---|---|")
        for c in checks:
            result = {True: "**pass**", False: "**FAIL**", None: "n/a"}[c["pass"]]
            lines.append(f"| {c['target']} | {_n(c['value'])} | {_n(c['limit'])} | {result} |")
    return "\n".join(lines)


def cache_table(report: dict[str, Any]) -> str:
    lines = [
        f"Backend: {report['backend']}; SLO: TTFT ≤ {report['slo']['ttft_ms']:g} ms, TPOT ≤ "
        f"{report['slo']['tpot_ms']:g} ms; load average {report['machine']['loadavg_start'][0]:.2f}"
        f" at the start, {report['machine']['loadavg_end'][0]:.2f} at the end.",
        "",
        "| workload | requests | prompt tokens direct / prefixgate | cached share direct → "
        "prefixgate | TTFT p50 ms | TTFT p90 ms | SLO met | goodput req/s | rules fired |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, runs in report["workloads"].items():
        d, p = runs["direct"], runs["prefixgate"]
        share = f"{_pct(d['cached_share'])} → **{_pct(p['cached_share'])}**"
        rules = ", ".join(f"{k} x{v}" for k, v in p["canonical_rules"].items()) or "-"
        lines.append(
            f"| {name} | {d['requests']} | {d['prompt_tokens']:,} / {p['prompt_tokens']:,} | "
            f"{share} | {_arrow(d['ttft_ms']['p50'], p['ttft_ms']['p50'])} | "
            f"{_arrow(d['ttft_ms']['p90'], p['ttft_ms']['p90'])} | "
            f"{_pct(d['slo_met_share'])} → {_pct(p['slo_met_share'])} | "
            f"{_n(d['goodput_rps'])} → {_n(p['goodput_rps'])} | {rules} |"
        )
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _arrow(a: float | None, b: float | None) -> str:
    return f"{_n(a, 0)} → {_n(b, 0)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(RESULTS))
    args = parser.parse_args(argv)
    out = Path(args.results)
    parts = []
    if (out / "overhead.json").exists():
        parts.append(overhead_tables(orjson.loads((out / "overhead.json").read_bytes())))
    if (out / "cache.json").exists():
        parts.append(cache_table(orjson.loads((out / "cache.json").read_bytes())))
    print("\n\n".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
