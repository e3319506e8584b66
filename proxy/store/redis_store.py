"""The Redis store: the index and statistics shared by every proxy replica.

The keys, and the script call each operation sends, are ``RedisLayout``'s
(``proxy.store.redis_layout``, with the key layout and how it suits a cluster); the statistics'
reads are ``proxy.store.redis_stats``'s.

Each proxy writes its own *absolute* in-flight count per replica (it keeps the count locally),
so a write lost to a Redis blip is healed by the next one instead of drifting for ever.

Every call is bounded and guarded by a circuit breaker (``RedisCalls``,
``proxy.store.redis_calls``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from proxy.store.base import DEFAULT_NAMESPACE, LookupResult, StoreOptions
from proxy.store.ranking import PrefixStat
from proxy.store.redis_calls import STALE_READ, RedisCalls
from proxy.store.redis_cluster import cluster_client
from proxy.store.redis_layout import Call, RedisLayout, numbers
from proxy.store.redis_scripts import ALL_SCRIPTS, pack_chain
from proxy.store.redis_stats import read_top, read_window
from proxy.store.resp import RespAddress, RespLink
from proxy.store.stats import StatsSample
from proxy.store.window import StatsWindow, hours_between
from proxy.store.window_query import WindowQuery
from proxy.store.write_behind import WriteBatch


def _nothing(results: list[Any]) -> None:
    """A write's answer: none (its failures raise in ``_eval_all``)."""


class RedisStore(RedisCalls):
    """Prefix index and statistics in Redis, shared by every proxy replica."""

    def __init__(
        self,
        client: Redis | RedisCluster,
        options: StoreOptions | None = None,
        *,
        owns_client: bool = True,
        clock: Callable[[], float] = time.time,
        link: RespLink | None = None,
        write_link: RespLink | None = None,
    ) -> None:
        super().__init__(
            client,
            options or StoreOptions(),
            owns_client=owns_client,
            link=link,
            write_link=write_link,
        )
        self._clock = clock
        self.keys = RedisLayout(self._opts, clock, uuid.uuid4().hex[:12])
        """The store's keys and the script call each operation sends."""
        self._in_flight: dict[str, int] = {}
        self._in_flight_writing: set[str] = set()  # replicas with a count write under way
        self._in_flight_stale: set[str] = set()  # ... whose count changed since it started

    @property
    def proxy_id(self) -> str:
        """This proxy's field in the fleet's loads (``RedisLayout.proxy_id``)."""
        return self.keys.proxy_id

    @classmethod
    def from_url(cls, url: str, options: StoreOptions | None = None) -> RedisStore:
        """A store with its own client for ``url``.

        ``redis://host:port/db``, ``rediss://`` (TLS), ``unix://``: one Redis or Valkey primary.
        ``redis+cluster://host:port[,host:port...]``, ``rediss+cluster://``: a Redis or Valkey
        Cluster, found from any of those seed nodes (see ``proxy.store.redis_cluster``).
        """
        opts = options or StoreOptions()
        t = opts.timeouts
        common: dict[str, Any] = {
            # The per-call deadlines (``_guarded``) are the real bounds; these only stop a hung
            # socket from holding a pooled connection forever.
            "socket_connect_timeout": t.connect_s,
            "socket_timeout": max(t.read_s, t.write_s),
            # No retries inside redis-py: a retry would spend the caller's deadline, and the
            # breaker decides when Redis is tried again.
            "retry": Retry(NoBackoff(), 0),
            # RESP2: no HELLO handshake on a new connection.
            "protocol": 2,
        }
        cluster = cluster_client(url, **common)
        if cluster is not None:
            return cls(cluster, opts, owns_client=True)
        address = RespAddress.from_url(url)
        if address is None:
            return cls(Redis.from_url(url, **common), opts, owns_client=True)
        stale_s = max(t.read_s, t.write_s)  # redis-py's socket timeout, as below
        link = RespLink(address, connect_timeout_s=t.connect_s, stale_s=stale_s)
        writes = RespLink(address, connect_timeout_s=t.connect_s, stale_s=stale_s)
        client = Redis.from_url(url, **common)
        return cls(client, opts, owns_client=True, link=link, write_link=writes)

    async def recall(self, namespace: str, kind: str, keys: Sequence[str]) -> list[bytes | None]:
        """``MGET`` of the keys (one slot, so one node on a cluster); all ``None`` when degraded."""
        if not keys:
            return []
        names = [self.keys.memory_key(namespace, kind, k) for k in keys]
        none: list[bytes | None] = [None] * len(keys)
        timeout_s = self._opts.timeouts.lookup_s
        link = self._link
        if link is not None:
            found = await self._linked("recall", link, timeout_s, [("MGET", *names)])
            return none if found is None else list(found[0])

        async def run() -> list[bytes | None]:
            values = await self._client.mget(names)
            return [v if isinstance(v, bytes) or v is None else str(v).encode() for v in values]

        return await self._guarded("recall", timeout_s, none, run)

    async def remember(
        self, namespace: str, kind: str, items: Mapping[str, bytes], ttl_s: float
    ) -> None:
        """``SET … PX`` of each value, pipelined (values too large for the store are skipped)."""
        ttl_ms = max(round(ttl_s * 1000), 1)
        cap = self._opts.memory_value_bytes
        kept = [
            (self.keys.memory_key(namespace, kind, k), v) for k, v in items.items() if len(v) <= cap
        ]
        if not kept:
            return
        timeout_s = self._opts.timeouts.write_s
        link = self._write_link
        if link is not None:
            commands = [("SET", name, value, "PX", ttl_ms) for name, value in kept]
            await self._linked("remember", link, timeout_s, commands)
            return

        async def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            for name, value in kept:
                pipe.set(name, value, px=ttl_ms)
            await pipe.execute()

        await self._guarded("remember", timeout_s, None, run)

    async def warm(self) -> bool:
        """Connect, learn a cluster's layout and load every script on every primary, once.

        Without it the first calls pay for all of that under their deadlines (a lookup's is a
        few milliseconds) and answer neutrally: the first prefixes a proxy learns would be lost.
        ``SCRIPT LOAD`` on a cluster goes to every primary (redis-py's default for it).
        """

        async def run() -> None:
            if isinstance(self._client, RedisCluster):
                for script in ALL_SCRIPTS:
                    await self._client.execute_command(
                        "SCRIPT LOAD", script.source, target_nodes=RedisCluster.PRIMARIES
                    )
                return
            pipe = self._client.pipeline(transaction=False)
            for script in ALL_SCRIPTS:
                pipe.script_load(script.source)
            await pipe.execute()
            for link in {self._link, self._write_link} - {None}:  # off the first deadlines
                assert link is not None
                await link.execute([("PING",)])

        await self._guarded("warm", self._opts.timeouts.read_s, None, run)
        return not self.degraded

    # -- prefix index ---------------------------------------------------------------------------

    async def longest_match(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> dict[str, int]:
        """Blocks matched per replica, in one pipelined round trip; ``{}`` when degraded."""
        if not replicas:
            return {}
        if not hashes:
            return dict.fromkeys(replicas, 0)
        chain = pack_chain(hashes)
        calls = [self.keys.match(namespace, r, chain) for r in replicas]

        def answer(counts: list[Any]) -> dict[str, int]:
            return {r: int(c) for r, c in zip(replicas, counts, strict=True)}

        return await self._scripts("lookup", self._opts.timeouts.lookup_s, {}, calls, answer)

    async def record_prefix(
        self, namespace: str, replica: str, hashes: Sequence[int], capacity_blocks: int
    ) -> None:
        """Touch the chain, trim the index to capacity and renew its idle TTL (one script)."""
        if not hashes:
            return
        call = self.keys.record(namespace, replica, hashes, capacity_blocks)
        await self._scripts("record", self._opts.timeouts.write_s, None, [call], _nothing)

    # -- routing inputs -------------------------------------------------------------------------

    async def lookup(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> LookupResult:
        """Index match, loads and traffic counts in one pipelined round trip."""
        calls, answer = self.keys.lookup(namespace, replicas, hashes)
        unavailable = LookupResult.unavailable()
        return await self._scripts(
            "lookup", self._opts.timeouts.lookup_s, unavailable, calls, answer
        )

    async def traffic_counts(self, namespace: str, hashes: Sequence[int]) -> tuple[int, list[int]]:
        """Requests in the window and how many carried each leading hash (one script)."""
        call = self.keys.traffic_read(namespace, hashes)

        def answer(results: list[Any]) -> tuple[int, list[int]]:
            window, *counts = numbers(results[0])
            return window, counts

        return await self._scripts("traffic", self._opts.timeouts.lookup_s, (0, []), [call], answer)

    async def observe_traffic(self, namespace: str, hashes: Sequence[int]) -> None:
        """Count one request in the current traffic bucket."""
        call = self.keys.observe(namespace, hashes)
        await self._scripts("observe", self._opts.timeouts.write_s, None, [call], _nothing)

    async def add_in_flight(self, namespace: str, replica: str, delta: int) -> None:
        """Adjust this proxy's count and write it, absolute, under this proxy's id.

        Loads are per replica across namespaces; ``namespace`` only says who asked. Writes for
        one replica never overlap: a change made while one is under way marks the replica, and
        the writer under way writes again with the newest count. Two overlapping writes could
        reach Redis in either order (separate connections), and an older count landing last
        would stay there for as long as the replica gets no more traffic.
        """
        self._count_in_flight(replica, delta)
        if replica in self._in_flight_writing:
            self._in_flight_stale.add(replica)
            return
        self._in_flight_writing.add(replica)
        try:
            while True:
                self._in_flight_stale.discard(replica)
                await self._write_in_flight(replica)
                if replica not in self._in_flight_stale:
                    return
        finally:
            self._in_flight_writing.discard(replica)

    async def _write_in_flight(self, replica: str) -> None:
        """Write this proxy's current count for ``replica`` (bounded, like every call)."""
        call = self.keys.in_flight(replica, self._in_flight.get(replica, 0))
        await self._scripts("in_flight", self._opts.timeouts.write_s, None, [call], _nothing)

    def _count_in_flight(self, replica: str, delta: int) -> None:
        count = max(self._in_flight.get(replica, 0) + delta, 0)
        if count:
            self._in_flight[replica] = count
        else:
            self._in_flight.pop(replica, None)

    # -- statistics -----------------------------------------------------------------------------

    async def add_stats(self, sample: StatsSample) -> None:
        """Add the sample to its minute and hour buckets and its anchor's ranking (one script)."""
        calls = self.keys.stats([sample])
        if not calls:
            return  # older than anything kept
        await self._scripts("add_stats", self._opts.timeouts.write_s, None, calls, _nothing)

    # -- write behind ---------------------------------------------------------------------------

    async def apply_writes(self, batch: WriteBatch) -> None:
        """A batch of queued writes (``proxy.store.write_behind``) in one pipelined round trip:
        its lookups (answered from the store as it was before the batch's writes), each
        replica's in-flight count (absolute, as ``add_in_flight`` writes it), the traffic
        counts, the chains and the statistics, in that order. The lookups of a batch that fails
        are left unanswered (``WriteBatch.unanswered`` answers them as unavailable), and so is
        one that had to run again after the writes (``STALE_READ``: a script cache emptied)."""
        calls: list[Call] = []
        reads: list[tuple[int, int, Callable[[Sequence[Any]], LookupResult]]] = []
        for lookup in batch.lookups:
            lookup_calls, answer = self.keys.lookup(
                lookup.namespace, lookup.replicas, lookup.hashes
            )
            reads.append((len(calls), len(calls) + len(lookup_calls), answer))
            calls += lookup_calls
        for replica, (_, delta) in batch.in_flight.items():
            self._count_in_flight(replica, delta)
            if replica not in self._in_flight_writing:  # else the writer under way writes it
                calls.append(self.keys.in_flight(replica, self._in_flight.get(replica, 0)))
            else:
                self._in_flight_stale.add(replica)
        calls += [self.keys.observe(ns, hashes) for ns, hashes in batch.observes]
        for (ns, replica, _, _), (hashes, capacity) in batch.records.items():
            calls.append(self.keys.record(ns, replica, hashes, capacity))
        calls += self.keys.stats(batch.stats)
        if not calls:
            return
        # A batch takes Redis longer than one write: its bound grows with it (0.2 ms a script).
        limit_s = self._opts.timeouts.write_s + 0.0002 * len(calls)

        def answered(results: list[Any]) -> None:
            for lookup, (start, end, answer) in zip(batch.lookups, reads, strict=True):
                got = results[start:end]
                if any(r is STALE_READ for r in got):  # it may count the batch's own writes
                    lookup.answer(LookupResult.unavailable())
                else:
                    lookup.answer(answer(got))

        n_reads = reads[-1][1] if reads else 0
        await self._scripts("writes", limit_s, None, calls, answered, writes=True, reads=n_reads)

    async def query_stats(
        self,
        *,
        since_s: float,
        until_s: float | None = None,
        model: str | None = None,
        backend: str | None = None,
        namespace: str | None = None,
    ) -> StatsWindow:
        """Add up the window's buckets (one pipelined ``HGETALL`` per bucket)."""
        query = WindowQuery.resolve(
            since_s, until_s, self._clock, namespace=namespace, model=model, backend=backend
        )
        empty = query.builder().build()
        return await self._guarded(
            "query_stats",
            self._opts.timeouts.read_s,
            empty,
            lambda: read_window(self._client, self.keys.stats_key, query),
        )

    async def top_prefixes(
        self, *, since_s: float, limit: int = 10, namespace: str | None = None
    ) -> list[PrefixStat]:
        """The anchors that served the most prompt tokens in the hours since ``since_s``.

        Two round trips: the hourly rankings, then the counters of the leading anchors.
        """
        ns = namespace or DEFAULT_NAMESPACE
        hours = list(hours_between(since_s, self._clock()))
        if not hours or limit <= 0:
            return []
        return await self._guarded(
            "top_prefixes",
            self._opts.timeouts.read_s,
            [],
            lambda: read_top(self._client, self.keys.stats_key, ns, hours, limit),
        )
