"""Coalescing through the proxy, against a vLLM fake whose prefix cache costs what vLLM's does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fakes import ApcVllmFake, Knobs, MakeProxy, ProxyClient, serve

from proxy.scheduling import SchedulingConfig
from proxy.state import STATE

SYSTEM = " ".join(f"clause{i} the tenant agrees to section {i} of the lease." for i in range(50))
PREFIX_WORDS = len(SYSTEM.split())


def chat(system: str, question: str, *, stream: bool = True) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "stream": stream,
    }


async def post_all(client: ProxyClient, bodies: list[dict[str, Any]]) -> None:
    async def one(body: dict[str, Any]) -> None:
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        await resp.read()

    await asyncio.gather(*(one(b) for b in bodies))


@pytest.fixture
async def apc_fake(aiohttp_server: Any) -> ApcVllmFake:
    """vLLM with automatic prefix caching: 0.3 ms per computed word, prefills share compute."""
    return await serve(ApcVllmFake(Knobs(prefill_ms_per_token=0.3)), aiohttp_server)


async def test_concurrent_requests_compute_a_shared_prefix_once(
    apc_fake: ApcVllmFake, make_proxy: MakeProxy
) -> None:
    """Followers wait for the leader's first token, then find the prefix cached."""
    client, records, _ = await make_proxy(apc_fake.url)
    await post_all(client, [chat(SYSTEM, f"question {i}?") for i in range(3)])
    await records.wait(3)
    assert apc_fake.computed_tokens <= 1.5 * PREFIX_WORDS
    reasons = sorted(r.schedule_reason for r in records)
    assert reasons == ["coalesced", "coalesced", "lead"]
    held = sorted(r.held_ms for r in records)
    assert held[0] == 0.0 and held[1] > 0.0
    followers = [r for r in records if r.schedule_reason == "coalesced"]
    assert all(r.cached_tokens and r.cached_tokens >= PREFIX_WORDS - 16 for r in followers)
    assert all(r.proxy_overhead_ms < r.held_ms for r in followers)


async def test_a_follower_arriving_after_the_claim_landed_still_waits(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """Routing claims the leader's blocks in the index as soon as it is sent; a follower that
    arrives once that claim is stored must still see those blocks as being prefilled, not as
    cached, and wait for them."""
    fake = await serve(ApcVllmFake(Knobs(prefill_ms_per_token=1.0)), aiohttp_server)
    client, records, app = await make_proxy(fake.url)

    async def follower() -> None:
        await asyncio.sleep(0.15)  # the leader's ~0.5 s prefill is under way, its claim stored
        await app[STATE].writer.drain()
        await post_all(client, [chat(SYSTEM, "question 1?")])

    await asyncio.gather(post_all(client, [chat(SYSTEM, "question 0?")]), follower())
    await records.wait(2)
    assert fake.computed_tokens <= 1.5 * PREFIX_WORDS
    assert sorted(r.schedule_reason for r in records) == ["coalesced", "lead"]


async def test_without_coalescing_every_request_computes_the_prefix(
    apc_fake: ApcVllmFake, make_proxy: MakeProxy
) -> None:
    """``--coalesce off``: the burst is sent at once and each request pays for every block."""
    client, records, _ = await make_proxy(apc_fake.url, scheduling=SchedulingConfig(coalesce=False))
    await post_all(client, [chat(SYSTEM, f"question {i}?") for i in range(3)])
    await records.wait(3)
    assert apc_fake.computed_tokens >= 2.9 * PREFIX_WORDS
    assert all(r.schedule_reason is None for r in records)


async def test_hold_is_bounded_by_the_maximum_wait(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """A leader slower than the maximum wait releases its followers at the bound."""
    fake = await serve(ApcVllmFake(Knobs(prefill_ms_per_token=1.0)), aiohttp_server)
    client, records, _ = await make_proxy(
        fake.url, scheduling=SchedulingConfig(coalesce_max_wait_ms=30.0)
    )
    await post_all(client, [chat(SYSTEM, f"question {i}?") for i in range(2)])
    await records.wait(2)
    follower = next(r for r in records if r.schedule_reason != "lead")
    assert follower.schedule_reason == "coalesce_timeout"
    assert 25.0 <= follower.held_ms < 400.0


async def test_short_shared_prefix_is_not_worth_a_wait(
    apc_fake: ApcVllmFake, make_proxy: MakeProxy
) -> None:
    """Requests sharing less than the minimum prefix are sent at once."""
    client, records, _ = await make_proxy(apc_fake.url)
    short = "You are helpful."
    await post_all(client, [chat(short, f"{i} " + SYSTEM) for i in range(2)])
    await records.wait(2)
    assert [r.schedule_reason for r in records] == ["lead", "lead"]
    assert all(r.held_ms == 0.0 for r in records)


async def test_failed_leader_releases_its_followers(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """A leader that fails before its first token does not keep followers waiting."""
    fake = await serve(ApcVllmFake(Knobs(prefill_ms_per_token=0.3)), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)
    fake.knobs.fail_after = 0  # every stream fails before its first token
    bodies = [chat(SYSTEM, f"question {i}?") for i in range(2)]
    await post_all(client, bodies)
    await records.wait(2)
    follower = next(r for r in records if r.schedule_reason != "lead")
    assert follower.held_ms < 1000.0


async def test_non_streamed_leader_releases_followers_after_its_expected_prefill(
    apc_fake: ApcVllmFake, make_proxy: MakeProxy
) -> None:
    """A leader without a visible first token holds followers for its estimated prefill only."""
    client, records, _ = await make_proxy(
        apc_fake.url, scheduling=SchedulingConfig(coalesce_max_wait_ms=10_000.0)
    )
    await post_all(client, [chat(SYSTEM, f"question {i}?", stream=False) for i in range(2)])
    await records.wait(2)
    follower = next(r for r in records if r.schedule_reason != "lead")
    assert follower.schedule_reason == "coalesced"
    assert follower.held_ms < 2000.0


async def test_decisions_are_counted_in_stats_and_metrics(
    apc_fake: ApcVllmFake, make_proxy: MakeProxy
) -> None:
    """``/stats`` counts ``schedule:<reason>``; ``/metrics`` has the decisions and held time."""
    client, records, app = await make_proxy(apc_fake.url)
    await post_all(client, [chat(SYSTEM, f"question {i}?") for i in range(3)])
    await records.wait(3)
    await app[STATE].writer.drain()
    async with client.admin.get("/stats?window=5m") as resp:
        stats = await resp.json()
    assert stats["totals"]["schedules"] == {"coalesced": 2, "lead": 1}
    async with client.admin.get("/metrics") as resp:
        text = await resp.text()
    backend = apc_fake.url
    assert (
        f'prefixgate_schedule_decisions_total{{backend="{backend}",reason="coalesced"}} 2.0' in text
    )
    assert f'prefixgate_held_seconds_count{{backend="{backend}"}} 2.0' in text
