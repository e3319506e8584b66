"""One request as the analyzer sees it, whatever file it came from.

Every input format is reduced to a chain of *prefix keys*: key ``i`` stands for the first
``i + 1`` blocks (or segments) of the prompt and everything before them, so two requests share
their first ``k`` keys exactly when they share that much of their prompt. Keys are block ids
from public traces (ints, namespaced per file), chained block hashes from re-fingerprinted
bodies (ints), or cumulative segment hashes from prefixgate records (kept as their hex strings:
parsing them would only cost time).

Token accounting: key ``i`` ends at ``tokens_upto(i + 1)`` tokens, which is either a uniform
block size (traces, re-fingerprinted bodies) or a per-key cumulative table times a scale
(segment end offsets in bytes times the record's tokens per byte), always capped at the
request's prompt length (the last block of a trace may be partial).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from analyzers.misses import MissTotals

PrefixKey: TypeAlias = Hashable  # an int block id or hash, or a hex segment hash


class TraceRequest:
    """A request reduced to its prefix keys, token counts and what was measured for it."""

    __slots__ = (
        "affinity_key",
        "anchor",
        "backend",
        "block_tokens",
        "body",
        "cached_tokens",
        "canonical_rules",
        "cum_tokens",
        "keys",
        "kinds",
        "model",
        "prompt_tokens",
        "route",
        "slo_met",
        "source",
        "stable_keys",
        "tenant",
        "token_scale",
        "tpot_ms",
        "ts",
        "ttft_ms",
    )

    def __init__(
        self,
        *,
        ts: float,
        source: str,
        keys: Sequence[PrefixKey],
        prompt_tokens: float,
        block_tokens: float = 0.0,
        cum_tokens: Sequence[float] | None = None,
        token_scale: float = 1.0,
        kinds: Sequence[str] | None = None,
        stable_keys: int = 0,
        anchor: int | None = None,
        cached_tokens: int | None = None,
        ttft_ms: float | None = None,
        tpot_ms: float | None = None,
        slo_met: bool | None = None,
        backend: str | None = None,
        model: str | None = None,
        tenant: str | None = None,
        route: str | None = None,
        body: dict[str, Any] | None = None,
        canonical_rules: Sequence[str] = (),
        affinity_key: int | None = None,
    ) -> None:
        self.ts = ts
        self.source = source
        self.keys = keys
        self.prompt_tokens = prompt_tokens
        self.block_tokens = block_tokens
        self.cum_tokens = cum_tokens
        self.token_scale = token_scale
        self.kinds = kinds
        self.stable_keys = stable_keys
        self.anchor = anchor
        self.cached_tokens = cached_tokens
        self.ttft_ms = ttft_ms
        self.tpot_ms = tpot_ms
        self.slo_met = slo_met
        self.backend = backend
        self.model = model
        self.tenant = tenant
        self.route = route
        self.body = body
        self.canonical_rules = canonical_rules
        self.affinity_key = affinity_key  # the conversation key as the proxy hashed it

    def tokens_upto(self, n_keys: int) -> float:
        """Tokens covered by the first ``n_keys`` keys, capped at the prompt length."""
        if n_keys <= 0:
            return 0.0
        cum = self.cum_tokens
        if cum is None:
            return min(n_keys * self.block_tokens, self.prompt_tokens)
        return min(cum[n_keys - 1] * self.token_scale, self.prompt_tokens)

    def charge(self, lo: int, hi: int) -> float:
        """Cache space of keys ``lo`` to ``hi`` (a partial last block takes a whole block)."""
        if hi <= lo:
            return 0.0
        cum = self.cum_tokens
        if cum is None:
            return (hi - lo) * self.block_tokens
        return (cum[hi - 1] - (cum[lo - 1] if lo else 0.0)) * self.token_scale

    @property
    def app(self) -> PrefixKey | None:
        """The application prompt this request belongs to: its anchor, else its first key."""
        if self.anchor is not None:
            return self.anchor
        return self.keys[0] if self.keys else None


@dataclass(slots=True)
class Trace:
    """All requests read from the inputs, in timestamp order, and what was learnt reading."""

    requests: list[TraceRequest] = field(default_factory=list)
    formats: dict[str, str] = field(default_factory=dict)  # path -> detected format
    granularity: set[str] = field(default_factory=set)  # "block", "segment"
    skipped: int = 0  # lines that were not requests (other log events, blank, unreadable)
    errors: int = 0  # requests that failed (status >= 400): not replayed through the cache
    errors_slo_missed: int = 0  # of those, how many were marked as missing the SLO
    without_prefix: int = 0  # records with neither prefix segments nor a body
    notes: list[str] = field(default_factory=list)
    template_clocks: dict[str, str] = field(default_factory=dict)
    """Backends whose chat template prints the ``date`` or ``time`` into every prompt (from the
    records' ``template_clock``)."""
    misses: MissTotals = field(default_factory=MissTotals)
    """The records' miss attribution, added up (``analyzers.misses``)."""
    learned_spans: dict[str, int] = field(default_factory=dict)
    """Requests per learned volatile-span pattern id whose value the proxy relocated (from the
    records' ``canonical_learned_spans``)."""

    def sort(self) -> None:
        """Put requests in timestamp order (stable: file order breaks ties)."""
        self.requests.sort(key=_ts)


def _ts(request: TraceRequest) -> float:
    return request.ts
