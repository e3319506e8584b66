"""One analysis run: read the inputs, replay them, and gather every finding in one object.

``analyze`` is the library entry point behind ``prefixgate analyze``; ``Analysis.to_json``
is the ``--json`` document (its keys are a contract for scripts: added to, never renamed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from analyzers.breakers import Breaker, find_breakers
from analyzers.capacity import DEFAULT_POINTS, CapacityCurve, capacity_curve
from analyzers.goodput import Goodput, Latency, goodput
from analyzers.ideal import (
    IdealReplay,
    Measured,
    TimeBucket,
    measured,
    replay_unbounded,
    timeline,
)
from analyzers.prefixtree import PrefixTree, shared_prefixes
from analyzers.providers import DEFAULT_MIN_CACHEABLE_TOKENS, ProviderRules, provider_rules
from analyzers.readers import Progress, read_paths
from analyzers.trace import Trace


@dataclass(frozen=True, slots=True)
class AnalyzeOptions:
    """Knobs of one run; the defaults are what ``prefixgate analyze`` uses."""

    min_cacheable_tokens: int = DEFAULT_MIN_CACHEABLE_TOKENS
    max_backends_per_prompt: int = 1
    capacities: tuple[int, ...] | None = None
    capacity_points: int = DEFAULT_POINTS
    top: int = 10
    timeline_buckets: int = 40


@dataclass(frozen=True, slots=True)
class Analysis:
    """Everything one run found."""

    paths: list[str]
    trace: Trace
    ideal: IdealReplay
    ideal_request_hit_rate: float
    measured: Measured | None
    curve: CapacityCurve
    tree: PrefixTree
    breakers: list[Breaker]
    providers: ProviderRules
    goodput: Goodput
    timeline: list[TimeBucket]
    seconds: dict[str, float]

    def to_json(self, *, top: int | None = None) -> dict[str, Any]:
        """The ``--json`` document."""
        m = self.measured
        t = self.trace
        return {
            "inputs": t.formats,
            "granularity": sorted(t.granularity),
            "requests": len(t.requests),
            "failed_requests": t.errors,
            "requests_without_prefix": t.without_prefix,
            "skipped_lines": t.skipped,
            "prompt_tokens": round(self.ideal.prompt_tokens),
            "ideal_cached_tokens": round(self.ideal.cached_tokens),
            "ideal_hit_rate": self.ideal.hit_rate,
            "ideal_request_hit_rate": self.ideal_request_hit_rate,
            "measured_hit_rate": m.hit_rate if m else None,
            "measured_request_hit_rate": m.request_hit_rate if m else None,
            "measured_requests": m.requests if m else 0,
            "ideal_hit_rate_where_measured": m.ideal_hit_rate if m else None,
            "hit_rate_gap": m.gap if m else None,
            "footprint_tokens": self.curve.footprint_tokens,
            "capacity_curve": [
                {
                    "capacity_tokens": p.capacity_tokens,
                    "hit_rate": p.hit_rate,
                    "request_hit_rate": p.request_hit_rate,
                }
                for p in self.curve.points
            ],
            "capacity_for_90pct_of_ideal_tokens": self.curve.tokens_for_90pct,
            "shared_prefixes": [asdict(g) for g in self.tree.groups],
            "shared_prefix_groups": self.tree.total_groups,
            "breakers": [b.as_dict() for b in self.breakers[:top]],
            "provider_rules": asdict(self.providers),
            "goodput": _goodput_json(self.goodput),
            "miss_attribution": t.misses.to_json(),
            "timeline": [asdict(b) for b in self.timeline],
            "notes": t.notes,
            "template_clocks": t.template_clocks,
            "learned_spans": t.learned_spans,
            "seconds": self.seconds,
        }


def _latency_json(lat: Latency) -> dict[str, Any]:
    return {"count": lat.count, "p50": lat.p50, "p90": lat.p90, "p99": lat.p99}


def _goodput_json(g: Goodput) -> dict[str, Any]:
    return {
        "slo_requests": g.slo_requests,
        "slo_met": g.slo_met,
        "slo_share": g.slo_share,
        "hit_basis": g.basis,
        "ttft_ms": {"hit": _latency_json(g.ttft_hit), "miss": _latency_json(g.ttft_miss)},
        "tpot_ms": {"hit": _latency_json(g.tpot_hit), "miss": _latency_json(g.tpot_miss)},
    }


def template_clock_notes(clocks: dict[str, str]) -> list[str]:
    """What to tell about backends whose chat template prints the clock into every prompt."""
    out = []
    for backend, kind in sorted(clocks.items()):
        cost = "every request" if kind == "time" else "once a day"
        out.append(
            f"{backend}: its chat template prints the {kind} into every prompt (strftime_now), "
            f"which breaks the prefix cache {cost} from that point on; no rewrite of the "
            "request can help: serve a template without it (--chat-template-file) or pass the "
            "date in the system prompt yourself, where the proxy can relocate it"
        )
    return out


def analyze(
    paths: Sequence[Path],
    options: AnalyzeOptions | None = None,
    *,
    progress: Progress | None = None,
    phase: Callable[[str], None] | None = None,
) -> Analysis:
    """Read ``paths`` and run every analysis over them.

    ``progress`` is called with bytes read as reading advances; ``phase`` with the name of
    each step that follows reading.
    """
    opts = options or AnalyzeOptions()
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = round(now - clock, 4)
        clock = now
        if phase is not None:
            phase(name)

    trace = read_paths(paths, progress=progress)
    lap("read")
    requests = trace.requests
    ideal = replay_unbounded(requests)
    lap("ideal")
    curve = capacity_curve(requests, ideal, capacities=opts.capacities, points=opts.capacity_points)
    lap("capacity")
    tree = shared_prefixes(requests, ideal, top=opts.top)
    lap("prefix_tree")
    breakers = find_breakers(requests, ideal)
    lap("breakers")
    if "block" in trace.granularity and not any(r.body or r.kinds for r in requests):
        trace.notes.append("block-id traces carry no prompt text or structure: no breakers")
    providers = provider_rules(
        requests,
        ideal,
        min_cacheable_tokens=opts.min_cacheable_tokens,
        max_backends_per_prompt=opts.max_backends_per_prompt,
        top=opts.top,
    )
    trace.notes.extend(template_clock_notes(trace.template_clocks))
    if trace.learned_spans:
        listed = ", ".join(f"{k} ({n})" for k, n in sorted(trace.learned_spans.items()))
        trace.notes.append(
            "the proxy relocated values it learned from traffic (volatile_learned), by pattern "
            f"id (requests): {listed}; /stats canonical.learned_spans describes each"
        )
    if trace.without_prefix:
        trace.notes.append(
            f"{trace.without_prefix} records had neither prefix segments nor a body: "
            "counted in totals with no possible hit"
        )
    return Analysis(
        paths=[str(p) for p in paths],
        trace=trace,
        ideal=ideal,
        ideal_request_hit_rate=ideal.request_hit_rate(requests),
        measured=measured(requests, ideal),
        curve=curve,
        tree=tree,
        breakers=breakers,
        providers=providers,
        goodput=goodput(trace, ideal),
        timeline=timeline(requests, ideal, buckets=opts.timeline_buckets),
        seconds=seconds,
    )
