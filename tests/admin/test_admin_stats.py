"""GET /stats: the JSON Schema under real traffic, values, windows, filters, bad parameters.

Every document a test reads is validated against docs/schemas/stats-v1.schema.json, whose fixed
shapes list all their keys and allow no other: a key added to or dropped from /stats without the
schema following fails here.
"""

from __future__ import annotations

import copy
import math
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

import pytest
from admin_traffic import chat, mixed_requests, send_all, traffic_with_an_error
from fakes import LlamaFake, MakeProxy, fleet_proxy, serve
from stats_schema import assert_valid, object_schemas, schema, violations

from proxy.admin.stats import SCHEMA, WINDOWS
from proxy.backends import DIALECTS
from proxy.records import RequestRecord
from proxy.state import STATE
from proxy.store import LATENCY_BOUNDS_MS, StatsSample, Tally
from proxy.store.stats import LATENCY_METRICS

LATENCY_FIELDS = {"ttft": "ttft_ms", "ttfvt": "ttfvt_ms", "tpot": "tpot_ms", "e2e": "e2e_ms"}


async def get_stats(client: Any, query: str = "", status: int = 200, **headers: str) -> Any:
    async with client.admin.get("/stats" + query, headers=headers) as resp:
        assert resp.status == status, (await resp.text())[:300]
        assert resp.content_type == "application/json"
        body = await resp.json()
    if status == 200:
        assert_valid(body)
    return body


def bucket_bounds(value_ms: float) -> tuple[float, float]:
    """The (lower, upper) bounds of the statistics histogram bucket holding ``value_ms``."""
    i = bisect_left(LATENCY_BOUNDS_MS, value_ms)
    lo = LATENCY_BOUNDS_MS[i - 1] if i > 0 else 0.0
    hi = LATENCY_BOUNDS_MS[i] if i < len(LATENCY_BOUNDS_MS) else lo
    return lo, hi


def check_percentiles(latency: dict[str, Any], values: Sequence[float], name: str) -> None:
    """p50 <= p90 <= p99, each inside the histogram bucket of the true quantile of ``values``
    (the sample of rank ceil(q * n)), and the mean exact."""
    assert latency["count"] == len(values), name
    if not values:
        assert latency["mean"] is None and latency["p50"] is None, name
        return
    assert latency["mean"] == pytest.approx(sum(values) / len(values), abs=2e-3), name
    ordered = sorted(values)
    assert latency["p50"] <= latency["p90"] <= latency["p99"], (name, latency)
    for q in (0.5, 0.9, 0.99):
        true = ordered[max(math.ceil(q * len(ordered)) - 1, 0)]
        lo, hi = bucket_bounds(true)
        got = latency[f"p{round(q * 100)}"]
        assert lo - 1e-3 <= got <= hi + 1e-3, (name, q, got, true, (lo, hi))


def latencies(recs: Sequence[RequestRecord], metric: str) -> list[float]:
    out = [getattr(r, LATENCY_FIELDS[metric]) for r in recs]
    return [v for v in out if v is not None and math.isfinite(v) and v >= 0]


async def test_schema_under_traffic(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """The document validates, and its totals and derived figures equal what the records say."""
    client, recs = await traffic_with_an_error(llama_fake, make_proxy, chat("support", "rejected?"))

    body = await get_stats(client)
    assert body["schema"] == SCHEMA == "prefixgate.stats/v1"
    assert body["window"] == "1h" and body["namespace"] == "default"
    assert abs(body["generated_at"] - time.time()) < 60
    assert body["filters"] == {"model": None, "backend": None}
    assert body["resolution_s"] == 60 and body["until"] - body["since"] >= 3600
    totals = body["totals"]
    assert totals["requests"] == len(recs) == 10
    assert totals["errors"] == 1 and totals["error_rate"] == pytest.approx(0.1)
    prompt = sum(r.prompt_tokens or 0 for r in recs)
    cached = sum(r.cached_tokens or 0 for r in recs)
    assert totals["prompt_tokens"] == prompt
    assert totals["completion_tokens"] == sum(r.completion_tokens or 0 for r in recs)
    assert totals["cached_tokens"] == cached > 0
    reported = [r for r in recs if r.cached_tokens is not None and r.prompt_tokens is not None]
    assert totals["cached_reported_requests"] == len(reported) == 9
    assert totals["hit_rate_token_weighted"] == pytest.approx(
        cached / sum(r.prompt_tokens or 0 for r in reported), abs=1e-4
    )
    per_request = [(r.cached_tokens or 0) / r.prompt_tokens for r in reported if r.prompt_tokens]
    assert totals["hit_rate_per_request_mean"] == pytest.approx(
        sum(per_request) / len(per_request), abs=1e-4
    )
    predicted = [
        r for r in recs if r.predicted_cached_tokens is not None and r.prompt_tokens is not None
    ]
    assert totals["predicted_requests"] == len(predicted) > 0
    assert totals["predicted_cached_tokens"] == sum(
        r.predicted_cached_tokens or 0 for r in predicted
    )
    assert totals["predicted_hit_rate"] == pytest.approx(
        sum(r.predicted_cached_tokens or 0 for r in predicted)
        / sum(r.prompt_tokens or 0 for r in predicted),
        abs=1e-4,
    )
    both = [r for r in predicted if r.cached_tokens is not None]
    assert totals["prediction_mae_tokens"] == pytest.approx(
        sum(abs((r.predicted_cached_tokens or 0) - (r.cached_tokens or 0)) for r in both)
        / len(both),
        abs=0.01,
    )
    assert totals["rules"].get("volatile_timestamps") == 3  # the planner's three requests
    assert totals["routes"] == {"single": 10}  # one backend: every request routed "single"
    assert sum(totals["schedules"].values()) == sum(bool(r.schedule_reason) for r in recs)
    for metric in LATENCY_METRICS:
        check_percentiles(totals["latency_ms"][metric], latencies(recs, metric), metric)

    met = sum(r.slo_met is True for r in recs)
    assert body["goodput"]["slo"] == {"ttft_ms": 5000, "tpot_ms": 1000}
    assert body["goodput"]["met"] == met == 9 and body["goodput"]["evaluated"] == 10
    assert body["goodput"]["share"] == pytest.approx(met / 10, abs=1e-4)
    assert body["goodput"]["rate_per_s"] == pytest.approx(met / 3600, abs=1e-6)
    assert body["requests_per_s"] == pytest.approx(10 / 3600, abs=1e-6)
    assert body["savings"]["cached_tokens"] == cached
    assert body["savings"]["usd"] == pytest.approx(cached * 2.7 / 1e6, abs=1e-6)
    saved_ms = sum(r.saved_prefill_ms or 0 for r in recs)
    assert saved_ms > 0  # later requests hit the cache and the backend's prefill rate is known
    assert totals["saved_prefill_ms"] == pytest.approx(saved_ms, abs=1e-2)
    assert body["savings"]["prefill_s"] == pytest.approx(saved_ms / 1000, abs=1e-3)
    assert body["savings"]["prefill_s"] > 0

    series = body["series"]
    assert len(series) in (60, 61)
    assert sum(p["requests"] for p in series) == 10
    assert sum(p["cached_tokens"] for p in series) == cached
    assert sum(p["slo_met"] for p in series) == met
    assert [p["ts"] for p in series] == sorted(p["ts"] for p in series)
    for p in series:
        if p["ttft_p50_ms"] is not None:
            assert p["ttft_p50_ms"] <= p["ttft_p90_ms"] <= p["ttft_p99_ms"]
        if p["tpot_p50_ms"] is not None:
            assert p["tpot_p50_ms"] <= p["tpot_p90_ms"] <= p["tpot_p99_ms"]

    assert set(body["by_backend"]) == {llama_fake.url}
    assert set(body["by_model"]) == {"fake-model"}
    assert body["by_backend"][llama_fake.url] == totals == body["by_model"]["fake-model"]
    assert body["backends"][llama_fake.url]["in_flight"] == 0
    assert body["backends"][llama_fake.url]["healthy"] is True
    assert body["backends"][llama_fake.url]["dialect"] == "llamacpp"
    assert body["store"] == {"kind": "embedded", "degraded": False}
    tops = body["top_prefixes"]
    assert len(tops) == 3  # one application prefix per system prompt
    assert sum(p["requests"] for p in tops) == 10
    assert tops[0]["prompt_tokens"] >= tops[-1]["prompt_tokens"]
    assert all(p["label"] is None for p in tops)  # prompt logging is off


async def test_known_latencies(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """With the backend's pacing fixed, TTFT, TTFVT, TPOT and e2e land where the pacing puts them.

    Streams: the headers wait ``HEAD`` s, then one reasoning and three content tokens come
    ``GAP`` s apart, so TTFT ~ HEAD, TTFVT ~ HEAD + GAP, TPOT ~ GAP, e2e ~ HEAD + 3 GAP.
    """
    head, gap = 0.12, 0.04
    llama_fake.knobs.header_delay_s = head
    llama_fake.knobs.token_delay_s = gap
    llama_fake.knobs.reasoning = ["hmm"]
    llama_fake.knobs.tokens = ["a", " b", " c"]
    client, records, app = await make_proxy(llama_fake.url)
    bodies = [chat("coder", f"question {i}?", stream=True) for i in range(4)]
    recs = await send_all(client, records, app, bodies)
    lat = (await get_stats(client, "?window=5m"))["totals"]["latency_ms"]
    expected = {"ttft": head, "ttfvt": head + gap, "tpot": gap, "e2e": head + 3 * gap}
    for metric, seconds in expected.items():
        known = seconds * 1000
        summary = lat[metric]
        assert summary["count"] == 4, metric
        check_percentiles(summary, latencies(recs, metric), metric)
        # Latencies from arrival are never below the pacing; TPOT (a span between two tokens the
        # proxy saw) may be a little, when the first token was read late. The upper slack is for
        # a loaded 2-core machine; a unit error (s for ms) is still far outside it.
        assert 0.8 * known <= summary["mean"] <= known + 250, (metric, summary)
        lo, _ = bucket_bounds(0.8 * known)
        assert lo <= summary["p50"] <= summary["p99"] <= known * 1.3 + 250, (metric, summary)


async def test_two_backends_load_and_routes(aiohttp_server: Any, make_proxy: MakeProxy) -> None:
    """Two replicas: backends.<url>.load is the load the router sees, by_backend.<url>.routes
    counts the routing reasons of that replica's requests."""
    busy = await serve(LlamaFake(), aiohttp_server)
    idle = await serve(LlamaFake(), aiohttp_server)
    busy.serve_metrics, busy.load_running = True, 3
    client, records, app = await fleet_proxy(make_proxy, busy, idle, policy="round-robin")
    await app[STATE].fleet.check_all()  # reads busy's own /metrics: 3 requests processing
    recs = await send_all(client, records, app, [chat("coder", f"q{i}") for i in range(4)])
    assert {r.backend for r in recs} == {busy.url, idle.url}

    body = await get_stats(client)
    assert body["backends"][busy.url]["load"] == 3.0
    assert body["backends"][idle.url]["load"] == 0.0
    assert {b["dialect"] for b in body["backends"].values()} == {"llamacpp"}
    assert {b["weight"] for b in body["backends"].values()} == {1.0}
    per_backend = {url: sum(r.backend == url for r in recs) for url in (busy.url, idle.url)}
    for url, n in per_backend.items():
        assert body["by_backend"][url]["requests"] == n
        assert body["by_backend"][url]["routes"] == {"round_robin": n}
    assert body["totals"]["routes"] == {"round_robin": 4}

    only_idle = await get_stats(client, f"?backend={idle.url}")
    assert set(only_idle["by_backend"]) == {idle.url}
    assert only_idle["totals"]["routes"] == {"round_robin": per_backend[idle.url]}
    assert set(only_idle["backends"]) == {busy.url, idle.url}  # the local view is not filtered


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
    await client.admin.get("/healthz")  # the application has started: its store exists
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
    assert body["goodput"]["evaluated"] == 0 and body["goodput"]["rate_per_s"] == 0
    assert body["savings"] == {"cached_tokens": 0, "prefill_s": 0.0, "usd": None}  # no prices
    assert body["totals"]["latency_ms"]["ttft"] == {
        "count": 0,
        "mean": None,
        "p50": None,
        "p90": None,
        "p99": None,
    }
    assert body["by_model"] == {} and body["by_backend"] == {}
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


def test_schema_shapes_are_closed() -> None:
    """Every fixed-shape object in the schema requires all its keys and allows no other."""
    shapes = list(object_schemas(schema()))
    assert len(shapes) >= 10
    for path, node in shapes:
        assert node.get("additionalProperties") is False, path
        assert set(node.get("required", [])) == set(node["properties"]), path


def test_schema_matches_the_code() -> None:
    """The schema's keys and vocabularies are the ones the code writes (no traffic needed)."""
    s = schema()
    defs = s["$defs"]
    props = s["properties"]
    assert props["schema"]["const"] == SCHEMA
    assert props["window"]["enum"] == list(WINDOWS)
    assert props["window_s"]["enum"] == list(WINDOWS.values())
    assert set(defs["tally"]["required"]) == set(Tally().summary())
    assert set(defs["point"]["required"]) == {"ts", *Tally().point()}
    assert set(defs["latency"]["required"]) == set(Tally().latency_summary("ttft"))
    latency_ms = defs["tally"]["properties"]["latency_ms"]
    assert set(latency_ms["required"]) == set(LATENCY_METRICS)
    assert set(defs["backend"]["properties"]["dialect"]["enum"]) == set(DIALECTS)


async def test_schema_catches_drift(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """A key added, a key dropped, a wrong type or a null where none may be fails validation."""
    client, records, app = await make_proxy(llama_fake.url)
    await send_all(client, records, app, mixed_requests(per_app=1))
    body = await get_stats(client, "?window=5m")
    url = llama_fake.url

    def broken(change: Any) -> list[str]:
        doc = copy.deepcopy(body)
        change(doc)
        return violations(doc)

    assert violations(body) == []
    assert broken(lambda d: d.update(extra=1))
    assert broken(lambda d: d["totals"].update(new_figure=0.5))
    assert broken(lambda d: d["totals"].pop("schedules"))
    assert broken(lambda d: d["series"][-1].pop("e2e_p50_ms"))
    assert broken(lambda d: d["by_backend"][url]["latency_ms"]["ttft"].update(p95=1.0))
    assert broken(lambda d: d["backends"][url].pop("load"))
    assert broken(lambda d: d["top_prefixes"][0].update(anchor="not-hex"))
    assert broken(lambda d: d["savings"].update(usd="0.1"))
    assert broken(lambda d: d["totals"].update(requests=None))
    assert broken(lambda d: d["store"].update(kind="memcached"))
    assert broken(lambda d: d.update(schema="prefixgate.stats/v2"))


async def test_prefix_labels_only_when_prompts_are_logged_and_redacted(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """With ``--log-prompts`` a top prefix is named by the start of its system prompt, secrets
    redacted first; the label is never longer than 80 characters."""
    client, records, app = await make_proxy(llama_fake.url, log_prompts=True)
    system = "Support bot for ops@example.com   with key sk-" + "a" * 40 + ". " + "Policy. " * 200
    body = {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "hello"},
        ],
    }
    async with client.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    await records.wait(1)
    await app[STATE].writer.drain()
    (top,) = (await get_stats(client))["top_prefixes"]
    label = top["label"]
    assert label.startswith("Support bot for [REDACTED:email] with key [REDACTED:")
    assert "ops@example.com" not in label and "sk-aaaa" not in label
    assert len(label) <= 80 and not label.endswith(" ")
