"""Provider caching rules that turn an ideal hit into a miss.

- **Minimum cacheable length.** Hosted providers cache only prompts of at least a minimum
  length (OpenAI: 1,024 tokens), so shared prefixes shorter than that are recomputed anyway.
- **Spread.** Each backend replica has its own cache: an application prompt served by several
  replicas is prefilled once per replica. Requests with the same anchor spread over more than
  the allowed number of backends cost ``(backends - allowed) * prompt tokens`` extra prefill.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from analyzers.ideal import IdealReplay
from analyzers.trace import TraceRequest
from proxy.fingerprint import hex64

DEFAULT_MIN_CACHEABLE_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class SpreadPrompt:
    """An application prompt whose requests went to more backends than allowed."""

    app: str
    requests: int
    backends: dict[str, int]
    stable_tokens: int
    extra_prefill_tokens: int


@dataclass(frozen=True, slots=True)
class ProviderRules:
    """What a minimum cacheable length and backend spread cost against the ideal."""

    min_cacheable_tokens: int
    short_prompt_requests: int  # prompts below the minimum: never cached by such a provider
    short_prefix_requests: int  # ideal hits shorter than the minimum
    short_prefix_tokens: int  # ideal cached tokens those hits account for
    hit_rate_with_minimum: float  # the ideal hit rate once the minimum applies
    max_backends_per_prompt: int
    spread: list[SpreadPrompt] = field(default_factory=list)
    spread_extra_tokens: int = 0


def provider_rules(
    requests: Sequence[TraceRequest],
    ideal: IdealReplay,
    *,
    min_cacheable_tokens: int = DEFAULT_MIN_CACHEABLE_TOKENS,
    max_backends_per_prompt: int = 1,
    top: int = 10,
) -> ProviderRules:
    """Apply the minimum cacheable length and the spread rule to the ideal replay."""
    short_prompts = short_prefixes = 0
    short_tokens = 0.0
    for r, cached in zip(requests, ideal.cached, strict=True):
        if r.prompt_tokens < min_cacheable_tokens:
            short_prompts += 1
        if 0 < cached < min_cacheable_tokens:
            short_prefixes += 1
            short_tokens += cached
    kept = ideal.cached_tokens - short_tokens
    spread, extra = _spread(requests, max_backends_per_prompt, top)
    return ProviderRules(
        min_cacheable_tokens=min_cacheable_tokens,
        short_prompt_requests=short_prompts,
        short_prefix_requests=short_prefixes,
        short_prefix_tokens=round(short_tokens),
        hit_rate_with_minimum=kept / ideal.prompt_tokens if ideal.prompt_tokens else 0.0,
        max_backends_per_prompt=max_backends_per_prompt,
        spread=spread,
        spread_extra_tokens=extra,
    )


def _spread(
    requests: Sequence[TraceRequest], allowed: int, top: int
) -> tuple[list[SpreadPrompt], int]:
    backends: dict[int, Counter[str]] = {}
    stable: dict[int, float] = {}
    for r in requests:
        if r.backend is None or r.anchor is None:
            continue
        backends.setdefault(r.anchor, Counter())[r.backend] += 1
        stable.setdefault(r.anchor, r.tokens_upto(r.stable_keys))
    out: list[SpreadPrompt] = []
    total = 0
    for anchor, counts in backends.items():
        if len(counts) <= allowed:
            continue
        tokens = stable[anchor]
        extra = round((len(counts) - allowed) * tokens)
        total += extra
        out.append(
            SpreadPrompt(
                app=hex64(anchor),
                requests=sum(counts.values()),
                backends=dict(counts.most_common()),
                stable_tokens=round(tokens),
                extra_prefill_tokens=extra,
            )
        )
    out.sort(key=lambda s: (-s.extra_prefill_tokens, -s.requests))
    return out[:top], total
