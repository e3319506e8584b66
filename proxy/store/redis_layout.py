"""What the Redis store sends: its keys, and the script call each operation makes.

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
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from proxy.routing import TRAFFIC_MAX_BLOCKS
from proxy.store.base import LookupResult, StoreOptions
from proxy.store.redis_scripts import (
    IN_FLIGHT,
    LOADS_READ,
    LOOKUP,
    OBSERVE,
    RECORD,
    TRAFFIC_READ,
    LuaScript,
    pack_chain,
)
from proxy.store.redis_stats import add_stats_calls, text
from proxy.store.stats import StatsSample

Call = tuple[LuaScript, Sequence[str], Sequence[Any]]
"""One script call: the script, its keys, its arguments."""

_PLAIN_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def namespace_key(namespace: str) -> str:
    """The namespace as it appears in keys: itself when plain, else a stable hash."""
    if _PLAIN_NAMESPACE.fullmatch(namespace):
        return namespace
    return "~" + xxhash.xxh3_64_hexdigest(namespace.encode())


def replica_id(replica: str) -> str:
    """Short stable id of a replica URL (a field of the loads, the name of its index)."""
    return xxhash.xxh3_64_hexdigest(replica.encode())[:12]


def numbers(value: bytes | str) -> list[int]:
    """The integers of a comma-separated script answer (the routing reads)."""
    content = text(value)
    return [int(v) for v in content.split(",")] if content else []


class RedisLayout:
    """The keys of one store (``options.key_prefix``) and the calls that read and write them."""

    def __init__(self, options: StoreOptions, clock: Callable[[], float], proxy_id: str) -> None:
        self._opts = options
        self._clock = clock
        self.proxy_id = proxy_id
        """This proxy's field in the fleet's loads."""

    # -- keys -----------------------------------------------------------------------------------

    def _routing_tag(self, namespace: str) -> str:
        """``pg:{rt:<ns>}``: a namespace's indexes and traffic counts, one cluster slot."""
        return f"{self._opts.key_prefix}:{{rt:{namespace_key(namespace)}}}"

    def index_key(self, namespace: str, replica: str) -> str:
        """Key of one replica's index in one namespace (in the namespace's routing slot)."""
        return f"{self._routing_tag(namespace)}:idx:{replica_id(replica)}"

    def stats_key(self, namespace: str, kind: str, index: int) -> str:
        """Key of one statistics bucket (``m``, ``h``), ranking (``top``) or anchor table."""
        return f"{self._opts.key_prefix}:{{st:{namespace_key(namespace)}}}:{kind}:{index}"

    def traffic_key(self, namespace: str, bucket: int) -> str:
        """Key of a namespace's traffic counts for one bucket (in its routing slot)."""
        return f"{self._routing_tag(namespace)}:tc:{bucket}"

    def fleet_key(self, kind: str) -> str:
        """Key of the fleet-wide in-flight counts (``load``) or proxy liveness (``proxies``)."""
        return f"{self._opts.key_prefix}:{{fleet}}:{kind}"

    def memory_key(self, namespace: str, kind: str, key: str) -> str:
        """Key of one remembered value: a namespace's memory shares one slot (one MGET)."""
        return f"{self._opts.key_prefix}:{{mem:{namespace_key(namespace)}}}:{kind}:{key}"

    # -- calls ----------------------------------------------------------------------------------

    def _traffic_bucket(self) -> int:
        return math.floor(self._clock() / self._opts.traffic_window_s)

    def _in_flight_ttl_ms(self) -> int:
        return max(round(self._opts.in_flight_ttl_s * 1000), 1)

    def traffic_read(self, namespace: str, hashes: Sequence[int]) -> Call:
        """Requests in the window and how many carried each leading hash."""
        bucket = self._traffic_bucket()
        keys = (self.traffic_key(namespace, bucket), self.traffic_key(namespace, bucket - 1))
        return TRAFFIC_READ, keys, (pack_chain(hashes[:TRAFFIC_MAX_BLOCKS]),)

    def loads_read(self, replicas: Sequence[str]) -> Call:
        """Every live proxy's in-flight counts for ``replicas``, summed."""
        keys = (self.fleet_key("load"), self.fleet_key("proxies"))
        return LOADS_READ, keys, (self._in_flight_ttl_ms(), *map(replica_id, replicas))

    def match(self, namespace: str, replica: str, chain: bytes) -> Call:
        """Leading blocks of ``chain`` (``pack_chain``) the replica's index holds."""
        return LOOKUP, (self.index_key(namespace, replica),), (chain,)

    def record(
        self, namespace: str, replica: str, hashes: Sequence[int], capacity_blocks: int
    ) -> Call:
        """Touch the chain, trim the index to capacity and renew its idle TTL."""
        ttl_ms = max(round(self._opts.index_ttl_s * 1000), 1)
        keys = (self.index_key(namespace, replica),)
        return RECORD, keys, (pack_chain(hashes), max(capacity_blocks, 0), ttl_ms)

    def observe(self, namespace: str, hashes: Sequence[int]) -> Call:
        """Count one request in the current traffic bucket."""
        bucket = self._traffic_bucket()
        expire_at = math.ceil((bucket + 2) * self._opts.traffic_window_s)
        keys = (self.traffic_key(namespace, bucket),)
        chain = pack_chain(hashes[:TRAFFIC_MAX_BLOCKS])
        return OBSERVE, keys, (chain, expire_at, self._opts.traffic_max_hashes)

    def in_flight(self, replica: str, count: int) -> Call:
        """This proxy's absolute in-flight count for ``replica``, and its liveness."""
        keys = (self.fleet_key("load"), self.fleet_key("proxies"))
        args = (self.proxy_id, replica_id(replica), count, self._in_flight_ttl_ms())
        return IN_FLIGHT, keys, args

    def stats(self, samples: Sequence[StatsSample]) -> list[Call]:
        """The samples added to their minute and hour buckets and their anchors' rankings
        (none for a sample older than anything kept)."""
        return add_stats_calls(
            samples,
            stats_key=self.stats_key,
            retention_s=self._opts.stats_retention_s,
            top_cap=self._opts.top_prefixes_cap,
            now=self._clock(),
        )

    def lookup(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> tuple[list[Call], Callable[[Sequence[Any]], LookupResult]]:
        """A lookup's scripts (traffic, loads, each replica's match), and what makes its
        answer of their results."""
        chain = pack_chain(hashes) if hashes and replicas else None
        calls = [self.traffic_read(namespace, hashes), self.loads_read(replicas)]
        if chain is not None:
            calls += [self.match(namespace, r, chain) for r in replicas]

        def answer(results: Sequence[Any]) -> LookupResult:
            counts_raw, loads_raw, *found = results
            window, *counts = numbers(counts_raw)
            matched = (
                {r: int(c) for r, c in zip(replicas, found, strict=True)}
                if chain is not None
                else dict.fromkeys(replicas, 0)
            )
            loads = numbers(loads_raw)
            return LookupResult(
                matched=matched,
                loads={r: float(v) for r, v in zip(replicas, loads, strict=True)},
                window_requests=window,
                hash_counts=counts,
            )

        return calls, answer
