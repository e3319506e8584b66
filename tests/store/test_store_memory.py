"""The store's small shared memory (``remember`` / ``recall``), pinned on every store kind."""

from __future__ import annotations

import asyncio

import pytest
from redis_process import RedisServer, StoreFactory

from proxy.store import EmbeddedStore, PrefixStore, RedisStore, StoreOptions, StoreTimeouts


async def test_a_remembered_value_is_recalled_per_namespace_and_kind(store: PrefixStore) -> None:
    """Values come back under their namespace and kind only; unknown keys are ``None``."""
    await store.remember("t1", "form", {"a": b"1", "b": b"\x00\xff"}, ttl_s=60)
    assert await store.recall("t1", "form", ["a", "b", "c"]) == [b"1", b"\x00\xff", None]
    assert await store.recall("t2", "form", ["a"]) == [None]
    assert await store.recall("t1", "note", ["a"]) == [None]
    assert await store.recall("t1", "form", []) == []
    await store.remember("t1", "form", {"a": b"2"}, ttl_s=60)
    assert await store.recall("t1", "form", ["a"]) == [b"2"]


async def test_remembered_values_expire(store: PrefixStore) -> None:
    """A value is gone ``ttl_s`` after it was last remembered."""
    await store.remember("default", "form", {"k": b"v"}, ttl_s=0.2)
    assert await store.recall("default", "form", ["k"]) == [b"v"]
    await asyncio.sleep(0.35)
    assert await store.recall("default", "form", ["k"]) == [None]


async def test_values_over_the_size_cap_are_not_kept(make_store: StoreFactory) -> None:
    """A value larger than ``memory_value_bytes`` is skipped; the others of the call are kept."""
    store = await make_store(memory_value_bytes=8)
    await store.remember("default", "form", {"big": b"x" * 9, "small": b"ok"}, ttl_s=60)
    assert await store.recall("default", "form", ["big", "small"]) == [None, b"ok"]


async def test_the_embedded_memory_is_bounded() -> None:
    """The embedded store keeps at most ``memory_entries``, the least recently written out."""
    store = EmbeddedStore(StoreOptions(memory_entries=2))
    for key in ("a", "b", "c"):
        await store.remember("default", "form", {key: key.encode()}, ttl_s=60)
    assert await store.recall("default", "form", ["a", "b", "c"]) == [None, b"b", b"c"]


async def test_the_embedded_memory_is_bounded_in_bytes() -> None:
    """Values remembered once each (a form per request of an application whose text changes
    every time) are held to ``memory_bytes``, least recently written out; rewriting a key
    counts its bytes once."""
    store = EmbeddedStore(StoreOptions(memory_bytes=10_000))
    for i in range(1_000):
        await store.remember("default", "form", {f"k{i}": b"x" * 500}, ttl_s=60)
        await store.remember("default", "form", {"stable": b"y" * 500}, ttl_s=60)
    assert store.memory_bytes <= 10_000
    assert await store.recall("default", "form", ["stable", "k999", "k0"]) == [
        b"y" * 500,
        b"x" * 500,
        None,
    ]


@pytest.mark.redis
async def test_recall_answers_none_while_redis_is_down(own_redis_server: RedisServer) -> None:
    """A Redis that is down costs the bound and answers ``None``: the request goes on unchanged."""
    opts = StoreOptions(timeouts=StoreTimeouts(lookup_s=0.05, write_s=0.05, breaker_s=0.0))
    store = RedisStore.from_url(own_redis_server.url, opts)
    try:
        assert await store.warm()  # (as at start-up: the first calls' deadlines are 50 ms)
        await store.remember("default", "form", {"k": b"v"}, ttl_s=60)
        assert await store.recall("default", "form", ["k"]) == [b"v"]
        own_redis_server.kill()
        assert await store.recall("default", "form", ["k", "j"]) == [None, None]
        await store.remember("default", "form", {"k": b"w"}, ttl_s=60)  # does not raise
        assert store.degraded
    finally:
        await store.aclose()
