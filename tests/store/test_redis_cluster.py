"""The Redis store on a real three-node Redis Cluster: URLs, slots, sharing, failures, resharding.

The behavioural suite (``test_store_*.py``) already runs against the cluster through the
``make_store`` parametrization; these tests pin what only a cluster has: which slot and node
each key lands on, one round trip per node, a node killed, frozen or handing its slots on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
import xxhash
from cluster_process import RedisClusterServer
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis_process import RELAXED
from store_timing import events
from store_timing import timed as bounded
from structlog.testing import capture_logs

from proxy.config import ConfigError, resolve
from proxy.store import (
    LookupResult,
    RedisStore,
    StatsSample,
    StoreOptions,
    StoreTimeouts,
    open_store,
)
from proxy.store.redis_cluster import cluster_url
from proxy.store.redis_scripts import ALL_SCRIPTS

T = TypeVar("T")
CAP = 10_000
R1, R2, R3 = "http://10.0.0.1:8080", "http://10.0.0.2:8080", "http://10.0.0.3:8080"
# A 20 ms lookup deadline, as in the single-node failure tests: far below any socket timeout.
TIGHT = StoreOptions(timeouts=StoreTimeouts(lookup_s=0.02, write_s=0.05, breaker_s=0.2))
BOUND_S = 0.1


def chain(tag: str, n: int) -> list[int]:
    out: list[int] = []
    h = 0
    for i in range(n):
        h = xxhash.xxh3_64_intdigest(f"{tag}{i}".encode(), seed=h)
        out.append(h)
    return out


def slot(key: str) -> int:
    return int(key_slot(key.encode()))


async def timed(aw: Awaitable[T], bound_s: float = BOUND_S) -> T:
    return await bounded(aw, bound_s)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.05)


def namespace_on(store: RedisStore, cluster: RedisClusterServer, port: int) -> str:
    """A namespace whose routing slot lives on the node at ``port``."""
    for i in range(1000):
        ns = f"tenant-{i}"
        if cluster.port_of_slot(slot(store.keys.index_key(ns, R1))) == port:
            return ns
    raise AssertionError(f"no namespace routes to {port}")


# -- URLs and configuration ---------------------------------------------------------------------


def test_cluster_urls_name_their_seed_nodes() -> None:
    """``redis+cluster://`` lists seed nodes; the first, with the rest of the URL, is redis-py's."""
    assert cluster_url("redis://h:6379/0") is None
    assert cluster_url("unix:///tmp/redis.sock") is None
    assert cluster_url("redis+cluster://h1:7000") == ("redis://h1:7000", [("h1", 7000)])
    assert cluster_url("rediss+cluster://u:p%40w@h1:7000,h2:7001,h3/0?ssl_cert_reqs=none") == (
        "rediss://u:p%40w@h1:7000/0?ssl_cert_reqs=none",
        [("h1", 7000), ("h2", 7001), ("h3", 6379)],
    )
    assert cluster_url("REDIS+CLUSTER://[::1]:7000,[::2]") == (
        "redis://[::1]:7000",
        [("::1", 7000), ("::2", 6379)],
    )
    with pytest.raises(ValueError, match="host:port"):
        cluster_url("redis+cluster://h1:7000,,h2:7001")


def test_settings_accept_cluster_urls_and_refuse_unknown_schemes() -> None:
    """The option takes the cluster schemes; a typo fails at start-up, not at the first request."""
    base = {"backend": ["http://b:8080"]}
    for url in ("redis://r:6379/0", "rediss+cluster://r1:6379,r2:6379", "redis+cluster://r:1"):
        assert resolve({**base, "redis_url": url}, environ={}).redis_url == url
    assert resolve(base, environ={"PREFIXGATE_REDIS_URL": ""}).redis_url is None
    with pytest.raises(ConfigError, match="redis\\+cluster://"):
        resolve({**base, "redis_url": "redis-cluster://r:6379"}, environ={})


@pytest.mark.redis
async def test_open_store_picks_the_cluster_client(redis_cluster: RedisClusterServer) -> None:
    """A ``redis+cluster://`` URL opens a store on redis-py's cluster client, seeds and all."""
    other = ",".join(f"127.0.0.1:{p}" for p in redis_cluster.ports[1:])
    store = open_store(redis_url=f"{redis_cluster.url},{other}", options=StoreOptions())
    try:
        assert isinstance(store, RedisStore) and store.cluster
        assert isinstance(store.client, RedisCluster)
        seeds = {n.port for n in store.client.startup_nodes}
        assert seeds == set(redis_cluster.ports)
    finally:
        await store.aclose()


# -- key layout -----------------------------------------------------------------------------------


@pytest.mark.redis
async def test_a_namespace_routing_keys_share_one_slot_and_namespaces_spread(
    redis_cluster: RedisClusterServer,
) -> None:
    """Index and traffic keys of a namespace share a slot; namespaces land on every node."""
    redis_cluster.flush()
    store = RedisStore.from_url(redis_cluster.url, StoreOptions(timeouts=RELAXED))
    try:
        ns = "tenant-a"
        routing = {store.keys.index_key(ns, r) for r in (R1, R2, R3)}
        routing |= {store.keys.traffic_key(ns, b) for b in (100, 101)}
        assert len({slot(k) for k in routing}) == 1
        stats_slot = slot(store.keys.stats_key(ns, "m", 1))
        assert stats_slot != slot(store.keys.index_key(ns, R1))

        spaces = [f"tenant-{i}" for i in range(24)]
        ports = {redis_cluster.port_of_slot(slot(store.keys.index_key(n, R1))) for n in spaces}
        assert ports == set(redis_cluster.ports)

        p = chain("spread", 3)
        for n in spaces:
            await store.record_prefix(n, R1, p, CAP)
            await store.observe_traffic(n, p)
        assert not store.degraded
        assert isinstance(store.client, RedisCluster)
        for node in store.client.get_primaries():
            keys = await store.client.dbsize(target_nodes=node)  # type: ignore[call-arg]
            assert keys > 0, f"node {node.name} holds nothing"
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_lookup_is_one_round_trip_per_node(
    redis_cluster: RedisClusterServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lookup sends one pipeline to each node it touches: the namespace's and {fleet}'s."""
    redis_cluster.flush()
    store = RedisStore.from_url(redis_cluster.url, StoreOptions(timeouts=RELAXED))
    try:
        p = chain("rt", 5)
        await store.record_prefix("default", R1, p, CAP)
        await store.add_in_flight("default", R2, 2)
        await store.lookup("default", [R1], p)  # scripts cached on both nodes
        assert isinstance(store.client, RedisCluster)
        sent: list[tuple[str, int]] = []
        execute = ClusterNode.execute_pipeline

        async def counted(node: ClusterNode, commands: Any) -> Any:
            sent.append((node.name, len(commands)))
            return await execute(node, commands)

        monkeypatch.setattr(ClusterNode, "execute_pipeline", counted)
        got = await store.lookup("default", [R1, R2, R3], p)
        assert got.matched == {R1: 5, R2: 0, R3: 0} and got.loads[R2] == 2.0
        nodes = {
            redis_cluster.port_of_slot(slot(store.keys.index_key("default", R1))),
            redis_cluster.port_of_slot(slot(store.keys.fleet_key("load"))),
        }
        assert sorted(name for name, _ in sent) == sorted(f"127.0.0.1:{p}" for p in nodes)
        assert sum(n for _, n in sent) == 5  # traffic, loads, one index script per replica
    finally:
        await store.aclose()


# -- sharing --------------------------------------------------------------------------------------


@pytest.mark.redis
async def test_two_proxies_on_one_cluster_share_everything(
    redis_cluster: RedisClusterServer,
) -> None:
    """Prefixes, traffic counts, loads and statistics written by one proxy are read by another."""
    redis_cluster.flush()
    one = RedisStore.from_url(redis_cluster.url, StoreOptions(timeouts=RELAXED))
    two = RedisStore.from_url(redis_cluster.url, StoreOptions(timeouts=RELAXED))
    try:
        for ns in ("default", "tenant-b"):
            p = chain(ns, 6)
            await one.record_prefix(ns, R1, p, CAP)
            await two.record_prefix(ns, R2, p[:2], CAP)
            await one.observe_traffic(ns, p)
            await two.observe_traffic(ns, p[:3])
            for store in (one, two):
                got = await store.lookup(ns, [R1, R2, R3], p)
                assert got.matched == {R1: 6, R2: 2, R3: 0}
                assert got.window_requests == 2 and got.hash_counts[:4] == [2, 2, 2, 1]
        await one.add_in_flight("default", R1, 1)
        await two.add_in_flight("tenant-b", R1, 2)
        assert (await two.lookup("default", [R1], [])).loads == {R1: 3.0}
        now = time.time()
        for store in (one, two):
            await store.add_stats(
                StatsSample(
                    ts=now, namespace="default", model="m", backend=R1, status=200, error=False
                )
            )
        assert (await one.query_stats(since_s=now - 60)).requests == 2
        assert not one.degraded and not two.degraded
    finally:
        await one.aclose()
        await two.aclose()


# -- discovery and failures -----------------------------------------------------------------------


@pytest.mark.redis
async def test_the_layout_is_learned_off_the_request_path(
    redis_cluster: RedisClusterServer,
) -> None:
    """Learning the slots outlives a lookup's deadline: a timed-out first call does not undo it."""
    redis_cluster.flush()
    opts = StoreOptions(timeouts=StoreTimeouts(lookup_s=0.0005, write_s=1.0, breaker_s=0.05))
    store = RedisStore.from_url(redis_cluster.url, opts)
    try:
        assert isinstance(store.client, RedisCluster)
        got = await store.lookup("default", [R1], chain("d", 2))  # COMMAND alone takes longer
        assert not got.available and store.degraded

        async def learned() -> bool:
            return store.client.get_default_node() is not None  # type: ignore[union-attr]

        await eventually(learned, 5.0)
        await asyncio.sleep(0.06)  # the breaker lets the next call through
        await store.record_prefix("default", R1, chain("d", 2), CAP)
        assert not store.degraded
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_a_store_opened_in_a_running_loop_learns_the_layout_at_once(
    redis_cluster: RedisClusterServer,
) -> None:
    """Opening starts the discovery, so the first request's lookup finds the slots known."""
    store = RedisStore.from_url(redis_cluster.url, TIGHT)
    try:
        assert isinstance(store.client, RedisCluster)

        async def learned() -> bool:
            return store.client.get_default_node() is not None  # type: ignore[union-attr]

        await eventually(learned, 5.0)
        got = await store.lookup("default", [R1], chain("warm", 2))
        assert got.available and not store.degraded
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_warming_loads_every_script_on_every_primary(
    redis_cluster: RedisClusterServer,
) -> None:
    """After ``warm`` the first write and lookup fit a 20 ms deadline on any node's slots."""
    redis_cluster.flush()
    store = RedisStore.from_url(redis_cluster.url, TIGHT)
    try:
        assert await store.warm() and not store.degraded
        for port in redis_cluster.ports:
            node = Redis(port=port)
            try:
                assert all(await node.script_exists(*(s.sha for s in ALL_SCRIPTS)))
            finally:
                await node.aclose()
        for port in redis_cluster.ports:
            ns = namespace_on(store, redis_cluster, port)
            await store.record_prefix(ns, R1, chain(ns, 3), CAP)
            assert (await store.lookup(ns, [R1], chain(ns, 3))).matched == {R1: 3}
        assert store.failures == 0
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_a_killed_node_degrades_the_store_then_it_recovers(
    own_redis_cluster: RedisClusterServer,
) -> None:
    """One node killed: calls stay bounded and neutral, never raise; a restart recovers alone."""
    cluster = own_redis_cluster
    store = RedisStore.from_url(cluster.url, TIGHT)
    try:
        assert await store.warm()  # the first calls are then as fast as any (as in the proxy)
        victim = cluster.ports[1]
        ns = namespace_on(store, cluster, victim)
        p = chain("k", 4)
        await store.record_prefix(ns, R1, p, CAP)
        assert (await store.lookup(ns, [R1, R2], p)).matched == {R1: 4, R2: 0}

        with capture_logs() as logs:
            cluster.kill(victim)
            got = await timed(store.lookup(ns, [R1, R2], p))
            assert got == LookupResult.unavailable()
            assert store.degraded
            await timed(store.record_prefix(ns, R1, p, CAP))
            await timed(store.observe_traffic(ns, p))
            await timed(store.add_in_flight(ns, R1, 1))
            assert await timed(store.longest_match(ns, [R1], p)) in ({}, {R1: 4})
            await asyncio.sleep(0.25)  # a probe, which fails again on the dead node
            assert not (await timed(store.lookup(ns, [R1], p))).available

            cluster.start_node(victim)
            cluster.wait_ok()

            async def recovered() -> bool:
                got = await store.lookup(ns, [R1], p)
                return got.available and not store.degraded

            await eventually(recovered)
        assert len(events(logs, "store_degraded")) >= 1
        assert events(logs, "store_degraded")[0]["log_level"] == "warning"
        assert events(logs, "store_recovered")

        assert (await store.lookup(ns, [R1], p)).matched == {R1: 0}  # the node kept nothing
        await store.record_prefix(ns, R1, p, CAP)
        assert (await store.lookup(ns, [R1], p)).matched == {R1: 4}
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_a_hung_node_costs_at_most_the_lookup_timeout(
    own_redis_cluster: RedisClusterServer,
) -> None:
    """SIGSTOP on a node: the lookup gives up at its deadline, and recovers once it answers."""
    cluster = own_redis_cluster
    store = RedisStore.from_url(cluster.url, TIGHT)
    victim = cluster.ports[2]
    try:
        assert await store.warm()
        ns = namespace_on(store, cluster, victim)
        p = chain("h", 3)
        await store.record_prefix(ns, R1, p, CAP)
        cluster.freeze(victim)
        got = await timed(store.lookup(ns, [R1], p), bound_s=0.02 + BOUND_S)
        assert not got.available and store.degraded
        cluster.thaw(victim)

        async def recovered() -> bool:
            return (await store.lookup(ns, [R1], p)).matched == {R1: 3}

        await eventually(recovered)
        assert not store.degraded
    finally:
        cluster.thaw(victim)
        await store.aclose()


@pytest.mark.redis
async def test_the_store_follows_a_slot_to_its_new_node(
    own_redis_cluster: RedisClusterServer,
) -> None:
    """A resharded slot: MOVED sends the call on to the new owner (scripts loaded there too)."""
    cluster = own_redis_cluster
    store = RedisStore.from_url(cluster.url, StoreOptions(timeouts=RELAXED))
    try:
        ns = namespace_on(store, cluster, cluster.ports[0])
        p = chain("m", 3)
        assert (await store.lookup(ns, [R1], p)).matched == {R1: 0}  # the old layout is known
        cluster.move_slot(slot(store.keys.index_key(ns, R1)), cluster.ports[2])
        await store.record_prefix(ns, R1, p, CAP)
        assert (await store.lookup(ns, [R1], p)).matched == {R1: 3}
        assert not store.degraded
        assert cluster.port_of_slot(slot(store.keys.index_key(ns, R1))) == cluster.ports[2]
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_a_plain_url_at_a_cluster_node_says_so(redis_cluster: RedisClusterServer) -> None:
    """``redis://`` pointed at a cluster node: keys of other nodes fail, and one line says why."""
    redis_cluster.flush()
    url = f"redis://127.0.0.1:{redis_cluster.ports[0]}/0"
    store = RedisStore.from_url(url, StoreOptions(timeouts=StoreTimeouts(breaker_s=0.0)))
    try:
        assert not store.cluster
        elsewhere = namespace_on(store, redis_cluster, redis_cluster.ports[1])
        with capture_logs() as logs:
            for _ in range(3):
                await store.record_prefix(elsewhere, R1, chain("x", 2), CAP)
        assert store.degraded
        hints = events(logs, "store_is_a_cluster")
        assert len(hints) == 1 and "redis+cluster://" in hints[0]["hint"]
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_closing_while_learning_the_layout_answers_neutrally(
    redis_cluster: RedisClusterServer,
) -> None:
    """A call waiting for the discovery when the store closes gets its neutral answer."""
    store = RedisStore.from_url(redis_cluster.url, StoreOptions(timeouts=RELAXED))
    pending = asyncio.ensure_future(store.lookup("default", [R1], chain("c", 2)))
    for _ in range(3):
        await asyncio.sleep(0)  # the lookup is now waiting for the discovery
    assert not pending.done()
    await store.aclose()
    assert await pending == LookupResult.unavailable()
    assert await store.longest_match("default", [R1], chain("c", 2)) == {}
