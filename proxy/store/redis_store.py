"""The Redis store: the index and statistics shared by every proxy replica.

Key layout (``pg`` is ``StoreOptions.key_prefix``; ``<ns>`` the namespace, kept as is when it is
short and plain, else ``~`` + a hash; ``<rid>`` the first 12 hex digits of xxh3-64 of the
replica URL)::

    pg:{rt:<ns>}:idx:<rid>       ZSET  block hash (8 bytes BE) -> last use (ms since 2020)
    pg:{rt:<ns>}:tc:<bucket>     HASH  leading block hash (8 bytes BE) -> requests carrying it,
                                       "n" -> requests   (bucket = ts // traffic_window_s)
    pg:{fleet}:load              HASH  "<proxy id>|<rid>" -> that proxy's requests in flight
    pg:{fleet}:proxies           ZSET  proxy id -> its last in-flight write (ms since 2020)
    pg:{st:<ns>}:m:<minute>      HASH  "<model>|<backend>|<field>" -> sum   (minute = ts // 60)
    pg:{st:<ns>}:h:<hour>        HASH  the same counters, rolled up by hour (hour = ts // 3600)
    pg:{st:<ns>}:top:<hour>      ZSET  anchor -> prompt tokens served in that hour
    pg:{st:<ns>}:anchor:<hour>   HASH  "<anchor>|r|p|c|cp|t|l" -> per-anchor counters, label
    pg:{mem:<ns>}:<kind>:<key>   STRING  a value ``remember`` kept (expires ``ttl_s`` after)

The braces are Redis Cluster hash tags, and every script and pipeline was laid out around them:

* each script touches keys of one tag (so of one slot): ``CROSSSLOT`` cannot happen;
* a namespace's routing state, the index of every replica and its traffic counts, shares the
  ``{rt:<ns>}`` slot, so the critical-path lookup reads two slots in all, that one and
  ``{fleet}``: one round trip to one node on a single Redis, at most two nodes in parallel on a
  cluster;
* a namespace's statistics have a slot of their own (``{st:<ns>}``): a ``/stats`` read of a
  week of buckets, one pipeline to one node, does not queue behind the lookups;
* loads belong to the replicas, not to a tenant (a replica is as busy whoever sends to it):
  they are kept once for the whole fleet, in ``{fleet}``.

Different namespaces hash to different slots, which is how a cluster spreads the load: a
cluster helps a multi-tenant fleet; one tenant's routing state stays on one node.

Indexes expire after ``index_ttl_s`` without a write; buckets ``stats_retention_s`` after their
minute or hour ends; traffic buckets two window lengths after they start; in-flight counts
``in_flight_ttl_s`` after the last write, and a proxy silent that long stops counting.

Each proxy writes its own *absolute* in-flight count per replica (it keeps the count locally),
so a write lost to a Redis blip is healed by the next one instead of drifting for ever.

Every call is bounded (``StoreTimeouts``) and guarded by a circuit breaker (``StoreHealth``):
Redis down, hung or restarted costs a request ``lookup_s`` (and what the proxy's own loop is
late by), and the store reconnects by itself (redis-py opens a new connection on the next call
after one was dropped). The deadline of a call on the scripts' link (the scripts, ``recall``,
``remember``) is the link's (``RespLink.execute``): the call fails only if Redis had not
answered when the loop came to look, so a proxy whose own loop runs late does not open the
breaker on a Redis that answered in time.

Redis Cluster (``redis+cluster://`` / ``rediss+cluster://``; the client and its layout are
``proxy.store.redis_cluster``'s): pipelines are split per node and sent in parallel. One
breaker guards the whole cluster: a node down degrades the store (every call answers its
neutral result, the traffic flows), exactly as a single Redis down does. While the cluster
still serves the other nodes' slots, a probe that lands on one of them closes the breaker until
the next call to the dead node opens it again: a ``store_degraded`` / ``store_recovered`` pair
per ``breaker_s`` at most, until the cluster fails the node over (or declares itself down).
"""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import structlog
import xxhash
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    NoScriptError,
    RedisClusterException,
    RedisError,
)

from proxy.routing import TRAFFIC_MAX_BLOCKS
from proxy.store.base import DEFAULT_NAMESPACE, LookupResult, StoreOptions
from proxy.store.health import StoreHealth
from proxy.store.ranking import (
    ANCHOR_FIELDS,
    LABEL,
    LAST_SEEN,
    PrefixStat,
    rank,
)
from proxy.store.redis_cluster import CLUSTER_ANSWERS, ClusterLayout, cluster_client
from proxy.store.redis_scripts import (
    ALL_SCRIPTS,
    IN_FLIGHT,
    LOADS_READ,
    LOOKUP,
    OBSERVE,
    RECORD,
    TRAFFIC_READ,
    LuaScript,
    pack_chain,
)
from proxy.store.redis_stats import add_stats_calls
from proxy.store.resp import Command, RespAddress, RespLink
from proxy.store.stats import StatsSample
from proxy.store.window import (
    MINUTE_S,
    StatsWindow,
    hours_between,
)
from proxy.store.window_query import WindowQuery
from proxy.store.write_behind import WriteBatch

T = TypeVar("T")
_log = structlog.get_logger("prefixgate.store")
_Call = tuple[LuaScript, Sequence[str], Sequence[Any]]
_PLAIN_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# What a failed Redis call can raise: redis-py's errors (the cluster client's own ones are not
# RedisErrors: "cannot be connected", "slot not covered"), socket errors it did not translate,
# and our own deadline.
_FAILURES = (RedisError, RedisClusterException, OSError, TimeoutError)


async def _within(call: Awaitable[T], timeout_s: float) -> T:
    """``call``'s result, or TimeoutError at ``timeout_s`` sharp.

    Unlike ``asyncio.timeout``, the deadline does not wait for the cancelled call to unwind:
    redis-py can take up to its socket timeout to do so (a connection being set up to a Redis
    that accepts and never answers), and the caller may be a request on its critical path.
    The abandoned call finishes being cancelled in the background.
    """
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except BaseException:  # the caller itself was cancelled
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_retrieve)
        raise TimeoutError
    return task.result()


def _raised(results: list[Any]) -> list[Any]:
    """``results``, or the first error among them raised (a pipeline's errors come in place)."""
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


def _nothing(results: list[Any]) -> None:
    """A write's answer: none (its failures raise in ``_eval_all``)."""


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved: an abandoned call's failure is already accounted for


def namespace_key(namespace: str) -> str:
    """The namespace as it appears in keys: itself when plain, else a stable hash."""
    if _PLAIN_NAMESPACE.fullmatch(namespace):
        return namespace
    return "~" + xxhash.xxh3_64_hexdigest(namespace.encode())


def replica_id(replica: str) -> str:
    """Short stable id of a replica URL (a field of the loads, the name of its index)."""
    return xxhash.xxh3_64_hexdigest(replica.encode())[:12]


def _numbers(value: bytes | str) -> list[int]:
    """The integers of a comma-separated script answer (the routing reads)."""
    text = _text(value)
    return [int(v) for v in text.split(",")] if text else []


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisStore:
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
        self._client = client
        self._link = link
        """The scripts' own connection (``proxy.store.resp``), where the URL allows one."""
        self._write_link = write_link or link
        """The batched writes' (``apply_writes``): a lookup never waits behind a batch."""
        self._opts = options or StoreOptions()
        self._owns_client = owns_client
        self._clock = clock
        self._health = StoreHealth(store="redis", breaker_s=self._opts.timeouts.breaker_s)
        self._closed = False
        self.proxy_id = uuid.uuid4().hex[:12]
        self._in_flight: dict[str, int] = {}
        self._in_flight_writing: set[str] = set()  # replicas with a count write under way
        self._in_flight_stale: set[str] = set()  # ... whose count changed since it started
        self._layout: ClusterLayout | None = None
        if isinstance(client, RedisCluster):
            timeouts = self._opts.timeouts
            self._layout = ClusterLayout(client, timeout_s=max(timeouts.read_s, timeouts.connect_s))
        self._hinted = False

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

    # -- state ----------------------------------------------------------------------------------

    @property
    def degraded(self) -> bool:
        return self._health.degraded

    @property
    def failures(self) -> int:
        """Failed Redis calls since start-up."""
        return self._health.failures

    @property
    def client(self) -> Redis | RedisCluster:
        return self._client

    @property
    def options(self) -> StoreOptions:
        """The sizing, retention and deadlines the store was opened with."""
        return self._opts

    @property
    def cluster(self) -> bool:
        """Whether the store talks to a Redis Cluster."""
        return self._layout is not None

    async def aclose(self) -> None:
        """Close the client if this store created it; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._layout is not None:
            await self._layout.aclose()
        if self._link is not None:
            await self._link.aclose()
        if self._write_link is not None and self._write_link is not self._link:
            await self._write_link.aclose()
        if self._owns_client:
            await self._client.aclose()

    def memory_key(self, namespace: str, kind: str, key: str) -> str:
        """Key of one remembered value: a namespace's memory shares one slot (one MGET)."""
        return f"{self._opts.key_prefix}:{{mem:{namespace_key(namespace)}}}:{kind}:{key}"

    async def recall(self, namespace: str, kind: str, keys: Sequence[str]) -> list[bytes | None]:
        """``MGET`` of the keys (one slot, so one node on a cluster); all ``None`` when degraded."""
        if not keys:
            return []
        names = [self.memory_key(namespace, kind, k) for k in keys]
        none: list[bytes | None] = [None] * len(keys)
        timeout_s = self._opts.timeouts.lookup_s
        link = self._link
        if link is not None:  # on the scripts' link, under its deadline (``_scripts``)
            deadline = asyncio.get_running_loop().time() + timeout_s

            async def linked() -> list[bytes | None]:
                (values,) = _raised(await link.execute([("MGET", *names)], deadline))
                return list(values)

            return await self._guarded("recall", None, none, linked)

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
        kept = [(self.memory_key(namespace, kind, k), v) for k, v in items.items() if len(v) <= cap]
        if not kept:
            return
        timeout_s = self._opts.timeouts.write_s
        link = self._write_link
        if link is not None:
            deadline = asyncio.get_running_loop().time() + timeout_s
            commands = [("SET", name, value, "PX", ttl_ms) for name, value in kept]

            async def linked() -> None:
                _raised(await link.execute(commands, deadline))

            await self._guarded("remember", None, None, linked)
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

    async def _guarded(
        self,
        op: str,
        timeout_s: float | None,
        neutral: T,
        call: Callable[[], Awaitable[T]],
    ) -> T:
        """Run ``call`` within ``timeout_s``; on any failure answer ``neutral`` and note it.

        ``timeout_s`` None: ``call`` keeps its own deadline (the scripts' link, ``_scripts``).
        """
        if self._closed or not self._health.allow():
            return neutral
        try:
            if timeout_s is None:
                result = await call()
            elif self._layout is not None and self._layout.pending:
                result = await _within(self._layout.then(call), timeout_s)
            else:
                result = await _within(call(), timeout_s)
        except _FAILURES as exc:
            self._failed(op, exc)
            return neutral
        except BaseException:  # cancelled from outside (e.g. the client went away)
            self._health.abandoned()
            raise
        self._health.succeeded()
        return result

    def _failed(self, op: str, exc: BaseException) -> None:
        self._health.failed(op, exc)
        if self._layout is not None and not self._closed:
            self._layout.refresh()
        elif isinstance(exc, CLUSTER_ANSWERS) and not self._hinted:
            self._hinted = True
            _log.error(
                "store_is_a_cluster",
                error=type(exc).__name__,
                detail=str(exc)[:200],
                hint="the Redis URL names a cluster node: use redis+cluster://host:port",
            )

    async def _scripts(
        self,
        op: str,
        timeout_s: float,
        neutral: T,
        calls: Sequence[_Call],
        answer: Callable[[list[Any]], T],
        *,
        writes: bool = False,
    ) -> T:
        """``answer`` to the results of ``calls`` (``_eval_all``) within ``timeout_s``, guarded.

        On the scripts' own connection (``RespLink``: writes on their own one) the deadline is
        the link's: it fails the call only if Redis's replies had not been read when the loop
        came to look, so a proxy too busy to notice an answer in time does not put its own lag
        down to Redis (and open the breaker on it). A frozen or slow Redis still misses it.
        Through redis-py (Cluster, TLS) ``_guarded`` bounds the call.
        """
        if (self._write_link if writes else self._link) is None:

            async def run() -> T:
                return answer(await self._eval_all(calls, writes=writes))

            return await self._guarded(op, timeout_s, neutral, run)

        async def bounded() -> T:
            return answer(await self._eval_all(calls, writes=writes, timeout_s=timeout_s))

        return await self._guarded(op, None, neutral, bounded)

    async def _eval_all(
        self,
        calls: Sequence[_Call],
        *,
        writes: bool = False,
        timeout_s: float | None = None,
    ) -> list[Any]:
        """Run each (script, keys, args) in one pipelined round trip (one per node, in parallel,
        on a cluster). ``timeout_s``: the scripts' link's deadline (``_scripts``), from now.

        After a Redis restart the script cache is empty: the calls that failed for it are sent
        once more with the scripts' source (``EVAL`` runs and caches them), one more round trip
        in all, so that the first lookup after a restart still fits its deadline. Only those
        calls run again: a script that did run is never applied twice. Should the first round
        trip's replies have been read past the deadline (the loop's lag: they count), the second
        has a window of its own, else it would be given up before Redis could answer it.
        """
        link = self._write_link if writes else self._link
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s

        async def send(commands: list[Command]) -> list[Any]:
            if link is None:
                return await self._pipelined(commands)
            return await link.execute(commands, deadline)

        results = await send(
            [("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args in calls]
        )
        missing = [i for i, r in enumerate(results) if isinstance(r, NoScriptError)]
        if missing:
            if deadline is not None and timeout_s is not None and loop.time() >= deadline:
                deadline = loop.time() + timeout_s
            again = await send(
                [
                    ("EVAL", calls[i][0].source, len(calls[i][1]), *calls[i][1], *calls[i][2])
                    for i in missing
                ]
            )
            for i, r in zip(missing, again, strict=True):
                results[i] = r
        return _raised(results)

    async def _pipelined(self, commands: Sequence[Sequence[Any]]) -> list[Any]:
        """``commands`` in one redis-py pipeline; errors as values in place.

        ``execute_command`` rather than ``pipe.evalsha``: the very same command, but redis-py's
        cluster pipeline refuses the ``evalsha`` method wholesale (it cannot know that each
        script's keys share a slot; ours do, and the cluster client routes EVALSHA by them).
        """
        pipe = self._client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(await pipe.execute(raise_on_error=False))

    # -- keys -----------------------------------------------------------------------------------

    def _routing_tag(self, namespace: str) -> str:
        """``pg:{rt:<ns>}``: a namespace's indexes and traffic counts, one cluster slot."""
        return f"{self._opts.key_prefix}:{{rt:{namespace_key(namespace)}}}"

    def index_key(self, namespace: str, replica: str) -> str:
        """Key of one replica's index in one namespace (in the namespace's routing slot)."""
        return f"{self._routing_tag(namespace)}:idx:{replica_id(replica)}"

    def _stats_key(self, namespace: str, kind: str, index: int) -> str:
        return f"{self._opts.key_prefix}:{{st:{namespace_key(namespace)}}}:{kind}:{index}"

    def traffic_key(self, namespace: str, bucket: int) -> str:
        """Key of a namespace's traffic counts for one bucket (in its routing slot)."""
        return f"{self._routing_tag(namespace)}:tc:{bucket}"

    def fleet_key(self, kind: str) -> str:
        """Key of the fleet-wide in-flight counts (``load``) or proxy liveness (``proxies``)."""
        return f"{self._opts.key_prefix}:{{fleet}}:{kind}"

    def _traffic_bucket(self) -> int:
        return math.floor(self._clock() / self._opts.traffic_window_s)

    def _in_flight_ttl_ms(self) -> int:
        return max(round(self._opts.in_flight_ttl_s * 1000), 1)

    def _traffic_read(self, namespace: str, hashes: Sequence[int]) -> _Call:
        bucket = self._traffic_bucket()
        keys = (self.traffic_key(namespace, bucket), self.traffic_key(namespace, bucket - 1))
        return TRAFFIC_READ, keys, (pack_chain(hashes[:TRAFFIC_MAX_BLOCKS]),)

    def _loads_read(self, replicas: Sequence[str]) -> _Call:
        keys = (self.fleet_key("load"), self.fleet_key("proxies"))
        return LOADS_READ, keys, (self._in_flight_ttl_ms(), *map(replica_id, replicas))

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
        calls: list[_Call] = [(LOOKUP, (self.index_key(namespace, r),), (chain,)) for r in replicas]

        def answer(counts: list[Any]) -> dict[str, int]:
            return {r: int(c) for r, c in zip(replicas, counts, strict=True)}

        return await self._scripts("lookup", self._opts.timeouts.lookup_s, {}, calls, answer)

    async def record_prefix(
        self, namespace: str, replica: str, hashes: Sequence[int], capacity_blocks: int
    ) -> None:
        """Touch the chain, trim the index to capacity and renew its idle TTL (one script)."""
        if not hashes:
            return
        call = self._record_call(namespace, replica, hashes, capacity_blocks)
        await self._scripts("record", self._opts.timeouts.write_s, None, [call], _nothing)

    def _record_call(
        self, namespace: str, replica: str, hashes: Sequence[int], capacity_blocks: int
    ) -> _Call:
        ttl_ms = max(round(self._opts.index_ttl_s * 1000), 1)
        keys = (self.index_key(namespace, replica),)
        return RECORD, keys, (pack_chain(hashes), max(capacity_blocks, 0), ttl_ms)

    # -- routing inputs -------------------------------------------------------------------------

    async def lookup(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> LookupResult:
        """Index match, loads and traffic counts in one pipelined round trip."""
        calls, answer = self._lookup_calls(namespace, replicas, hashes)
        unavailable = LookupResult.unavailable()
        return await self._scripts(
            "lookup", self._opts.timeouts.lookup_s, unavailable, calls, answer
        )

    def _lookup_calls(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> tuple[list[_Call], Callable[[Sequence[Any]], LookupResult]]:
        """A lookup's scripts, and what makes its answer of their results."""
        chain = pack_chain(hashes) if hashes and replicas else None
        calls = [self._traffic_read(namespace, hashes), self._loads_read(replicas)]
        if chain is not None:
            calls += [(LOOKUP, (self.index_key(namespace, r),), (chain,)) for r in replicas]

        def answer(results: Sequence[Any]) -> LookupResult:
            counts_raw, loads_raw, *found = results
            window, *counts = _numbers(counts_raw)
            matched = (
                {r: int(c) for r, c in zip(replicas, found, strict=True)}
                if chain is not None
                else dict.fromkeys(replicas, 0)
            )
            loads = _numbers(loads_raw)
            return LookupResult(
                matched=matched,
                loads={r: float(v) for r, v in zip(replicas, loads, strict=True)},
                window_requests=window,
                hash_counts=counts,
            )

        return calls, answer

    async def traffic_counts(self, namespace: str, hashes: Sequence[int]) -> tuple[int, list[int]]:
        """Requests in the window and how many carried each leading hash (one script)."""
        call = self._traffic_read(namespace, hashes)

        def answer(results: list[Any]) -> tuple[int, list[int]]:
            window, *counts = _numbers(results[0])
            return window, counts

        return await self._scripts("traffic", self._opts.timeouts.lookup_s, (0, []), [call], answer)

    async def observe_traffic(self, namespace: str, hashes: Sequence[int]) -> None:
        """Count one request in the current traffic bucket."""
        call = self._observe_call(namespace, hashes)
        await self._scripts("observe", self._opts.timeouts.write_s, None, [call], _nothing)

    def _observe_call(self, namespace: str, hashes: Sequence[int]) -> _Call:
        bucket = self._traffic_bucket()
        expire_at = math.ceil((bucket + 2) * self._opts.traffic_window_s)
        keys = (self.traffic_key(namespace, bucket),)
        chain = pack_chain(hashes[:TRAFFIC_MAX_BLOCKS])
        return OBSERVE, keys, (chain, expire_at, self._opts.traffic_max_hashes)

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
        call = self._in_flight_call(replica)
        await self._scripts("in_flight", self._opts.timeouts.write_s, None, [call], _nothing)

    def _in_flight_call(self, replica: str) -> _Call:
        keys = (self.fleet_key("load"), self.fleet_key("proxies"))
        count = self._in_flight.get(replica, 0)
        args = (self.proxy_id, replica_id(replica), count, self._in_flight_ttl_ms())
        return IN_FLIGHT, keys, args

    def _count_in_flight(self, replica: str, delta: int) -> None:
        count = max(self._in_flight.get(replica, 0) + delta, 0)
        if count:
            self._in_flight[replica] = count
        else:
            self._in_flight.pop(replica, None)

    # -- statistics -----------------------------------------------------------------------------

    async def add_stats(self, sample: StatsSample) -> None:
        """Add the sample to its minute and hour buckets and its anchor's ranking (one script)."""
        calls = self._stats_calls([sample])
        if not calls:
            return  # older than anything kept
        await self._scripts("add_stats", self._opts.timeouts.write_s, None, calls, _nothing)

    def _stats_calls(self, samples: Sequence[StatsSample]) -> list[_Call]:
        return add_stats_calls(
            samples,
            stats_key=self._stats_key,
            retention_s=self._opts.stats_retention_s,
            top_cap=self._opts.top_prefixes_cap,
            now=self._clock(),
        )

    # -- write behind ---------------------------------------------------------------------------

    async def apply_writes(self, batch: WriteBatch) -> None:
        """A batch of queued writes (``proxy.store.write_behind``) in one pipelined round trip:
        its lookups (answered from the store as it was before the batch's writes), each
        replica's in-flight count (absolute, as ``add_in_flight`` writes it), the traffic
        counts, the chains and the statistics, in that order. The lookups of a batch that fails
        are left unanswered (``WriteBatch.unanswered`` answers them as unavailable)."""
        calls: list[_Call] = []
        reads: list[tuple[int, int, Callable[[Sequence[Any]], LookupResult]]] = []
        for lookup in batch.lookups:
            lookup_calls, answer = self._lookup_calls(
                lookup.namespace, lookup.replicas, lookup.hashes
            )
            reads.append((len(calls), len(calls) + len(lookup_calls), answer))
            calls += lookup_calls
        for replica, (_, delta) in batch.in_flight.items():
            self._count_in_flight(replica, delta)
            if replica not in self._in_flight_writing:  # else the writer under way writes it
                calls.append(self._in_flight_call(replica))
            else:
                self._in_flight_stale.add(replica)
        calls += [self._observe_call(ns, hashes) for ns, hashes in batch.observes]
        for (ns, replica, _, _), (hashes, capacity) in batch.records.items():
            calls.append(self._record_call(ns, replica, hashes, capacity))
        calls += self._stats_calls(batch.stats)
        if not calls:
            return
        # A batch takes Redis longer than one write: its bound grows with it (0.2 ms a script).
        limit_s = self._opts.timeouts.write_s + 0.0002 * len(calls)

        def answered(results: list[Any]) -> None:
            for lookup, (start, end, answer) in zip(batch.lookups, reads, strict=True):
                lookup.answer(answer(results[start:end]))

        await self._scripts("writes", limit_s, None, calls, answered, writes=True)

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
        buckets = query.plan.buckets

        async def run() -> StatsWindow:
            builder = query.builder()
            if buckets:
                pipe = self._client.pipeline(transaction=False)
                for ref in buckets:
                    kind = "m" if ref.resolution_s == MINUTE_S else "h"
                    pipe.hgetall(self._stats_key(query.namespace, kind, ref.index))
                hashes = await pipe.execute()
                for ref, raw in zip(buckets, hashes, strict=True):
                    if raw:
                        builder.add_bucket(
                            ref.point_ts, ((_text(k), float(v)) for k, v in raw.items())
                        )
            return builder.build()

        empty = query.builder().build()
        return await self._guarded("query_stats", self._opts.timeouts.read_s, empty, run)

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
        fields = (*ANCHOR_FIELDS, LAST_SEEN, LABEL)

        async def run() -> list[PrefixStat]:
            pipe = self._client.pipeline(transaction=False)
            for hour in hours:
                pipe.zrange(self._stats_key(ns, "top", hour), 0, -1, withscores=True)
            tokens: dict[str, float] = {}
            for ranking in await pipe.execute():
                for member, score in ranking:
                    anchor = _text(member)
                    tokens[anchor] = tokens.get(anchor, 0.0) + float(score)
            if not tokens:
                return []
            # Keep ties at the cut: the final order also looks at requests.
            cut = sorted(tokens.values(), reverse=True)[min(limit, len(tokens)) - 1]
            anchors = [a for a, t in tokens.items() if t >= cut]
            names = [f"{a}|{f}" for a in anchors for f in fields]
            pipe = self._client.pipeline(transaction=False)
            for hour in hours:
                pipe.hmget(self._stats_key(ns, "anchor", hour), names)
            merged = {a: PrefixStat(anchor=a) for a in anchors}
            for values in await pipe.execute():
                for i, anchor in enumerate(anchors):
                    row = values[i * len(fields) : (i + 1) * len(fields)]
                    if row[0] is None:
                        continue
                    counters = {f: float(v) for f, v in zip(ANCHOR_FIELDS, row, strict=False) if v}
                    seen = float(row[-2]) if row[-2] is not None else 0.0
                    label = _text(row[-1]) if row[-1] is not None else None
                    merged[anchor].add(counters, seen, label)
            return rank(merged.values(), limit)

        return await self._guarded("top_prefixes", self._opts.timeouts.read_s, [], run)
