"""OpenTelemetry traces over OTLP/HTTP to an in-process receiver: one trace per request, the
stages as child spans, the GenAI attributes on the backend call; nothing when not configured."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fakes import LlamaFake, MakeProxy
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from proxy.tracing import RecordTracer, parse_traceparent, trace_context, tracing_configured

BODY = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Say hello."}],
    "stream": True,
    "stream_options": {"include_usage": True},
}


class Receiver:
    """An OTLP/HTTP trace receiver: decodes what the exporter posts to ``/v1/traces``."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.resources: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()

    async def traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        export = ExportTraceServiceRequest.FromString(await request.read())
        for rs in export.resource_spans:
            self.resources.append({a.key: _value(a.value) for a in rs.resource.attributes})
            for ss in rs.scope_spans:
                self.spans.extend(ss.spans)
        self.arrived.set()
        return web.Response(body=b"", content_type="application/x-protobuf")


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def attrs(span: Any) -> dict[str, Any]:
    return {a.key: _value(a.value) for a in span.attributes}


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, str]]:
    rec = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", rec.traces)
    server = TestServer(app)
    await server.start_server()
    yield rec, str(server.make_url("")).rstrip("/")
    await server.close()


def test_tracing_is_off_unless_an_endpoint_is_set() -> None:
    """No OTLP endpoint, or the SDK disabled: no tracer (the SDK is not even imported)."""
    assert not tracing_configured({})
    assert RecordTracer.from_env({}) is None
    assert tracing_configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert tracing_configured({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"})
    off = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}
    assert not tracing_configured(off)


STAGES = [
    "prefixgate.canonicalize",
    "prefixgate.lookup",
    "prefixgate.route",
    "prefixgate.schedule",
    "prefixgate.upstream",
]
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


async def _one_traced_request(
    llama_fake: LlamaFake,
    make_proxy: MakeProxy,
    receiver: tuple[Receiver, str],
    monkeypatch: pytest.MonkeyPatch,
    headers: dict[str, str] | None = None,
) -> tuple[Any, list[Any]]:
    rec, url = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pg-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json=BODY, headers=headers or {}) as resp:
        assert resp.status == 200
        await resp.read()
    await client.close()  # shutting down flushes the exporter
    await asyncio.wait_for(rec.arrived.wait(), 10)
    (record,) = records
    return record, rec.spans


async def test_a_request_is_one_trace_with_its_stages_and_genai_attributes(
    llama_fake: LlamaFake,
    make_proxy: MakeProxy,
    receiver: tuple[Receiver, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reasoning stream through the proxy: a SERVER span for the request, its stages as
    children in order (canonicalize, lookup, route, schedule, upstream), and a CLIENT span for
    the backend's answer with the GenAI usage (cache reads included) and first-token /
    first-visible-token events in that order."""
    llama_fake.knobs.reasoning = ["Let", " me", " think"]
    llama_fake.knobs.token_delay_s = 0.01
    record, spans = await _one_traced_request(llama_fake, make_proxy, receiver, monkeypatch)
    rec, _ = receiver
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"POST /v1/chat/completions", "chat smollm2", *STAGES}
    root = by_name["POST /v1/chat/completions"]
    upstream = by_name["chat smollm2"]
    assert len({s.trace_id for s in spans}) == 1
    assert all(s.parent_span_id == root.span_id for s in spans if s is not root)
    assert root.parent_span_id == b""  # no caller: the request starts the trace
    assert root.kind == root.SPAN_KIND_SERVER and upstream.kind == upstream.SPAN_KIND_CLIENT
    assert rec.resources[0]["service.name"] == "pg-test"
    stages = sorted((by_name[n] for n in STAGES), key=lambda s: s.start_time_unix_nano)
    assert [s.name for s in stages] == STAGES
    for before, after in itertools.pairwise(stages):
        assert before.end_time_unix_nano <= after.start_time_unix_nano
    assert root.start_time_unix_nano <= stages[0].start_time_unix_nano
    assert by_name["prefixgate.upstream"].start_time_unix_nano == upstream.start_time_unix_nano
    assert attrs(by_name["prefixgate.route"])["prefixgate.route_reason"] == record.route_reason
    a = attrs(upstream)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "llama.cpp"
    assert a["gen_ai.request.model"] == "smollm2"
    assert a["gen_ai.usage.input_tokens"] == record.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == record.completion_tokens
    assert a["gen_ai.usage.cache_read.input_tokens"] == record.cached_tokens
    assert attrs(root)["prefixgate.request_id"] == record.request_id
    events = {e.name: e.time_unix_nano for e in upstream.events}
    assert by_name["prefixgate.upstream"].end_time_unix_nano <= events["gen_ai.first_token"]
    assert events["gen_ai.first_token"] < events["gen_ai.first_visible_token"]
    assert events["gen_ai.first_visible_token"] <= root.end_time_unix_nano
    e2e_ns = root.end_time_unix_nano - root.start_time_unix_nano
    assert abs(e2e_ns / 1e6 - record.e2e_ms) < 1.0
    # The backend was told the CLIENT span is its parent, in the request's trace.
    sent = llama_fake.last_headers["traceparent"]
    assert sent == f"00-{root.trace_id.hex()}-{upstream.span_id.hex()}-01"


async def test_a_caller_traceparent_makes_the_request_its_child(
    llama_fake: LlamaFake,
    make_proxy: MakeProxy,
    receiver: tuple[Receiver, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An incoming ``traceparent`` (and ``tracestate``): the request span is a child of the
    caller's span in the caller's trace, and the backend gets a ``traceparent`` of the same
    trace naming the proxy's CLIENT span, with the caller's ``tracestate``."""
    headers = {
        "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01",
        "tracestate": "vendor=abc,other=1",
    }
    record, spans = await _one_traced_request(
        llama_fake, make_proxy, receiver, monkeypatch, headers
    )
    by_name = {s.name: s for s in spans}
    root = by_name["POST /v1/chat/completions"]
    upstream = by_name["chat smollm2"]
    assert {s.trace_id.hex() for s in spans} == {CALLER_TRACE}
    assert root.parent_span_id.hex() == CALLER_SPAN
    assert root.trace_state == "vendor=abc,other=1"
    assert upstream.parent_span_id == root.span_id
    assert llama_fake.last_headers["traceparent"] == (
        f"00-{CALLER_TRACE}-{upstream.span_id.hex()}-01"
    )
    assert llama_fake.last_headers["tracestate"] == "vendor=abc,other=1"
    assert record.request_id == attrs(root)["prefixgate.request_id"]


async def test_without_an_endpoint_trace_headers_pass_through_untouched(
    llama_fake: LlamaFake, make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tracing off: the proxy adds no ``traceparent`` and passes the client's as sent."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json=BODY) as resp:
        assert resp.status == 200
    assert "traceparent" not in llama_fake.last_headers
    assert "tracestate" not in llama_fake.last_headers
    mine = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-00", "tracestate": "k=v"}
    async with client.post("/v1/chat/completions", json=BODY, headers=mine) as resp:
        assert resp.status == 200
    assert llama_fake.last_headers["traceparent"] == mine["traceparent"]
    assert llama_fake.last_headers["tracestate"] == "k=v"
    assert len(records) == 2


def test_traceparent_parsing_follows_w3c() -> None:
    """Valid headers parse; a wrong length, upper case, zero ids, version ff, or extra fields
    on version 00 do not (the request then starts a trace of its own)."""
    good = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    assert parse_traceparent(good) == (int(CALLER_TRACE, 16), int(CALLER_SPAN, 16), 1)
    assert parse_traceparent(f"01-{CALLER_TRACE}-{CALLER_SPAN}-00-later") is not None
    for bad in (
        "",
        good.upper(),
        good + "-x",
        f"ff-{CALLER_TRACE}-{CALLER_SPAN}-01",
        f"00-{'0' * 32}-{CALLER_SPAN}-01",
        f"00-{CALLER_TRACE}-{'0' * 16}-01",
        f"00-{CALLER_TRACE[:-1]}-{CALLER_SPAN}-01",
    ):
        assert parse_traceparent(bad) is None, bad
    fresh = trace_context({"traceparent": "garbage", "tracestate": "k=v"})
    assert fresh.parent_span_id is None and fresh.tracestate is None and fresh.flags == 1


async def test_a_collector_that_is_down_costs_no_traffic(
    llama_fake: LlamaFake, make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans to a port nobody listens on are dropped by the exporter; requests are answered."""
    from tests.ports import free_port

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    client, records, _ = await make_proxy(llama_fake.url)
    for _ in range(3):
        async with client.post("/v1/chat/completions", json=BODY) as resp:
            assert resp.status == 200
    assert len(records) == 3
