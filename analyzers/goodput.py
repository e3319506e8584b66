"""Goodput: how many requests met the SLO, and latency for cache hits against misses.

A request counts as a *hit* when at least half its prompt came from cache: what the backend
reported where it did, else what the unbounded replay says could have been cached (the
``basis`` field says which). Failed requests count against the SLO when marked so.
"""

from __future__ import annotations

from dataclasses import dataclass

from analyzers.ideal import IdealReplay
from analyzers.quantile import percentile
from analyzers.trace import Trace

HIT_SHARE = 0.5
CDF_POINTS = 200


@dataclass(frozen=True, slots=True)
class Latency:
    """Percentiles of one latency over one class of requests, and a thinned sorted sample."""

    count: int
    p50: float | None
    p90: float | None
    p99: float | None
    sample: list[float]


@dataclass(frozen=True, slots=True)
class Goodput:
    """SLO attainment and TTFT/TPOT by cache hit and miss."""

    slo_requests: int
    slo_met: int
    ttft_hit: Latency
    ttft_miss: Latency
    tpot_hit: Latency
    tpot_miss: Latency
    basis: str  # "measured", "ideal" or "mixed"

    @property
    def slo_share(self) -> float | None:
        return self.slo_met / self.slo_requests if self.slo_requests else None


def latency(values: list[float]) -> Latency:
    """Summarise one set of latencies."""
    values.sort()
    n = len(values)
    step = max(1, n // CDF_POINTS)
    sample = values[::step]
    if values and sample[-1] != values[-1]:
        sample.append(values[-1])
    return Latency(
        n,
        percentile(values, 0.5),
        percentile(values, 0.9),
        percentile(values, 0.99),
        sample,
    )


def goodput(trace: Trace, ideal: IdealReplay) -> Goodput:
    """SLO share and latency percentiles, split by cache hit and miss."""
    slo_requests = trace.errors_slo_missed
    slo_met = 0
    ttft: tuple[list[float], list[float]] = ([], [])
    tpot: tuple[list[float], list[float]] = ([], [])
    bases: set[str] = set()
    for r, best in zip(trace.requests, ideal.cached, strict=True):
        if r.slo_met is not None:
            slo_requests += 1
            slo_met += r.slo_met
        if r.ttft_ms is None and r.tpot_ms is None:
            continue
        if r.cached_tokens is not None:
            cached, basis = float(r.cached_tokens), "measured"
        else:
            cached, basis = best, "ideal"
        bases.add(basis)
        miss = int(not r.prompt_tokens or cached / r.prompt_tokens < HIT_SHARE)
        if r.ttft_ms is not None:
            ttft[miss].append(r.ttft_ms)
        if r.tpot_ms is not None:
            tpot[miss].append(r.tpot_ms)
    basis = "mixed" if len(bases) > 1 else (bases.pop() if bases else "ideal")
    return Goodput(
        slo_requests=slo_requests,
        slo_met=slo_met,
        ttft_hit=latency(ttft[0]),
        ttft_miss=latency(ttft[1]),
        tpot_hit=latency(tpot[0]),
        tpot_miss=latency(tpot[1]),
        basis=basis,
    )
