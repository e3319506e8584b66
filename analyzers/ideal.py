"""The unbounded prefix cache: what caching could have saved at best, beside what it did.

Requests are replayed in timestamp order through a cache that never evicts. A request's cached
tokens are the tokens of its leading keys already seen (capped at its prompt length). Because a
key stands for its whole prefix, the keys already seen always form a leading run of a request's
chain, so the run's length is found by binary search: the replay costs O(log n) lookups per
request plus one C-level set update, not a Python step per block.

Measured hit rates come from records that carry ``cached_tokens`` (what the backend said it
served from cache); ``None`` (not reported) is kept apart from zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from analyzers.trace import PrefixKey, TraceRequest
from proxy.fingerprint import leading_run


@dataclass(slots=True)
class IdealReplay:
    """Per-request results of the unbounded replay and their totals."""

    hit_keys: list[int] = field(default_factory=list)
    cached: list[float] = field(default_factory=list)
    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    footprint_tokens: float = 0.0  # cache space of all distinct keys: the size that is enough
    unique_keys: int = 0

    @property
    def hit_rate(self) -> float:
        """Token-weighted ideal hit rate."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def request_hit_rate(self, requests: Sequence[TraceRequest]) -> float:
        """Mean of the per-request ideal hit rates (requests with a prompt)."""
        rates = [
            c / r.prompt_tokens
            for c, r in zip(self.cached, requests, strict=True)
            if r.prompt_tokens
        ]
        return sum(rates) / len(rates) if rates else 0.0


def replay_unbounded(requests: Sequence[TraceRequest]) -> IdealReplay:
    """Replay requests (already in timestamp order) through a cache that never evicts."""
    out = IdealReplay()
    seen: set[PrefixKey] = set()
    hit_keys = out.hit_keys
    cached = out.cached
    total_prompt = total_cached = footprint = 0.0
    for r in requests:
        keys = r.keys
        k = leading_run(keys, seen)
        hit = r.tokens_upto(k)
        hit_keys.append(k)
        cached.append(hit)
        total_prompt += r.prompt_tokens
        total_cached += hit
        if k < len(keys):
            footprint += r.charge(k, len(keys))
            seen.update(keys[k:])  # the leading k are there already (prefix-closed)
    out.prompt_tokens = total_prompt
    out.cached_tokens = total_cached
    out.footprint_tokens = footprint
    out.unique_keys = len(seen)
    return out


@dataclass(frozen=True, slots=True)
class Measured:
    """What backends reported, over the requests that reported it, beside the ideal there."""

    requests: int
    prompt_tokens: float
    cached_tokens: float
    ideal_cached_tokens: float
    request_hit_rate: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gap(self) -> float:
        """Ideal minus measured, token-weighted, on the same requests."""
        return self.ideal_hit_rate - self.hit_rate


def measured(requests: Sequence[TraceRequest], ideal: IdealReplay) -> Measured | None:
    """Measured hit rates, or None when no request has ``cached_tokens``."""
    n = 0
    prompt = cached = ideal_cached = rate_sum = 0.0
    for r, best in zip(requests, ideal.cached, strict=True):
        if r.cached_tokens is None or not r.prompt_tokens:
            continue
        n += 1
        prompt += r.prompt_tokens
        cached += r.cached_tokens
        ideal_cached += best
        rate_sum += r.cached_tokens / r.prompt_tokens
    if not n:
        return None
    return Measured(n, prompt, cached, ideal_cached, rate_sum / n)


@dataclass(frozen=True, slots=True)
class TimeBucket:
    """Hit rates over one slice of the run."""

    start: float  # seconds from the first request
    requests: int
    ideal_hit_rate: float
    measured_hit_rate: float | None


def timeline(
    requests: Sequence[TraceRequest], ideal: IdealReplay, *, buckets: int = 40
) -> list[TimeBucket]:
    """Token-weighted ideal (and measured, where reported) hit rate over time."""
    if not requests:
        return []
    t0, t1 = requests[0].ts, requests[-1].ts
    width = (t1 - t0) / buckets if t1 > t0 else 1.0
    n = buckets if t1 > t0 else 1
    prompt = [0.0] * n
    best = [0.0] * n
    count = [0] * n
    m_prompt = [0.0] * n
    m_cached = [0.0] * n
    for r, c in zip(requests, ideal.cached, strict=True):
        i = min(int((r.ts - t0) / width), n - 1)
        count[i] += 1
        prompt[i] += r.prompt_tokens
        best[i] += c
        if r.cached_tokens is not None:
            m_prompt[i] += r.prompt_tokens
            m_cached[i] += r.cached_tokens
    return [
        TimeBucket(
            start=i * width,
            requests=count[i],
            ideal_hit_rate=best[i] / prompt[i] if prompt[i] else 0.0,
            measured_hit_rate=m_cached[i] / m_prompt[i] if m_prompt[i] else None,
        )
        for i in range(n)
        if count[i]
    ]
