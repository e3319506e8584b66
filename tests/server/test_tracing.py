"""OpenTelemetry traces over OTLP/HTTP to an in-process receiver: one trace per request, the
stages as child spans, the GenAI attributes on the backend call; nothing when not configured."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from fakes import LlamaFake, MakeProxy
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from proxy.tracing import RecordTracer, tracing_configured

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


async def test_a_request_is_one_trace_with_its_stages_and_genai_attributes(
    llama_fake: LlamaFake,
    make_proxy: MakeProxy,
    receiver: tuple[Receiver, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A reasoning stream through the proxy: a SERVER span for the request, the proxy's own
    work, and a CLIENT span for the backend's answer with the GenAI usage (cache reads
    included) and first-token / first-visible-token events in that order."""
    rec, url = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pg-test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    llama_fake.knobs.reasoning = ["Let", " me", " think"]
    llama_fake.knobs.token_delay_s = 0.01
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json=BODY) as resp:
        assert resp.status == 200
        await resp.read()
    await client.close()  # shutting down flushes the exporter
    await asyncio.wait_for(rec.arrived.wait(), 10)
    (record,) = records
    by_name = {s.name: s for s in rec.spans}
    assert set(by_name) >= {"POST /v1/chat/completions", "prefixgate.prepare", "chat smollm2"}
    root = by_name["POST /v1/chat/completions"]
    upstream = by_name["chat smollm2"]
    assert len({s.trace_id for s in rec.spans}) == 1
    assert all(s.parent_span_id == root.span_id for s in rec.spans if s is not root)
    assert root.kind == root.SPAN_KIND_SERVER and upstream.kind == upstream.SPAN_KIND_CLIENT
    assert rec.resources[0]["service.name"] == "pg-test"
    a = attrs(upstream)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "llama.cpp"
    assert a["gen_ai.request.model"] == "smollm2"
    assert a["gen_ai.usage.input_tokens"] == record.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == record.completion_tokens
    assert a["gen_ai.usage.cache_read.input_tokens"] == record.cached_tokens
    assert attrs(root)["prefixgate.request_id"] == record.request_id
    events = {e.name: e.time_unix_nano for e in upstream.events}
    assert root.start_time_unix_nano <= events["gen_ai.first_token"]
    assert events["gen_ai.first_token"] < events["gen_ai.first_visible_token"]
    assert events["gen_ai.first_visible_token"] <= root.end_time_unix_nano
    e2e_ns = root.end_time_unix_nano - root.start_time_unix_nano
    assert abs(e2e_ns / 1e6 - record.e2e_ms) < 1.0


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
