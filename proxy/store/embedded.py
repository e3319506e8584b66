"""The in-process store: the default when no Redis is configured.

Same contract and same numbers as the Redis store, kept in dicts: one ``OrderedDict`` LRU per
(namespace, replica) with an idle TTL, a ``TrafficWindow`` and the in-flight counts per
namespace, statistics buckets as dicts of ``bucket_field`` counters (what Redis keeps in
hashes), and the hourly anchor rankings. Nothing here awaits anything, so
a lookup costs no round trip; state lives and dies with the process.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from proxy.fingerprint import leading_run
from proxy.routing import TRAFFIC_MAX_BLOCKS, TrafficWindow
from proxy.sized_lru import SizedLRU
from proxy.store.base import DEFAULT_NAMESPACE, LookupResult, StoreOptions
from proxy.store.ranking import (
    ANCHOR_FIELDS,
    PrefixStat,
    anchor_increments,
    rank,
    trim_threshold,
)
from proxy.store.stats import StatsSample, sample_increments
from proxy.store.window import (
    HOUR_S,
    MINUTE_S,
    StatsWindow,
    bucket_field,
    hours_between,
)
from proxy.store.window_query import WindowQuery

if TYPE_CHECKING:
    from proxy.store.write_behind import WriteBatch

_BucketKey = tuple[str, int, int]  # (namespace, resolution_s, index)
_FIELD_KEY_PAIRS = 1024
"""(model, backend) pairs whose bucket keys are kept made (model names are the clients')."""


class _ReplicaIndex:
    """One replica's LRU of block hashes (oldest first) and when it was last written."""

    __slots__ = ("blocks", "touched")

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.touched = 0.0


class _Anchor:
    __slots__ = ("counts", "label", "last_seen")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(ANCHOR_FIELDS, 0.0)
        self.last_seen = 0.0
        self.label: str | None = None


class EmbeddedStore:
    """Prefix index and statistics in this process's memory."""

    def __init__(
        self, options: StoreOptions | None = None, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._opts = options or StoreOptions()
        self._clock = clock
        self._indexes: dict[tuple[str, str], _ReplicaIndex] = {}
        self._buckets: dict[_BucketKey, dict[str, float]] = {}
        self._field_keys: dict[tuple[str, str], dict[str, str]] = {}
        """Each (model, backend)'s bucket keys by counter name (``bucket_field``), made once."""
        self._anchors: dict[tuple[str, int], dict[str, _Anchor]] = {}
        self._traffic: dict[str, TrafficWindow] = {}
        self._in_flight: dict[str, int] = {}  # per replica, across namespaces
        # (namespace, kind, key) -> (value, expires at), least recently written first
        self._memory: SizedLRU[tuple[str, str, str], tuple[bytes, float]] = SizedLRU(
            entries=self._opts.memory_entries,
            max_bytes=self._opts.memory_bytes,
            size=lambda slot, entry: len(slot[2]) + len(entry[0]),
        )
        self._next_sweep = 0.0

    @property
    def degraded(self) -> bool:
        return False

    @property
    def failures(self) -> int:
        return 0

    # -- prefix index ---------------------------------------------------------------------------

    def _live_index(self, namespace: str, replica: str, now: float) -> _ReplicaIndex | None:
        index = self._indexes.get((namespace, replica))
        if index is not None and now - index.touched > self._opts.index_ttl_s:
            del self._indexes[(namespace, replica)]
            return None
        return index

    async def longest_match(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> dict[str, int]:
        """Blocks matched per replica; no I/O."""
        return self._longest_match(namespace, replicas, hashes)

    def _longest_match(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> dict[str, int]:
        now = self._clock()
        out: dict[str, int] = {}
        for replica in replicas:
            index = self._live_index(namespace, replica, now)
            if index is None or not hashes:
                out[replica] = 0
                continue
            out[replica] = leading_run(hashes, index.blocks)
        return out

    async def record_prefix(
        self, namespace: str, replica: str, hashes: Sequence[int], capacity_blocks: int
    ) -> None:
        """Touch the chain (its head most recent), then evict the least recent past capacity."""
        if hashes:
            self._record_prefix(namespace, replica, hashes, capacity_blocks, self._clock())

    def _record_prefix(
        self,
        namespace: str,
        replica: str,
        hashes: Sequence[int],
        capacity_blocks: int,
        now: float,
    ) -> None:
        index = self._live_index(namespace, replica, now)
        if index is None:
            index = self._indexes[(namespace, replica)] = _ReplicaIndex()
        index.touched = now
        blocks = index.blocks
        # The chain is touched tail first, so past capacity its own tail is what goes: touching
        # only the leading ``capacity_blocks`` leaves the index exactly as touching all would.
        if len(hashes) > capacity_blocks:
            hashes = hashes[: max(capacity_blocks, 0)]
        if hashes and hashes[-1] in blocks and all(map(blocks.__contains__, hashes)):
            # The whole chain is there (a request's blocks recorded again once it has ended):
            # the same moves, driven in C.
            deque(map(blocks.move_to_end, reversed(hashes)), maxlen=0)
        else:
            for h in reversed(hashes):
                if h in blocks:
                    blocks.move_to_end(h)
                else:
                    blocks[h] = None
        excess = len(blocks) - max(capacity_blocks, 0)
        for _ in range(excess):
            blocks.popitem(last=False)
        if not blocks:
            del self._indexes[(namespace, replica)]
        self._sweep(now)

    # -- routing inputs -------------------------------------------------------------------------

    async def lookup(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> LookupResult:
        """Index match, loads and traffic counts; no I/O."""
        return self.lookup_now(namespace, replicas, hashes)

    def lookup_now(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> LookupResult:
        """``lookup``, answered in the caller's own step (``PrefixTracker.lookup``, deferred)."""
        matched = self._longest_match(namespace, replicas, hashes)
        window, counts = self._traffic_counts(namespace, hashes)
        loads = {r: float(self._in_flight.get(r, 0)) for r in replicas}
        return LookupResult(matched, loads, window, counts)

    def _window(self, namespace: str) -> TrafficWindow:
        window = self._traffic.get(namespace)
        if window is None:
            window = self._traffic[namespace] = TrafficWindow(
                bucket_s=self._opts.traffic_window_s, max_hashes=self._opts.traffic_max_hashes
            )
        return window

    async def traffic_counts(self, namespace: str, hashes: Sequence[int]) -> tuple[int, list[int]]:
        """Requests in the window and how many carried each leading hash (``hashes``: a block
        chain, as every store reads it)."""
        return self._traffic_counts(namespace, hashes)

    def _traffic_counts(self, namespace: str, hashes: Sequence[int]) -> tuple[int, list[int]]:
        window = self._traffic.get(namespace)
        if window is None:
            return 0, [0] * min(len(hashes), TRAFFIC_MAX_BLOCKS)
        return window.counts(hashes, self._clock())

    async def observe_traffic(self, namespace: str, hashes: Sequence[int]) -> None:
        """Count one request in the namespace's rolling window."""
        self._window(namespace).observe(hashes, self._clock())

    async def add_in_flight(self, namespace: str, replica: str, delta: int) -> None:
        """Adjust the replica's count (across namespaces); it never goes below zero."""
        self._add_in_flight(replica, delta)

    def _add_in_flight(self, replica: str, delta: int) -> None:
        count = self._in_flight.get(replica, 0) + delta
        if count > 0:
            self._in_flight[replica] = count
        else:
            self._in_flight.pop(replica, None)

    async def apply_writes(self, batch: WriteBatch) -> None:
        """A write-behind batch (``proxy.store.write_behind``) in one step, in
        ``apply_batch``'s order: the lookups (through ``lookup``), then the in-flight counts,
        the traffic, the chains and the statistics, each a plain call under one reading of the
        clock rather than an awaited coroutine of its own (some five writes a request). It
        calls the writes' own bodies, not ``record_prefix``, ``observe_traffic``,
        ``add_in_flight`` and ``add_stats``: a subclass overriding those is written past."""
        for lookup in batch.lookups:
            lookup.answer(await self.lookup(lookup.namespace, lookup.replicas, lookup.hashes))
        now = self._clock()
        for replica, (_, delta) in batch.in_flight.items():
            if delta:
                self._add_in_flight(replica, delta)
        for namespace, hashes in batch.observes:
            self._window(namespace).observe(hashes, now)
        record = self._record_prefix
        for (namespace, replica, _, _), (hashes, capacity) in batch.records.items():
            if hashes:
                record(namespace, replica, hashes, capacity, now)
        if batch.stats:
            self._add_stats(batch.stats, now)

    # -- statistics -----------------------------------------------------------------------------

    async def add_stats(self, sample: StatsSample) -> None:
        """Fold the sample into its minute bucket, its hour rollup and its anchor's hour."""
        self._add_stats((sample,), self._clock())

    def _add_stats(self, samples: Sequence[StatsSample], now: float) -> None:
        """``add_stats`` of each of ``samples``. The counters of samples of one minute, model
        and backend are summed first and folded into their buckets once, as the Redis store
        sends a batch (``redis_stats.add_stats_calls``): a write-behind batch's samples mostly
        share all three."""
        retention = self._opts.stats_retention_s
        groups: dict[tuple[str, int, str, str], dict[str, float]] = {}
        for sample in samples:
            minute = int(sample.ts // MINUTE_S)
            hour = int(sample.ts // HOUR_S)
            if (hour + 1) * HOUR_S + retention <= now:
                continue  # older than anything kept
            inc = sample_increments(sample)  # (a dict of its own)
            key = (sample.namespace, minute, sample.model, sample.backend)
            summed = groups.get(key)
            if summed is None:
                groups[key] = inc
            else:
                for name, value in inc.items():
                    summed[name] = summed.get(name, 0.0) + value
            self._add_anchor(sample, hour)
        for (namespace, minute, model, backend), inc in groups.items():
            self._fold(namespace, minute, model, backend, inc, now)
        if groups:  # (samples all past retention leave the store as it was: no sweep either)
            self._sweep(now)

    def _fold(
        self,
        namespace: str,
        minute: int,
        model: str,
        backend: str,
        inc: Mapping[str, float],
        now: float,
    ) -> None:
        """Add ``inc`` to the minute's bucket and its hour's rollup."""
        retention = self._opts.stats_retention_s
        pair = (model, backend)
        keys = self._field_keys.get(pair)
        if keys is None:
            if len(self._field_keys) >= _FIELD_KEY_PAIRS:
                self._field_keys.clear()
            keys = self._field_keys[pair] = {}
        buckets = self._buckets
        hourly = buckets.setdefault((namespace, HOUR_S, minute * MINUTE_S // HOUR_S), {})
        if (minute + 1) * MINUTE_S + retention > now:
            minutely = buckets.setdefault((namespace, MINUTE_S, minute), {})
        else:
            minutely = {}  # its minute has expired already, its hour not: in its hour only
        for name, value in inc.items():
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
        for name, value in inc.items():
            entry.counts[name] += value
        entry.last_seen = max(entry.last_seen, sample.ts)
        if sample.prefix_label:
            entry.label = sample.prefix_label
        cap = self._opts.top_prefixes_cap
        if len(ranked) > trim_threshold(cap):
            # Same order as Redis ZPOPMIN: lowest score first, ties by anchor.
            by_score = sorted(ranked.items(), key=lambda kv: (kv[1].counts["p"], kv[0]))
            for anchor, _ in by_score[: len(ranked) - cap]:
                del ranked[anchor]

    async def query_stats(
        self,
        *,
        since_s: float,
        until_s: float | None = None,
        model: str | None = None,
        backend: str | None = None,
        namespace: str | None = None,
    ) -> StatsWindow:
        """Add up the window's buckets."""
        query = WindowQuery.resolve(
            since_s, until_s, self._clock, namespace=namespace, model=model, backend=backend
        )
        builder = query.builder()
        for ref in query.plan.buckets:
            bucket = self._buckets.get((query.namespace, ref.resolution_s, ref.index))
            if bucket:
                builder.add_bucket(ref.point_ts, bucket.items())
        return builder.build()

    async def top_prefixes(
        self, *, since_s: float, limit: int = 10, namespace: str | None = None
    ) -> list[PrefixStat]:
        """The anchors that served the most prompt tokens in the hours since ``since_s``."""
        ns = namespace or DEFAULT_NAMESPACE
        merged: dict[str, PrefixStat] = {}
        for hour in hours_between(since_s, self._clock()):
            for anchor, entry in self._anchors.get((ns, hour), {}).items():
                stat = merged.get(anchor)
                if stat is None:
                    stat = merged[anchor] = PrefixStat(anchor=anchor)
                stat.add(entry.counts, entry.last_seen, entry.label)
        return rank(merged.values(), limit)

    # -- housekeeping ---------------------------------------------------------------------------

    def _sweep(self, now: float) -> None:
        """Drop idle indexes and expired buckets, at most once a minute."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + MINUTE_S
        ttl = self._opts.index_ttl_s
        for key in [k for k, v in self._indexes.items() if now - v.touched > ttl]:
            del self._indexes[key]
        retention = self._opts.stats_retention_s
        for bkey in [k for k in self._buckets if (k[2] + 1) * k[1] + retention <= now]:
            del self._buckets[bkey]
        for akey in [k for k in self._anchors if (k[1] + 1) * HOUR_S + retention <= now]:
            del self._anchors[akey]

    async def recall(self, namespace: str, kind: str, keys: Sequence[str]) -> list[bytes | None]:
        """The remembered values (``None`` where none or expired); no I/O."""
        now = self._clock()
        out: list[bytes | None] = []
        for key in keys:
            entry = self._memory.get((namespace, kind, key))
            if entry is None or entry[1] <= now:
                out.append(None)
            else:
                out.append(entry[0])
        return out

    async def remember(
        self, namespace: str, kind: str, items: Mapping[str, bytes], ttl_s: float
    ) -> None:
        """Keep the values (the least recently written beyond ``memory_entries`` or
        ``memory_bytes`` go)."""
        expires = self._clock() + ttl_s
        for key, value in items.items():
            if len(value) <= self._opts.memory_value_bytes:
                self._memory.put((namespace, kind, key), (value, expires))

    @property
    def memory_bytes(self) -> int:
        """Bytes of the values (and their keys) kept for ``remember`` now."""
        return self._memory.bytes

    async def warm(self) -> bool:
        """Always ready: nothing to connect to."""
        return True

    async def aclose(self) -> None:
        """Nothing to release: the state goes with the process (idempotent)."""
