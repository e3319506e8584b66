"""The router's inputs, pinned on both stores: the one-call lookup, traffic counts over a rolling
window, in-flight loads shared by every proxy, and the route reasons in the statistics."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import xxhash
from redis_process import RELAXED, RedisServer, StoreFactory

from proxy.routing import TRAFFIC_MAX_BLOCKS
from proxy.store import LookupResult, PrefixStore, RedisStore, StatsSample, StoreOptions
from proxy.store.base import StoreTimeouts
from proxy.store.write_behind import Lookup, WriteBatch

CAP = 10_000
R1, R2, R3 = "http://10.0.0.1:8080", "http://10.0.0.2:8080", "http://10.0.0.3:8080"


def chain(tag: str, n: int, *, head: list[int] | None = None) -> list[int]:
    """Chained hashes of ``n`` blocks named ``tag0..``, continuing ``head`` when given."""
    out = list(head or [])
    h = out[-1] if out else 0
    for i in range(n):
        h = xxhash.xxh3_64_intdigest(f"{tag}{i}".encode(), seed=h)
        out.append(h)
    return out


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def test_lookup_reads_matches_loads_and_counts_at_once(store: PrefixStore) -> None:
    """One call answers what longest_match does, every replica's load and the traffic counts."""
    system = chain("sys", 3)
    a = chain("a", 4, head=system)
    b = chain("b", 2, head=system)
    await store.record_prefix("default", R1, a, CAP)
    await store.record_prefix("default", R2, b, CAP)
    for request in (a, b, a):
        await store.observe_traffic("default", request)
    await store.add_in_flight("default", R1, 1)
    await store.add_in_flight("default", R1, 1)
    await store.add_in_flight("default", R2, 1)

    got = await store.lookup("default", [R1, R2, R3], a)
    assert got == LookupResult(
        matched={R1: 7, R2: 3, R3: 0},
        loads={R1: 2.0, R2: 1.0, R3: 0.0},
        window_requests=3,
        hash_counts=[3, 3, 3, 2, 2, 2, 2],
    )
    assert got.matched == await store.longest_match("default", [R1, R2, R3], a)
    assert await store.traffic_counts("default", a) == (3, [3, 3, 3, 2, 2, 2, 2])


async def test_lookup_without_blocks_still_reads_loads(store: PrefixStore) -> None:
    """A request too short for a block matches nothing but still sees the loads."""
    await store.add_in_flight("default", R2, 3)
    got = await store.lookup("default", [R1, R2], [])
    assert got.matched == {R1: 0, R2: 0}
    assert got.loads == {R1: 0.0, R2: 3.0}
    assert got.hash_counts == []
    assert got.available
    assert (await store.lookup("default", [], chain("x", 2))).matched == {}


async def test_traffic_counts_only_the_leading_blocks(store: PrefixStore) -> None:
    """Only the first TRAFFIC_MAX_BLOCKS hashes are counted and answered."""
    long = chain("long", TRAFFIC_MAX_BLOCKS + 10)
    await store.observe_traffic("default", long)
    window, counts = await store.traffic_counts("default", long)
    assert window == 1
    assert counts == [1] * TRAFFIC_MAX_BLOCKS
    assert await store.traffic_counts("default", long[TRAFFIC_MAX_BLOCKS:]) == (
        1,
        [0] * 10,
    )


async def test_traffic_counts_are_per_namespace(store: PrefixStore) -> None:
    """One tenant's traffic does not make another tenant's prompt look shared."""
    p = chain("n", 3)
    await store.observe_traffic("tenant-a", p)
    await store.observe_traffic("tenant-a", p)
    assert await store.traffic_counts("tenant-a", p) == (2, [2, 2, 2])
    assert await store.traffic_counts("odd {tenant}/é", p) == (0, [0, 0, 0])


async def test_traffic_window_forgets(make_store: StoreFactory) -> None:
    """Counts leave the window between one and two bucket lengths after they were made."""
    store = await make_store(traffic_window_s=0.3)
    p = chain("w", 2)
    await store.observe_traffic("default", p)
    assert (await store.traffic_counts("default", p))[0] == 1, f"{store.failures} failed calls"
    await asyncio.sleep(0.65)  # two full buckets later
    assert await store.traffic_counts("default", p) == (0, [0, 0])


async def test_a_full_traffic_bucket_counts_only_the_hashes_it_holds(
    make_store: StoreFactory,
) -> None:
    """Past ``traffic_max_hashes`` a bucket still counts each request and the hashes it holds
    (the shared prefix, exactly), and adds no new one (the second family's own blocks)."""
    store = await make_store(traffic_max_hashes=6, traffic_window_s=3600.0)  # one bucket throughout
    system = chain("sys", 2)
    a, b = chain("a", 2, head=system), chain("b", 2, head=system)
    await store.observe_traffic("default", a)  # 4 hashes
    await store.observe_traffic("default", b)  # 4 more would pass 6: only the held ones count
    await store.observe_traffic("default", b)
    assert await store.traffic_counts("default", a) == (3, [3, 3, 1, 1])
    assert await store.traffic_counts("default", b) == (3, [3, 3, 0, 0])
    assert await store.traffic_counts("default", system) == (3, [3, 3])


async def test_in_flight_loads_go_up_and_down_and_never_below_zero(store: PrefixStore) -> None:
    """+1 and -1 pairs cancel out; an unmatched -1 leaves zero, not a negative load."""
    for _ in range(3):
        await store.add_in_flight("default", R1, 1)
    await store.add_in_flight("default", R1, -1)
    assert (await store.lookup("default", [R1, R2], chain("l", 1))).loads == {R1: 2.0, R2: 0.0}
    for _ in range(3):
        await store.add_in_flight("default", R1, -1)
    assert (await store.lookup("default", [R1], [])).loads == {R1: 0.0}
    await store.add_in_flight("default", R1, 1)
    assert (await store.lookup("default", [R1], [])).loads == {R1: 1.0}


async def test_overlapping_in_flight_writes_leave_the_newest_count(store: PrefixStore) -> None:
    """Requests starting and ending at once (a fast failure, a burst): writes that overlap end
    with the count as it is now, whatever order they would have reached the store in."""
    for _ in range(5):
        ups = [store.add_in_flight("default", R1, 1) for _ in range(8)]
        downs = [store.add_in_flight("default", R1, -1) for _ in range(8)]
        await asyncio.gather(*(c for pair in zip(ups, downs, strict=True) for c in pair))
        assert (await store.lookup("default", [R1], [])).loads == {R1: 0.0}
    await asyncio.gather(*(store.add_in_flight("default", R1, 1) for _ in range(6)))
    await asyncio.gather(*(store.add_in_flight("default", R1, -1) for _ in range(2)))
    assert (await store.lookup("default", [R1], [])).loads == {R1: 4.0}


async def test_loads_belong_to_replicas_not_tenants(store: PrefixStore) -> None:
    """A replica busy with one tenant's requests is as busy for every other tenant."""
    await store.add_in_flight("tenant-a", R1, 1)
    await store.add_in_flight("tenant-b", R1, 1)
    got = await store.lookup("tenant-c", [R1, R2], chain("t", 2))
    assert got.loads == {R1: 2.0, R2: 0.0}


async def test_route_reasons_are_counted(store: PrefixStore) -> None:
    """Each request's route reason becomes a route:<reason> counter and a "routes" summary."""
    now = time.time()
    for reason in ("affinity", "affinity", "miss", None):
        await store.add_stats(
            StatsSample(
                ts=now,
                namespace="default",
                model="m",
                backend=R1,
                status=200,
                error=False,
                route_reason=reason,
            )
        )
    window = await store.query_stats(since_s=now - 60)
    assert window.total.routes() == {"affinity": 2, "miss": 1}
    assert window.to_json()["totals"]["routes"] == {"affinity": 2, "miss": 1}
    assert window.by_backend[R1].routes() == {"affinity": 2, "miss": 1}


@pytest.mark.redis
async def test_proxies_on_one_redis_see_the_same_inputs(redis_server: RedisServer) -> None:
    """Two proxies: loads add up over both, and both read the same counts and matches."""
    redis_server.flush()
    one = RedisStore.from_url(redis_server.url, StoreOptions(timeouts=RELAXED))
    two = RedisStore.from_url(redis_server.url, StoreOptions(timeouts=RELAXED))
    try:
        p = chain("shared", 4)
        await one.record_prefix("default", R1, p, CAP)
        await one.observe_traffic("default", p)
        await two.observe_traffic("default", p[:2])
        await one.add_in_flight("default", R1, 1)
        await two.add_in_flight("default", R1, 1)
        await two.add_in_flight("default", R2, 1)
        a = await one.lookup("default", [R1, R2], p)
        b = await two.lookup("default", [R1, R2], p)
        assert a == b
        assert a.loads == {R1: 2.0, R2: 1.0}
        assert a.hash_counts == [2, 2, 1, 1]
        assert a.matched == {R1: 4, R2: 0}
        # A proxy writes its own absolute count: its -1 removes its request, not the other's.
        await two.add_in_flight("default", R1, -1)
        await two.add_in_flight("default", R1, -1)
        assert (await one.lookup("default", [R1], [])).loads == {R1: 1.0}
    finally:
        await one.aclose()
        await two.aclose()


@pytest.mark.redis
async def test_a_silent_proxy_stops_counting(redis_server: RedisServer) -> None:
    """A crashed proxy's in-flight requests leave the loads after in_flight_ttl_s."""
    redis_server.flush()
    opts = StoreOptions(timeouts=RELAXED, in_flight_ttl_s=0.6)
    crashed = RedisStore.from_url(redis_server.url, opts)
    alive = RedisStore.from_url(redis_server.url, opts)
    try:
        for _ in range(5):
            await crashed.add_in_flight("default", R1, 1)
        await alive.add_in_flight("default", R1, 1)
        assert (await alive.lookup("default", [R1], [])).loads == {R1: 6.0}
        await asyncio.sleep(0.7)
        await alive.add_in_flight("default", R1, 0)  # the live proxy keeps writing
        assert (await alive.lookup("default", [R1], [])).loads == {R1: 1.0}
        fields = await alive.client.hkeys(alive.keys.fleet_key("load"))
        assert [text(f).split("|")[0] for f in fields] == [alive.proxy_id]
    finally:
        await crashed.aclose()
        await alive.aclose()


@pytest.mark.redis
async def test_redis_routing_keys_layout(redis_server: RedisServer) -> None:
    """Traffic counts carry the namespace's routing tag and expire; loads live under {fleet}."""
    redis_server.flush()
    store = RedisStore.from_url(
        redis_server.url, StoreOptions(timeouts=RELAXED, traffic_window_s=60.0)
    )
    try:
        await store.observe_traffic("tenant-a", chain("k", 2))
        keys = sorted(text(k) for k in await store.client.keys("pg:{rt:*"))
        assert len(keys) == 1 and keys[0].startswith("pg:{rt:tenant-a}:tc:")
        assert 0 < await store.client.ttl(keys[0]) <= 120
        await store.add_in_flight("tenant-a", R1, 1)
        assert (
            await store.client.exists(store.keys.fleet_key("load"), store.keys.fleet_key("proxies"))
            == 2
        )
        assert store.keys.fleet_key("load") == "pg:{fleet}:load"
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_lookup_degrades_to_unavailable(own_redis_server: RedisServer) -> None:
    """Redis gone: the lookup answers ``unavailable`` within its bound, then recovers."""
    opts = StoreOptions(timeouts=StoreTimeouts(lookup_s=0.02, breaker_s=0.1))
    store = RedisStore.from_url(own_redis_server.url, opts)
    try:
        # Connected and the scripts loaded first, as the proxy does at start-up: a first lookup
        # paying for that could miss its 20 ms deadline on a loaded machine.
        assert await store.warm()
        p = chain("d", 3)
        await store.record_prefix("default", R1, p, CAP)
        assert (await store.lookup("default", [R1], p)).matched == {R1: 3}
        own_redis_server.kill()
        start = time.perf_counter()
        got = await store.lookup("default", [R1], p)
        assert time.perf_counter() - start < 0.1
        assert got == LookupResult.unavailable()
        assert not got.available
        await store.add_in_flight("default", R1, 1)  # lost, never raised
        await store.observe_traffic("default", p)
        assert await store.traffic_counts("default", p) == (0, [])
    finally:
        await store.aclose()


@pytest.mark.redis
@pytest.mark.parametrize("client", ["link", "redis-py"])
async def test_lookup_is_one_round_trip(redis_server: RedisServer, client: str) -> None:
    """Matches for every replica, loads and traffic counts travel in a single pipeline, over
    the scripts' own connection (``proxy.store.resp``) or redis-py's."""
    redis_server.flush()
    store = RedisStore.from_url(redis_server.url, StoreOptions(timeouts=RELAXED))
    try:
        if client == "redis-py":
            store._link = None
        p = chain("rt", 5)
        await store.record_prefix("default", R1, p, CAP)
        await store.lookup("default", [R1], p)  # scripts loaded
        executed: list[int] = []
        link = store._link
        if link is not None:
            send = link.execute

            async def counted_send(commands: Any, deadline: float | None = None) -> Any:
                executed.append(len(commands))
                return await send(commands, deadline)

            link.execute = counted_send  # type: ignore[method-assign]  # counting wrapper
        make_pipeline = store.client.pipeline

        def counting_pipeline(*args: Any, **kwargs: Any) -> Any:
            pipe = make_pipeline(*args, **kwargs)
            execute = pipe.execute

            async def counted(*a: Any, **kw: Any) -> Any:
                executed.append(len(pipe.command_stack))
                return await execute(*a, **kw)

            pipe.execute = counted  # type: ignore[method-assign]  # counting wrapper
            return pipe

        store.client.pipeline = counting_pipeline  # type: ignore[method-assign]  # counting
        got = await store.lookup("default", [R1, R2, R3], p)
        assert got.matched == {R1: 5, R2: 0, R3: 0}
        assert executed == [5]  # traffic, loads, and one index script per replica
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_an_emptied_script_cache_costs_one_retry_and_no_double_write(
    redis_server: RedisServer,
) -> None:
    """After SCRIPT FLUSH (a restarted Redis) calls still answer, and a write runs once."""
    redis_server.flush()
    store = RedisStore.from_url(redis_server.url, StoreOptions(timeouts=RELAXED))
    try:
        p = chain("sf", 3)
        await store.record_prefix("default", R1, p, CAP)
        await store.client.script_flush()
        await store.observe_traffic("default", p)
        await store.client.script_flush()
        got = await store.lookup("default", [R1, R2], p)
        assert got.matched == {R1: 3, R2: 0}
        assert (got.window_requests, got.hash_counts) == (1, [1, 1, 1])
        assert not store.degraded
    finally:
        await store.aclose()


def _claiming(p: list[int]) -> WriteBatch:
    """A request's queued batch: its lookup, then its claim of the same chain."""
    batch = WriteBatch()
    batch.lookups.append(Lookup("default", [R1], p, asyncio.get_running_loop().create_future()))
    batch.records[("default", R1, p[-1], len(p))] = (p, CAP)
    return batch


@pytest.mark.redis
async def test_a_batch_lookup_sent_again_after_its_own_writes_is_no_answer(
    redis_server: RedisServer,
) -> None:
    """Redis's script cache emptied (a restart), and the write scripts loaded again first (a
    batch of writes alone): a batch's lookup that misses the cache runs again only after the
    batch's writes ran, and would find its own request's claim. It is answered as unavailable
    (no prediction) rather than as a match; the writes run once. With the cache whole, a
    batch's lookup reads the store as it was before the batch's writes."""
    redis_server.flush()
    store = RedisStore.from_url(redis_server.url, StoreOptions(timeouts=RELAXED))
    try:
        await store.client.script_flush()
        await store.record_prefix("default", R1, chain("w", 2), CAP)  # the write script only
        own = chain("own", 3)
        batch = _claiming(own)
        await store.apply_writes(batch)
        got = batch.lookups[0].future.result()
        assert not got.available and not got.matched.get(R1)
        assert (await store.lookup("default", [R1], own)).matched == {R1: 3}  # claimed once
        assert not store.degraded  # a script cache miss is not a failure of Redis

        later = chain("later", 2)
        batch = _claiming(later)
        await store.apply_writes(batch)
        got = batch.lookups[0].future.result()
        assert got.available and got.matched == {R1: 0}
    finally:
        await store.aclose()
