"""Retrying on another replica: only before the client received a byte, once, and recorded."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fakes import (
    Knobs,
    LlamaFake,
    MakeProxy,
    ProxyClient,
    RecordLog,
    fleet_proxy,
    serve,
    sse_payloads,
)

from proxy.state import STATE

CHAT: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def pair(aiohttp_server: Any) -> tuple[LlamaFake, LlamaFake]:
    """Two llama.cpp fakes: the first (``bad``) is the one tests break."""
    return (await serve(LlamaFake(), aiohttp_server), await serve(LlamaFake(), aiohttp_server))


@pytest.fixture
async def doomed_pair(aiohttp_server: Any) -> tuple[LlamaFake, LlamaFake, TestServer]:
    """Two llama.cpp fakes and the first one's server, which tests close to make it go away."""
    doomed = LlamaFake()
    server = await aiohttp_server(doomed.app())
    doomed.url = str(server.make_url("")).rstrip("/")
    return doomed, await serve(LlamaFake(), aiohttp_server), server


async def round_robin(
    make_proxy: MakeProxy, bad: LlamaFake, good: LlamaFake, knobs: Knobs
) -> tuple[ProxyClient, RecordLog, web.Application]:
    """The proxy taking turns between ``bad``, set to misbehave as ``knobs`` say, and ``good``."""
    bad.knobs = knobs
    return await fleet_proxy(make_proxy, bad, good, policy="round-robin")


async def first_to(client: ProxyClient, body: dict[str, Any]) -> tuple[int, bytes]:
    async with client.post("/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize("stream", [False, True])
async def test_connection_reset_is_retried_on_another_replica(
    pair: tuple[LlamaFake, LlamaFake], make_proxy: MakeProxy, stream: bool
) -> None:
    """A replica that drops the connection before answering: the client gets the other's answer,
    the record says where it went and why, and the dropping replica is ejected at once."""
    bad, good = pair
    # Two drops: the relay resends once on a fresh connection (a stale keep-alive one looks
    # the same); only a replica failing that too is given up on.
    client, records, app = await round_robin(make_proxy, bad, good, Knobs(drop_connections=2))
    got = [await first_to(client, {**CHAT, "stream": stream}) for _ in range(2)]
    assert [status for status, _ in got] == [200, 200]
    if stream:
        assert all(sse_payloads(raw) for _, raw in got)
    await records.wait(2)
    retried = [r for r in records if r.retried_from is not None]
    assert len(retried) == 1
    assert retried[0].retried_from == bad.url
    assert retried[0].route_reason == "retry"
    assert (retried[0].backend, retried[0].status, retried[0].error) == (good.url, 200, None)
    assert len(bad.requests) == 2 and len(good.requests) == 2
    fleet = app[STATE].fleet
    assert not fleet[bad.url].healthy  # ejected by live traffic, without a health check
    await fleet.check_all()
    assert fleet[bad.url].healthy  # and back once a check passes


async def test_503_is_retried_without_ejecting(
    pair: tuple[LlamaFake, LlamaFake], make_proxy: MakeProxy
) -> None:
    """A 503 status line (no slot, loading) goes to the other replica; the first stays in."""
    bad, good = pair
    client, records, app = await round_robin(make_proxy, bad, good, Knobs(reject_status=503))
    for _ in range(2):
        assert (await first_to(client, CHAT))[0] == 200
    await records.wait(2)
    assert [r.retried_from for r in records].count(bad.url) == 1
    assert {r.backend for r in records} == {good.url}
    assert app[STATE].fleet[bad.url].healthy


async def test_other_statuses_are_not_retried(
    pair: tuple[LlamaFake, LlamaFake], make_proxy: MakeProxy
) -> None:
    """A 500 or a 400 from the backend is its answer: relayed as is, never retried."""
    bad, good = pair
    client, records, _ = await round_robin(make_proxy, bad, good, Knobs(reject_status=500))
    statuses = sorted([(await first_to(client, CHAT))[0] for _ in range(2)])
    assert statuses == [200, 500]
    await records.wait(2)
    assert all(r.retried_from is None for r in records)
    assert len(good.requests) == 1


async def test_503_relayed_when_no_other_replica_is_healthy(
    pair: tuple[LlamaFake, LlamaFake], make_proxy: MakeProxy
) -> None:
    """No healthy replica to retry on: the client gets the backend's 503 exactly as it was sent."""
    bad, other = pair
    bad.knobs = Knobs(reject_status=503)
    other.health_status = 503
    client, records, app = await fleet_proxy(make_proxy, bad, other)
    fleet = app[STATE].fleet
    fleet.report_failure(fleet[other.url], "test")
    status, raw = await first_to(client, CHAT)
    assert status == 503
    assert b"the request exceeds the context size" in raw
    record = await records.wait()
    assert (record.backend, record.error) == (bad.url, "upstream_error")
    assert record.retried_from is None and not other.requests


async def test_no_retry_once_bytes_reached_the_client(
    pair: tuple[LlamaFake, LlamaFake], make_proxy: MakeProxy
) -> None:
    """A stream cut after its first tokens ends with an error event; nothing is resent."""
    bad, good = pair
    client, records, app = await round_robin(make_proxy, bad, good, Knobs(drop_after=2))
    streams = [await first_to(client, {**CHAT, "stream": True}) for _ in range(2)]
    await records.wait(2)
    cut = next(r for r in records if r.backend == bad.url)
    assert cut.error == "backend_disconnected" and cut.retried_from is None
    assert len(good.requests) == 1  # only its own round-robin turn
    raw = next(raw for _, raw in streams if b"Hello" in raw and b'"error"' in raw)
    assert sse_payloads(raw)[-1]["error"]["type"] == "backend_unavailable"
    assert not app[STATE].fleet[bad.url].healthy


async def test_dead_replica_is_retried_and_ejected(
    doomed_pair: tuple[LlamaFake, LlamaFake, TestServer], make_proxy: MakeProxy
) -> None:
    """A replica whose server went away (connection refused) is skipped for the request."""
    bad, good, server = doomed_pair
    client, records, app = await fleet_proxy(make_proxy, bad, good, policy="round-robin")
    await server.close()
    for _ in range(3):
        assert (await first_to(client, CHAT))[0] == 200
    await records.wait(3)
    assert [r.retried_from for r in records].count(bad.url) == 1
    assert not app[STATE].fleet[bad.url].healthy


async def test_single_replica_connection_failure_is_502(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """With nowhere else to go, a dropped connection is the proxy's 502, as before."""
    llama_fake.knobs = Knobs(drop_connections=2)
    client, records, _ = await make_proxy(llama_fake.url)
    status, raw = await first_to(client, CHAT)
    assert status == 502 and b"backend_unavailable" in raw
    assert (await records.wait()).error == "backend_unavailable"


async def test_passthrough_get_goes_to_the_next_replica(
    doomed_pair: tuple[LlamaFake, LlamaFake, TestServer], make_proxy: MakeProxy
) -> None:
    """A GET the first backend cannot take (it went away) is served by the next healthy one."""
    first, second, server = doomed_pair
    client, _, app = await fleet_proxy(make_proxy, first, second)
    await server.close()
    async with client.get("/v1/models") as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["owned_by"] == "llamacpp"
    assert not app[STATE].fleet[first.url].healthy
    async with client.post("/tokenize", json={"content": "a b"}) as resp:
        assert resp.status == 200  # the ejected first replica is no longer asked
