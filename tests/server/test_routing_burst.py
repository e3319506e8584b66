"""A system prompt shared by all traffic does not pin the traffic to one replica."""

from __future__ import annotations

import asyncio
from typing import Any

from fakes import Knobs, LlamaFake, MakeProxy, ProxyClient, fleet_proxy, serve

from proxy.state import STATE

SYSTEM = "You are the Acme support assistant. Follow the policy below exactly. " + " ".join(
    f"policy-clause-{i}" for i in range(200)
)


def ask(n: int) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"customer question number {n}"},
        ],
    }


async def post(client: ProxyClient, body: dict[str, Any]) -> None:
    async with client.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        await resp.read()


async def test_shared_system_prompt_burst_spreads(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """Once most traffic carries the system prompt, matching it is not affinity: a burst of
    different questions spreads over the replicas instead of piling onto the one that has it."""
    fakes = [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]
    client, records, app = await fleet_proxy(make_proxy, *fakes)
    warm = 20
    for n in range(warm):  # steady traffic: every request carries the same system prompt
        await post(client, ask(n))
    await records.wait(warm)
    await app[STATE].writer.drain()
    for f in fakes:
        f.knobs = Knobs(header_delay_s=0.3)
    burst = 8
    await asyncio.gather(*(post(client, ask(warm + n)) for n in range(burst)))
    await records.wait(warm + burst)
    late = records[warm:]
    counts = sorted(sum(r.backend == f.url for r in late) for f in fakes)
    assert counts == [4, 4]
    assert {r.route_reason for r in late} == {"miss"}
    holder = records[0].backend  # it has held the system prompt since the first request
    assert all(r.prefix_matched_blocks >= 8 for r in late if r.backend == holder)


DOCUMENT = "Attached report for the sub-agents. " + " ".join(f"finding-{i}" for i in range(400))


async def test_related_burst_arriving_together_lands_together(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """An agent fans out: six requests carrying the same new document arrive at once. The
    first one's claim is visible to the next lookups before any store write lands, so all six
    go where the first went (1 miss, 5 affinity) instead of splitting 3 and 3."""
    fakes = [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]
    for f in fakes:
        f.knobs = Knobs(header_delay_s=0.3)
    client, records, _ = await fleet_proxy(make_proxy, *fakes)

    def subtask(n: int) -> dict[str, Any]:
        return {
            "model": "fake-model",
            "messages": [
                {"role": "system", "content": DOCUMENT},
                {"role": "user", "content": f"sub-task {n}: summarise section {n}"},
            ],
        }

    await asyncio.gather(*(post(client, subtask(n)) for n in range(6)))
    await records.wait(6)
    assert len({r.backend for r in records}) == 1
    reasons = sorted(r.route_reason for r in records)
    assert reasons == ["affinity"] * 5 + ["miss"]
