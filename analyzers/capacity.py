"""Hit rate against cache size: an LRU over prefix keys, replayed at several capacities.

The cache holds keys (blocks or segments), each charged its tokens. A request looks up its
leading run of cached keys, then touches its whole chain from the last key to the first, so a
prefix is always more recently used than anything below it. LRU therefore evicts leaves before
their ancestors, the cached set stays prefix-closed, and the leading run is again a binary
search. Touching is C-level work (``OrderedDict.update`` and ``move_to_end`` driven by
``map``), so one replay of the 12k-request Mooncake conversation trace takes a fraction of a
second.

Capacities are log-spaced up to the trace's footprint (the distinct tokens ever seen: at that
size LRU equals the unbounded cache). The size that reaches 90 % of the ideal hit rate is
located by bisection between the two points that bracket it.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

from analyzers.ideal import IdealReplay
from analyzers.trace import PrefixKey, TraceRequest
from proxy.fingerprint import leading_run

DEFAULT_POINTS = 11  # 1/1024 of the footprint up to the footprint, doubling
TARGET_SHARE = 0.9
_BISECT_STEPS = 4


@dataclass(frozen=True, slots=True)
class CapacityPoint:
    """Token-weighted and per-request hit rate of an LRU cache of ``capacity_tokens``."""

    capacity_tokens: int
    hit_rate: float
    request_hit_rate: float


@dataclass(frozen=True, slots=True)
class CapacityCurve:
    """The LRU curve, the ideal it tends to, and the size that reaches 90 % of that ideal."""

    points: list[CapacityPoint]
    ideal_hit_rate: float
    footprint_tokens: int
    tokens_for_90pct: int | None


def simulate_lru(requests: Sequence[TraceRequest], capacity_tokens: float) -> tuple[float, float]:
    """Token-weighted and mean per-request hit rate of an LRU prefix cache of that size."""
    uniform = _uniform_block(requests)
    if uniform is not None:
        return _simulate_uniform(requests, int(capacity_tokens // uniform))
    cache: OrderedDict[PrefixKey, float] = OrderedDict()
    move = cache.move_to_end
    evict = cache.popitem
    size = 0.0
    hit_tokens: list[float] = []
    for r in requests:
        keys = r.keys
        n = len(keys)
        k = leading_run(keys, cache)
        hit_tokens.append(r.tokens_upto(k))
        if k < n:
            new = keys[n - 1 : k - 1 : -1] if k else keys[::-1]
            cum = r.cum_tokens
            if cum is None:
                cache.update(zip(new, repeat(r.block_tokens)))
            else:
                scale = r.token_scale
                weights = [
                    (cum[i] - (cum[i - 1] if i else 0.0)) * scale for i in range(n - 1, k - 1, -1)
                ]
                cache.update(zip(new, weights, strict=False))
            size += r.charge(k, n)
        if k:
            deque(map(move, keys[k - 1 :: -1]), maxlen=0)
        while size > capacity_tokens and cache:
            size -= evict(last=False)[1]
    return _hit_rates(requests, hit_tokens)


def _uniform_block(requests: Sequence[TraceRequest]) -> float | None:
    """The one block size every request uses, or None (segments, or mixed sizes)."""
    sizes = {r.block_tokens if r.cum_tokens is None else -1.0 for r in requests}
    if len(sizes) == 1:
        (size,) = sizes
        return size if size > 0 else None
    return None


def _simulate_uniform(
    requests: Sequence[TraceRequest], capacity_blocks: int
) -> tuple[float, float]:
    """The same replay when all blocks cost the same: evictions are counted, not summed."""
    od: OrderedDict[PrefixKey, None] = OrderedDict()
    move = od.move_to_end
    evict = od.popitem
    hit_tokens: list[float] = []
    for r in requests:
        keys = r.keys
        n = len(keys)
        k = leading_run(keys, od)
        hit_tokens.append(r.tokens_upto(k))
        if k < n:
            od.update(zip(keys[n - 1 : k - 1 : -1] if k else keys[::-1], repeat(None)))
        if k:
            deque(map(move, keys[k - 1 :: -1]), maxlen=0)
        excess = len(od) - capacity_blocks
        if excess > 0:  # evict the least recent, in C: popitem(last=False) ``excess`` times
            deque(map(evict, repeat(False, excess)), maxlen=0)
    return _hit_rates(requests, hit_tokens)


def _hit_rates(
    requests: Sequence[TraceRequest], hit_tokens: Sequence[float]
) -> tuple[float, float]:
    """Token-weighted and mean per-request hit rate, from each request's hit tokens."""
    total = hits = rate_sum = 0.0
    counted = 0
    for r, hit in zip(requests, hit_tokens, strict=True):
        total += r.prompt_tokens
        hits += hit
        if r.prompt_tokens:
            rate_sum += hit / r.prompt_tokens
            counted += 1
    return (hits / total if total else 0.0), (rate_sum / counted if counted else 0.0)


def default_capacities(footprint_tokens: float, points: int = DEFAULT_POINTS) -> list[int]:
    """``points`` capacities, doubling, ending at the footprint."""
    if footprint_tokens <= 0:
        return []
    caps = {max(1, round(footprint_tokens / 2**i)) for i in range(points)}
    return sorted(caps)


def capacity_curve(
    requests: Sequence[TraceRequest],
    ideal: IdealReplay,
    *,
    capacities: Sequence[int] | None = None,
    points: int = DEFAULT_POINTS,
) -> CapacityCurve:
    """Replay the LRU at each capacity and find the size reaching 90 % of the ideal."""
    footprint = ideal.footprint_tokens
    caps = sorted(set(capacities)) if capacities else default_capacities(footprint, points)
    ideal_request = ideal.request_hit_rate(requests)
    results: dict[int, tuple[float, float]] = {}

    def run(cap: int) -> tuple[float, float]:
        if cap not in results:
            at_least_all = cap >= footprint
            results[cap] = (
                (ideal.hit_rate, ideal_request) if at_least_all else simulate_lru(requests, cap)
            )
        return results[cap]

    curve = [CapacityPoint(cap, *run(cap)) for cap in caps]
    return CapacityCurve(
        points=curve,
        ideal_hit_rate=ideal.hit_rate,
        footprint_tokens=round(footprint),
        tokens_for_90pct=_size_for_share(curve, ideal.hit_rate, footprint, run),
    )


def _size_for_share(
    curve: list[CapacityPoint],
    ideal_hit_rate: float,
    footprint: float,
    run: object,
) -> int | None:
    if ideal_hit_rate <= 0 or not curve:
        return None
    target = TARGET_SHARE * ideal_hit_rate
    assert callable(run)
    above = next((p for p in curve if p.hit_rate >= target), None)
    if above is None:
        above = CapacityPoint(math.ceil(footprint), ideal_hit_rate, 0.0)
    below = max(
        (p for p in curve if p.capacity_tokens < above.capacity_tokens),
        default=None,
        key=lambda p: p.capacity_tokens,
    )
    if below is None:
        return above.capacity_tokens
    lo, hi = below.capacity_tokens, above.capacity_tokens
    for _ in range(_BISECT_STEPS):
        mid = round(math.sqrt(lo * hi))
        if mid in (lo, hi):
            break
        if run(mid)[0] >= target:
            hi = mid
        else:
            lo = mid
    return hi
