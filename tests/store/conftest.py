"""Fixtures for the store suite: a real redis-server and Redis Cluster, every test on each store.

``redis_server`` starts ``redis-server`` once per session on a free port (no persistence);
``redis_cluster`` a three-node Redis Cluster the same way. The ``make_store`` fixture is
parametrized over the implementations, so each behavioural test runs embedded, against one
Redis and against the cluster (both marked ``redis``). A missing redis-server binary fails those
tests loudly: it is a broken environment, not a reason to skip.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from cluster_process import RedisClusterServer
from redis_process import RELAXED, RedisServer, StoreFactory

from proxy.store import EmbeddedStore, PrefixStore, RedisStore, StoreOptions


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session."""
    server = RedisServer()
    server.start()
    yield server
    server.kill()


def _running_cluster() -> Iterator[RedisClusterServer]:
    cluster = RedisClusterServer()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServer]:
    """One three-node Redis Cluster for the session."""
    yield from _running_cluster()


@pytest.fixture
def own_redis_cluster() -> Iterator[RedisClusterServer]:
    """A Redis Cluster of this test's own, whose nodes it may kill, freeze and restart."""
    yield from _running_cluster()


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test's own, free to be killed."""
    server = RedisServer()
    server.start()
    yield server
    with contextlib.suppress(Exception):
        server.thaw()
    server.kill()


@pytest.fixture(
    params=[
        "embedded",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("cluster", marks=pytest.mark.redis),
    ]
)
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """Builds stores of the parametrized kind with given ``StoreOptions`` fields; closes them."""
    kind: str = request.param
    made: list[PrefixStore] = []
    server: RedisServer | RedisClusterServer | None = None
    if kind != "embedded":
        server = request.getfixturevalue("redis_server" if kind == "redis" else "redis_cluster")
        server.flush()

    async def factory(**options: Any) -> PrefixStore:
        opts = StoreOptions(**{"timeouts": RELAXED, **options})
        store: PrefixStore = (
            EmbeddedStore(opts) if server is None else RedisStore.from_url(server.url, opts)
        )
        made.append(store)
        # Connected, a cluster's layout learned and the scripts loaded before the test's first
        # call, as the proxy does at start-up: a first call paying for that on a loaded machine
        # could miss even a relaxed deadline and answer neutrally.
        if not await store.warm():
            pytest.fail(f"the {kind} store did not warm up ({store.failures} failures)")
        return store

    yield factory
    for store in made:
        await store.aclose()


@pytest.fixture
async def store(make_store: StoreFactory) -> PrefixStore:
    """A store of each kind with default options."""
    return await make_store()
