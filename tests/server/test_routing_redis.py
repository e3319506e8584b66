"""Two proxies on one Redis route alike: same index, same shared loads, same decisions."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from fakes import Knobs, LlamaFake, MakeProxy, ProxyClient, RecordLog, fleet_proxy, serve

from proxy.backends import CHAT
from proxy.config import Timeouts
from proxy.routing import Decision
from proxy.state import STATE
from proxy.store.redis_store import RedisStore
from tests.store.redis_process import RedisServer

pytestmark = pytest.mark.redis

Proxy = tuple[ProxyClient, RecordLog, web.Application]


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A fresh redis-server for the test."""
    server = RedisServer()
    server.start()
    yield server
    server.kill()


def conversation(n: int, turns: int) -> dict[str, Any]:
    system = f"Agent {n} instructions. " + " ".join(f"step{n}-{j}" for j in range(200))
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": f"done {t}"})
        messages.append({"role": "user", "content": f"task {t} for agent {n}"})
    return {"model": "fake-model", "messages": messages}


async def two_proxies(
    make_proxy: MakeProxy, redis_url: str, *fakes: LlamaFake
) -> tuple[Proxy, Proxy]:
    # Behavioural test: a generous store deadline so a busy machine never degrades a lookup.
    timeouts = Timeouts(connect=2, idle=10, store=0.5)
    made = [
        await fleet_proxy(make_proxy, *fakes, redis_url=redis_url, timeouts=timeouts)
        for _ in range(2)
    ]
    return made[0], made[1]


async def decide(app: web.Application, body: dict[str, Any]) -> Decision:
    """What this proxy would decide for ``body`` now (nothing is sent, nothing recorded)."""
    state = app[STATE]
    view = await state.tracker.lookup(CHAT, body, [r.url for r in state.fleet.replicas])
    assert view.available
    return state.fleet.route(view)


async def post(client: ProxyClient, body: dict[str, Any]) -> None:
    async with client.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()


async def test_conversation_alternating_proxies_stays_on_one_replica(
    aiohttp_server: Any, make_proxy: MakeProxy, redis_server: RedisServer
) -> None:
    """Each turn through the other proxy: the turns still follow the first turn's replica."""
    fakes = [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]
    proxies = await two_proxies(make_proxy, redis_server.url, *fakes)
    convs, turns = 12, 3  # 12 first turns: all on one replica by chance is 1 in 2,048
    backends: dict[int, list[tuple[str | None, str]]] = {n: [] for n in range(convs)}
    sent = [0, 0]
    for t in range(1, turns + 1):
        for n in range(convs):
            which = (n + t) % 2
            client, records, app = proxies[which]
            await post(client, conversation(n, t))
            sent[which] += 1
            record = await records.wait(sent[which])
            await app[STATE].writer.drain()
            backends[n].append((record.backend, record.route_reason))
    for got in backends.values():
        assert len({b for b, _ in got}) == 1
        assert [reason for _, reason in got] == ["miss", "affinity", "affinity"]
    assert {got[0][0] for got in backends.values()} == {f.url for f in fakes}


async def test_a_chosen_store_deadline_also_bounds_the_background_writes(
    aiohttp_server: Any, make_proxy: MakeProxy, redis_server: RedisServer
) -> None:
    """A write batch timing out at the default 50 ms (a busy machine, not a failing Redis)
    would open the breaker and skip a second of lookups: with ``--store-timeout 0.5`` the
    writes get ten times that."""
    fake = await serve(LlamaFake(), aiohttp_server)
    (_, _, app), _ = await two_proxies(make_proxy, redis_server.url, fake, fake)
    store = app[STATE].store
    assert isinstance(store, RedisStore)
    assert store.options.timeouts.lookup_s == 0.5
    assert store.options.timeouts.write_s == pytest.approx(5.0)


async def test_same_request_same_decision_with_shared_loads(
    aiohttp_server: Any, make_proxy: MakeProxy, redis_server: RedisServer
) -> None:
    """Both proxies decide alike for fresh requests, also while one of them keeps a replica busy:
    the other sees that load through Redis and avoids it just the same."""
    fakes = [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]
    (c1, r1, app1), (_, _, app2) = await two_proxies(make_proxy, redis_server.url, *fakes)
    assert app1[STATE].tracker.share_in_flight  # (a store of the proxy's own is not told)
    fresh = [conversation(100 + i, 1) for i in range(12)]
    idle = [await decide(app1, b) for b in fresh]
    assert idle == [await decide(app2, b) for b in fresh]
    assert {d.replica for d in idle} == {f.url for f in fakes}  # spread by rendezvous hash

    await post(c1, conversation(0, 1))  # conversation 0 now lives on one replica
    await app1[STATE].writer.drain()
    holder = (await r1.wait()).backend
    busy = next(f for f in fakes if f.url == holder)
    busy.knobs = Knobs(header_delay_s=1.0)
    slow = [asyncio.create_task(post(c1, conversation(0, t))) for t in (2, 3, 4)]
    await busy.wait_requests(4)
    await app1[STATE].writer.drain()  # the +1s reached Redis
    loaded = [await decide(app2, b) for b in fresh]
    assert loaded == [await decide(app1, b) for b in fresh]
    assert {d.replica for d in loaded} == {f.url for f in fakes} - {holder}
    assert all(d.reason == "miss" for d in loaded)
    await asyncio.gather(*slow)


async def test_a_fast_failure_leaves_no_load_behind(
    aiohttp_server: Any, make_proxy: MakeProxy, redis_server: RedisServer
) -> None:
    """A request that fails before the claim's store writes are done (connection refused) must
    not leave its +1 in the shared count: every proxy would see the replica busy for good."""
    fake = LlamaFake()
    server = await aiohttp_server(fake.app())
    fake.url = str(server.make_url("")).rstrip("/")
    client, _, app = await fleet_proxy(
        make_proxy, fake, redis_url=redis_server.url, timeouts=Timeouts(connect=2, store=0.5)
    )
    state = app[STATE]
    await server.close()  # connections are now refused at once
    for n in range(6):
        async with client.post("/v1/chat/completions", json=conversation(n, 1)) as resp:
            assert resp.status == 502
    await state.writer.drain()
    view = await state.tracker.lookup(CHAT, conversation(0, 1), [fake.url])
    assert view.available
    assert view.loads == {fake.url: 0.0}


@pytest.mark.parametrize("stream", [True, False])
async def test_one_replica_the_lookup_rides_with_the_writes_and_the_record_has_its_answer(
    llama_fake: LlamaFake, make_proxy: MakeProxy, redis_server: RedisServer, stream: bool
) -> None:
    """With one replica nothing waits for the store's lookup: it goes with the queued writes,
    ahead of them. A request that ends before they are sent (here: a long write delay) sends
    them then, and its record still has the store's answer (the misses explained, not all
    'unexplained': without the wait at the request's end the record is built first); no
    request's lookup sees its own claim (the ordering itself: test_write_behind)."""
    client, records, app = await make_proxy(
        llama_fake.url,
        redis_url=redis_server.url,
        timeouts=Timeouts(connect=2, idle=10, store=0.5),
        store_write_delay_ms=60_000.0,
    )
    writes = app[STATE].tracker.writes
    assert writes is not None
    for turn in range(3):
        body = {**conversation(7, turn + 1), "stream": stream}
        async with client.post("/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        record = await records.wait(turn + 1)
        assert writes.batches >= turn + 1  # sent by the request, not 60 s later
        assert record.cached_tokens is not None and record.prompt_tokens is not None
        uncached = record.prompt_tokens - record.cached_tokens
        assert uncached > 0  # (a store that did not answer leaves all of it unexplained)
        assert record.miss_unexplained_tokens is not None
        assert record.miss_unexplained_tokens < uncached
    first = records[0]
    assert first.predicted_cached_tokens == 0  # not its own claim, written right after
    assert records[2].predicted_cached_tokens  # the earlier turns' claims
    store = app[STATE].store
    assert isinstance(store, RedisStore) and not store.degraded
