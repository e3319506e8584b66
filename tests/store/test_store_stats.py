"""Statistics and top prefixes, pinned on both stores: round trip, windows, filters, ranking."""

from __future__ import annotations

import random
import time
from typing import Any

import orjson
import pytest
from redis_process import RELAXED, RedisServer, StoreFactory

from proxy.store import EmbeddedStore, PrefixStore, RedisStore, StatsSample, StoreOptions

NOW = time.time()
BASE = (int(NOW) // 3600 - 12) * 3600  # an hour boundary 11 to 12 hours ago


def sample(ts: float, **fields: Any) -> StatsSample:
    values: dict[str, Any] = {
        "namespace": "default",
        "model": "m1",
        "backend": "b1",
        "status": 200,
        "error": False,
    }
    values.update(fields)
    return StatsSample(ts=ts, **values)


FOUR = [
    sample(
        BASE + 10,
        prompt_tokens=1000,
        cached_tokens=800,
        predicted_cached_tokens=900,
        completion_tokens=10,
        ttft_ms=50.0,
        tpot_ms=10.0,
        e2e_ms=200.0,
        slo_met=True,
        saved_prefill_ms=30.0,
        saved_usd=0.001,
        canonical_rules=["json_keys"],
    ),
    sample(
        BASE + 20,
        prompt_tokens=3000,
        cached_tokens=0,
        predicted_cached_tokens=0,
        completion_tokens=20,
        ttft_ms=400.0,
        slo_met=False,
        canonical_rules=["json_keys", "volatile"],
    ),
    sample(BASE + 30, status=502, error=True, e2e_ms=5.0, slo_met=False),
    sample(BASE + 40, prompt_tokens=1000, predicted_cached_tokens=500, ttft_ms=60.0),
]


async def test_totals_round_trip(store: PrefixStore) -> None:
    """Sums, both hit rates, prediction error, goodput, savings and rules come back exact."""
    for s in FOUR:
        await store.add_stats(s)
    w = await store.query_stats(since_s=BASE, until_s=BASE + 60)
    assert w.requests == 4
    assert w.error_rate == 0.25
    assert w.hit_rate_token_weighted == pytest.approx(800 / 4000)
    assert w.hit_rate_per_request_mean == pytest.approx(0.4)
    assert w.predicted_hit_rate == pytest.approx(1400 / 5000)
    assert w.prediction_mae_tokens == pytest.approx(50.0)
    assert w.goodput_share == pytest.approx(1 / 3)
    totals = w.to_json()["totals"]
    assert totals["prompt_tokens"] == 5000
    assert totals["cached_reported_requests"] == 2
    assert totals["predicted_requests"] == 3
    assert totals["prediction_mae_points"] == pytest.approx(5.0)
    assert totals["completion_tokens"] == 30
    assert totals["saved_prefill_ms"] == pytest.approx(30.0)
    assert totals["saved_usd"] == pytest.approx(0.001)
    assert totals["rules"] == {"json_keys": 2, "volatile": 1}
    assert totals["latency_ms"]["ttft"]["count"] == 3
    assert totals["latency_ms"]["ttft"]["mean"] == pytest.approx(170.0)
    assert totals["latency_ms"]["ttfvt"]["count"] == 0
    assert totals["latency_ms"]["ttfvt"]["p50"] is None


async def test_percentiles_from_histograms(store: PrefixStore) -> None:
    """p50/p90/p99 land within a bucket's width of the true values."""
    for i in range(1, 101):
        await store.add_stats(sample(BASE + 5, ttft_ms=float(i), e2e_ms=10.0 * i))
    w = await store.query_stats(since_s=BASE, until_s=BASE + 60)
    for q, true in ((0.5, 50.0), (0.9, 90.0), (0.99, 99.0)):
        ttft = w.percentile("ttft", q)
        e2e = w.percentile("e2e", q)
        assert ttft is not None and abs(ttft - true) <= 0.25 * true
        assert e2e is not None and abs(e2e - 10 * true) <= 0.25 * 10 * true


async def test_minute_window_and_series(store: PrefixStore) -> None:
    """A short window reads whole minutes and charts one point a minute."""
    for k in range(10):
        await store.add_stats(sample(BASE + 60 * k + 5, prompt_tokens=100 * (k + 1)))
    w = await store.query_stats(since_s=BASE + 150, until_s=BASE + 300)
    assert (w.since_s, w.until_s, w.resolution_s) == (BASE + 120, BASE + 300, 60)
    assert w.requests == 3
    assert w.to_json()["totals"]["prompt_tokens"] == 300 + 400 + 500
    series = w.to_json()["series"]
    assert [p["ts"] for p in series] == [BASE + 120, BASE + 180, BASE + 240]
    assert [p["requests"] for p in series] == [1, 1, 1]
    empty = await store.query_stats(since_s=BASE + 3000, until_s=BASE + 3120)
    assert empty.requests == 0 and len(empty.series) == 2


async def test_long_window_uses_hour_rollups_and_exact_edges(store: PrefixStore) -> None:
    """Past six hours the series is hourly, and the window's edges still count minute by minute."""
    await store.add_stats(sample(BASE + 600))  # same hour as the window's start, before it
    for h in range(12):
        await store.add_stats(sample(BASE + h * 3600 + 1800, prompt_tokens=10))
    w = await store.query_stats(since_s=BASE + 1800, until_s=BASE + 11 * 3600 + 1800)
    assert w.resolution_s == 3600
    assert w.requests == 11
    assert w.to_json()["totals"]["prompt_tokens"] == 110
    points = w.to_json()["series"]
    assert [p["ts"] for p in points] == [BASE + h * 3600 for h in range(12)]
    assert [p["requests"] for p in points] == [1] * 11 + [0]


async def test_filters_and_breakdowns(store: PrefixStore) -> None:
    """Filtering by model or backend narrows the totals; breakdowns split them."""
    await store.add_stats(sample(BASE + 1, model="m1", backend="b1", prompt_tokens=1))
    await store.add_stats(sample(BASE + 2, model="m1", backend="b2", prompt_tokens=2))
    await store.add_stats(sample(BASE + 3, model="org/m|2", backend="b2", prompt_tokens=4))
    w = await store.query_stats(since_s=BASE, until_s=BASE + 60)
    doc = w.to_json()
    assert {k: v["prompt_tokens"] for k, v in doc["by_model"].items()} == {"m1": 3, "org/m|2": 4}
    assert {k: v["prompt_tokens"] for k, v in doc["by_backend"].items()} == {"b1": 1, "b2": 6}
    only = await store.query_stats(since_s=BASE, until_s=BASE + 60, model="org/m|2")
    assert only.requests == 1
    both = await store.query_stats(since_s=BASE, until_s=BASE + 60, model="m1", backend="b2")
    assert both.to_json()["totals"]["prompt_tokens"] == 2
    assert both.to_json()["filters"] == {"model": "m1", "backend": "b2"}


async def test_namespaces_keep_separate_stats(store: PrefixStore) -> None:
    """One tenant's requests never show in another tenant's window."""
    await store.add_stats(sample(BASE + 1, namespace="t1", prefix_anchor="aa", prompt_tokens=5))
    assert (await store.query_stats(since_s=BASE, until_s=BASE + 60, namespace="t1")).requests == 1
    assert (await store.query_stats(since_s=BASE, until_s=BASE + 60, namespace="t2")).requests == 0
    assert (await store.query_stats(since_s=BASE, until_s=BASE + 60)).requests == 0
    assert await store.top_prefixes(since_s=BASE, namespace="t2") == []
    assert [p.anchor for p in await store.top_prefixes(since_s=BASE, namespace="t1")] == ["aa"]


async def test_stats_past_retention_are_dropped(make_store: StoreFactory) -> None:
    """A sample older than the retention is not kept; a recent one is."""
    store = await make_store(stats_retention_s=3600)
    await store.add_stats(sample(NOW - 3 * 3600, prompt_tokens=1))
    await store.add_stats(sample(NOW - 60, prompt_tokens=2))
    w = await store.query_stats(since_s=NOW - 4 * 3600)
    assert w.requests == 1
    assert w.to_json()["totals"]["prompt_tokens"] == 2


async def test_window_json_is_serializable(store: PrefixStore) -> None:
    """``to_json`` is plain JSON with totals, series and breakdowns."""
    for s in FOUR:
        await store.add_stats(s)
    doc = (await store.query_stats(since_s=BASE, until_s=BASE + 120)).to_json()
    assert set(doc) == {
        "namespace",
        "since",
        "until",
        "resolution_s",
        "filters",
        "totals",
        "series",
        "by_model",
        "by_backend",
    }
    assert orjson.loads(orjson.dumps(doc)) == doc
    assert len(doc["series"]) == 2


async def test_top_prefixes_rank_by_tokens(store: PrefixStore) -> None:
    """Anchors rank by prompt tokens served, with requests, measured hit rate and label."""
    for _ in range(3):
        await store.add_stats(
            sample(BASE + 1, prefix_anchor="aa", prompt_tokens=1000, cached_tokens=500)
        )
    await store.add_stats(sample(BASE + 2, prefix_anchor="bb", prompt_tokens=5000))
    await store.add_stats(sample(BASE + 3600 + 9, prefix_anchor="aa", prefix_label="support bot"))
    await store.add_stats(sample(BASE + 4, prefix_anchor="cc", prompt_tokens=100))
    await store.add_stats(sample(BASE + 5, prompt_tokens=9999))  # no anchor: not ranked
    top = await store.top_prefixes(since_s=BASE, limit=2)
    assert [p.anchor for p in top] == ["bb", "aa"]
    aa = top[1]
    assert (aa.requests, aa.prompt_tokens, aa.cached_tokens) == (4, 3000, 1500)
    assert aa.hit_rate == pytest.approx(0.5)
    assert aa.label == "support bot"
    assert aa.last_seen_s == pytest.approx(BASE + 3600 + 9)
    assert top[0].hit_rate is None
    assert top[0].to_json()["anchor"] == "bb"
    later = await store.top_prefixes(since_s=BASE + 3600)
    assert [(p.anchor, p.requests) for p in later] == [("aa", 1)]


async def test_top_prefixes_are_trimmed_per_hour(make_store: StoreFactory) -> None:
    """Past the cap, the anchors that served the fewest tokens are dropped."""
    store = await make_store(top_prefixes_cap=3)
    for i, anchor in enumerate(["a1", "a2", "a3", "a4", "a5"]):
        await store.add_stats(sample(BASE + i, prefix_anchor=anchor, prompt_tokens=10 * (i + 1)))
    top = await store.top_prefixes(since_s=BASE, limit=10)
    assert [(p.anchor, p.prompt_tokens) for p in top] == [("a5", 50), ("a4", 40), ("a3", 30)]


@pytest.mark.redis
async def test_two_clients_share_stats(redis_server: RedisServer) -> None:
    """Statistics written by one proxy are read by another."""
    redis_server.flush()
    one = RedisStore.from_url(redis_server.url, StoreOptions(timeouts=RELAXED))
    two = RedisStore.from_url(redis_server.url, StoreOptions(timeouts=RELAXED))
    try:
        await one.add_stats(sample(BASE + 1, prompt_tokens=7, prefix_anchor="aa"))
        await two.add_stats(sample(BASE + 2, prompt_tokens=8, prefix_anchor="aa"))
        w = await one.query_stats(since_s=BASE, until_s=BASE + 60)
        assert w.to_json()["totals"]["prompt_tokens"] == 15
        assert [(p.anchor, p.requests) for p in await two.top_prefixes(since_s=BASE)] == [("aa", 2)]
    finally:
        await one.aclose()
        await two.aclose()


@pytest.mark.redis
async def test_both_stores_report_the_same_numbers(redis_server: RedisServer) -> None:
    """The same samples give the same window and ranking, embedded or in Redis."""
    redis_server.flush()
    rng = random.Random(7)
    samples = []
    for i in range(300):
        prompt = rng.choice([None, 0, 50, 900, 4000])
        samples.append(
            sample(
                BASE + rng.uniform(0, 9 * 3600),
                model=rng.choice(["m1", "m2"]),
                backend=rng.choice(["b1", "b2", "b3"]),
                error=rng.random() < 0.1,
                prompt_tokens=prompt,
                cached_tokens=rng.choice([None, 0, 40]) if prompt else None,
                predicted_cached_tokens=rng.choice([None, 0, 64, 128]),
                ttft_ms=rng.choice([None, rng.lognormvariate(4, 1)]),
                tpot_ms=rng.uniform(5, 40),
                e2e_ms=rng.uniform(10, 200_000),
                slo_met=rng.choice([None, True, False]),
                saved_usd=rng.choice([None, 0.0001 * i]),
                canonical_rules=rng.sample(["a", "b", "c"], rng.randint(0, 2)),
                prefix_anchor=rng.choice([None, "a1", "a2", "a3"]),
                prefix_label=rng.choice([None, "bot"]),
            )
        )
    embedded = EmbeddedStore(StoreOptions())
    shared = RedisStore.from_url(redis_server.url, StoreOptions(timeouts=RELAXED))
    try:
        for s in samples:
            await embedded.add_stats(s)
            await shared.add_stats(s)
        for since, until in ((BASE, BASE + 9 * 3600), (BASE + 1234, BASE + 5000)):
            a = await embedded.query_stats(since_s=since, until_s=until)
            b = await shared.query_stats(since_s=since, until_s=until)
            assert a.to_json() == b.to_json()
        top_a = await embedded.top_prefixes(since_s=BASE, limit=3)
        top_b = await shared.top_prefixes(since_s=BASE, limit=3)
        assert [p.to_json() for p in top_a] == [p.to_json() for p in top_b]
        assert shared.degraded is False
    finally:
        await embedded.aclose()
        await shared.aclose()
