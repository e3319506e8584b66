"""The per-request record: one object, one canonical JSON log line per request.

`RequestRecord` is the schema shared by the proxy (which writes it) and the analyzers (which read
it): every key of the line is a typed, described attribute, and the published JSON Schema
(``docs/schemas/record-v1.schema.json``, ``proxy.record_schema``) is generated from it. Field names
are a public contract: later features add fields, none is renamed.

`RecordBuilder` turns what the relay observed (timestamps, usage, backend timings) into the
derived figures: TTFT, time to first visible token, TPOT, savings and whether the SLO was met;
``proxy.exchange.build_record`` adds what the other stages handed on, and
``proxy.record_writer.RecordWriter`` delivers it (the log line, the sinks, the learners).
"""

from __future__ import annotations

import dataclasses
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

CachedSource = Literal["reported", "unknown"]
TimingSource = Literal["observed", "backend", "none"]

RECORD_EVENT = "request"
"""The ``event`` of a record's log line (what the analyzer recognises records by)."""

DOC = "doc"
ONLY_WHEN_SET = "only_when_set"
SCHEMA = "schema"


def doc(text: str) -> dict[str, Any]:
    """The metadata of a record field present in every record: its description."""
    return {DOC: text}


def when_set(text: str, *, schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metadata of a record field written only for the requests it applies to (absent from
    the line, never null, when None; declare it ``= field(default=None, metadata=when_set(…))``).

    ``schema``: the field's JSON Schema where its Python type does not say enough.
    """
    meta: dict[str, Any] = {DOC: text, ONLY_WHEN_SET: True}
    if schema is not None:
        meta[SCHEMA] = schema
    return meta


@dataclass(slots=True)
class RequestRecord:
    """Everything prefixgate knows about one request, once it has ended.

    Every key of the log line is a typed attribute here, and its description is the one the
    published schema (``docs/schemas/record-v1.schema.json``) carries. To add one: declare it
    below with ``metadata=doc(…)`` (in every record; with a default unless every record must
    set it) or ``default=None, metadata=when_set(…)`` (only for the requests it applies to;
    absent from the line when None), set it where the record is built
    (``proxy.exchange.build_record``), and regenerate the schema
    (``python -m proxy.record_schema --write``; a test fails while it is stale). Field names are
    a public contract: fields are added, never renamed.
    """

    ts: str = field(metadata=doc("When the request arrived (ISO 8601, UTC, milliseconds)."))
    request_id: str = field(
        metadata=doc("The request id (the X-Request-Id the client sent, or a new one).")
    )
    route: str = field(metadata=doc("The path the request was sent to, e.g. /v1/chat/completions."))
    model: str | None = field(
        metadata=doc("The model the request named (else the replica's model).")
    )
    backend: str | None = field(
        metadata=doc("Base URL of the replica that served it; null: none was chosen.")
    )
    stream: bool = field(metadata=doc("Whether the client asked for a streamed answer."))
    status: int = field(
        metadata=doc("HTTP status the client got (499: the client went away first).")
    )
    error: str | None = field(
        default=None, metadata=doc("Error type when the request failed (OpenAI error type).")
    )
    prompt_tokens: int | None = field(
        default=None, metadata=doc("Prompt tokens, as the backend reported them.")
    )
    cached_tokens: int | None = field(
        default=None,
        metadata=doc("Prompt tokens the backend served from its cache; null: it did not report."),
    )
    cached_tokens_source: CachedSource = field(
        default="unknown",
        metadata=doc("``reported`` when the backend reported cached tokens, else ``unknown``."),
    )
    completion_tokens: int | None = field(
        default=None, metadata=doc("Completion tokens, as the backend reported them.")
    )
    ttft_ms: float | None = field(default=None, metadata=doc("Time to first token, milliseconds."))
    ttfvt_ms: float | None = field(
        default=None, metadata=doc("Time to first visible (non-reasoning) token, ms.")
    )
    tpot_ms: float | None = field(
        default=None, metadata=doc("Time per output token after the first, milliseconds.")
    )
    e2e_ms: float = field(default=0.0, metadata=doc("Arrival to the answer's end, milliseconds."))
    backend_prefill_ms: float | None = field(
        default=None, metadata=doc("Prefill time the backend reported, ms.")
    )
    proxy_overhead_ms: float = field(
        default=0.0,
        metadata=doc(
            "The proxy's own time on the critical path (time held by the scheduler excluded), ms."
        ),
    )
    saved_prefill_ms: float | None = field(
        default=None,
        metadata=doc(
            "Prefill time the cached tokens saved, at the replica's measured prefill rate, ms."
        ),
    )
    saved_usd: float | None = field(
        default=None, metadata=doc("What the cached tokens saved at the configured prices.")
    )
    slo_met: bool | None = field(
        default=None, metadata=doc("Whether the request met the SLO; null: no SLO is set.")
    )
    # Added by later features (never renamed):
    dialect: str | None = field(
        default=None, metadata=doc("The replica's server kind (its dialect name).")
    )
    timing_source: TimingSource = field(
        default="none",
        metadata=doc(
            "Where TTFT/TPOT came from: ``observed`` (stream), ``backend`` (its timings), ``none``."
        ),
    )
    reasoning_tokens: int | None = field(
        default=None, metadata=doc("Reasoning tokens, as the backend reported them.")
    )
    tenant: str | None = field(
        default=None, metadata=doc("The tenant (API key's tenant or tenant header), if any.")
    )
    prompt_bytes: int = field(
        default=0, metadata=doc("Bytes of the rendered prompt the fingerprint hashed.")
    )
    predicted_cached_tokens: int | None = field(
        default=None,
        metadata=doc(
            "Cached tokens predicted before the request was sent (prefix index or cache model)."
        ),
    )
    prefix_anchor: str | None = field(
        default=None,
        metadata=doc("Hash of the request's first block (16 hex digits): its application prefix."),
    )
    prefix_blocks: int = field(
        default=0, metadata=doc("Whole blocks of the rendered prompt (the index's unit).")
    )
    canonical_rules: list[str] = field(
        default_factory=list, metadata=doc("Canonicalization rules that changed the request.")
    )
    cache_source: str | None = field(
        default=None,
        metadata=doc(
            "Where the replica's cache model expects the cached tokens from: ``slot``, "
            "``ram`` (its RAM prompt cache) or ``none``; null where no model applies."
        ),
    )
    # Only for the requests they apply to (absent from the line when None):
    canonical_dry_run_rules: list[str] | None = field(
        default=None, metadata=when_set("Rules that would have fired (dry-run mode).")
    )
    canonical_notes_restored: int | None = field(
        default=None,
        metadata=when_set("Notes of earlier turns put back as the proxy first wrote them."),
    )
    canonical_note_values_omitted: int | None = field(
        default=None,
        metadata=when_set("Volatile values left out of the note (unchanged since it was written)."),
    )
    canonical_learned_spans: list[str] | None = field(
        default=None,
        metadata=when_set(
            "Ids of the learned volatile-span patterns whose values were relocated (or, with "
            "volatile_learned in dry-run, would have been); see /stats canonical.learned_spans."
        ),
    )
    canonical_stable_bytes: dict[str, int] | None = field(
        default=None,
        metadata=when_set(
            "Per rule that fired (or would have), the rendered-prompt bytes it made stable."
        ),
    )
    affinity_key: str | None = field(
        default=None,
        metadata=when_set(
            "Keyed hash of the client's conversation key (16 hex digits), never the key itself."
        ),
    )
    affinity_source: str | None = field(
        default=None,
        metadata=when_set(
            "Where the conversation key came from: ``prompt_cache_key`` or a header's name."
        ),
    )
    control_group: bool | None = field(
        default=None,
        metadata=when_set(
            "With a control group configured (--control-share): true when the request's "
            "conversation is in it (forwarded as the client sent it, routed plainly), else false."
        ),
    )
    hosted_fields_stripped: list[str] | None = field(
        default=None, metadata=when_set("Hosted-API-only fields removed for the replica's server.")
    )
    route_reason: str | None = field(
        default=None, metadata=when_set("Why the replica was chosen (affinity, miss, retry, ...).")
    )
    template_clock: str | None = field(
        default=None,
        metadata=when_set(
            "The replica's chat template prints the clock: ``time`` or ``date`` (it changes "
            "the prompt the model sees)."
        ),
    )
    replica_load: float | None = field(
        default=None, metadata=when_set("The chosen replica's load when it was chosen.")
    )
    retried_from: str | None = field(
        default=None,
        metadata=when_set(
            "The replica that failed before the client saw a byte (the request was sent again)."
        ),
    )
    prefix_block_bytes: int | None = field(
        default=None, metadata=when_set("Block size of the fingerprint, bytes.")
    )
    prefix_matched_blocks: int | None = field(
        default=None,
        metadata=when_set("Leading blocks the prefix index said the chosen replica holds."),
    )
    prefix_segments: list[list[Any]] | None = field(
        default=None,
        metadata=when_set(
            "The rendered prompt's segments, ``[hash (16 hex), end offset in bytes, kind]`` each "
            "(the first 512).",
            schema={
                "type": "array",
                "items": {
                    "type": "array",
                    "prefixItems": [
                        {"type": "string", "pattern": "^[0-9a-f]{16}$"},
                        {"type": "integer", "minimum": 0},
                        {"type": "string"},
                    ],
                    "minItems": 3,
                    "maxItems": 3,
                },
            },
        ),
    )
    miss_new_tokens: int | None = field(
        default=None,
        metadata=when_set(
            "Uncached prompt tokens no earlier request in the index's window shared (miss "
            "attribution: the five ``miss_*_tokens`` add up to ``prompt_tokens - cached_tokens``)."
        ),
    )
    miss_breaker_tokens: int | None = field(
        default=None,
        metadata=when_set(
            "Uncached prompt tokens an earlier request shared but for a span a canonicalizer "
            "rule in dry-run would fix (``miss_breaker_rules``)."
        ),
    )
    miss_breaker_rules: list[str] | None = field(
        default=None,
        metadata=when_set(
            "The dry-run rules behind ``miss_breaker_tokens``, the largest stable-bytes gain "
            "first (the likeliest breaker)."
        ),
    )
    miss_routing_tokens: int | None = field(
        default=None,
        metadata=when_set(
            "Uncached prompt tokens another replica (or slot) held that the chosen one did not."
        ),
    )
    miss_routing_why: str | None = field(
        default=None,
        metadata=when_set(
            "Why the replica or slot holding more was passed over: ``load_gate``, ``health``, "
            "``round_robin``, ``least_loaded``, ``min_affinity``, ``affinity_key``, ``retry``, "
            "``slot``, ``stale``."
        ),
    )
    miss_evicted_tokens: int | None = field(
        default=None,
        metadata=when_set(
            "Uncached prompt tokens the chosen replica held by its cache model (or the index) "
            "but the backend did not serve (capacity, eviction, a restart)."
        ),
    )
    miss_unexplained_tokens: int | None = field(
        default=None,
        metadata=when_set(
            "Uncached prompt tokens no cause accounts for (index unavailable, or a shortfall "
            "within one index block of the prediction)."
        ),
    )
    body: dict[str, Any] | None = field(
        default=None, metadata=when_set("The request as sent, redacted (only with --log-prompts).")
    )
    schedule_reason: str | None = field(
        default=None,
        metadata=when_set(
            "The scheduler's decision (llama.cpp slot placement or prefill coalescing)."
        ),
    )
    held_ms: float | None = field(
        default=None, metadata=when_set("Time the scheduler held the request before sending, ms.")
    )
    slot: int | None = field(
        default=None, metadata=when_set("The llama.cpp slot the request was pinned to or ran in.")
    )

    def as_dict(self) -> dict[str, Any]:
        """The record as the flat JSON object written to the log.

        Fields in every record first, then the two hit rates, then the fields that are set.
        """
        out = dict(zip(_ALWAYS, _always(self), strict=True))
        out["hit_rate"] = _rate(self.hit_rate)
        out["predicted_hit_rate"] = _rate(self.predicted_hit_rate)
        for name, value in zip(_WHEN_SET, _when_set(self), strict=True):
            if value is not None:
                out[name] = value
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


_ALWAYS = tuple(
    f.name for f in dataclasses.fields(RequestRecord) if not f.metadata.get(ONLY_WHEN_SET)
)
_WHEN_SET = tuple(
    f.name for f in dataclasses.fields(RequestRecord) if f.metadata.get(ONLY_WHEN_SET)
)
_always = operator.attrgetter(*_ALWAYS)  # every field's value in one call
_when_set = operator.attrgetter(*_WHEN_SET)
DERIVED = {
    "hit_rate": "Measured share of prompt tokens served from cache (4 decimals); null: unknown.",
    "predicted_hit_rate": "Predicted share of prompt tokens from cache (4 decimals, at most 1).",
}
"""Keys of the line computed from fields (the properties of the same names)."""
RECORD_KEYS = frozenset((*_ALWAYS, *DERIVED, *_WHEN_SET))
"""Every key a record's JSON object may have (its log line adds ``event``, ``level`` and
``logged_at``)."""


def record_key(name: str) -> str:
    """``name``, checked to be a key of the record's JSON object (readers name keys with it).

    Raises ``KeyError`` at once (at import time, where readers call it) for a key the record does
    not have, so a reader cannot drift from the definition.
    """
    if name not in RECORD_KEYS:
        raise KeyError(f"{name!r} is not a field of RequestRecord")
    return name


def _rate(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


@dataclass(slots=True)
class Observation:
    """What the relay saw of one response, in monotonic seconds (``time.perf_counter``)."""

    t_start: float
    t_body_read: float | None = None
    t_canonical: float | None = None
    """Canonicalized (or, in the control group, left as it was)."""
    t_lookup: float | None = None
    """Fingerprinted and looked up in the prefix index."""
    t_routed: float | None = None
    """The replica chosen."""
    t_admitted: float | None = None
    """Past the scheduler (placed on a slot, or released from a hold)."""
    t_forward: float | None = None
    t_headers: float | None = None
    """The backend's status line and headers arrived."""
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


monotonic: Callable[[], float] = time.perf_counter
"""The clock every latency in a record is measured with (the C function itself, not a wrapper:
a request reads it some fifty times, twice per read of its answer)."""


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
