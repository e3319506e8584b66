"""OpenTelemetry traces of requests, exported over OTLP when configured; nothing when not.

Configured the OpenTelemetry way, by its standard environment variables:
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_ENDPOINT``, to which
``/v1/traces`` is appended) turns tracing on, OTLP over HTTP/protobuf;
``OTEL_EXPORTER_OTLP_HEADERS``, ``OTEL_SERVICE_NAME`` (default ``prefixgate``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER`` and ``OTEL_SDK_DISABLED`` do what they do
for any OpenTelemetry SDK. With none of the endpoints set the SDK is not even imported.

The spans are built from the finished request's record and the timestamps its stages left
(``RecordTracer.observe`` is a learner of the record writer), so the request path pays only a
few clock reads for them, and the SDK's batch processor exports them from a thread of its own: a
collector that is slow or down costs dropped spans, never traffic. One trace per request::

    POST /v1/chat/completions        SERVER    the request at the proxy, arrival to last byte
      prefixgate.canonicalize        INTERNAL  body read to canonical body (the rules that fired)
      prefixgate.lookup              INTERNAL  fingerprint and prefix-index lookup
      prefixgate.route               INTERNAL  the replica chosen (route reason, load)
      prefixgate.schedule            INTERNAL  slot placement or coalescing, time held included
      prefixgate.upstream            INTERNAL  forwarded to the backend's response headers
      chat <model>                   CLIENT    the backend's answer, forwarded to last byte;
                                               events: gen_ai.first_token,
                                               gen_ai.first_visible_token

The ``chat <model>`` span carries the GenAI semantic-convention attributes
(``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens``, ``gen_ai.usage.cache_read.input_tokens``, ...) and
prefixgate's own (``prefixgate.*``: predicted cached tokens, the schedule reason, the rules
that fired). The times are the record's (its start, ``e2e_ms``, ``ttft_ms``, ``ttfvt_ms``) and
the stages' marks on its ``Observation``, so a span says what the record says.

W3C trace context: with tracing on, a request carrying a valid ``traceparent`` (and
``tracestate``) gets its SERVER span as a child of the caller's span, in the caller's trace;
the backend is sent a ``traceparent`` naming the ``chat <model>`` span (the caller's
``tracestate`` with it), so a traced backend's own spans join the same trace beneath it. With
tracing off the proxy adds nothing and the client's trace headers reach the backend as sent.

"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from proxy.backends import PROVIDER_NAMES
from proxy.backends.apis import MESSAGES, RESPONSES
from proxy.backends.base import CHAT, COMPLETIONS, NATIVE_COMPLETION
from proxy.config import ConfigError
from proxy.records import RequestRecord

if TYPE_CHECKING:
    from proxy.exchange import Exchange

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_OPERATIONS = {
    CHAT: "chat",
    COMPLETIONS: "text_completion",
    NATIVE_COMPLETION: "text_completion",
    RESPONSES: "chat",
    MESSAGES: "chat",
}
# W3C Trace Context, level 1: version-trace_id-parent_id-flags; a later version may add fields.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-\S*)?$")
_MAX_TRACESTATE = 512  # the recommended minimum a vendor must propagate
_SAMPLED = 0x01


def tracing_configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for traces (an OTLP endpoint, the SDK not disabled)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARIABLES)


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A request's place in a trace, decided when it arrives (only with tracing on)."""

    trace_id: int
    parent_span_id: int | None
    """The caller's span (its ``traceparent``), or None: the request starts a trace."""
    flags: int
    tracestate: str | None
    upstream_span_id: int
    """The ``chat <model>`` span, named in the ``traceparent`` sent to the backend."""

    @property
    def upstream_headers(self) -> dict[str, str]:
        """The trace headers of the request sent to the backend."""
        headers = {
            TRACEPARENT: f"00-{self.trace_id:032x}-{self.upstream_span_id:016x}-{self.flags:02x}"
        }
        if self.tracestate:
            headers[TRACESTATE] = self.tracestate
        return headers


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """``(trace_id, parent_span_id, flags)`` of a valid ``traceparent``, else None."""
    if not value:
        return None
    m = _TRACEPARENT.match(value.strip())
    if m is None:
        return None
    version, trace, parent, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace, 16), int(parent, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(flags, 16)


def trace_context(headers: Mapping[str, str], rng: random.Random | None = None) -> TraceContext:
    """The request's trace context: the caller's trace when it sent a valid ``traceparent``,
    else a new sampled trace; a fresh span id for the backend call either way."""
    bits = (rng or random).getrandbits
    parsed = parse_traceparent(headers.get(TRACEPARENT))
    if parsed is None:
        return TraceContext(bits(128) or 1, None, _SAMPLED, None, bits(64) or 1)
    trace_id, parent, flags = parsed
    state = headers.get(TRACESTATE)
    state = state.strip()[:_MAX_TRACESTATE] if state and state.strip() else None
    return TraceContext(trace_id, parent, flags, state, bits(64) or 1)


def _ns(ts: str) -> int:
    """Nanoseconds since the epoch of a record's ISO 8601 ``ts``."""
    return int(datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() * 1e9)


def _at(start_ns: int, ms: float | None) -> int | None:
    return None if ms is None else start_ns + int(ms * 1e6)


class _PresetIds:
    """The SDK's id generator, told in advance which ids the next span gets.

    The ids a request's trace context promised (its trace, the backend call's span) were put on
    the wire before the span was built; every other id is random, as the SDK's own generator
    makes them. ``observe`` runs on the event loop's thread only, so one slot each suffices.
    """

    def __init__(self) -> None:
        self.trace_id: int | None = None
        self.span_id: int | None = None

    def generate_span_id(self) -> int:
        preset, self.span_id = self.span_id, None
        return preset if preset is not None else random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        preset, self.trace_id = self.trace_id, None
        return preset if preset is not None else random.getrandbits(128) or 1

    def is_trace_id_random(self) -> bool:
        return True


class RecordTracer:
    """Turns finished requests into spans on an OpenTelemetry ``TracerProvider``."""

    def __init__(self, provider: Any, ids: _PresetIds | None = None) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("prefixgate")
        self._ids = ids or _PresetIds()

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
        ids = _PresetIds()
        # ``_PresetIds`` is a duck-typed IdGenerator (the SDK calls only its three methods).
        provider = TracerProvider(resource=resource, id_generator=ids)  # type: ignore[arg-type]
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider, ids)

    def begin(self, headers: Mapping[str, str]) -> TraceContext:
        """The trace context of a request that just arrived (its caller's ``traceparent``)."""
        return trace_context(headers)

    def observe(self, record: RequestRecord, ex: Exchange | None = None) -> None:
        """The spans of one finished request (a record writer learner)."""
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
            TraceState,
            set_span_in_context,
        )

        start = _ns(record.ts)
        end = start + int(record.e2e_ms * 1e6)
        failed = record.status >= 500 or record.error is not None
        trace = ex.trace if ex is not None else None
        obs = ex.obs if ex is not None else None

        def at(t: float | None) -> int | None:
            """A stage's monotonic mark as epoch nanoseconds, within the request."""
            if t is None or obs is None:
                return None
            return max(min(start + int((t - obs.t_start) * 1e9), end), start)

        parent = None
        if trace is not None and trace.parent_span_id is not None:
            caller = SpanContext(
                trace.trace_id,
                trace.parent_span_id,
                is_remote=True,
                trace_flags=TraceFlags(trace.flags),
                trace_state=TraceState.from_header([trace.tracestate or ""]),
            )
            parent = set_span_in_context(NonRecordingSpan(caller))
        elif trace is not None:
            self._ids.trace_id = trace.trace_id
        root = self._tracer.start_span(
            f"POST {record.route}",
            kind=SpanKind.SERVER,
            context=parent,
            start_time=start,
            attributes=_drop_none(
                {
                    "http.request.method": "POST",
                    "http.route": record.route,
                    "http.response.status_code": record.status,
                    "prefixgate.request_id": record.request_id,
                    "prefixgate.tenant": record.tenant,
                    "prefixgate.control_group": record.control_group,
                    "error.type": record.error,
                }
            ),
        )
        if failed:
            root.set_status(Status(StatusCode.ERROR, record.error or str(record.status)))
        context = set_span_in_context(root)

        def stage(name: str, begin: int | None, until: int | None, **attributes: Any) -> None:
            if begin is None or until is None:
                return
            span = self._tracer.start_span(
                name, context=context, start_time=begin, attributes=_drop_none(attributes)
            )
            span.end(end_time=max(until, begin))

        forwarded = at(obs.t_forward) if obs is not None else None
        if obs is not None:
            read = at(obs.t_body_read)
            canonical, looked_up, routed = at(obs.t_canonical), at(obs.t_lookup), at(obs.t_routed)
            stage(
                "prefixgate.canonicalize",
                read,
                canonical,
                **{"prefixgate.canonical_rules": list(record.canonical_rules) or None},
            )
            stage(
                "prefixgate.lookup",
                canonical,
                looked_up,
                **{
                    "prefixgate.prefix_blocks": record.prefix_blocks or None,
                    "prefixgate.prefix_matched_blocks": record.prefix_matched_blocks,
                },
            )
            stage(
                "prefixgate.route",
                looked_up,
                routed,
                **{
                    "prefixgate.route_reason": record.route_reason,
                    "prefixgate.backend": record.backend,
                    "prefixgate.replica_load": record.replica_load,
                },
            )
            stage(
                "prefixgate.schedule",
                routed,
                at(obs.t_admitted),
                **{
                    "prefixgate.schedule_reason": record.schedule_reason,
                    "prefixgate.slot": record.slot,
                    "prefixgate.held_ms": record.held_ms,
                },
            )
            headers = at(obs.t_headers)
            stage("prefixgate.upstream", forwarded, headers if headers is not None else end)
        else:  # a record without its stages: the proxy's time as one span
            prepared = min(start + int(record.proxy_overhead_ms * 1e6), end)
            stage("prefixgate.prepare", start, prepared)
            forwarded = min(prepared + int(float(record.held_ms or 0.0) * 1e6), end)
        if record.backend is not None and forwarded is not None:
            if trace is not None:
                self._ids.span_id = trace.upstream_span_id
            upstream = self._tracer.start_span(
                f"{_OPERATIONS.get(record.route, 'chat')} {record.model or ''}".strip(),
                kind=SpanKind.CLIENT,
                context=context,
                start_time=forwarded,
                attributes=_genai_attributes(record),
            )
            marks = (("first_token", record.ttft_ms), ("first_visible_token", record.ttfvt_ms))
            for name, ms in marks:
                t = _at(start, ms)
                if t is not None:
                    upstream.add_event(f"gen_ai.{name}", timestamp=max(min(t, end), forwarded))
            if failed:
                upstream.set_status(Status(StatusCode.ERROR, record.error or str(record.status)))
            upstream.end(end_time=end)
        self._ids.trace_id = self._ids.span_id = None
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
