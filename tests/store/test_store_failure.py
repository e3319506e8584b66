"""Redis failing under the Redis store: bounded calls, neutral answers, one log line, recovery."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import pytest
from redis_process import RedisServer
from store_timing import events
from store_timing import timed as bounded
from structlog.testing import capture_logs

from proxy.store import RedisStore, StatsSample, StoreOptions, StoreTimeouts

pytestmark = pytest.mark.redis

T = TypeVar("T")
R1, R2 = "http://a:1", "http://b:1"
CHAIN = [11, 22, 33, 44]
BOUND_S = 0.05
# A 20 ms lookup deadline (the default is 5 ms) keeps a loaded test machine from failing the
# healthy calls, and is still far below the 2 s socket timeout it must beat.
OPTIONS = StoreOptions(timeouts=StoreTimeouts(lookup_s=0.02, breaker_s=0.2))


async def timed(aw: Awaitable[T], bound_s: float = BOUND_S) -> T:
    return await bounded(aw, bound_s)


async def exercise_every_call(store: RedisStore) -> None:
    """Every store call returns its neutral answer within the bound."""
    assert await timed(store.longest_match("default", [R1, R2], CHAIN)) == {}
    await timed(store.record_prefix("default", R1, CHAIN, 100))
    await timed(
        store.add_stats(
            StatsSample(
                ts=time.time(), namespace="default", model="m", backend="b", status=200, error=False
            )
        )
    )
    window = await timed(store.query_stats(since_s=time.time() - 60))
    assert window.requests == 0
    assert await timed(store.top_prefixes(since_s=time.time() - 60)) == []


async def wait_recovered(store: RedisStore, timeout_s: float = 3.0) -> dict[str, int]:
    """Look up until the store answers again (the breaker lets a probe through)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await store.longest_match("default", [R1], CHAIN)
        if not store.degraded:
            return got
        assert time.monotonic() < deadline, "store did not recover"
        await asyncio.sleep(0.05)


async def test_killed_redis_degrades_then_recovers(own_redis_server: RedisServer) -> None:
    """SIGKILL: calls stay fast and neutral, one warning; a restart on the port recovers alone."""
    store = RedisStore.from_url(own_redis_server.url, OPTIONS)
    try:
        assert await store.warm()  # (as at start-up: the first calls' deadlines are 20 ms)
        await store.record_prefix("default", R1, CHAIN, 100)
        assert await store.longest_match("default", [R1], CHAIN) == {R1: 4}

        with capture_logs() as logs:
            own_redis_server.kill()
            for _ in range(3):
                await exercise_every_call(store)
            assert store.degraded
            await asyncio.sleep(0.25)  # the breaker lets one probe through, which fails again
            await exercise_every_call(store)
            assert store.degraded
            assert store.failures >= 2

            own_redis_server.start()
            assert await wait_recovered(store) == {R1: 0}  # what Redis held is gone
        assert len(events(logs, "store_degraded")) == 1
        assert len(events(logs, "store_recovered")) == 1
        assert events(logs, "store_degraded")[0]["log_level"] == "warning"

        await store.record_prefix("default", R1, CHAIN, 100)
        assert await store.longest_match("default", [R1], CHAIN) == {R1: 4}
    finally:
        await store.aclose()


async def test_hung_redis_costs_at_most_the_lookup_timeout(own_redis_server: RedisServer) -> None:
    """SIGSTOP: the lookup gives up after its timeout, not the socket's, and recovers after."""
    store = RedisStore.from_url(own_redis_server.url, OPTIONS)
    try:
        assert await store.warm()
        await store.record_prefix("default", R1, CHAIN, 100)
        with capture_logs() as logs:
            own_redis_server.freeze()
            assert await timed(store.longest_match("default", [R1], CHAIN)) == {}
            assert store.degraded
            await timed(store.record_prefix("default", R1, CHAIN, 100))  # breaker open: skipped
            own_redis_server.thaw()
            assert await wait_recovered(store) == {R1: 4}
        assert [e["event"] for e in logs] == ["store_degraded", "store_recovered"]
        assert logs[0]["op"] == "lookup"
        assert logs[0]["error"] == "TimeoutError"
    finally:
        await store.aclose()


async def test_background_write_is_bounded_by_its_own_timeout(
    own_redis_server: RedisServer,
) -> None:
    """A hung Redis holds a background write no longer than ``write_s``."""
    opts = StoreOptions(timeouts=StoreTimeouts(lookup_s=0.02, write_s=0.03, breaker_s=0.2))
    store = RedisStore.from_url(own_redis_server.url, opts)
    try:
        assert await store.warm()
        await store.record_prefix("default", R1, CHAIN, 100)
        own_redis_server.freeze()
        await timed(store.record_prefix("default", R2, CHAIN, 100), bound_s=0.03 + BOUND_S)
        assert store.degraded and store.failures == 1
    finally:
        own_redis_server.thaw()
        await store.aclose()


async def test_closed_store_answers_neutrally(own_redis_server: RedisServer) -> None:
    """After ``aclose`` calls return neutral results instead of raising."""
    store = RedisStore.from_url(own_redis_server.url)
    await store.aclose()
    assert await store.longest_match("default", [R1], CHAIN) == {}
    await store.record_prefix("default", R1, CHAIN, 100)
