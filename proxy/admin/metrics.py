"""``GET /metrics``: Prometheus exposition of this proxy process.

Two sources feed one ``CollectorRegistry`` per application (never the global registry, so two
proxies in one process, as in the tests, keep their own numbers):

* a record sink (``ProxyMetrics.observe``, registered on the ``RecordWriter``) turns every finished
  request into counter increments and histogram observations, off the request's critical path;
* a collector asked at scrape time (``_LiveCollector``) reads what is true *now*: whether the store
  is degraded, its failure count, and each replica's requests in flight and health.

Unlike ``/stats``, these numbers are per process: Prometheus adds the replicas up with ``sum``.
Names, labels and units follow the project's metrics contract (the Grafana dashboard is built on
them): every name starts with ``prefixgate_`` (none can collide with what an OpenTelemetry SDK in
the same scrape exports) and the model label is ``model`` throughout. The histograms use the
OpenTelemetry GenAI bucket boundaries, widened at both ends for CPU backends (tens of seconds of
prefill) and fast GPUs (a few ms per token). A proxy sees a request as the model server does,
from its arrival to its last byte, so the latencies correspond to the GenAI *server* metrics:

    prefixgate_time_to_first_token_seconds    ~ gen_ai.server.time_to_first_token
    prefixgate_time_per_output_token_seconds  ~ gen_ai.server.time_per_output_token
    prefixgate_request_duration_seconds       ~ gen_ai.server.request.duration
    prefixgate_gen_ai_token_usage             ~ gen_ai.client.token.usage (the conventions define
                                                token usage for clients only; same buckets)

Cardinality: ``model`` comes from the client's request body, so only the first ``max_models``
distinct names get their own label value; later ones are counted under ``other``. ``backend`` is
one of the configured replicas, ``rule`` and ``reason`` are the proxy's own vocabularies.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.admin.labels import LabelCap, Series
from proxy.admin.series import LoopCounter, LoopHistogram
from proxy.control import CONTROL, TREATED
from proxy.records import RequestRecord
from proxy.state import ProxyState
from proxy.store.stats import UNKNOWN

DEFAULT_MAX_MODELS = 100
_REASON_OK = re.compile(r"^[a-z_]{1,32}$")

# OpenTelemetry GenAI semantic-convention boundaries (gen_ai.server.time_to_first_token,
# gen_ai.server.time_per_output_token, gen_ai.server.request.duration, gen_ai.client.token.usage),
# widened as noted above.
TTFT_BUCKETS_S = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0),
    *(15.0, 30.0, 60.0, 120.0),
)
TPOT_BUCKETS_S = (
    *(0.001, 0.0025, 0.005),
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5),
)
DURATION_BUCKETS_S = (
    *(0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92),
    *(163.84, 327.68, 655.36),
)
OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
TOKEN_BUCKETS = tuple(float(4**i) for i in range(14))  # 1, 4, 16, … 67,108,864

MODEL_BACKEND = ("model", "backend")


def _positive(value: float | None) -> float | None:
    """``value`` when it is a finite number ≥ 0, else None (a counter never goes down)."""
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return float(value)


class _LiveCollector(Collector):
    """What is true at scrape time: store health and each replica's load and health."""

    def __init__(self, state: Callable[[], ProxyState | None]) -> None:
        self._state = state

    def collect(self) -> Iterable[Metric]:
        state = self._state()
        if state is None:  # the application has not started (or has stopped)
            return
        degraded = GaugeMetricFamily(
            "prefixgate_store_degraded", "1 while the shared store (Redis) is failing, else 0"
        )
        degraded.add_metric([], 1.0 if state.store.degraded else 0.0)
        failures = CounterMetricFamily(
            "prefixgate_store_failures", "store calls that failed since start-up"
        )
        failures.add_metric([], float(state.store.failures))
        in_flight = GaugeMetricFamily(
            "prefixgate_backend_in_flight",
            "requests this proxy has in flight to the replica",
            labels=["backend"],
        )
        healthy = GaugeMetricFamily(
            "prefixgate_backend_healthy",
            "1 when the replica is healthy, else 0",
            labels=["backend"],
        )
        for replica in state.fleet.replicas:
            in_flight.add_metric([replica.url], float(replica.in_flight))
            healthy.add_metric([replica.url], 1.0 if replica.healthy else 0.0)
        yield from (degraded, failures, in_flight, healthy)


class ProxyMetrics:
    """The registry of one proxy application and the record sink that feeds it."""

    def __init__(
        self,
        *,
        state: Callable[[], ProxyState | None],
        max_models: int = DEFAULT_MAX_MODELS,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._model = LabelCap(max_models)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._by_backend: dict[tuple[str, str], Series] = {}
        reg = self.registry

        # Updated from the event loop only: values kept without locks (``proxy.admin.series``).
        def counter(name: str, doc: str, labels: Sequence[str] = MODEL_BACKEND) -> LoopCounter:
            return LoopCounter(name, doc, labels, registry=reg)

        def histogram(
            name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = MODEL_BACKEND
        ) -> LoopHistogram:
            return LoopHistogram(name, doc, labels, registry=reg, buckets=buckets)

        self.requests = counter(
            "prefixgate_requests", "requests by HTTP status sent", ("model", "backend", "status")
        )
        self.prompt_tokens = counter("prefixgate_prompt_tokens", "backend-reported prompt tokens")
        self.cached_tokens = counter(
            "prefixgate_cached_tokens", "backend-reported prompt tokens served from its cache"
        )
        self.cached_reported_prompt_tokens = counter(
            "prefixgate_cached_reported_prompt_tokens",
            "prompt tokens of requests whose backend reported cached tokens "
            "(denominator of the token-weighted hit rate)",
        )
        self.predicted_cached_tokens = counter(
            "prefixgate_predicted_cached_tokens",
            "cached prompt tokens the prefix index predicted before sending",
        )
        self.completion_tokens = counter(
            "prefixgate_completion_tokens", "backend-reported completion tokens"
        )
        self.slo_met = counter("prefixgate_slo_met", "requests that met the latency SLO")
        self.slo_evaluated = counter(
            "prefixgate_slo_evaluated", "requests judged against the latency SLO"
        )
        self.saved_prefill_seconds = counter(
            "prefixgate_saved_prefill_seconds", "estimated prefill time saved by cache hits"
        )
        self.saved_usd = counter(
            "prefixgate_saved_usd", "money saved by cache hits at the configured prices"
        )
        self.canonical_rules = counter(
            "prefixgate_canonical_rule_fired", "requests a canonicalization rule changed", ("rule",)
        )
        self.uncached_tokens = counter(
            "prefixgate_uncached_tokens",
            "backend-reported prompt tokens not served from cache, by cause (miss attribution: "
            "new, breaker, routing, evicted, unexplained)",
            ("model", "backend", "cause"),
        )
        self.breaker_tokens = counter(
            "prefixgate_breaker_tokens",
            "uncached prompt tokens a canonicalization rule in dry-run would have made cacheable",
            ("rule",),
        )
        self.route_decisions = counter(
            "prefixgate_route_decisions", "routing decisions by reason", ("backend", "reason")
        )
        self.schedule_decisions = counter(
            "prefixgate_schedule_decisions",
            "scheduling decisions on the chosen backend (slot pinning, coalescing) by reason",
            ("backend", "reason"),
        )
        self.held = histogram(
            "prefixgate_held_seconds",
            "time a request was held before it was sent (coalescing, slot fan-out); "
            "requests not held are not observed",
            TTFT_BUCKETS_S,
            labels=("backend",),
        )
        self.ttft = histogram(
            "prefixgate_time_to_first_token_seconds",
            "time to first token (reasoning included), from request arrival "
            "(OpenTelemetry gen_ai.server.time_to_first_token)",
            TTFT_BUCKETS_S,
        )
        self.ttfvt = histogram(
            "prefixgate_time_to_first_visible_token_seconds",
            "time to first visible token (content or tool call), from request arrival",
            TTFT_BUCKETS_S,
        )
        self.tpot = histogram(
            "prefixgate_time_per_output_token_seconds",
            "time per output token after the first "
            "(OpenTelemetry gen_ai.server.time_per_output_token)",
            TPOT_BUCKETS_S,
        )
        self.duration = histogram(
            "prefixgate_request_duration_seconds",
            "request arrival to response end (OpenTelemetry gen_ai.server.request.duration)",
            DURATION_BUCKETS_S,
        )
        self.overhead = histogram(
            "prefixgate_proxy_overhead_seconds",
            "the proxy's own time on the request's critical path",
            OVERHEAD_BUCKETS_S,
            labels=(),
        )
        self.token_usage = histogram(
            "prefixgate_gen_ai_token_usage",
            "input and output tokens per request, by token_type (input, output); "
            "buckets of OpenTelemetry gen_ai.client.token.usage",
            TOKEN_BUCKETS,
            labels=("token_type", "model"),
        )
        # The control group (--control-share): the same figures per group, treated or control.
        group = ("group",)
        self.group_requests = counter(
            "prefixgate_control_group_requests",
            "requests by group (treated, control) when a control group is configured",
            group,
        )
        self.group_prompt_tokens = counter(
            "prefixgate_control_group_prompt_tokens",
            "prompt tokens by group, of requests whose backend reported cached tokens",
            group,
        )
        self.group_cached_tokens = counter(
            "prefixgate_control_group_cached_tokens",
            "backend-reported cached prompt tokens by group",
            group,
        )
        self.group_slo_met = counter(
            "prefixgate_control_group_slo_met", "requests that met the SLO, by group", group
        )
        self.group_slo_evaluated = counter(
            "prefixgate_control_group_slo_evaluated",
            "requests judged against the SLO, by group",
            group,
        )
        self.group_ttft = histogram(
            "prefixgate_control_group_time_to_first_token_seconds",
            "time to first token by group",
            TTFT_BUCKETS_S,
            labels=group,
        )
        reg.register(_LiveCollector(state))

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: one record touches a dozen of them."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def route_decision(self, backend: str, reason: str) -> None:
        """Count one routing decision (also done from records carrying ``route_reason``)."""
        if _REASON_OK.match(reason):
            self._child(self.route_decisions, backend, reason).inc()

    def _series(self, model: str, backend: str) -> Series:
        key = (model, backend)
        series = self._by_backend.get(key)
        if series is None:
            series = self._by_backend[key] = Series(self, model, backend)
        return series

    def observe(self, record: RequestRecord) -> None:
        """Record sink: fold one finished request into the counters and histograms."""
        backend = record.backend or UNKNOWN
        s = self._series(self._model(record.model), backend)
        status = s.status.get(record.status)
        if status is None:
            status = s.status[record.status] = self.requests.labels(
                s.model, backend, str(record.status)
            )
        status.inc()
        prompt = record.prompt_tokens
        if prompt is not None and prompt >= 0:
            s.prompt_tokens.inc(prompt)
            s.input_usage.observe(prompt)
            if record.cached_tokens is not None and record.cached_tokens >= 0:
                s.cached_tokens.inc(record.cached_tokens)
                s.cached_reported_prompt_tokens.inc(prompt)
            predicted = record.predicted_cached_tokens
            if predicted is not None and predicted >= 0:
                s.predicted_cached_tokens.inc(predicted)
        if record.completion_tokens is not None and record.completion_tokens >= 0:
            s.completion_tokens.inc(record.completion_tokens)
            s.output_usage.observe(record.completion_tokens)
        if record.slo_met is not None:
            s.slo_evaluated.inc()
            if record.slo_met:
                s.slo_met.inc()
        saved_ms = _positive(record.saved_prefill_ms)
        if saved_ms is not None:
            s.saved_prefill_seconds.inc(saved_ms / 1000.0)
        saved_usd = _positive(record.saved_usd)
        if saved_usd is not None:
            s.saved_usd.inc(saved_usd)
        for rule in record.canonical_rules:
            self._child(self.canonical_rules, rule).inc()
        if record.miss_new_tokens is not None:
            self._observe_misses(record, s)
        if record.route_reason is not None and record.backend:
            self.route_decision(record.backend, record.route_reason)
        if record.schedule_reason is not None:
            self._observe_schedule(record)
        self._observe_latencies(record, s)
        if record.control_group is not None:
            self._observe_group(record, CONTROL if record.control_group else TREATED)

    def _observe_group(self, record: RequestRecord, group: str) -> None:
        self._child(self.group_requests, group).inc()
        prompt, cached = record.prompt_tokens, record.cached_tokens
        if prompt is not None and prompt > 0 and cached is not None and cached >= 0:
            self._child(self.group_prompt_tokens, group).inc(prompt)
            self._child(self.group_cached_tokens, group).inc(min(cached, prompt))
        if record.slo_met is not None:
            self._child(self.group_slo_evaluated, group).inc()
            if record.slo_met:
                self._child(self.group_slo_met, group).inc()
        ttft = _positive(record.ttft_ms)
        if ttft is not None:
            self._child(self.group_ttft, group).observe(ttft / 1000.0)

    def _observe_misses(self, record: RequestRecord, s: Series) -> None:
        # Every cause of an attributed request, zeros included: the series exist at once.
        new, breaker_tokens, routing, evicted, unexplained = s.uncached
        new.inc(max(record.miss_new_tokens or 0, 0))
        breaker_tokens.inc(max(record.miss_breaker_tokens or 0, 0))
        routing.inc(max(record.miss_routing_tokens or 0, 0))
        evicted.inc(max(record.miss_evicted_tokens or 0, 0))
        unexplained.inc(max(record.miss_unexplained_tokens or 0, 0))
        breaker = record.miss_breaker_tokens or 0
        for rule in record.miss_breaker_rules or ():
            if breaker > 0 and _REASON_OK.match(rule):
                self._child(self.breaker_tokens, rule).inc(breaker)

    def _observe_schedule(self, record: RequestRecord) -> None:
        reason = record.schedule_reason
        if reason is None or not record.backend or not _REASON_OK.match(reason):
            return
        self._child(self.schedule_decisions, record.backend, reason).inc()
        held = record.held_ms
        if held is not None and held > 0 and math.isfinite(held):
            self._child(self.held, record.backend).observe(held / 1000.0)

    def _observe_latencies(self, record: RequestRecord, s: Series) -> None:
        for name, ms in (
            ("ttft", record.ttft_ms),
            ("ttfvt", record.ttfvt_ms),
            ("tpot", record.tpot_ms),
            ("duration", record.e2e_ms),
        ):
            if ms is not None and ms >= 0 and math.isfinite(ms):  # ``_positive``
                getattr(s, name).observe(ms / 1000.0)
        if record.backend is not None:
            overhead = _positive(record.proxy_overhead_ms)
            if overhead is not None:
                self.overhead.observe(overhead / 1000.0)
