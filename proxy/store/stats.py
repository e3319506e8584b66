"""Request statistics as additive counters: one sample in, a bag of increments out.

Every finished request becomes a ``StatsSample``; ``sample_increments`` turns it into named
counters that only ever add up (sums, counts, histogram buckets). Because every field is a plain
sum, a minute bucket, an hour rollup and a whole window are all the same thing, a ``Tally``, and
both stores keep them the same way: a Redis hash with ``HINCRBYFLOAT`` per field, or a dict.

Derived figures are computed at read time from exact sums, so the token-weighted measured hit
rate of a window is exact whatever its bucket size. Latencies go into fixed log-spaced buckets
(``LATENCY_BOUNDS_MS``, ten per decade from 1 ms to 125 s) and percentiles are interpolated
within a bucket, so they are good to about a quarter of the bucket's value.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.records import RequestRecord

UNKNOWN = "unknown"

# Ten buckets per decade (the R10 preferred numbers), 1 ms .. 125 s; one more for anything above.
_R10 = (1.0, 1.25, 1.6, 2.0, 2.5, 3.15, 4.0, 5.0, 6.3, 8.0)
LATENCY_BOUNDS_MS: tuple[float, ...] = (
    *(round(m * 10**d, 2) for d in range(5) for m in _R10),
    100_000.0,
    125_000.0,
)
LATENCY_METRICS = ("ttft", "ttfvt", "tpot", "e2e")
PERCENTILES = (0.5, 0.9, 0.99)
RULE_PREFIX = "rule:"
ROUTE_PREFIX = "route:"
SCHEDULE_PREFIX = "schedule:"
SOURCE_PREFIX = "source:"
KEY_PREFIX = "key:"
STRIPPED_PREFIX = "stripped:"
MISS_PREFIX = "miss:"
MISS_RULE_PREFIX = "miss_rule:"
MISS_WHY_PREFIX = "miss_why:"
MISS_CAUSES = ("new", "breaker", "routing", "evicted", "unexplained")
"""The causes of uncached tokens (``proxy.attribution.CAUSES``, which a test keeps equal)."""


def latency_bucket(value_ms: float) -> int:
    """Index of the histogram bucket holding ``value_ms`` (upper bounds are inclusive)."""
    return bisect_left(LATENCY_BOUNDS_MS, value_ms)


@dataclass(slots=True, kw_only=True)
class StatsSample:
    """What the statistics keep of one finished request."""

    ts: float
    namespace: str
    model: str
    backend: str
    status: int
    error: bool
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    predicted_cached_tokens: int | None = None
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    ttfvt_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    slo_met: bool | None = None
    saved_prefill_ms: float | None = None
    saved_usd: float | None = None
    prefix_anchor: str | None = None
    canonical_rules: list[str] = field(default_factory=list)
    prefix_label: str | None = None
    route_reason: str | None = None
    """Why the router chose this request's backend (``proxy.routing.REASONS``)."""
    schedule_reason: str | None = None
    """Where on the backend it went, or why it waited (``proxy.scheduling.REASONS``)."""
    cache_source: str | None = None
    """llama.cpp: where its cached tokens were expected from (slot, ram, none)."""
    affinity_source: str | None = None
    """Where the client's conversation key came from (``prompt_cache_key``, a header)."""
    hosted_stripped: list[str] = field(default_factory=list)
    """Hosted-only fields removed before the request went upstream."""
    misses: dict[str, int] | None = None
    """Uncached prompt tokens by cause (``MISS_CAUSES``); None: not attributed."""
    miss_breaker_rules: list[str] = field(default_factory=list)
    miss_routing_why: str | None = None

    @classmethod
    def from_record(
        cls,
        record: RequestRecord,
        *,
        namespace: str,
        ts: float,
        prefix_label: str | None = None,
    ) -> StatsSample:
        """The sample for one finished request.

        ``prefix_label`` is a short human-readable name for the request's application prefix;
        pass it only when the operator opted in to logging prompt text.
        """
        return cls(
            ts=ts,
            namespace=namespace,
            model=record.model or UNKNOWN,
            backend=record.backend or UNKNOWN,
            status=record.status,
            error=record.error is not None or record.status >= 400,
            prompt_tokens=record.prompt_tokens,
            cached_tokens=record.cached_tokens,
            predicted_cached_tokens=record.predicted_cached_tokens,
            completion_tokens=record.completion_tokens,
            ttft_ms=record.ttft_ms,
            ttfvt_ms=record.ttfvt_ms,
            tpot_ms=record.tpot_ms,
            e2e_ms=record.e2e_ms,
            slo_met=record.slo_met,
            saved_prefill_ms=record.saved_prefill_ms,
            saved_usd=record.saved_usd,
            prefix_anchor=record.prefix_anchor,
            canonical_rules=list(record.canonical_rules),
            prefix_label=prefix_label,
            route_reason=record.route_reason or None,
            schedule_reason=record.schedule_reason or None,
            cache_source=record.cache_source,
            affinity_source=record.affinity_source or None,
            hosted_stripped=[n for n in record.hosted_fields_stripped or () if n],
            misses=_misses(record),
            miss_breaker_rules=[r for r in record.miss_breaker_rules or () if r],
            miss_routing_why=record.miss_routing_why or None,
        )


def _misses(record: RequestRecord) -> dict[str, int] | None:
    if record.miss_new_tokens is None:
        return None
    return {
        "new": record.miss_new_tokens,
        "breaker": record.miss_breaker_tokens or 0,
        "routing": record.miss_routing_tokens or 0,
        "evicted": record.miss_evicted_tokens or 0,
        "unexplained": record.miss_unexplained_tokens or 0,
    }


def _miss_increments(sample: StatsSample, inc: dict[str, float]) -> None:
    misses = sample.misses
    if misses is None or sample.prompt_tokens is None or sample.cached_tokens is None:
        return
    inc["miss_requests"] = 1.0
    inc["miss_prompt_tokens"] = float(sample.prompt_tokens)
    inc["miss_cached_tokens"] = float(sample.cached_tokens)
    for cause in MISS_CAUSES:
        inc[MISS_PREFIX + cause] = float(misses.get(cause, 0))
    breaker = misses.get("breaker", 0)
    for rule in sample.miss_breaker_rules:  # each rule named is credited the whole span
        inc[MISS_RULE_PREFIX + rule] = float(breaker)
    if sample.miss_routing_why:
        inc[MISS_WHY_PREFIX + sample.miss_routing_why] = float(misses.get("routing", 0))


def sample_increments(sample: StatsSample) -> dict[str, float]:
    """The counters one request adds to its bucket (fields that would add zero are left out)."""
    return {k: v for k, v in _increments(sample).items() if v != 0.0 or k == "requests"}


def add_increments(into: dict[str, float], sample: StatsSample) -> None:
    """Add ``sample_increments(sample)`` into ``into``, counter by counter (both stores sum a
    batch's samples of one bucket so), without making the filtered bag first."""
    get = into.get
    for name, value in _increments(sample).items():
        if value != 0.0:  # ("requests" is always 1)
            into[name] = get(name, 0.0) + value


def _increments(sample: StatsSample) -> dict[str, float]:
    """``sample_increments`` with the counters that add zero still in."""
    inc: dict[str, float] = {"requests": 1.0}
    if sample.error:
        inc["errors"] = 1.0
    prompt = sample.prompt_tokens
    if prompt is not None:
        inc["prompt_known"] = 1.0
        inc["prompt_tokens"] = float(prompt)
    if sample.completion_tokens:
        inc["completion_tokens"] = float(sample.completion_tokens)
    cached, predicted = sample.cached_tokens, sample.predicted_cached_tokens
    if cached is not None and prompt is not None:
        inc["cached_known"] = 1.0
        inc["cached_tokens"] = float(cached)
        inc["cached_prompt_tokens"] = float(prompt)
        if prompt > 0:
            inc["hit_rate_n"] = 1.0
            inc["hit_rate_sum"] = cached / prompt
    if predicted is not None and prompt is not None:
        inc["predicted_known"] = 1.0
        inc["predicted_tokens"] = float(predicted)
        inc["predicted_prompt_tokens"] = float(prompt)
    if cached is not None and predicted is not None and prompt is not None:
        miss = abs(predicted - cached)
        inc["pred_err_n"] = 1.0
        inc["pred_err_tokens"] = float(miss)
        inc["pred_err_points"] = 100.0 * miss / prompt if prompt > 0 else 0.0
    if sample.slo_met is not None:
        inc["slo_evaluated"] = 1.0
        if sample.slo_met:
            inc["slo_met"] = 1.0
    saved_ms, saved_usd = sample.saved_prefill_ms, sample.saved_usd
    if saved_ms is not None and math.isfinite(saved_ms):
        inc["saved_prefill_ms"] = float(saved_ms)
    if saved_usd is not None and math.isfinite(saved_usd):
        inc["saved_usd"] = float(saved_usd)
    for rule in sample.canonical_rules:
        key = RULE_PREFIX + rule
        inc[key] = inc.get(key, 0.0) + 1.0
    if sample.route_reason:
        inc[ROUTE_PREFIX + sample.route_reason] = 1.0
    if sample.schedule_reason:
        inc[SCHEDULE_PREFIX + sample.schedule_reason] = 1.0
    if sample.cache_source:
        inc[SOURCE_PREFIX + sample.cache_source] = 1.0
    if sample.affinity_source:
        inc[KEY_PREFIX + sample.affinity_source] = 1.0
    for name in sample.hosted_stripped:
        inc[STRIPPED_PREFIX + name] = 1.0
    _miss_increments(sample, inc)
    for keys, value in (
        (_TTFT_KEYS, sample.ttft_ms),
        (_TTFVT_KEYS, sample.ttfvt_ms),
        (_TPOT_KEYS, sample.tpot_ms),
        (_E2E_KEYS, sample.e2e_ms),
    ):
        if value is None or not math.isfinite(value) or value < 0:
            continue
        n_key, sum_key, bucket_keys = keys
        inc[n_key] = 1.0
        inc[sum_key] = value
        inc[bucket_keys[bisect_left(LATENCY_BOUNDS_MS, value)]] = 1.0  # ``latency_bucket``
    return inc


_LATENCY_KEYS = {
    metric: (
        f"{metric}:n",
        f"{metric}:sum",
        tuple(f"{metric}:h{i}" for i in range(len(LATENCY_BOUNDS_MS) + 1)),
    )
    for metric in LATENCY_METRICS
}
"""Each latency's counter names: its count, its sum, its histogram buckets (``latency_bucket``)."""
_TTFT_KEYS, _TTFVT_KEYS, _TPOT_KEYS, _E2E_KEYS = (_LATENCY_KEYS[m] for m in LATENCY_METRICS)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _quantile(counts: list[int], total: int, q: float) -> float:
    """The ``q`` quantile of a latency histogram with ``total`` > 0 samples."""
    target = q * total
    seen = 0
    for i, c in enumerate(counts):
        if c and seen + c >= target:
            lo = LATENCY_BOUNDS_MS[i - 1] if i > 0 else 0.0
            hi = LATENCY_BOUNDS_MS[i] if i < len(LATENCY_BOUNDS_MS) else lo
            return lo + (hi - lo) * max(target - seen, 0.0) / c
        seen += c
    return LATENCY_BOUNDS_MS[-1]  # unreachable: the loop always reaches ``total``


class Tally:
    """Additive counters of one bucket, one window or one breakdown, and what derives from them."""

    __slots__ = ("counts",)

    def __init__(self, counts: Mapping[str, float] | None = None) -> None:
        self.counts: dict[str, float] = dict(counts or {})

    def add(self, field_name: str, value: float) -> None:
        """Add ``value`` to one counter."""
        self.counts[field_name] = self.counts.get(field_name, 0.0) + value

    def merge(self, other: Tally) -> None:
        """Add every counter of ``other``."""
        for name, value in other.counts.items():
            self.add(name, value)

    def get(self, name: str) -> float:
        """A counter, 0 when never incremented."""
        return self.counts.get(name, 0.0)

    @property
    def requests(self) -> int:
        return round(self.get("requests"))

    @property
    def hit_rate_token_weighted(self) -> float | None:
        """Measured cached tokens over prompt tokens, over requests whose backend reported."""
        return _ratio(self.get("cached_tokens"), self.get("cached_prompt_tokens"))

    @property
    def hit_rate_per_request_mean(self) -> float | None:
        """Mean of per-request measured hit rates."""
        return _ratio(self.get("hit_rate_sum"), self.get("hit_rate_n"))

    @property
    def predicted_hit_rate(self) -> float | None:
        """Predicted cached tokens over prompt tokens (token-weighted)."""
        return _ratio(self.get("predicted_tokens"), self.get("predicted_prompt_tokens"))

    @property
    def prediction_mae_tokens(self) -> float | None:
        """Mean |predicted - measured| cached tokens, over requests where both are known."""
        return _ratio(self.get("pred_err_tokens"), self.get("pred_err_n"))

    @property
    def prediction_mae_points(self) -> float | None:
        """The same error in hit-rate percentage points."""
        return _ratio(self.get("pred_err_points"), self.get("pred_err_n"))

    @property
    def error_rate(self) -> float | None:
        return _ratio(self.get("errors"), self.get("requests"))

    @property
    def goodput_share(self) -> float | None:
        """Share of SLO-evaluated requests that met the SLO (None when no SLO is set)."""
        return _ratio(self.get("slo_met"), self.get("slo_evaluated"))

    def rules(self) -> dict[str, int]:
        """How often each canonicalization rule fired."""
        n = len(RULE_PREFIX)
        return {
            k[n:]: round(v) for k, v in sorted(self.counts.items()) if k.startswith(RULE_PREFIX)
        }

    def routes(self) -> dict[str, int]:
        """How many requests the router sent for each reason (affinity, miss, load_gate...)."""
        n = len(ROUTE_PREFIX)
        return {
            k[n:]: round(v) for k, v in sorted(self.counts.items()) if k.startswith(ROUTE_PREFIX)
        }

    def schedules(self) -> dict[str, int]:
        """How many requests each scheduling decision applied to (slot_hit, coalesced...)."""
        n = len(SCHEDULE_PREFIX)
        return {
            k[n:]: round(v) for k, v in sorted(self.counts.items()) if k.startswith(SCHEDULE_PREFIX)
        }

    def cache_sources(self) -> dict[str, int]:
        """llama.cpp: requests by where their cached tokens were expected from (slot, ram...)."""
        return self.prefixed(SOURCE_PREFIX)

    def prefixed(self, prefix: str) -> dict[str, int]:
        """The counters under ``prefix``, by the rest of their name."""
        n = len(prefix)
        return {k[n:]: round(v) for k, v in sorted(self.counts.items()) if k.startswith(prefix)}

    def hosted(self) -> dict[str, dict[str, int]]:
        """Requests that carried a conversation key, by its source, and requests each hosted
        field was removed from, by field."""
        return {"keys": self.prefixed(KEY_PREFIX), "stripped": self.prefixed(STRIPPED_PREFIX)}

    def misses(self) -> dict[str, Any]:
        """The attributed requests' uncached prompt tokens by cause, with the dry-run rules
        behind the breakers and the reasons behind routing (tokens each)."""
        tokens = {c: round(self.get(MISS_PREFIX + c)) for c in MISS_CAUSES}
        uncached = sum(tokens.values())
        return {
            "requests": round(self.get("miss_requests")),
            "prompt_tokens": round(self.get("miss_prompt_tokens")),
            "cached_tokens": round(self.get("miss_cached_tokens")),
            "uncached_tokens": uncached,
            "tokens": tokens,
            "shares": {c: _rounded(_ratio(n, uncached)) for c, n in tokens.items()},
            "breaker_rules": self.prefixed(MISS_RULE_PREFIX),
            "routing_why": self.prefixed(MISS_WHY_PREFIX),
        }

    def histogram(self, metric: str) -> list[int]:
        """Counts per latency bucket (one more than ``LATENCY_BOUNDS_MS``: the overflow)."""
        return [round(self.get(f"{metric}:h{i}")) for i in range(len(LATENCY_BOUNDS_MS) + 1)]

    def percentile(self, metric: str, q: float) -> float | None:
        """The ``q`` quantile of a latency, interpolated linearly inside its bucket."""
        return self.percentiles(metric, (q,))[0]

    def percentiles(self, metric: str, qs: Iterable[float]) -> list[float | None]:
        """Several quantiles of one latency, its histogram read once (None without samples)."""
        counts = self.histogram(metric)
        total = sum(counts)
        return [_quantile(counts, total, q) if total else None for q in qs]

    def latency_summary(self, metric: str) -> dict[str, float | int | None]:
        """Count, mean and p50/p90/p99 of one latency metric."""
        n = self.get(f"{metric}:n")
        out: dict[str, float | int | None] = {
            "count": round(n),
            "mean": _rounded(_ratio(self.get(f"{metric}:sum"), n), 3),
        }
        for q, value in zip(PERCENTILES, self.percentiles(metric, PERCENTILES), strict=True):
            out[f"p{round(q * 100)}"] = _rounded(value, 3)
        return out

    def summary(self) -> dict[str, Any]:
        """Totals and derived figures as a JSON-ready dict."""
        return {
            "requests": self.requests,
            "errors": round(self.get("errors")),
            "error_rate": _rounded(self.error_rate),
            "prompt_tokens": round(self.get("prompt_tokens")),
            "completion_tokens": round(self.get("completion_tokens")),
            "cached_tokens": round(self.get("cached_tokens")),
            "cached_reported_requests": round(self.get("cached_known")),
            "predicted_cached_tokens": round(self.get("predicted_tokens")),
            "predicted_requests": round(self.get("predicted_known")),
            "hit_rate_token_weighted": _rounded(self.hit_rate_token_weighted),
            "hit_rate_per_request_mean": _rounded(self.hit_rate_per_request_mean),
            "predicted_hit_rate": _rounded(self.predicted_hit_rate),
            "prediction_mae_tokens": _rounded(self.prediction_mae_tokens, 2),
            "prediction_mae_points": _rounded(self.prediction_mae_points, 2),
            "slo_met": round(self.get("slo_met")),
            "slo_evaluated": round(self.get("slo_evaluated")),
            "goodput_share": _rounded(self.goodput_share),
            "saved_prefill_ms": round(self.get("saved_prefill_ms"), 3),
            "saved_usd": round(self.get("saved_usd"), 6),
            "rules": self.rules(),
            "routes": self.routes(),
            "schedules": self.schedules(),
            "cache_sources": self.cache_sources(),
            "hosted": self.hosted(),
            "misses": self.misses(),
            "latency_ms": {m: self.latency_summary(m) for m in LATENCY_METRICS},
        }

    def point(self) -> dict[str, Any]:
        """One chart point of ``/stats``'s series: counts, rates and the percentiles charted."""
        ttft50, ttft90, ttft99 = self.percentiles("ttft", (0.5, 0.9, 0.99))
        tpot50, tpot90, tpot99 = self.percentiles("tpot", (0.5, 0.9, 0.99))
        return {
            "requests": self.requests,
            "errors": round(self.get("errors")),
            "prompt_tokens": round(self.get("prompt_tokens")),
            "cached_tokens": round(self.get("cached_tokens")),
            "predicted_cached_tokens": round(self.get("predicted_tokens")),
            "hit_rate_token_weighted": _rounded(self.hit_rate_token_weighted),
            "predicted_hit_rate": _rounded(self.predicted_hit_rate),
            "goodput_share": _rounded(self.goodput_share),
            "slo_met": round(self.get("slo_met")),
            "slo_evaluated": round(self.get("slo_evaluated")),
            "ttft_p50_ms": _rounded(ttft50, 3),
            "ttft_p90_ms": _rounded(ttft90, 3),
            "ttft_p99_ms": _rounded(ttft99, 3),
            "tpot_p50_ms": _rounded(tpot50, 3),
            "tpot_p90_ms": _rounded(tpot90, 3),
            "tpot_p99_ms": _rounded(tpot99, 3),
            "e2e_p50_ms": _rounded(self.percentile("e2e", 0.5), 3),
            "saved_prefill_ms": round(self.get("saved_prefill_ms"), 3),
            "saved_usd": round(self.get("saved_usd"), 6),
        }


def total_of(tallies: Iterable[Tally]) -> Tally:
    """One tally adding up several."""
    out = Tally()
    for t in tallies:
        out.merge(t)
    return out
