"""OpenTelemetry traces of requests, exported over OTLP when configured; nothing when not.

Configured the OpenTelemetry way, by its standard environment variables:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT``, to which
``/v1/traces`` is appended) turns tracing on, OTLP over HTTP/protobuf;
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME`` (default ``prefixgate``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and ``OTEL_SDK_DISABLED`` do what they do
for any OpenTelemetry SDK. With none of the endpoints set the SDK is not even imported.

The spans are built from the finished request's record (``RecordTracer.observe`` is a sink of
the record writer), so the request path pays nothing for them, and the SDK's batch processor
exports them from a thread of its own: a collector that is slow or down costs dropped spans,
never traffic. One trace per request::

    POST /v1/chat/completions        SERVER    the request at the proxy, arrival to last byte
      prefixgate.prepare             INTERNAL  canonicalize, fingerprint, lookup, route
      prefixgate.schedule            INTERNAL  waiting for a slot (only when it waited)
      chat <model>                   CLIENT    the backend's answer; events: first_token,
                                               first_visible_token

The ``chat <model>`` span carries the GenAI semantic-convention attributes
(``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``, ``gen_ai.usage.cache_read.input_tokens``, ...) and
prefixgate's own (``prefixgate.*``: predicted cached tokens, the schedule reason, the rules
that fired). The times are the record's (its start, ``proxy_overhead_ms``, ``held_ms``,
``ttft_ms``, ``ttfvt_ms``, ``e2e_ms``), so a span says what the record says.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from proxy.backends import PROVIDER_NAMES
from proxy.backends.apis import MESSAGES, RESPONSES
from proxy.backends.base import CHAT, COMPLETIONS, NATIVE_COMPLETION
from proxy.config import ConfigError
from proxy.records import RequestRecord

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_OPERATIONS = {
    CHAT: "chat",
    COMPLETIONS: "text_completion",
    NATIVE_COMPLETION: "text_completion",
    RESPONSES: "chat",
    MESSAGES: "chat",
}


def tracing_configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces (an OTLP endpoint, the SDK not disabled)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES)


def _ns(ts: str) -> int:
    """Nanoseconds since the epoch of a record's ISO 8601 ``ts``."""
    return int(datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() * 1e9)


def _at(start_ns: int, ms: float | None) -> int | None:
    return None if ms is None else start_ns + int(ms * 1e6)


class RecordTracer:
    """Turns finished records into spans on an OpenTelemetry ``TracerProvider``."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("prefixgate")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RecordTracer | None:
        """A tracer exporting over OTLP/HTTP as the environment says; ``None`` when it does not
        ask for traces."""
        if not tracing_configured(environ):
            return None
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import SERVICE_NAME, Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as exc:
            raise ConfigError(
                f"an OTLP endpoint is set ({', '.join(ENDPOINT_VARIABLES)}) but the "
                "OpenTelemetry SDK is not installed: pip install 'prefixgate[otel]'"
            ) from exc

        env = os.environ if environ is None else environ
        resource = Resource.create({SERVICE_NAME: env.get("OTEL_SERVICE_NAME") or "prefixgate"})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider)

    def observe(self, record: RequestRecord) -> None:
        """The spans of one finished request (a record writer sink)."""
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        start = _ns(record.ts)
        end = start + int(record.e2e_ms * 1e6)
        failed = record.status >= 500 or record.error is not None
        root = self._tracer.start_span(
            f"POST {record.route}",
            kind=SpanKind.SERVER,
            start_time=start,
            attributes=_drop_none(
                {
                    "http.request.method": "POST",
                    "http.route": record.route,
                    "http.response.status_code": record.status,
                    "prefixgate.request_id": record.request_id,
                    "prefixgate.tenant": record.tenant,
                    "error.type": record.error,
                }
            ),
        )
        if failed:
            root.set_status(Status(StatusCode.ERROR, record.error or str(record.status)))
        context = set_span_in_context(root)
        prepared = min(start + int(record.proxy_overhead_ms * 1e6), end)
        self._tracer.start_span("prefixgate.prepare", context=context, start_time=start).end(
            end_time=prepared
        )
        held_ms = float(record.held_ms or 0.0)
        forwarded = min(prepared + int(held_ms * 1e6), end)
        if held_ms > 0.0:
            self._tracer.start_span(
                "prefixgate.schedule",
                context=context,
                start_time=prepared,
                attributes=_drop_none(
                    {
                        "prefixgate.schedule_reason": record.schedule_reason,
                        "prefixgate.slot": record.slot,
                    }
                ),
            ).end(end_time=forwarded)
        if record.backend is not None:
            upstream = self._tracer.start_span(
                f"{_OPERATIONS.get(record.route, 'chat')} {record.model or ''}".strip(),
                kind=SpanKind.CLIENT,
                context=context,
                start_time=forwarded,
                attributes=_genai_attributes(record),
            )
            marks = (("first_token", record.ttft_ms), ("first_visible_token", record.ttfvt_ms))
            for name, ms in marks:
                at = _at(start, ms)
                if at is not None:
                    upstream.add_event(f"gen_ai.{name}", timestamp=max(min(at, end), forwarded))
            if failed:
                upstream.set_status(Status(StatusCode.ERROR, record.error or str(record.status)))
            upstream.end(end_time=end)
        root.end(end_time=end)

    def shutdown(self) -> None:
        """Flush what is queued and stop the exporter (blocks: call it from a thread)."""
        self._provider.shutdown()


def _genai_attributes(record: RequestRecord) -> dict[str, Any]:
    server = urlsplit(record.backend or "")
    return _drop_none(
        {
            "gen_ai.operation.name": _OPERATIONS.get(record.route, "chat"),
            "gen_ai.provider.name": PROVIDER_NAMES.get(record.dialect or "", record.dialect),
            "gen_ai.request.model": record.model,
            "gen_ai.usage.input_tokens": record.prompt_tokens,
            "gen_ai.usage.output_tokens": record.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
            "gen_ai.usage.reasoning.output_tokens": record.reasoning_tokens,
            "server.address": server.hostname,
            "server.port": server.port,
            "http.response.status_code": record.status,
            "prefixgate.stream": record.stream,
            "prefixgate.ttft_ms": record.ttft_ms,
            "prefixgate.ttfvt_ms": record.ttfvt_ms,
            "prefixgate.tpot_ms": record.tpot_ms,
            "prefixgate.predicted_cached_tokens": record.predicted_cached_tokens,
            "prefixgate.cache_source": record.cache_source,
            "prefixgate.canonical_rules": list(record.canonical_rules) or None,
            "prefixgate.slo_met": record.slo_met,
        }
    )


def _drop_none(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}
