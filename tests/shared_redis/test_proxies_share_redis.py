"""Proxies sharing one Redis (or one Redis Cluster): shared prefix knowledge; Redis failures
never fail traffic."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fakes import RecordLog
from redis.crc import key_slot

from proxy.app import build_app
from proxy.config import Timeouts, resolve
from proxy.log import get_logger
from proxy.record_writer import RecordWriter
from proxy.records import RequestRecord
from tests.store.cluster_process import RedisClusterServer
from tests.store.redis_process import RedisServer

pytestmark = pytest.mark.redis

SYSTEM = "You are a careful assistant for the Acme help desk. " * 40


async def _chat(request: web.Request) -> web.Response:
    body = await request.json()
    await asyncio.sleep(0.01)
    n = len(str(body.get("messages"))) // 4
    return web.json_response(
        {
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": "ok"},
                }
            ],
            "usage": {
                "prompt_tokens": n,
                "completion_tokens": 1,
                "total_tokens": n + 1,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    )


class SharedRedis:
    """One Redis, or a three-node Redis Cluster, that a test can take down and bring back."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._server = RedisServer() if kind == "redis" else None
        self._cluster = RedisClusterServer() if kind == "cluster" else None
        self._down: int | None = None

    @property
    def url(self) -> str:
        return self._server.url if self._server else self._cluster_().url

    def _cluster_(self) -> RedisClusterServer:
        assert self._cluster is not None
        return self._cluster

    def start(self) -> None:
        if self._server:
            self._server.start()
        else:
            self._cluster_().start()

    def take_down(self) -> None:
        """Kill Redis; on a cluster, the node holding the default tenant's prefix index."""
        if self._server:
            self._server.kill()
            return
        cluster = self._cluster_()
        self._down = cluster.port_of_slot(key_slot(b"pg:{rt:default}:idx"))
        cluster.kill(self._down)

    def bring_back(self) -> None:
        if self._server:
            self._server.start()
            return
        assert self._down is not None
        self._cluster_().start_node(self._down)
        self._cluster_().wait_ok()

    def stop(self) -> None:
        if self._server:
            self._server.kill()
        else:
            self._cluster_().stop()


@pytest.fixture(params=["redis", "cluster"])
def shared_redis(request: pytest.FixtureRequest) -> Iterator[SharedRedis]:
    """A fresh Redis of the parametrized kind for this test."""
    shared = SharedRedis(request.param)
    try:
        shared.start()
        yield shared
    finally:
        shared.stop()


@pytest.fixture
async def backend() -> AsyncIterator[str]:
    """A minimal OpenAI-compatible backend."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _chat)
    server = TestServer(app)
    await server.start_server()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


Proxy = tuple[str, list[RequestRecord], RecordWriter]


@pytest.fixture
async def start_proxy() -> AsyncIterator[Callable[[str, str], Awaitable[Proxy]]]:
    """Starts proxies in process; closes them after the test."""
    servers: list[TestServer] = []

    async def start(backend_url: str, redis_url: str) -> Proxy:
        writer = RecordWriter(logger=get_logger("test.records"))
        records = RecordLog.of(writer)
        settings = resolve({"backend": [backend_url], "redis_url": redis_url}, environ={})
        settings = dataclasses.replace(
            settings, timeouts=Timeouts(connect=2, idle=5, store=0.05), dialect="openai"
        )
        server = TestServer(build_app(settings, writer=writer))
        await server.start_server()
        servers.append(server)
        return str(server.make_url("/")), records, writer

    yield start
    for s in servers:
        await s.close()


def _body(question: str) -> dict[str, object]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }


async def test_two_proxies_see_each_others_prefixes(
    backend: str, start_proxy: Callable[[str, str], Awaitable[Proxy]], shared_redis: SharedRedis
) -> None:
    """A prefix learned through proxy A is predicted as cached by proxy B on the same Redis."""
    url_a, recs_a, writer_a = await start_proxy(backend, shared_redis.url)
    url_b, recs_b, writer_b = await start_proxy(backend, shared_redis.url)
    async with aiohttp.ClientSession() as s:
        async with s.post(url_a + "v1/chat/completions", json=_body("first?")) as r:
            assert r.status == 200
        await writer_a.drain()
        async with s.post(url_b + "v1/chat/completions", json=_body("second?")) as r:
            assert r.status == 200
        await writer_b.drain()
    assert recs_a[0].prefix_blocks > 4
    assert recs_b[0].prefix_matched_blocks >= recs_a[0].prefix_blocks - 1
    assert (recs_b[0].predicted_cached_tokens or 0) > 0


async def test_redis_killed_and_restarted_mid_load_loses_no_request(
    backend: str, start_proxy: Callable[[str, str], Awaitable[Proxy]], shared_redis: SharedRedis
) -> None:
    """Killing and restarting Redis (a cluster's node) under load fails no client request; the
    index recovers."""
    url, records, writer = await start_proxy(backend, shared_redis.url)
    statuses: list[int] = []

    async def one(s: aiohttp.ClientSession, i: int) -> None:
        async with s.post(url + "v1/chat/completions", json=_body(f"q{i % 5}")) as r:
            await r.read()
            statuses.append(r.status)

    async with aiohttp.ClientSession() as s:
        load = [asyncio.create_task(one(s, i)) for i in range(20)]
        await asyncio.sleep(0.02)
        shared_redis.take_down()
        load += [asyncio.create_task(one(s, i)) for i in range(20, 40)]
        await asyncio.gather(*load)
        shared_redis.bring_back()
        await asyncio.sleep(1.2)  # past the circuit breaker's back-off
        for i in range(40, 50):
            await one(s, i)
        await writer.drain()
    assert statuses == [200] * 50
    assert (records[-1].predicted_cached_tokens or 0) > 0  # learned again after restart
