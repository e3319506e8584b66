"""The in-process store: the default when no Redis is configured.

Same contract and same numbers as the Redis store, kept in dicts: one ``OrderedDict`` LRU per
(namespace, replica) with an idle TTL, a ``TrafficWindow`` and the in-flight counts per
namespace, and the statistics (``proxy.store.embedded_stats``: buckets of ``bucket_field``
counters, what Redis keeps in hashes, and the hourly anchor rankings). Nothing here awaits
anything, so a lookup costs no round trip; state lives and dies with the process.
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
from proxy.store.embedded_stats import StatsBuckets
from proxy.store.ranking import PrefixStat
from proxy.store.stats import StatsSample
from proxy.store.window import MINUTE_S, StatsWindow, hours_between
from proxy.store.window_query import WindowQuery

if TYPE_CHECKING:
    from proxy.store.write_behind import WriteBatch


class _ReplicaIndex:
    """One replica's LRU of block hashes (oldest first) and when it was last written."""

    __slots__ = ("blocks", "touched")

    def __init__(self) -> None:
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.touched = 0.0


class EmbeddedStore:
    """Prefix index and statistics in this process's memory."""

    def __init__(
        self, options: StoreOptions | None = None, *, clock: Callable[[], float] = time.time
    ) -> None:
        self._opts = options or StoreOptions()
        self._clock = clock
        self._indexes: dict[tuple[str, str], _ReplicaIndex] = {}
        self._stats = StatsBuckets(
            retention_s=self._opts.stats_retention_s, top_cap=self._opts.top_prefixes_cap
        )
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
        if self._stats.add(samples, now):  # (samples all past retention: no sweep either)
            self._sweep(now)

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
        return self._stats.window(query)

    async def top_prefixes(
        self, *, since_s: float, limit: int = 10, namespace: str | None = None
    ) -> list[PrefixStat]:
        """The anchors that served the most prompt tokens in the hours since ``since_s``."""
        hours = hours_between(since_s, self._clock())
        return self._stats.top(namespace or DEFAULT_NAMESPACE, hours, limit)

    # -- housekeeping ---------------------------------------------------------------------------

    def _sweep(self, now: float) -> None:
        """Drop idle indexes and expired buckets, at most once a minute."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + MINUTE_S
        ttl = self._opts.index_ttl_s
        for key in [k for k, v in self._indexes.items() if now - v.touched > ttl]:
            del self._indexes[key]
        self._stats.expire(now)

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
