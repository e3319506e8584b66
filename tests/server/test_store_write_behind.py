"""The proxy's store writes: queued and sent together (the default), or one by one (delay 0).

Either way, once the writer has drained, the store holds every request's chain, its traffic
count (where a router reads it) and its statistics, and no request is left counted in flight
(by the proxy; the store of its own is not told the counts, below).
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from fakes import LlamaFake, MakeProxy, fleet_proxy, serve

from proxy.state import STATE

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8


def chat(question: str) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }


@pytest.mark.parametrize("delay_ms", [5.0, 0.0])
async def test_every_write_reaches_the_store(
    llama_fake: LlamaFake, make_proxy: MakeProxy, delay_ms: float
) -> None:
    client, records, app = await make_proxy(llama_fake.url, store_write_delay_ms=delay_ms)
    state = app[STATE]
    for n in range(5):
        async with client.post("/v1/chat/completions", json=chat(f"question {n}")) as r:
            assert r.status == 200
    await records.wait(5)
    await state.writer.drain()
    writes = state.tracker.writes
    if delay_ms:
        assert writes is not None and writes.pending == 0
        assert 1 <= writes.batches <= 10  # five requests, about four writes each
    else:
        assert writes is None
    replica = llama_fake.url
    last = records[-1]
    assert last.predicted_cached_tokens  # the earlier turns' shared system prompt
    now = time.time()
    window = await state.store.query_stats(since_s=now - 300, until_s=now + 60)
    assert window.requests == 5
    found = await state.store.lookup("default", [replica], [])
    assert state.tracker.local_in_flight(replica) == 0
    assert found.window_requests == 0  # one replica: the traffic is not counted (below)


async def test_the_traffic_is_counted_where_a_router_reads_it(
    llama_fake: LlamaFake, aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """The traffic window is the router's input (the traffic-shared depth). With one replica
    and a store of the proxy's own nothing reads it, and the requests are not counted; with
    two replicas every request is."""
    other = await serve(LlamaFake(), aiohttp_server)
    for fakes, counted in (((llama_fake,), 0), ((llama_fake, other), 3)):
        client, records, app = await fleet_proxy(make_proxy, *fakes)
        state = app[STATE]
        assert state.tracker.count_traffic is (counted > 0)
        for n in range(3):
            async with client.post("/v1/chat/completions", json=chat(f"question {n}")) as r:
                assert r.status == 200
        await records.wait(3)
        await state.writer.drain()
        found = await state.store.lookup("default", [f.url for f in fakes], [])
        assert found.window_requests == counted


@pytest.mark.parametrize("delay_ms", [5.0, 0.0])
async def test_a_store_of_its_own_is_not_told_the_load(
    llama_fake: LlamaFake, make_proxy: MakeProxy, delay_ms: float
) -> None:
    """A store of the proxy's own would count in flight what the proxy counts already, a
    moment late: the count is kept by the proxy alone, and routing reads that."""
    client, records, app = await make_proxy(llama_fake.url, store_write_delay_ms=delay_ms)
    state = app[STATE]
    assert state.tracker.share_in_flight is False
    told: list[tuple[str, int]] = []
    state.store._add_in_flight = lambda replica, delta: told.append((replica, delta))
    tracker, counted = state.tracker, []
    count = tracker.in_flight

    def counting(view: Any, replica: str, delta: int) -> Any:
        done = count(view, replica, delta)
        counted.append(tracker.local_in_flight(replica))
        return done

    tracker.in_flight = counting
    for n in range(2):
        async with client.post("/v1/chat/completions", json=chat(f"question {n}")) as r:
            assert r.status == 200
    await records.wait(2)
    await state.writer.drain()
    assert counted == [1, 0, 1, 0]  # the proxy's own count, as each went out and ended
    assert told == []


async def test_the_writes_wait_for_the_delay(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """With a long delay nothing reaches the store until it passes (or the writer drains),
    and this proxy still predicts from its own claims."""
    client, records, app = await make_proxy(llama_fake.url, store_write_delay_ms=1000.0)
    state = app[STATE]
    for n in range(2):
        async with client.post("/v1/chat/completions", json=chat(f"question {n}")) as r:
            assert r.status == 200
    await records.wait(2)
    assert records[1].predicted_cached_tokens  # RecentClaims: this proxy sees its claim
    now = time.time()
    assert (await state.store.query_stats(since_s=now - 300, until_s=now + 60)).requests == 0
    assert state.tracker.writes is not None and state.tracker.writes.pending > 0
    await state.writer.drain()
    assert (await state.store.query_stats(since_s=now - 300, until_s=now + 60)).requests == 2
