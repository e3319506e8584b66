"""The prefix index, pinned on both stores: leading matches, LRU capacity, idle TTL, tenants."""

from __future__ import annotations

import asyncio

import pytest
import xxhash
from redis_process import RELAXED, RedisServer, StoreFactory

from proxy.store import PrefixStore, RedisStore, StoreOptions, open_store

CAP = 10_000
R1, R2, R3 = "http://10.0.0.1:8080", "http://10.0.0.2:8080", "http://10.0.0.3:8080"


def chain(*blocks: str, seed: int = 0) -> list[int]:
    """Chained 64-bit block hashes, as the fingerprint builds them: ``h_i = xxh3(b_i, h_{i-1})``."""
    out: list[int] = []
    h = seed
    for block in blocks:
        h = xxhash.xxh3_64_intdigest(block.encode(), seed=h)
        out.append(h)
    return out


def blocks(tag: str, n: int) -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


async def test_leading_blocks_count_per_replica(store: PrefixStore) -> None:
    """A replica matches the blocks its index holds up to where the prompt leaves it."""
    prompt = chain(*blocks("a", 8))
    await store.record_prefix("default", R1, prompt, CAP)
    await store.record_prefix("default", R2, prompt[:3], CAP)

    diverged = chain(*blocks("a", 5), "x", "y", "z")
    assert diverged[:5] == prompt[:5]
    assert await store.longest_match("default", [R1, R2, R3], diverged) == {R1: 5, R2: 3, R3: 0}
    assert await store.longest_match("default", [R1], prompt) == {R1: 8}
    longer = chain(*blocks("a", 8), "more", "and more")
    assert await store.longest_match("default", [R1, R2], longer) == {R1: 8, R2: 3}
    assert await store.longest_match("default", [R1], prompt[:2]) == {R1: 2}


async def test_a_different_first_block_matches_nothing(store: PrefixStore) -> None:
    """Chains that differ in their first block share no index entry."""
    await store.record_prefix("default", R1, chain(*blocks("a", 6)), CAP)
    other = chain("b0", *blocks("a", 6)[1:])
    assert await store.longest_match("default", [R1], other) == {R1: 0}


async def test_empty_inputs(store: PrefixStore) -> None:
    """No hashes matches zero blocks everywhere; no replicas gives an empty answer."""
    await store.record_prefix("default", R1, chain("a"), CAP)
    assert await store.longest_match("default", [R1, R2], []) == {R1: 0, R2: 0}
    assert await store.longest_match("default", [], chain("a")) == {}
    await store.record_prefix("default", R1, [], CAP)  # a no-op, not an error


async def test_lru_evicts_least_recent_tails_first(store: PrefixStore) -> None:
    """Past capacity the oldest blocks go, a prompt's tail before its head."""
    p = chain(*blocks("p", 8))
    q = chain(*blocks("q", 4))
    await store.record_prefix("default", R1, p, 8)
    await store.record_prefix("default", R1, q, 8)
    assert await store.longest_match("default", [R1], p) == {R1: 4}
    assert await store.longest_match("default", [R1], q) == {R1: 4}

    await store.record_prefix("default", R1, p, 8)  # p is now the most recent: q goes
    assert await store.longest_match("default", [R1], p) == {R1: 8}
    assert await store.longest_match("default", [R1], q) == {R1: 0}


async def test_shared_head_survives_eviction(store: PrefixStore) -> None:
    """A head shared by a later prompt is refreshed with it and outlives the older tails."""
    a = chain(*blocks("s", 4), *blocks("a", 4))
    b = chain(*blocks("s", 4), *blocks("b", 4))
    c = chain(*blocks("c", 4))
    await store.record_prefix("default", R1, a, 12)
    await store.record_prefix("default", R1, b, 12)
    await store.record_prefix("default", R1, c, 12)  # 16 distinct blocks: a's tail goes
    assert await store.longest_match("default", [R1], a) == {R1: 4}
    assert await store.longest_match("default", [R1], b) == {R1: 8}
    assert await store.longest_match("default", [R1], c) == {R1: 4}


async def test_prompt_longer_than_capacity_keeps_its_head(store: PrefixStore) -> None:
    """A prompt longer than the replica's capacity keeps its first ``capacity`` blocks."""
    p = chain(*blocks("long", 20))
    await store.record_prefix("default", R1, p, 6)
    assert await store.longest_match("default", [R1], p) == {R1: 6}


async def test_idle_ttl_drops_a_replica_index(make_store: StoreFactory) -> None:
    """An index not written for ``index_ttl_s`` is gone; a write renews it."""
    store = await make_store(index_ttl_s=0.25)
    p = chain(*blocks("t", 3))
    await store.record_prefix("default", R1, p, CAP)
    await store.record_prefix("default", R2, p, CAP)
    await asyncio.sleep(0.15)
    await store.record_prefix("default", R2, p, CAP)
    await asyncio.sleep(0.15)
    assert await store.longest_match("default", [R1, R2], p) == {R1: 0, R2: 3}


async def test_namespaces_are_isolated(store: PrefixStore) -> None:
    """One tenant's index never answers another tenant's lookup."""
    p = chain(*blocks("n", 4))
    await store.record_prefix("tenant-a", R1, p, CAP)
    await store.record_prefix("odd {tenant}:b/é", R2, p[:2], CAP)
    assert await store.longest_match("tenant-a", [R1, R2], p) == {R1: 4, R2: 0}
    assert await store.longest_match("odd {tenant}:b/é", [R1, R2], p) == {R1: 0, R2: 2}
    assert await store.longest_match("default", [R1, R2], p) == {R1: 0, R2: 0}


async def test_healthy_store_is_not_degraded_and_closes_twice(make_store: StoreFactory) -> None:
    """A working store reports not degraded; ``aclose`` may be called again."""
    store = await make_store()
    await store.record_prefix("default", R1, chain("x"), CAP)
    assert await store.longest_match("default", [R1], chain("x")) == {R1: 1}
    assert store.degraded is False
    await store.aclose()
    await store.aclose()


@pytest.mark.redis
async def test_open_store_picks_the_implementation(redis_server: RedisServer) -> None:
    """No URL gives the embedded store, a URL the Redis store; both follow the protocol."""
    embedded = open_store()
    shared = open_store(redis_url=redis_server.url, options=StoreOptions(key_prefix="t"))
    try:
        assert isinstance(embedded, PrefixStore)
        assert isinstance(shared, RedisStore)
        assert isinstance(shared, PrefixStore)
    finally:
        await embedded.aclose()
        await shared.aclose()


@pytest.mark.redis
async def test_two_clients_share_one_index(redis_server: RedisServer) -> None:
    """Two proxies on one Redis see each other's prefixes."""
    redis_server.flush()
    one = RedisStore.from_url(redis_server.url, StoreOptions(timeouts=RELAXED))
    two = RedisStore.from_url(redis_server.url, StoreOptions(timeouts=RELAXED))
    try:
        p = chain(*blocks("shared", 5))
        await one.record_prefix("default", R1, p, CAP)
        await two.record_prefix("default", R2, p[:2], CAP)
        assert await two.longest_match("default", [R1, R2], p) == {R1: 5, R2: 2}
        assert await one.longest_match("default", [R1, R2], p) == {R1: 5, R2: 2}
    finally:
        await one.aclose()
        await two.aclose()


@pytest.mark.redis
async def test_redis_layout_uses_namespace_hash_tags(redis_server: RedisServer) -> None:
    """Index keys carry the namespace's routing hash tag, compact members and an idle TTL."""
    redis_server.flush()
    store = RedisStore.from_url(redis_server.url, StoreOptions(index_ttl_s=60, timeouts=RELAXED))
    try:
        p = chain(*blocks("k", 3))
        await store.record_prefix("tenant-a", R1, p, CAP)
        key = store.keys.index_key("tenant-a", R1)
        assert key.startswith("pg:{rt:tenant-a}:idx:")
        assert store.keys.index_key("tenant-a", R2).split(":idx:")[0] == key.split(":idx:")[0]
        assert store.keys.index_key("tenant-b", R1).split(":idx:")[0] != key.split(":idx:")[0]
        members = await store.client.zrange(key, 0, -1)
        assert sorted(members) == sorted(h.to_bytes(8, "big") for h in p)
        assert 0 < await store.client.pttl(key) <= 60_000
    finally:
        await store.aclose()
