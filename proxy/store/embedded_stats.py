"""The embedded store's statistics (``EmbeddedStore``'s ``add_stats``, ``query_stats`` and
``top_prefixes``): what the Redis store keeps in hashes, kept in dicts.

A minute bucket and its hour's rollup per namespace, each a dict of ``bucket_field`` counters,
and per (namespace, hour) the application prefixes' counters, trimmed as Redis trims its
sorted set. Samples of one minute, model and backend are summed before they are added, as
``redis_stats.add_stats_calls`` sends a batch, so a write-behind batch folds into its buckets
once per group rather than once per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from proxy.store.ranking import (
    ANCHOR_FIELDS,
    PrefixStat,
    anchor_increments,
    rank,
    trim_threshold,
)
from proxy.store.stats import StatsSample, add_increments
from proxy.store.window import (
    HOUR_S,
    MINUTE_S,
    StatsWindow,
    add_counters,
    bucket_field,
)
from proxy.store.window_query import WindowQuery

_BucketKey = tuple[str, int, int]  # (namespace, resolution_s, index)
_FIELD_KEY_PAIRS = 1024
"""(model, backend) pairs whose bucket keys are kept made (model names are the clients')."""


class _Anchor:
    __slots__ = ("counts", "label", "last_seen")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(ANCHOR_FIELDS, 0.0)
        self.last_seen = 0.0
        self.label: str | None = None


class StatsBuckets:
    """Statistics buckets and anchor rankings in this process's memory."""

    def __init__(self, *, retention_s: float, top_cap: int) -> None:
        self.retention_s = retention_s
        self.top_cap = top_cap
        self._buckets: dict[_BucketKey, dict[str, float]] = {}
        self._field_keys: dict[tuple[str, str], dict[str, str]] = {}
        """Each (model, backend)'s bucket keys by counter name (``bucket_field``), made once."""
        self._anchors: dict[tuple[str, int], dict[str, _Anchor]] = {}

    def add(self, samples: Sequence[StatsSample], now: float) -> bool:
        """Fold each of ``samples`` into its minute bucket, its hour rollup and its anchor's
        hour; False when every one was past retention (nothing changed)."""
        retention = self.retention_s
        groups: dict[tuple[str, int, str, str], dict[str, float]] = {}
        for sample in samples:
            minute = int(sample.ts // MINUTE_S)
            hour = int(sample.ts // HOUR_S)
            if (hour + 1) * HOUR_S + retention <= now:
                continue  # older than anything kept
            key = (sample.namespace, minute, sample.model, sample.backend)
            add_increments(groups.setdefault(key, {}), sample)
            self._add_anchor(sample, hour)
        for (namespace, minute, model, backend), counters in groups.items():
            self._fold(namespace, minute, model, backend, counters, now)
        return bool(groups)

    def _fold(
        self,
        namespace: str,
        minute: int,
        model: str,
        backend: str,
        counters: Mapping[str, float],
        now: float,
    ) -> None:
        """Add ``counters`` to the minute's bucket and its hour's rollup."""
        pair = (model, backend)
        keys = self._field_keys.get(pair)
        if keys is None:
            if len(self._field_keys) >= _FIELD_KEY_PAIRS:
                self._field_keys.clear()
            keys = self._field_keys[pair] = {}
        buckets = self._buckets
        hourly = buckets.setdefault((namespace, HOUR_S, minute * MINUTE_S // HOUR_S), {})
        if (minute + 1) * MINUTE_S + self.retention_s > now:
            minutely = buckets.setdefault((namespace, MINUTE_S, minute), {})
        else:
            minutely = {}  # its minute has expired already, its hour not: in its hour only
        for name, value in counters.items():
            key = keys.get(name)
            if key is None:
                key = keys[name] = bucket_field(model, backend, name)
            minutely[key] = minutely.get(key, 0.0) + value
            hourly[key] = hourly.get(key, 0.0) + value

    def _add_anchor(self, sample: StatsSample, hour: int) -> None:
        inc = anchor_increments(sample)
        if inc is None or sample.prefix_anchor is None:
            return
        ranked = self._anchors.setdefault((sample.namespace, hour), {})
        entry = ranked.get(sample.prefix_anchor)
        if entry is None:
            entry = ranked[sample.prefix_anchor] = _Anchor()
        add_counters(entry.counts, inc)
        entry.last_seen = max(entry.last_seen, sample.ts)
        if sample.prefix_label:
            entry.label = sample.prefix_label
        cap = self.top_cap
        if len(ranked) > trim_threshold(cap):
            # Same order as Redis ZPOPMIN: lowest score first, ties by anchor.
            by_score = sorted(ranked.items(), key=lambda kv: (kv[1].counts["p"], kv[0]))
            for anchor, _ in by_score[: len(ranked) - cap]:
                del ranked[anchor]

    def window(self, query: WindowQuery) -> StatsWindow:
        """Add up the window's buckets."""
        builder = query.builder()
        for ref in query.plan.buckets:
            bucket = self._buckets.get((query.namespace, ref.resolution_s, ref.index))
            if bucket:
                builder.add_bucket(ref.point_ts, bucket.items())
        return builder.build()

    def top(self, namespace: str, hours: Iterable[int], limit: int) -> list[PrefixStat]:
        """The anchors that served the most prompt tokens in ``hours``."""
        merged: dict[str, PrefixStat] = {}
        for hour in hours:
            for anchor, entry in self._anchors.get((namespace, hour), {}).items():
                stat = merged.get(anchor)
                if stat is None:
                    stat = merged[anchor] = PrefixStat(anchor=anchor)
                stat.add(entry.counts, entry.last_seen, entry.label)
        return rank(merged.values(), limit)

    def expire(self, now: float) -> None:
        """Drop the buckets and rankings past retention."""
        retention = self.retention_s
        for bkey in [k for k in self._buckets if (k[2] + 1) * k[1] + retention <= now]:
            del self._buckets[bkey]
        for akey in [k for k in self._anchors if (k[1] + 1) * HOUR_S + retention <= now]:
            del self._anchors[akey]
