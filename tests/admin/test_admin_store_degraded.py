"""The admin routes while the store fails: traffic served, /metrics and /stats say degraded.

The proxy is pointed at a Redis that is not there: a closed port (every call refused at once) or
a port that accepts connections and never answers (every call runs into its deadline). Requests
must still be served; ``/metrics`` shows ``prefixgate_store_degraded 1`` and the failures;
``/stats`` answers 200 with ``store.degraded: true`` and an empty window in the versioned schema,
quickly, instead of an error. The dashboard's side of it is in ``test_admin_dashboard.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from admin_traffic import mixed_requests, send_all
from fakes import LlamaFake, MakeProxy
from prometheus_client.parser import text_string_to_metric_families
from stats_schema import assert_valid

from proxy.config import Timeouts
from proxy.records import Pricing, Slo
from tests.ports import free_port

TIMEOUTS = Timeouts(connect=2, idle=5, store=0.05)


@pytest.fixture
async def silent_redis() -> AsyncIterator[str]:
    """A ``redis://`` URL whose server accepts connections and never answers a command."""
    writers: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while await reader.read(4096):
            pass

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"redis://127.0.0.1:{port}/0"
    server.close()
    for w in writers:
        w.close()
    await server.wait_closed()


@pytest.fixture(params=["refused", "silent"])
def failing_redis(request: pytest.FixtureRequest) -> str:
    if request.param == "refused":
        return f"redis://127.0.0.1:{free_port()}/0"
    url: str = request.getfixturevalue("silent_redis")
    return url


def metric(text: str, name: str) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    )


async def test_degraded_store_keeps_serving_and_says_so(
    llama_fake: LlamaFake, make_proxy: MakeProxy, failing_redis: str
) -> None:
    client, records, app = await make_proxy(
        llama_fake.url,
        redis_url=failing_redis,
        timeouts=TIMEOUTS,
        slo=Slo(ttft_ms=5000, tpot_ms=1000),
        pricing=Pricing(input_per_mtok=3.0, cached_input_per_mtok=0.3),
    )
    bodies = mixed_requests(per_app=2)
    recs = await send_all(client, records, app, bodies)
    assert [r.status for r in recs] == [200] * len(bodies)  # the traffic is served
    assert len(llama_fake.requests) == len(bodies)

    async with client.admin.get("/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert metric(text, "prefixgate_store_degraded") == 1
    assert metric(text, "prefixgate_store_failures_total") >= 1
    # /metrics is this process's own count: the requests are there even though the store is not.
    assert metric(text, "prefixgate_requests_total") == len(bodies)

    for query in ("", "?window=5m", f"?window=7d&backend={llama_fake.url}"):
        start = time.perf_counter()
        async with client.admin.get("/stats" + query) as resp:
            assert resp.status == 200, await resp.text()
            body: dict[str, Any] = await resp.json()
        # Bounded by the store's read deadline (2 s), which only the breaker's probe waits out.
        assert time.perf_counter() - start < 3.0
        assert_valid(body)
        assert body["store"] == {"kind": "redis", "degraded": True}
        assert body["totals"]["requests"] == 0  # what was written while Redis failed is lost
        assert body["totals"]["hit_rate_token_weighted"] is None
        assert body["top_prefixes"] == [] and body["by_backend"] == {}
        assert len(body["series"]) >= 5 and all(p["requests"] == 0 for p in body["series"])
        assert body["savings"] == {"cached_tokens": 0, "prefill_s": 0.0, "usd": 0.0}
        assert body["backends"][llama_fake.url]["healthy"] is True  # local view still there
