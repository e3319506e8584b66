"""Traffic for the admin tests: a few application prompts, repeated questions, an error.

Each application has its own system prompt, so the fake backend serves its later requests
largely from cache (the fakes model prompt caching as longest common word prefix) and the
statistics have real hits, misses, an upstream error and a canonicalization rule to show.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web
from fakes import FakeBackend, MakeProxy, ProxyClient, RecordLog

from proxy.records import Pricing, RequestRecord, Slo
from proxy.state import STATE

APPS: dict[str, str] = {
    "support": "You are the Acme help desk. Answer briefly and politely. " * 6,
    "coder": "You are a careful senior engineer reviewing Python code for bugs. " * 8,
    # The date makes the canonicalizer's volatile_timestamps rule fire on every request.
    "planner": "You plan meetings. Today is 2026-11-30T09:41:00Z. Be concise. " * 4,
}


def chat(
    app: str, question: str, *, model: str = "fake-model", stream: bool = False
) -> dict[str, Any]:
    """A chat request of application ``app``."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "system", "content": APPS[app]},
            {"role": "user", "content": question},
        ],
    }
    if stream:
        body["stream"] = True
    return body


def mixed_requests(per_app: int = 3) -> list[dict[str, Any]]:
    """``per_app`` questions for each application, every second one streamed."""
    out: list[dict[str, Any]] = []
    for app in APPS:
        for i in range(per_app):
            out.append(chat(app, f"question number {i} about {app}?", stream=i % 2 == 1))
    return out


async def send_all(
    client: ProxyClient, records: RecordLog, app: web.Application, bodies: Sequence[dict[str, Any]]
) -> list[RequestRecord]:
    """Send ``bodies`` one after another; return once their records and statistics are written."""
    start = len(records)
    for body in bodies:
        async with client.post("/v1/chat/completions", json=body) as resp:
            await resp.read()
    await records.wait(start + len(bodies))
    await app[STATE].writer.drain()
    return list(records[start:])


async def traffic_with_an_error(
    fake: FakeBackend, make_proxy: MakeProxy, rejected: dict[str, Any]
) -> tuple[ProxyClient, list[RequestRecord]]:
    """A proxy with an SLO and prices in front of ``fake``, after ``mixed_requests`` and then
    ``rejected``, which the backend answers 400; the client and the records of all of them."""
    client, records, app = await make_proxy(
        fake.url,
        slo=Slo(ttft_ms=5000, tpot_ms=1000),
        pricing=Pricing(input_per_mtok=3.0, cached_input_per_mtok=0.3),
    )
    recs = await send_all(client, records, app, mixed_requests())
    fake.knobs.reject_status = 400
    recs += await send_all(client, records, app, [rejected])
    return client, recs
