"""Where the proxy keeps what it learns: the prefix index and the request statistics.

``open_store()`` gives the embedded, in-process store (the default: no Redis needed);
``open_store(redis_url=...)`` the Redis store shared by every proxy replica: one Redis or Valkey
(``redis://``, ``rediss://``, ``unix://``) or a Redis or Valkey Cluster
(``redis+cluster://host:port[,host:port...]``, ``rediss+cluster://``). Both follow
``PrefixStore`` (see ``proxy.store.base`` for the contract and the failure model).

Module map::

    base.py           PrefixStore protocol, LookupResult, StoreOptions / StoreTimeouts, leading_run
    embedded.py       EmbeddedStore: dicts and OrderedDict LRUs in this process
    redis_store.py    RedisStore: the operations, the in-flight writer, batched writes
    redis_calls.py    RedisCalls: the store's connections, bounded and guarded calls, breaker
    redis_layout.py   RedisLayout: the key layout (cluster hash tags), each operation's scripts
    redis_stats.py    the statistics' script runs and reads
    redis_cluster.py  Redis Cluster: its URLs, its client, learning its slots off the call path
    redis_scripts.py  the Lua the Redis store runs (lookup, record, add_stats, routing inputs)
    health.py         StoreHealth: circuit breaker, one log line per incident
    stats.py          StatsSample, its additive counters, Tally (derived figures, percentiles)
    window.py         which buckets make a window; StatsWindow and its JSON
    ranking.py        top application prefixes: PrefixStat
"""

from __future__ import annotations

from proxy.fingerprint import leading_run
from proxy.store.base import (
    DEFAULT_NAMESPACE,
    LookupResult,
    PrefixStore,
    StoreOptions,
    StoreTimeouts,
)
from proxy.store.embedded import EmbeddedStore
from proxy.store.ranking import PrefixStat
from proxy.store.redis_store import RedisStore
from proxy.store.stats import LATENCY_BOUNDS_MS, StatsSample, Tally
from proxy.store.window import StatsWindow

__all__ = [
    "DEFAULT_NAMESPACE",
    "LATENCY_BOUNDS_MS",
    "EmbeddedStore",
    "LookupResult",
    "PrefixStat",
    "PrefixStore",
    "RedisStore",
    "StatsSample",
    "StatsWindow",
    "StoreOptions",
    "StoreTimeouts",
    "Tally",
    "leading_run",
    "open_store",
]


def open_store(*, redis_url: str | None = None, options: StoreOptions | None = None) -> PrefixStore:
    """The store for this process: Redis when ``redis_url`` is given, else embedded.

    Opening never waits on the network (the Redis client connects on first use; a cluster
    store opened in a running event loop starts learning the cluster's layout in the
    background), so it can run in an application's start-up hook; close it with
    ``await store.aclose()``.
    """
    if redis_url:
        return RedisStore.from_url(redis_url, options)
    return EmbeddedStore(options)
