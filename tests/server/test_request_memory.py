"""A request's objects are freed by reference counting as it ends, however it ends.

A reference cycle through a request's objects (a callback kept on the exchange it closes over,
a connection's sink bound to the relay that holds the connection) keeps the whole request alive
(its body, its parsed and rendered prompt) until the cyclic collector's next pass over the
generation it reached. ``prefixgate serve`` runs that collector rarely (``GC_YOUNG_OBJECTS``),
so at 512 KB prompts such cycles held hundreds of MiB. Here the collector saves what it finds
(``gc.DEBUG_SAVEALL``) while requests run, and nothing of the proxy's may be among it.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from typing import Any

import pytest
from fakes import (
    Knobs,
    LlamaFake,
    MakeProxy,
    RecordLog,
    SlotLlamaFake,
    VllmFake,
    fleet_proxy,
    serve,
)

from proxy.state import STATE
from tests.store.redis_process import RedisServer

CHAT = {
    "model": "fake-model",
    "messages": [
        {"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": "hi"},
    ],
}


@pytest.fixture
def saved_garbage() -> Iterator[None]:
    """The collector keeps what it would free, from a clean start. It runs only when asked
    (``proxy_garbage``): an automatic young pass would save the young part of a cycle and
    leave the older objects it holds out of the list."""
    flags, enabled = gc.get_debug(), gc.isenabled()
    gc.collect()
    gc.garbage.clear()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        if enabled:
            gc.enable()


async def proxy_garbage(records: RecordLog, requests: int, settle_s: float = 0.05) -> list[str]:
    """The proxy's objects the collector found in cycles since the fixture started, once
    ``requests`` records are written and their background work (``settle_s``) has run."""
    if requests:
        await records.wait(requests)
    await asyncio.sleep(settle_s)
    gc.collect()
    return sorted(
        {type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("proxy.")}
    )


@pytest.mark.parametrize(
    ("knobs", "body"),
    [
        pytest.param(Knobs(), {**CHAT, "stream": True}, id="streamed"),
        pytest.param(Knobs(), CHAT, id="whole"),
        pytest.param(Knobs(reject_status=500), {**CHAT, "stream": True}, id="backend-error"),
        pytest.param(Knobs(fail_after=2), {**CHAT, "stream": True}, id="error-mid-stream"),
        pytest.param(Knobs(), {**CHAT, "messages": "not a list"}, id="refused"),
        pytest.param(Knobs(drop_connections=1), CHAT, id="connection-dropped-once"),
        pytest.param(Knobs(drop_connections=6), CHAT, id="backend-unreachable"),
    ],
)
async def test_no_cycle_keeps_a_request_alive(
    aiohttp_server: Any,
    make_proxy: MakeProxy,
    saved_garbage: None,
    knobs: Knobs,
    body: dict[str, Any],
) -> None:
    """Slot scheduling on (a llama-server with slots), three requests, their records written:
    none of the proxy's objects needed the cyclic collector."""
    fake = await serve(SlotLlamaFake(knobs, slots=2), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)
    for _ in range(3):
        async with client.post("/v1/chat/completions", json=body) as resp:
            await resp.read()
    assert await proxy_garbage(records, 3) == []


async def test_no_cycle_keeps_a_request_the_client_left_alive(
    aiohttp_server: Any, make_proxy: MakeProxy, saved_garbage: None
) -> None:
    """A client that goes away mid-stream: the answer is given up, nothing left in a cycle."""
    fake = await serve(LlamaFake(Knobs(token_delay_s=0.05)), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)
    for _ in range(2):
        async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            await resp.content.readany()  # the first event, then the connection is dropped
            resp.close()
    assert await proxy_garbage(records, 2) == []


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/responses", {"model": "fake-model", "input": "hi", "stream": True}),
        (
            "POST",
            "/v1/messages",
            {"model": "fake-model", "max_tokens": 8, "messages": CHAT["messages"][1:]},
        ),
        ("POST", "/v1/completions", {"model": "fake-model", "prompt": "hi", "stream": True}),
        ("GET", "/v1/models", None),
    ],
)
async def test_no_cycle_keeps_a_request_of_another_api_alive(
    llama_fake: LlamaFake,
    make_proxy: MakeProxy,
    saved_garbage: None,
    method: str,
    path: str,
    body: dict[str, Any] | None,
) -> None:
    """The Responses and Messages APIs, completions, and a path passed through."""
    client, records, _ = await make_proxy(llama_fake.url)
    for _ in range(2):
        async with client.request(method, path, json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
    assert await proxy_garbage(records, 2 if body is not None else 0) == []


@pytest.mark.parametrize("knobs", [Knobs(drop_connections=2), Knobs(reject_status=503)])
async def test_no_cycle_keeps_a_retried_request_alive(
    aiohttp_server: Any, make_proxy: MakeProxy, saved_garbage: None, knobs: Knobs
) -> None:
    """A replica that drops the connection or answers 503: the request goes to the other one
    (``NotStarted``, with the failure it carries); nothing left in a cycle."""
    bad = await serve(LlamaFake(knobs), aiohttp_server)
    good = await serve(LlamaFake(), aiohttp_server)
    client, records, _ = await fleet_proxy(make_proxy, bad, good, policy="round-robin")
    for stream in (False, True):
        async with client.post("/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
            assert resp.status == 200
            await resp.read()
    await records.wait(2)
    assert any(r.retried_from == bad.url for r in records)
    assert await proxy_garbage(records, 2) == []


async def test_no_cycle_keeps_a_coalesced_request_alive(
    aiohttp_server: Any, make_proxy: MakeProxy, saved_garbage: None
) -> None:
    """vLLM (no slots: requests sharing a prefix wait for its prefill, ``coalesce``), two at
    once; nothing left in a cycle."""
    fake = await serve(VllmFake(Knobs(token_delay_s=0.01)), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)

    async def one() -> None:
        async with client.post("/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status == 200
            await resp.read()

    await asyncio.gather(one(), one())
    assert await proxy_garbage(records, 2) == []


@pytest.mark.redis
async def test_no_cycle_keeps_a_request_alive_with_redis(
    aiohttp_server: Any, make_proxy: MakeProxy, saved_garbage: None
) -> None:
    """The Redis store (lookups, claims, write-behind batches over its own link): nothing left
    in a cycle."""
    server = RedisServer()
    server.start()
    try:
        fake = await serve(SlotLlamaFake(slots=2), aiohttp_server)
        client, records, _ = await make_proxy(fake.url, redis_url=server.url)
        for stream in (False, True, True):
            body = {**CHAT, "stream": stream}
            async with client.post("/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        assert await proxy_garbage(records, 3, settle_s=0.1) == []  # (the store's batches)
    finally:
        server.kill()


async def test_no_cycle_keeps_a_request_no_replica_could_take_alive(
    aiohttp_server: Any, make_proxy: MakeProxy, saved_garbage: None
) -> None:
    """The first replica drops the connection and no other is left to retry on (gone between
    the two): the client gets the first one's error, nothing left in a cycle."""
    bad = await serve(LlamaFake(Knobs(drop_connections=100)), aiohttp_server)
    good = await serve(LlamaFake(), aiohttp_server)
    client, records, app = await fleet_proxy(make_proxy, bad, good, policy="round-robin")
    app[STATE].fleet.reroute = lambda *args, **kwargs: None  # type: ignore[method-assign]
    statuses = []
    for _ in range(2):  # round robin: one of the two goes to the dropping replica first
        async with client.post("/v1/chat/completions", json=CHAT) as resp:
            statuses.append(resp.status)
            await resp.read()
    assert 502 in statuses
    assert await proxy_garbage(records, 2) == []
