"""Two real llama-server replicas behind one proxy: round-robin against prefix-affinity.

The same multi-conversation workload (distinct ~300-token system prompts, several turns each,
interleaved, a few requests at a time) runs once per policy, each with its own conversations
so neither run finds the other's prompts cached. What the backends *report* as cached prompt
tokens, and the time to first token seen at the proxy, are compared and printed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from fakes import RecordLog

from proxy.app import build_app
from proxy.backend_metrics import SOURCES
from proxy.config import BackendSpec, HealthChecks, resolve
from proxy.log import get_logger
from proxy.record_writer import RecordWriter
from proxy.records import RequestRecord
from proxy.routing import RoutingConfig
from proxy.state import STATE
from tests.integration.llama import running_llama_server

pytestmark = [pytest.mark.real, pytest.mark.timeout(420)]

CONVERSATIONS = 7  # odd: round-robin cannot pin conversations to replicas by accident
TURNS = 4
CONCURRENCY = 3
MAX_TOKENS = 8
WORDS = [
    *("order", "refund", "parcel", "invoice", "account", "shipping", "warranty", "return"),
    *("policy", "customer", "store", "item", "receipt", "exchange", "delivery", "address"),
    *("payment", "card", "balance", "discount", "voucher", "support", "ticket", "manager"),
    *("region", "product", "battery", "charger", "screen", "keyboard", "cable", "adapter"),
]


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[str, str]]:
    """Two llama-server replicas splitting the machine's cores."""
    threads = max((os.cpu_count() or 2) // 2, 1)
    with ExitStack() as stack:
        a = stack.enter_context(running_llama_server(slots=2, ctx=4096, threads=threads))
        b = stack.enter_context(running_llama_server(slots=2, ctx=4096, threads=threads))
        yield a, b


def system_prompt(rng: random.Random, n: int) -> str:
    """About 300 tokens of instructions, different for every conversation from the first word."""
    rules = [
        f"Rule {i}: when a customer asks about the {rng.choice(WORDS)} or the "
        f"{rng.choice(WORDS)}, check the {rng.choice(WORDS)} first."
        for i in range(1, 15)
    ]
    return f"Desk {n}-{rng.randrange(10**6)} assistant. " + " ".join(rules)


def conversation(system: str, turn: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}]
    for t in range(turn):
        if t:
            messages.append({"role": "assistant", "content": f"Noted, step {t} is done."})
        messages.append({"role": "user", "content": f"Question {t + 1}: what should I do next?"})
    return messages


async def run_workload(
    urls: tuple[str, str], policy: str, seed: str
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Serve the workload through a proxy with ``policy``; the records and fleet facts."""
    writer = RecordWriter(logger=get_logger("test.records"))
    records = RecordLog.of(writer)
    settings = dataclasses.replace(
        resolve({"backend": list(urls)}, environ={}),
        backends=tuple(BackendSpec(url=u) for u in urls),
        routing=RoutingConfig(policy=policy),
        health=HealthChecks(interval_s=1.0),
    )
    app = build_app(settings, writer=writer)
    server = TestServer(app)
    await server.start_server()
    rng = random.Random(seed)
    systems = [system_prompt(rng, n) for n in range(CONVERSATIONS)]
    gate = asyncio.Semaphore(CONCURRENCY)
    base = str(server.make_url("/v1/chat/completions"))
    try:
        async with aiohttp.ClientSession() as session:

            async def talk(n: int) -> None:
                for turn in range(1, TURNS + 1):
                    body = {
                        "model": "smollm2",
                        "messages": conversation(systems[n], turn),
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "stream": True,
                    }
                    async with gate, session.post(base, json=body) as resp:
                        assert resp.status == 200
                        await resp.read()

            t0 = time.monotonic()
            await asyncio.gather(*(talk(n) for n in range(CONVERSATIONS)))
            wall_s = time.monotonic() - t0
            await writer.drain()
            fleet = app[STATE].fleet
            await fleet.check_all()
            facts = {
                "loads": {r.url: r.backend_load for r in fleet.replicas},
                "healthy": fleet.readiness(),
                "wall_s": wall_s,
            }
    finally:
        await server.close()
    return records, facts


def summary(records: list[RequestRecord]) -> dict[str, float]:
    prompt = sum(r.prompt_tokens or 0 for r in records)
    cached = sum(r.cached_tokens or 0 for r in records)
    later = [r for r in records if (r.prompt_tokens or 0) > 0]
    ttfts = [r.ttft_ms for r in later if r.ttft_ms is not None]
    return {
        "requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": cached / prompt if prompt else 0.0,
        "ttft_p50_ms": statistics.median(ttfts),
        "ttft_mean_ms": statistics.fmean(ttfts),
    }


async def test_affinity_beats_round_robin_on_cached_tokens(replicas: tuple[str, str]) -> None:
    """Prefix-affinity keeps each conversation on the replica that holds it: the backends report
    a clearly larger share of cached prompt tokens than under round-robin."""
    rr_records, rr_facts = await run_workload(replicas, "round-robin", seed="rr")
    aff_records, facts = await run_workload(replicas, "prefix-affinity", seed="aff")
    rr, aff = summary(rr_records), summary(aff_records)
    print(f"\nrouting on 2 llama-server replicas, {CONVERSATIONS} conversations x {TURNS} turns")
    for name, s, f in (("round-robin", rr, rr_facts), ("prefix-affinity", aff, facts)):
        print(
            f"{name:>16}: cached {s['cached_tokens']:.0f}/{s['prompt_tokens']:.0f} prompt tokens "
            f"= {s['cached_share']:.1%}; TTFT p50 {s['ttft_p50_ms']:.0f} ms, "
            f"mean {s['ttft_mean_ms']:.0f} ms; workload {f['wall_s']:.1f} s"
        )
    reasons = [r.route_reason for r in aff_records]
    print(f"  affinity route reasons: { {x: reasons.count(x) for x in sorted(set(reasons))} }")
    for name, recs in (("round-robin", rr_records), ("prefix-affinity", aff_records)):
        per = [sum(r.backend == u for r in recs) for u in replicas]
        print(f"  {name} requests per replica: {per}")

    for recs in (rr_records, aff_records):
        assert len(recs) == CONVERSATIONS * TURNS
        assert all(r.status == 200 and r.error is None for r in recs)
        assert all(r.cached_tokens_source == "reported" for r in recs)
    assert {r.backend for r in rr_records} == set(replicas)
    assert {r.backend for r in aff_records} == set(replicas)
    assert reasons.count("affinity") >= CONVERSATIONS * (TURNS - 1) - 2
    assert aff["cached_share"] >= rr["cached_share"] + 0.10
    # The real /slots answer was read as each replica's own load.
    assert all(load is not None and load.source == "/slots" for load in facts["loads"].values())
    assert all(facts["healthy"].values())


async def test_real_metrics_page_parses(replicas: tuple[str, str]) -> None:
    """llama-server's own /metrics page (started with --metrics) yields its load gauges."""
    source = SOURCES["llamacpp"][1]
    async with aiohttp.ClientSession() as session, session.get(replicas[0] + source.path) as resp:
        assert resp.status == 200
        load = source.read(await resp.read())
    assert load is not None and load.source == "/metrics" and load.total >= 0
