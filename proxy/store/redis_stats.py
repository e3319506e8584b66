"""The ``ADD_STATS`` script runs that fold finished requests into the Redis statistics.

Requests of one bucket (namespace, minute, model, backend) are summed into one run, and each
application prefix's counters of one hour into one more: a batch of writes
(``proxy.store.write_behind``) adds as many runs as it has buckets and prefixes, not requests.
A batch of one is exactly what adding that request alone writes. The key layout is
``RedisStore``'s (``stats_key``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.store.ranking import anchor_increments, trim_threshold
from proxy.store.redis_scripts import ADD_STATS, LuaScript
from proxy.store.stats import StatsSample, sample_increments
from proxy.store.window import HOUR_S, MINUTE_S, bucket_field

StatsCall = tuple[LuaScript, Sequence[str], Sequence[Any]]
StatsKey = Callable[[str, str, int], str]
"""``(namespace, kind, index) -> key``: ``m`` minute, ``h`` hour, ``top`` and ``anchor`` hour."""


def add_stats_calls(
    samples: Sequence[StatsSample],
    *,
    stats_key: StatsKey,
    retention_s: float,
    top_cap: int,
    now: float,
) -> list[StatsCall]:
    """The runs that add ``samples`` (those past retention left out)."""
    buckets: dict[tuple[str, int, str, str], dict[str, float]] = {}
    # (namespace, hour, anchor) -> summed counters, newest ts, latest label, a minute of the hour
    anchors: dict[tuple[str, int, str], tuple[dict[str, float], float, str, int]] = {}
    for sample in samples:
        minute, hour = int(sample.ts // MINUTE_S), int(sample.ts // HOUR_S)
        if int((hour + 1) * HOUR_S + retention_s) <= now:
            continue  # older than anything kept
        ns = sample.namespace
        counters = buckets.setdefault((ns, minute, sample.model, sample.backend), {})
        _add(counters, sample_increments(sample))
        anchor_inc = anchor_increments(sample)
        if anchor_inc is None or not sample.prefix_anchor:
            continue
        key = (ns, hour, sample.prefix_anchor)
        summed, ts, label, first = anchors.get(key, ({}, sample.ts, "", minute))
        _add(summed, anchor_inc)
        anchors[key] = (summed, max(ts, sample.ts), sample.prefix_label or label, first)
    calls: list[StatsCall] = []
    for (ns, minute, model, backend), counters in buckets.items():
        args = _bucket_args(minute, counters, model, backend, retention_s)
        calls.append((ADD_STATS, _keys(stats_key, ns, minute), [*args, ""]))
    for (ns, _, anchor), (summed, ts, label, minute) in anchors.items():
        args = _bucket_args(minute, {}, "", "", retention_s)
        args += [anchor, repr(ts), label, top_cap, trim_threshold(top_cap)]
        for name, value in summed.items():
            args += (name, repr(value))
        calls.append((ADD_STATS, _keys(stats_key, ns, minute), args))
    return calls


def _add(into: dict[str, float], increments: Mapping[str, float]) -> None:
    for name, value in increments.items():
        into[name] = into.get(name, 0.0) + value


def _bucket_args(
    minute: int, counters: Mapping[str, float], model: str, backend: str, retention_s: float
) -> list[Any]:
    hour = int(minute * MINUTE_S // HOUR_S)
    minute_expire = int((minute + 1) * MINUTE_S + retention_s)
    hour_expire = int((hour + 1) * HOUR_S + retention_s)
    args: list[Any] = [minute_expire, hour_expire, len(counters)]
    for name, value in counters.items():
        args += (bucket_field(model, backend, name), repr(value))
    return args


def _keys(stats_key: StatsKey, ns: str, minute: int) -> tuple[str, str, str, str]:
    hour = int(minute * MINUTE_S // HOUR_S)
    return (
        stats_key(ns, "m", minute),
        stats_key(ns, "h", hour),
        stats_key(ns, "top", hour),
        stats_key(ns, "anchor", hour),
    )
