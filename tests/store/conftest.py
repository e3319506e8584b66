"""Fixtures for the store suite: a real redis-server, and every test run on both stores.

``redis_server`` starts ``redis-server`` once per session on a free port (no persistence). The
``make_store`` fixture is parametrized over the two implementations, so each behavioural test
runs once embedded and once against Redis (marked ``redis``). A missing redis-server binary
fails those tests loudly: it is a broken environment, not a reason to skip.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from redis_process import RELAXED, RedisServer, StoreFactory

from proxy.store import EmbeddedStore, PrefixStore, RedisStore, StoreOptions


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session."""
    server = RedisServer()
    server.start()
    yield server
    server.kill()


@pytest.fixture
def own_redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test's own, free to be killed."""
    server = RedisServer()
    server.start()
    yield server
    with contextlib.suppress(Exception):
        server.thaw()
    server.kill()


@pytest.fixture(params=["embedded", pytest.param("redis", marks=pytest.mark.redis)])
async def make_store(request: pytest.FixtureRequest) -> AsyncIterator[StoreFactory]:
    """Builds stores of the parametrized kind with given ``StoreOptions`` fields; closes them."""
    kind: str = request.param
    made: list[PrefixStore] = []
    server: RedisServer | None = None
    if kind == "redis":
        server = request.getfixturevalue("redis_server")
        server.flush()

    def factory(**options: Any) -> PrefixStore:
        opts = StoreOptions(**{"timeouts": RELAXED, **options})
        store: PrefixStore = (
            EmbeddedStore(opts) if server is None else RedisStore.from_url(server.url, opts)
        )
        made.append(store)
        return store

    yield factory
    for store in made:
        await store.aclose()


@pytest.fixture
def store(make_store: StoreFactory) -> PrefixStore:
    """A store of each kind with default options."""
    return make_store()
