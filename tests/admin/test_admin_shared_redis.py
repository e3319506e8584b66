"""Two proxies sharing one Redis serve the same /stats, whichever one the traffic went through."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from admin_traffic import chat, mixed_requests, send_all
from fakes import LlamaFake, MakeProxy
from stats_schema import assert_valid

from proxy.config import Timeouts
from tests.store.redis_process import RedisServer

pytestmark = pytest.mark.redis

# Fields that are this process's own view, not the shared store's.
LOCAL = ("generated_at", "backends")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer()
    server.start()
    yield server
    server.kill()


def shared_part(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in LOCAL}


async def stats(client: Any, query: str) -> dict[str, Any]:
    async with client.admin.get("/stats" + query) as resp:
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
    assert_valid(body)  # the Redis store's document has the embedded store's schema
    return body


async def test_two_proxies_show_the_same_stats(
    llama_fake: LlamaFake, make_proxy: MakeProxy, redis_server: RedisServer
) -> None:
    """Traffic split over two proxies on one Redis: both report all of it, identically."""
    timeouts = Timeouts(connect=2, idle=5, store=0.25)
    client_a, records_a, app_a = await make_proxy(
        llama_fake.url, redis_url=redis_server.url, timeouts=timeouts
    )
    client_b, records_b, app_b = await make_proxy(
        llama_fake.url, redis_url=redis_server.url, timeouts=timeouts
    )
    bodies = mixed_requests()
    sent_a = await send_all(client_a, records_a, app_a, bodies[::2])
    sent_b = await send_all(client_b, records_b, app_b, bodies[1::2])
    sent_b += await send_all(client_b, records_b, app_b, [chat("coder", "one more")])
    sent = sent_a + sent_b

    queries = ("?window=5m", "?window=1h", "?window=24h", "?window=7d")
    queries += (f"?backend={llama_fake.url}", "?model=fake-model&window=5m")
    for query in queries:
        # A minute boundary between the two reads would shift the window; read again then.
        for _ in range(3):
            a, b = await stats(client_a, query), await stats(client_b, query)
            if a["since"] == b["since"] and a["until"] == b["until"]:
                break
        assert shared_part(a) == shared_part(b), query
        assert a["totals"]["requests"] == len(sent) == 10
        assert a["totals"]["prompt_tokens"] == sum(r.prompt_tokens or 0 for r in sent)
        assert a["totals"]["cached_tokens"] == sum(r.cached_tokens or 0 for r in sent)
        rates = [
            r.cached_tokens / r.prompt_tokens
            for r in sent
            if r.prompt_tokens and r.cached_tokens is not None
        ]
        assert a["totals"]["hit_rate_per_request_mean"] == pytest.approx(
            sum(rates) / len(rates), abs=1e-4
        )
        assert a["totals"]["saved_prefill_ms"] == pytest.approx(
            sum(r.saved_prefill_ms or 0 for r in sent), abs=1e-2
        )
        assert a["totals"]["latency_ms"]["e2e"]["count"] == len(sent)
        assert a["store"] == {"kind": "redis", "degraded": False}
        assert sum(p["requests"] for p in a["top_prefixes"]) == 10
