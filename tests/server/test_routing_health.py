"""Active health checks: ejection after K failures, return after a pass, /readyz, start-up."""

from __future__ import annotations

import asyncio
from typing import Any

from fakes import LlamaFake, MakeProxy, ProxyClient, VllmFake, fleet_proxy, serve

from proxy.config import HealthChecks
from proxy.state import STATE
from tests.ports import free_port

CHAT: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def send(client: ProxyClient, n: int) -> None:
    for _ in range(n):
        async with client.post("/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            await resp.read()


async def readyz(client: ProxyClient) -> tuple[int, dict[str, Any]]:
    async with client.admin.get("/readyz") as resp:
        return resp.status, await resp.json()


async def test_ejected_after_k_failures_and_back_after_a_pass(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """K failed checks eject a replica (traffic avoids it, /readyz shows it); one pass restores."""
    sick, well = [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]
    client, records, app = await fleet_proxy(
        make_proxy, sick, well, policy="round-robin", health=HealthChecks(failures=3)
    )
    fleet = app[STATE].fleet
    sick.health_status = 503
    for _ in range(2):
        await fleet.check_all()
    assert fleet[sick.url].healthy  # two failures are not three
    await fleet.check_all()
    assert not fleet[sick.url].healthy
    assert fleet[sick.url].last_error == "/health answered 503"
    status, body = await readyz(client)
    assert (status, body["backends"]) == (200, {sick.url: False, well.url: True})

    await send(client, 4)
    assert (len(sick.requests), len(well.requests)) == (0, 4)

    sick.health_status = 200
    await fleet.check_all()
    assert fleet[sick.url].healthy and fleet[sick.url].failures == 0
    await send(client, 4)
    await records.wait(8)
    assert (len(sick.requests), len(well.requests)) == (2, 6)


async def test_readyz_503_when_every_replica_is_ejected(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """With every replica ejected the proxy is not ready, yet requests still go out (and answer)."""
    fakes = [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]
    client, _, app = await fleet_proxy(make_proxy, *fakes, health=HealthChecks(failures=1))
    for f in fakes:
        f.health_status = 503
    await app[STATE].fleet.check_all()
    status, body = await readyz(client)
    assert (status, body["status"]) == (503, "unavailable")
    await send(client, 1)  # an all-ejected fleet still gets a choice


async def test_monitor_runs_in_the_background(aiohttp_server: Any, make_proxy: MakeProxy) -> None:
    """Without anyone asking, the monitor checks on its interval and ejects a failing replica."""
    sick, well = [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]
    _, _, app = await fleet_proxy(
        make_proxy, sick, well, health=HealthChecks(interval_s=0.02, failures=2)
    )
    fleet = app[STATE].fleet
    sick.health_status = 503
    async with asyncio.timeout(5):
        while fleet[sick.url].healthy:
            fleet.round_done.clear()
            await fleet.round_done.wait()
    assert fleet.rounds >= 2 and sick.health_checks >= 2 and well.health_checks >= 2


async def test_backend_started_after_the_proxy_joins(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """A replica unreachable at start-up starts ejected, and is detected once it comes up."""
    well = await serve(LlamaFake(), aiohttp_server)
    port = free_port()
    late = LlamaFake()
    late.url = f"http://127.0.0.1:{port}"
    client, _, app = await fleet_proxy(make_proxy, well, late, policy="round-robin")
    fleet = app[STATE].fleet
    assert not fleet[late.url].healthy and not fleet[late.url].detected
    await send(client, 2)
    assert len(well.requests) == 2

    await aiohttp_server(late.app(), port=port)
    await fleet.check_all()
    assert fleet[late.url].healthy and fleet[late.url].dialect.name == "llamacpp"
    await send(client, 2)
    assert (len(well.requests), len(late.requests)) == (3, 1)


async def test_health_path_per_dialect(
    llama_fake: LlamaFake, vllm_fake: VllmFake, make_proxy: MakeProxy, aiohttp_server: Any
) -> None:
    """llama.cpp and vLLM are checked on /health; any other server on /v1/models."""
    generic = await serve(LlamaFake(), aiohttp_server)
    _, _, app = await fleet_proxy(make_proxy, llama_fake, vllm_fake)
    fleet = app[STATE].fleet
    before = (llama_fake.health_checks, vllm_fake.health_checks)
    await fleet.check_all()
    assert (llama_fake.health_checks, vllm_fake.health_checks) == (before[0] + 1, before[1] + 1)

    _, _, app2 = await fleet_proxy(make_proxy, generic, dialect="openai")
    fleet2 = app2[STATE].fleet
    assert fleet2[generic.url].health_path == "/v1/models"
    await fleet2.check_all()
    assert generic.health_checks == 0 and fleet2[generic.url].healthy
