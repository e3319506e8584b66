"""GET /stats: the versioned schema under real traffic, windows, filters, bad parameters."""

from __future__ import annotations

import time
from typing import Any

import pytest
from admin_traffic import chat, mixed_requests, send_all, traffic_with_an_error
from fakes import LlamaFake, MakeProxy

from proxy.admin.stats import SCHEMA, WINDOWS
from proxy.state import STATE
from proxy.store import StatsSample

TOTAL_KEYS = {
    "requests",
    "errors",
    "error_rate",
    "prompt_tokens",
    "cached_tokens",
    "predicted_cached_tokens",
    "hit_rate_token_weighted",
    "hit_rate_per_request_mean",
    "predicted_hit_rate",
    "goodput_share",
    "saved_prefill_ms",
    "saved_usd",
    "rules",
    "latency_ms",
}
POINT_KEYS = {
    "ts",
    "requests",
    "hit_rate_token_weighted",
    "predicted_hit_rate",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p90_ms",
    "tpot_p99_ms",
    "slo_met",
    "slo_evaluated",
}


async def get_stats(client: Any, query: str = "", status: int = 200, **headers: str) -> Any:
    async with client.get("/stats" + query, headers=headers) as resp:
        assert resp.status == status, (await resp.text())[:300]
        assert resp.content_type == "application/json"
        return await resp.json()


async def test_schema_under_traffic(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """Every contract key is present and the totals add up to the records the proxy wrote."""
    client, recs = await traffic_with_an_error(llama_fake, make_proxy, chat("support", "rejected?"))

    body = await get_stats(client)
    assert body["schema"] == SCHEMA == "prefixgate.stats/v1"
    assert body["window"] == "1h" and body["namespace"] == "default"
    assert abs(body["generated_at"] - time.time()) < 60
    assert body["filters"] == {"model": None, "backend": None}
    assert body["resolution_s"] == 60 and body["until"] - body["since"] >= 3600
    totals = body["totals"]
    assert set(totals) >= TOTAL_KEYS
    assert totals["requests"] == len(recs) == 10
    assert totals["errors"] == 1 and totals["error_rate"] == pytest.approx(0.1)
    prompt = sum(r.prompt_tokens or 0 for r in recs)
    cached = sum(r.cached_tokens or 0 for r in recs)
    assert totals["prompt_tokens"] == prompt
    assert totals["cached_tokens"] == cached > 0
    reported = sum(r.prompt_tokens or 0 for r in recs if r.cached_tokens is not None)
    assert totals["hit_rate_token_weighted"] == pytest.approx(cached / reported, abs=1e-4)
    assert totals["predicted_cached_tokens"] == sum(
        r.predicted_cached_tokens or 0 for r in recs if r.prompt_tokens is not None
    )
    assert totals["rules"].get("volatile_timestamps") == 3  # the planner's three requests
    for metric in ("ttft", "ttfvt", "tpot", "e2e"):
        assert {"count", "mean", "p50", "p90", "p99"} <= set(totals["latency_ms"][metric])
    assert totals["latency_ms"]["ttft"]["count"] == sum(r.ttft_ms is not None for r in recs)

    met = sum(r.slo_met is True for r in recs)
    assert body["goodput"]["slo"] == {"ttft_ms": 5000, "tpot_ms": 1000}
    assert body["goodput"]["met"] == met and body["goodput"]["evaluated"] == 10
    assert body["goodput"]["share"] == pytest.approx(met / 10, abs=1e-4)
    assert body["goodput"]["rate_per_s"] > 0
    assert body["savings"]["cached_tokens"] == cached
    assert body["savings"]["usd"] == pytest.approx(cached * 2.7 / 1e6, abs=1e-6)
    assert body["savings"]["prefill_s"] >= 0

    series = body["series"]
    assert len(series) in (60, 61)
    assert all(set(p) >= POINT_KEYS for p in series)
    assert sum(p["requests"] for p in series) == 10
    assert [p["ts"] for p in series] == sorted(p["ts"] for p in series)

    assert set(body["by_backend"]) == {llama_fake.url}
    assert set(body["by_model"]) == {"fake-model"}
    assert body["backends"][llama_fake.url]["in_flight"] == 0
    assert body["backends"][llama_fake.url]["healthy"] is True
    assert body["store"] == {"kind": "embedded", "degraded": False}
    tops = body["top_prefixes"]
    assert len(tops) == 3  # one application prefix per system prompt
    assert {"anchor", "requests", "prompt_tokens", "cached_tokens", "hit_rate", "last_seen"} <= set(
        tops[0]
    )
    assert sum(p["requests"] for p in tops) == 10
    assert tops[0]["prompt_tokens"] >= tops[-1]["prompt_tokens"]


@pytest.mark.parametrize(
    ("window", "resolution", "points"),
    [
        ("5m", 60, (5, 6)),
        ("1h", 60, (60, 61)),
        ("24h", 3600, (24, 25)),
        ("7d", 3600, (168, 169)),
    ],
)
async def test_windows(
    llama_fake: LlamaFake, make_proxy: MakeProxy, window: str, resolution: int, points: Any
) -> None:
    """Each window reads its span at its resolution; recent traffic is in every one of them."""
    client, records, app = await make_proxy(llama_fake.url)
    await send_all(client, records, app, [chat("coder", "q")])
    body = await get_stats(client, f"?window={window}")
    assert body["window"] == window and body["window_s"] == WINDOWS[window]
    assert body["resolution_s"] == resolution
    assert len(body["series"]) in points
    assert body["until"] - body["since"] >= WINDOWS[window]
    assert body["totals"]["requests"] == 1


async def test_older_traffic_only_in_longer_windows(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """A request two hours old counts in the 24 h and 7 d windows, not in 5 m or 1 h."""
    client, _, app = await make_proxy(llama_fake.url)
    await client.get("/healthz")  # the application has started: its store exists
    sample = StatsSample(
        ts=time.time() - 2 * 3600,
        namespace="default",
        model="old-model",
        backend=llama_fake.url,
        status=200,
        error=False,
        prompt_tokens=100,
        cached_tokens=80,
    )
    await app[STATE].store.add_stats(sample)
    counts = {}
    for window in WINDOWS:
        counts[window] = (await get_stats(client, f"?window={window}"))["totals"]["requests"]
    assert counts == {"5m": 0, "1h": 0, "24h": 1, "7d": 1}


async def test_model_and_backend_filters(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """model and backend narrow the totals, the series and the breakdowns; the filters echo."""
    client, records, app = await make_proxy(llama_fake.url)
    bodies = [chat("support", "a", model="m-one"), chat("support", "b", model="m-one")]
    bodies.append(chat("coder", "c", model="m-two"))
    await send_all(client, records, app, bodies)

    one = await get_stats(client, "?model=m-one")
    assert one["filters"] == {"model": "m-one", "backend": None}
    assert one["totals"]["requests"] == 2 and set(one["by_model"]) == {"m-one"}
    assert sum(p["requests"] for p in one["series"]) == 2
    assert (await get_stats(client, "?model=nobody"))["totals"]["requests"] == 0
    by_backend = await get_stats(client, f"?backend={llama_fake.url}&model=m-two")
    assert by_backend["totals"]["requests"] == 1
    other = await get_stats(client, "?backend=http://elsewhere:1")
    assert other["totals"]["requests"] == 0 and other["by_backend"] == {}


async def test_empty_proxy_answers_zeroes(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """Before any traffic: zero requests, null rates, an empty ranking, a full series."""
    client, _, _ = await make_proxy(llama_fake.url)
    body = await get_stats(client, "?window=5m")
    assert body["totals"]["requests"] == 0
    assert body["totals"]["hit_rate_token_weighted"] is None
    assert body["goodput"]["share"] is None
    assert body["top_prefixes"] == []
    assert all(p["requests"] == 0 for p in body["series"])


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("?window=2h", "window"),
        ("?window=", "window"),
        ("?windw=1h", "windw"),
        ("?model=", "model"),
        ("?top=0", "top"),
        ("?top=1000", "top"),
        ("?top=ten", "top"),
        ("?window=1h&window=5m", "window"),
        ("?backend=%00", "backend"),
    ],
)
async def test_bad_parameters_are_400(
    llama_fake: LlamaFake, make_proxy: MakeProxy, query: str, param: str
) -> None:
    """A bad or unknown parameter is a 400 in the OpenAI error shape naming the parameter."""
    client, _, _ = await make_proxy(llama_fake.url)
    body = await get_stats(client, query, status=400)
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param


async def test_top_limits_the_ranking(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """top=N returns at most N application prefixes, the largest first."""
    client, records, app = await make_proxy(llama_fake.url)
    await send_all(client, records, app, mixed_requests(per_app=1))
    body = await get_stats(client, "?top=2")
    assert len(body["top_prefixes"]) == 2
