"""The per-request record: one object, one canonical JSON log line per request.

`RequestRecord` is the schema shared by the proxy (which writes it) and the analyzers (which read
it). Field names are a public contract: later features add fields, none is renamed.

`RecordBuilder` turns what the relay observed (timestamps, usage, backend timings) into the
derived figures: TTFT, time to first visible token, TPOT, savings and whether the SLO was met.
`RecordWriter` fans a finished record out to its sinks (the structlog line, metrics, stats, the
prefix index) after the response has ended, so none of that sits on the client's critical path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import structlog

CachedSource = Literal["reported", "unknown"]
TimingSource = Literal["observed", "backend", "none"]


@dataclass(slots=True)
class RequestRecord:
    """Everything prefixgate knows about one request, once it has ended."""

    ts: str
    request_id: str
    route: str
    model: str | None
    backend: str | None
    stream: bool
    status: int
    error: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    cached_tokens_source: CachedSource = "unknown"
    completion_tokens: int | None = None
    ttft_ms: float | None = None
    ttfvt_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float = 0.0
    backend_prefill_ms: float | None = None
    proxy_overhead_ms: float = 0.0
    saved_prefill_ms: float | None = None
    saved_usd: float | None = None
    slo_met: bool | None = None
    # Added by later features (never renamed):
    dialect: str | None = None
    timing_source: TimingSource = "none"
    reasoning_tokens: int | None = None
    tenant: str | None = None
    prompt_bytes: int = 0
    predicted_cached_tokens: int | None = None
    prefix_anchor: str | None = None
    prefix_blocks: int = 0
    canonical_rules: list[str] = field(default_factory=list)
    cache_source: str | None = None
    """llama.cpp: where the replica's cache model expects the cached tokens from: ``slot``,
    ``ram`` (its RAM prompt cache), ``none``; None where no model applies."""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The record as the flat JSON object written to the log (``extra`` merged in)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out["hit_rate"] = _rate(self.hit_rate)
        out["predicted_hit_rate"] = _rate(self.predicted_hit_rate)
        out.update(self.extra)
        return out

    @property
    def predicted_hit_rate(self) -> float | None:
        """Share of prompt tokens the prefix index predicted would come from cache."""
        if self.predicted_cached_tokens is None or not self.prompt_tokens:
            return None
        return min(self.predicted_cached_tokens / self.prompt_tokens, 1.0)

    @property
    def hit_rate(self) -> float | None:
        """Measured share of prompt tokens served from cache, or None when unknown."""
        if self.cached_tokens is None or not self.prompt_tokens:
            return None
        return self.cached_tokens / self.prompt_tokens


def _rate(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def utc_now_iso() -> str:
    """The current time as an ISO 8601 UTC string with milliseconds."""
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(slots=True)
class Observation:
    """What the relay saw of one response, in monotonic seconds (``time.perf_counter``)."""

    t_start: float
    t_body_read: float | None = None
    t_forward: float | None = None
    t_first_token: float | None = None
    t_first_visible: float | None = None
    t_last_token: float | None = None
    t_end: float | None = None
    inspect_s: float = 0.0
    token_events: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    backend_prefill_ms: float | None = None
    backend_decode_ms: float | None = None
    backend_tpot_ms: float | None = None
    backend_prompt_processed: int | None = None


class PrefillRate:
    """Running estimate of a backend's prefill cost in milliseconds per uncached prompt token.

    Fed from requests that processed enough uncached tokens for the rate to mean something;
    token-weighted exponential average so one odd request does not swing it.
    """

    MIN_TOKENS = 32

    def __init__(self, *, alpha: float = 0.2) -> None:
        self._alpha = alpha
        self._rates: dict[str, float] = {}

    def observe(self, key: str, uncached_tokens: int | None, prefill_ms: float | None) -> None:
        """Fold one request's prefill time into the estimate for ``key``."""
        if not uncached_tokens or uncached_tokens < self.MIN_TOKENS or not prefill_ms:
            return
        rate = prefill_ms / uncached_tokens
        old = self._rates.get(key)
        self._rates[key] = rate if old is None else old + self._alpha * (rate - old)

    def ms_per_token(self, key: str) -> float | None:
        """Current estimate for ``key`` or None before the first usable observation."""
        return self._rates.get(key)


@dataclass(frozen=True, slots=True)
class Pricing:
    """Prices in USD per million input tokens, full and served from cache."""

    input_per_mtok: float | None = None
    cached_input_per_mtok: float | None = None

    def saved_usd(self, cached_tokens: int | None) -> float | None:
        if cached_tokens is None or self.input_per_mtok is None:
            return None
        cached_price = self.cached_input_per_mtok if self.cached_input_per_mtok is not None else 0.0
        return round(cached_tokens * (self.input_per_mtok - cached_price) / 1e6, 9)


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives; a request meets the SLO when it succeeded within both."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, status: int, ttft_ms: float | None, tpot_ms: float | None) -> bool | None:
        if self.ttft_ms is None and self.tpot_ms is None:
            return None
        if status >= 400:
            return False
        if self.ttft_ms is not None and (ttft_ms is None or ttft_ms > self.ttft_ms):
            return False
        return not (self.tpot_ms is not None and tpot_ms is not None and tpot_ms > self.tpot_ms)


def _ms(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    return round((b - a) * 1000.0, 3)


def _waited_ms(
    stream: bool, source: TimingSource, ttft: float | None, ttfvt: float | None
) -> float | None:
    """What the SLO's first-token objective is judged on: the time until the user saw something.

    On a stream timed at the proxy that is the first *visible* token (content or a tool call;
    a reasoning model's thinking is not shown), and a stream that showed nothing has none. A
    non-streamed response arrives whole: its derived TTFT.
    """
    if stream and source == "observed":
        return ttfvt
    return ttft


def derive_latencies(
    obs: Observation, *, stream: bool
) -> tuple[float | None, float | None, float | None, TimingSource]:
    """TTFT, time to first visible token and TPOT for one response, and where they came from.

    Streams are timed as observed at the proxy. A non-streamed response shows no first token, so
    TTFT is derived from the backend's own decode time when it reports one (end-to-end minus
    decode), and TPOT is the backend's per-token decode time.
    """
    if stream and obs.t_first_token is not None:
        ttft = _ms(obs.t_start, obs.t_first_token)
        ttfvt = _ms(obs.t_start, obs.t_first_visible)
        tpot = None
        n = obs.completion_tokens
        if n is None or n < 2:
            n = obs.token_events if obs.token_events >= 2 else None
        if n is not None and n >= 2 and obs.t_last_token is not None:
            span = _ms(obs.t_first_token, obs.t_last_token)
            tpot = round(span / (n - 1), 3) if span is not None else None
        return ttft, ttfvt, tpot, "observed"
    if not stream and obs.t_end is not None and obs.backend_decode_ms is not None:
        e2e = (obs.t_end - obs.t_start) * 1000.0
        ttft = round(max(e2e - obs.backend_decode_ms, 0.0), 3)
        return ttft, None, obs.backend_tpot_ms, "backend"
    return None, None, None, "none"


RecordSink = Callable[[RequestRecord], Awaitable[None] | None]


class RecordWriter:
    """Delivers finished records to their sinks, off the request's critical path.

    The structlog line is written synchronously (it is cheap and must never be lost); async
    sinks (statistics, the prefix index) run as background tasks that are tracked so shutdown
    can drain them.
    """

    def __init__(self, *, logger: structlog.typing.FilteringBoundLogger) -> None:
        self._log = logger
        self._sinks: list[RecordSink] = []
        self._tasks: set[asyncio.Future[None]] = set()

    def add_sink(self, sink: RecordSink) -> None:
        self._sinks.append(sink)

    def emit(self, record: RequestRecord) -> None:
        """Write the canonical log line and hand the record to every sink."""
        self._log.info("request", **record.as_dict())
        for sink in self._sinks:
            try:
                result = sink(record)
            except Exception:  # a sink must never break the traffic it observes
                self._log.exception("record_sink_failed", sink=repr(sink))
                continue
            if result is not None:
                self.spawn(result)

    def spawn(self, aw: Awaitable[None]) -> None:
        """Run background work for a finished request (tracked, errors logged)."""
        task = asyncio.ensure_future(aw)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._log.error("record_sink_failed", exc_info=exc)

    async def drain(self, limit_s: float = 5.0) -> None:
        """Wait (bounded) for background sink work, e.g. at shutdown or in tests."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=limit_s)

    @property
    def pending(self) -> Sequence[asyncio.Future[None]]:
        return tuple(self._tasks)


def monotonic() -> float:
    """The clock every latency in a record is measured with."""
    return time.perf_counter()


class RecordBuilder:
    """Turns an ended exchange's observations into a ``RequestRecord``.

    Holds the per-backend prefill-rate estimate used to price cache hits in milliseconds.
    """

    def __init__(self, *, slo: Slo, pricing: Pricing) -> None:
        self.slo = slo
        self.pricing = pricing
        self.prefill = PrefillRate()

    def build(
        self,
        obs: Observation,
        *,
        ts: str,
        request_id: str,
        route: str,
        model: str | None,
        backend: str | None,
        dialect: str | None,
        stream: bool,
        status: int,
        error: str | None,
    ) -> RequestRecord:
        t_end = obs.t_end if obs.t_end is not None else monotonic()
        ttft, ttfvt, tpot, source = derive_latencies(obs, stream=stream)
        cached = obs.cached_tokens
        overhead = obs.inspect_s
        if obs.t_forward is not None:
            overhead += obs.t_forward - (obs.t_body_read or obs.t_start)
        rate_key = backend or ""
        ms_per_token = self.prefill.ms_per_token(rate_key)
        saved_ms = None
        if cached is not None and ms_per_token is not None:
            saved_ms = round(cached * ms_per_token, 3)
        uncached = None
        if obs.prompt_tokens is not None:
            uncached = obs.backend_prompt_processed
            if uncached is None:
                uncached = obs.prompt_tokens - (cached or 0)
        if status < 400 and error is None:
            self.prefill.observe(rate_key, uncached, obs.backend_prefill_ms or ttft)
        return RequestRecord(
            ts=ts,
            request_id=request_id,
            route=route,
            model=model,
            backend=backend,
            stream=stream,
            status=status,
            error=error,
            prompt_tokens=obs.prompt_tokens,
            cached_tokens=cached,
            cached_tokens_source="reported" if cached is not None else "unknown",
            completion_tokens=obs.completion_tokens,
            ttft_ms=ttft,
            ttfvt_ms=ttfvt,
            tpot_ms=tpot,
            e2e_ms=round((t_end - obs.t_start) * 1000.0, 3),
            backend_prefill_ms=obs.backend_prefill_ms,
            proxy_overhead_ms=round(overhead * 1000.0, 3),
            saved_prefill_ms=saved_ms,
            saved_usd=self.pricing.saved_usd(cached),
            slo_met=self.slo.met(
                status if error is None else 599, _waited_ms(stream, source, ttft, ttfvt), tpot
            ),
            dialect=dialect,
            timing_source=source,
            reasoning_tokens=obs.reasoning_tokens,
        )
