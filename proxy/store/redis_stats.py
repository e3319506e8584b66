"""The Redis statistics: the ``ADD_STATS`` runs that fold finished requests in, and the reads
of ``/stats`` and the top prefixes.

Requests of one bucket (namespace, minute, model, backend) are summed into one run, and each
application prefix's counters of one hour into one more: a batch of writes
(``proxy.store.write_behind``) adds as many runs as it has buckets and prefixes, not requests.
A batch of one is exactly what adding that request alone writes. The key layout is
``RedisLayout``'s (``stats_key``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from proxy.store.ranking import (
    ANCHOR_FIELDS,
    LABEL,
    LAST_SEEN,
    PrefixStat,
    anchor_increments,
    rank,
    trim_threshold,
)
from proxy.store.redis_scripts import ADD_STATS, LuaScript
from proxy.store.stats import StatsSample, add_increments
from proxy.store.window import HOUR_S, MINUTE_S, StatsWindow, add_counters, bucket_field
from proxy.store.window_query import WindowQuery

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
        add_increments(counters, sample)
        anchor_inc = anchor_increments(sample)
        if anchor_inc is None or not sample.prefix_anchor:
            continue
        key = (ns, hour, sample.prefix_anchor)
        summed, ts, label, first = anchors.get(key, ({}, sample.ts, "", minute))
        add_counters(summed, anchor_inc)
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


def text(value: bytes | str) -> str:
    """A Redis answer as text."""
    return value.decode() if isinstance(value, bytes) else value


async def read_window(
    client: Redis | RedisCluster, stats_key: StatsKey, query: WindowQuery
) -> StatsWindow:
    """``query``'s buckets added up (one pipelined ``HGETALL`` per bucket)."""
    builder = query.builder()
    buckets = query.plan.buckets
    if buckets:
        pipe = client.pipeline(transaction=False)
        for ref in buckets:
            kind = "m" if ref.resolution_s == MINUTE_S else "h"
            pipe.hgetall(stats_key(query.namespace, kind, ref.index))
        hashes = await pipe.execute()
        for ref, raw in zip(buckets, hashes, strict=True):
            if raw:
                builder.add_bucket(ref.point_ts, ((text(k), float(v)) for k, v in raw.items()))
    return builder.build()


async def read_top(
    client: Redis | RedisCluster,
    stats_key: StatsKey,
    namespace: str,
    hours: Sequence[int],
    limit: int,
) -> list[PrefixStat]:
    """The anchors that served the most prompt tokens in ``hours``, in two round trips: the
    hourly rankings, then the counters of the leading anchors."""
    fields = (*ANCHOR_FIELDS, LAST_SEEN, LABEL)
    pipe = client.pipeline(transaction=False)
    for hour in hours:
        pipe.zrange(stats_key(namespace, "top", hour), 0, -1, withscores=True)
    tokens: dict[str, float] = {}
    for ranking in await pipe.execute():
        for member, score in ranking:
            anchor = text(member)
            tokens[anchor] = tokens.get(anchor, 0.0) + float(score)
    if not tokens:
        return []
    # Keep ties at the cut: the final order also looks at requests.
    cut = sorted(tokens.values(), reverse=True)[min(limit, len(tokens)) - 1]
    anchors = [a for a, t in tokens.items() if t >= cut]
    names = [f"{a}|{f}" for a in anchors for f in fields]
    pipe = client.pipeline(transaction=False)
    for hour in hours:
        pipe.hmget(stats_key(namespace, "anchor", hour), names)
    merged = {a: PrefixStat(anchor=a) for a in anchors}
    for values in await pipe.execute():
        for i, anchor in enumerate(anchors):
            row = values[i * len(fields) : (i + 1) * len(fields)]
            if row[0] is None:
                continue
            counters = {f: float(v) for f, v in zip(ANCHOR_FIELDS, row, strict=False) if v}
            seen = float(row[-2]) if row[-2] is not None else 0.0
            label = text(row[-1]) if row[-1] is not None else None
            merged[anchor].add(counters, seen, label)
    return rank(merged.values(), limit)
