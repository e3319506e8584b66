"""GET /metrics: the contract's names and labels, with values matching the traffic sent."""

from __future__ import annotations

from typing import Any

import pytest
from admin_traffic import chat, send_all, traffic_with_an_error
from fakes import LlamaFake, MakeProxy
from prometheus_client.parser import text_string_to_metric_families

from proxy.admin import METRICS
from proxy.admin.labels import OTHER
from proxy.admin.metrics import ProxyMetrics
from proxy.records import RequestRecord

Samples = dict[str, list[tuple[dict[str, str], float]]]

CONTRACT = {
    "prefixgate_requests_total",
    "prefixgate_prompt_tokens_total",
    "prefixgate_cached_tokens_total",
    "prefixgate_cached_reported_prompt_tokens_total",
    "prefixgate_predicted_cached_tokens_total",
    "prefixgate_completion_tokens_total",
    "prefixgate_slo_met_total",
    "prefixgate_slo_evaluated_total",
    "prefixgate_saved_prefill_seconds_total",
    "prefixgate_saved_usd_total",
    "prefixgate_canonical_rule_fired_total",
    "prefixgate_uncached_tokens_total",
    "prefixgate_store_failures_total",
    "prefixgate_time_to_first_token_seconds_bucket",
    "prefixgate_time_to_first_visible_token_seconds_bucket",
    "prefixgate_time_per_output_token_seconds_bucket",
    "prefixgate_request_duration_seconds_bucket",
    "prefixgate_proxy_overhead_seconds_bucket",
    "prefixgate_gen_ai_token_usage_bucket",
    "prefixgate_route_decisions_total",
    "prefixgate_store_degraded",
    "prefixgate_backend_in_flight",
    "prefixgate_backend_healthy",
}


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())
    )


async def scrape(client: Any) -> Samples:
    async with client.admin.get("/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return parse(await resp.text())


async def test_metrics_match_the_traffic(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """Counters equal the records' sums; histograms counted every request; gauges are live."""
    client, recs = await traffic_with_an_error(llama_fake, make_proxy, chat("coder", "too long?"))
    m = await scrape(client)

    assert set(m) >= CONTRACT, CONTRACT - set(m)
    url = llama_fake.url
    mb = {"model": "fake-model", "backend": url}
    assert total(m, "prefixgate_requests_total", **mb, status="200") == 9
    assert total(m, "prefixgate_requests_total", **mb, status="400") == 1
    prompt = sum(r.prompt_tokens or 0 for r in recs)
    cached = sum(r.cached_tokens or 0 for r in recs)
    reported = sum(r.prompt_tokens or 0 for r in recs if r.cached_tokens is not None)
    assert total(m, "prefixgate_prompt_tokens_total", **mb) == prompt
    assert total(m, "prefixgate_cached_tokens_total", **mb) == cached > 0
    assert total(m, "prefixgate_cached_reported_prompt_tokens_total", **mb) == reported
    assert total(m, "prefixgate_predicted_cached_tokens_total", **mb) == sum(
        r.predicted_cached_tokens or 0 for r in recs if r.prompt_tokens is not None
    )
    assert total(m, "prefixgate_completion_tokens_total", **mb) == sum(
        r.completion_tokens or 0 for r in recs
    )
    assert total(m, "prefixgate_slo_evaluated_total", **mb) == 10
    assert total(m, "prefixgate_slo_met_total", **mb) == sum(r.slo_met is True for r in recs)
    assert total(m, "prefixgate_saved_usd_total", **mb) == pytest.approx(cached * 2.7e-6)
    assert total(m, "prefixgate_saved_prefill_seconds_total", **mb) == pytest.approx(
        sum(r.saved_prefill_ms or 0 for r in recs) / 1000
    )
    assert total(m, "prefixgate_canonical_rule_fired_total", rule="volatile_timestamps") == 3
    attributed = [r for r in recs if r.miss_new_tokens is not None]
    assert total(m, "prefixgate_uncached_tokens_total", **mb) == sum(
        (r.prompt_tokens or 0) - (r.cached_tokens or 0) for r in attributed
    )
    assert total(m, "prefixgate_uncached_tokens_total", **mb, cause="new") == sum(
        r.miss_new_tokens or 0 for r in attributed
    )

    ttft_n = sum(r.ttft_ms is not None for r in recs)
    assert total(m, "prefixgate_time_to_first_token_seconds_count", **mb) == ttft_n
    assert total(m, "prefixgate_time_to_first_token_seconds_sum", **mb) == pytest.approx(
        sum(r.ttft_ms or 0 for r in recs) / 1000
    )
    assert total(m, "prefixgate_request_duration_seconds_count", **mb) == 10
    inf = total(m, "prefixgate_request_duration_seconds_bucket", **mb, le="+Inf")
    assert inf == 10
    assert total(m, "prefixgate_proxy_overhead_seconds_count") == 10
    usage = "prefixgate_gen_ai_token_usage"
    assert total(m, f"{usage}_sum", token_type="input", model="fake-model") == prompt
    assert total(m, f"{usage}_count", token_type="output", model="fake-model") == 9
    assert not [n for n in m if not n.startswith("prefixgate_")]  # no clash with an OTel SDK

    assert total(m, "prefixgate_backend_healthy", backend=url) == 1
    assert total(m, "prefixgate_backend_in_flight", backend=url) == 0
    assert total(m, "prefixgate_store_degraded") == 0
    assert total(m, "prefixgate_store_failures_total") == 0


async def test_in_flight_gauge_during_a_request(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """A scrape while a stream is open shows it in flight to its backend."""
    client, records, _ = await make_proxy(llama_fake.url)
    llama_fake.knobs.token_delay_s = 0.2
    async with client.post("/v1/chat/completions", json=chat("coder", "q", stream=True)) as resp:
        await resp.content.readline()  # the stream has started
        m = await scrape(client)
        await resp.read()
    assert total(m, "prefixgate_backend_in_flight", backend=llama_fake.url) == 1
    await records.wait()


async def test_each_app_has_its_own_registry(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """Two proxies in one process count their own requests only."""
    client_a, records_a, app_a = await make_proxy(llama_fake.url)
    client_b, _, _ = await make_proxy(llama_fake.url)
    await send_all(client_a, records_a, app_a, [chat("coder", "q")])
    assert total(await scrape(client_a), "prefixgate_requests_total") == 1
    assert total(await scrape(client_b), "prefixgate_requests_total") == 0


def _record(**fields: Any) -> RequestRecord:
    base: dict[str, Any] = {
        "ts": "2026-11-30T00:00:00.000Z",
        "request_id": "r",
        "route": "/v1/chat/completions",
        "model": "m",
        "backend": "http://b:1",
        "stream": False,
        "status": 200,
    }
    return RequestRecord(**{**base, **fields})


def test_route_reason_from_the_record() -> None:
    """A record's route_reason is counted per backend and reason; odd reasons are ignored."""
    metrics = ProxyMetrics(state=lambda: None)
    metrics.observe(_record(route_reason="affinity"))
    metrics.observe(_record(route_reason="affinity"))
    metrics.observe(_record(route_reason="miss"))
    metrics.observe(_record(route_reason="Not A Reason!"))
    metrics.route_decision("http://b:2", "load_gate")
    m = parse(_exposition(metrics))
    name = "prefixgate_route_decisions_total"
    assert total(m, name, backend="http://b:1", reason="affinity") == 2
    assert total(m, name, backend="http://b:1", reason="miss") == 1
    assert total(m, name, backend="http://b:2", reason="load_gate") == 1
    assert total(m, name) == 4


def test_model_label_is_capped() -> None:
    """Client-chosen model names beyond the cap are counted under 'other'."""
    metrics = ProxyMetrics(state=lambda: None, max_models=2)
    for model in ("a", "b", "c", "d", "a"):
        metrics.observe(_record(model=model, prompt_tokens=10))
    m = parse(_exposition(metrics))
    models = {lab["model"] for lab, _ in m["prefixgate_requests_total"]}
    assert models == {"a", "b", OTHER}
    assert total(m, "prefixgate_requests_total", model=OTHER) == 2
    assert total(m, "prefixgate_prompt_tokens_total") == 50


def test_unknown_values_never_break_the_sink() -> None:
    """Missing tokens and latencies add nothing; a request with no backend is 'unknown'."""
    metrics = ProxyMetrics(state=lambda: None)
    metrics.observe(_record(backend=None, model=None, status=400, e2e_ms=float("nan")))
    m = parse(_exposition(metrics))
    assert total(m, "prefixgate_requests_total", backend="unknown", model="unknown") == 1
    assert total(m, "prefixgate_request_duration_seconds_count") == 0
    assert total(m, "prefixgate_proxy_overhead_seconds_count") == 0


def _exposition(metrics: ProxyMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


async def test_metrics_object_is_on_the_app(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """The registry is reachable from the application for callers that count decisions."""
    _, _, app = await make_proxy(llama_fake.url)
    assert isinstance(app[METRICS], ProxyMetrics)


def test_a_series_appears_once_it_has_something_to_count() -> None:
    """A (model, backend) pair's series exist only for what its records carried: a request
    without usage adds no token series, an attributed one adds every cause, zeros included."""
    metrics = ProxyMetrics(state=lambda: None)
    metrics.observe(_record(status=502))
    m = parse(_exposition(metrics))
    assert total(m, "prefixgate_requests_total", status="502") == 1
    for name in (
        "prefixgate_prompt_tokens_total",
        "prefixgate_cached_tokens_total",
        "prefixgate_saved_usd_total",
        "prefixgate_uncached_tokens_total",
        "prefixgate_gen_ai_token_usage_count",
    ):
        assert name not in m, name
    metrics.observe(
        _record(prompt_tokens=10, cached_tokens=4, miss_new_tokens=6, ttft_ms=5.0, saved_usd=0.5)
    )
    m = parse(_exposition(metrics))
    causes = {lab["cause"]: v for lab, v in m["prefixgate_uncached_tokens_total"]}
    assert causes == {"new": 6, "breaker": 0, "routing": 0, "evicted": 0, "unexplained": 0}
    assert total(m, "prefixgate_cached_tokens_total") == 4
    assert total(m, "prefixgate_saved_usd_total") == 0.5
    assert total(m, "prefixgate_gen_ai_token_usage_count", token_type="input") == 1
    assert "prefixgate_gen_ai_token_usage_count" in m
    assert total(m, "prefixgate_time_to_first_token_seconds_count") == 1
    assert total(m, "prefixgate_requests_total") == 2
