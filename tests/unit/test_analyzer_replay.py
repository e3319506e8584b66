"""Cache replays: the unbounded ideal, the LRU capacity curve and the shared-prefix tree."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analyzers.capacity import capacity_curve, default_capacities, simulate_lru
from analyzers.ideal import measured, replay_unbounded, timeline
from analyzers.prefixtree import shared_prefixes
from analyzers.readers import read_paths
from analyzers.trace import TraceRequest
from proxy.fingerprint import leading_run

FIXTURES = Path(__file__).parents[1] / "data" / "analyzer"


def block_request(ts: float, keys: list[int], block: float = 10.0) -> TraceRequest:
    return TraceRequest(
        ts=ts, source="t", keys=keys, prompt_tokens=len(keys) * block, block_tokens=block
    )


@st.composite
def prefix_traces(draw: st.DrawFn, weighted: bool = False) -> list[TraceRequest]:
    """Random traces whose keys identify their prefixes (paths in a random tree)."""
    fresh = itertools.count(1)
    chains: list[list[int]] = []
    requests = []
    for i in range(draw(st.integers(1, 25))):
        if chains and draw(st.booleans()):
            base = draw(st.sampled_from(chains))
            keep = draw(st.integers(0, len(base)))
            chain = base[:keep]
        else:
            chain = []
        chain = chain + [next(fresh) for _ in range(draw(st.integers(0 if chain else 1, 6)))]
        chains.append(chain)
        if weighted:
            cum, total = [], 0.0
            for key in chain:
                total += float(key % 5 + 1)  # a key's weight is a function of the key
                cum.append(total)
            requests.append(
                TraceRequest(
                    ts=float(i), source="t", keys=chain, prompt_tokens=total, cum_tokens=cum
                )
            )
        else:
            requests.append(block_request(float(i), chain))
    return requests


def reference_lru(requests: list[TraceRequest], capacity: float) -> float:
    """A plain list LRU: linear lookups, explicit moves, evict from the old end."""
    order: list[int] = []
    weight: dict[int, float] = {}
    hits = total = 0.0
    for r in requests:
        k = 0
        while k < len(r.keys) and r.keys[k] in order:
            k += 1
        hits += r.tokens_upto(k)
        total += r.prompt_tokens
        for i in range(len(r.keys) - 1, -1, -1):
            key = r.keys[i]
            if key in order:
                order.remove(key)
            weight[key] = r.charge(i, i + 1)
            order.append(key)
        while sum(weight[key] for key in order) > capacity and order:
            order.pop(0)
    return hits / total if total else 0.0


def test_ideal_on_known_trace() -> None:
    """Leading seen blocks count, capped at the prompt; token and request rates are exact."""
    trace = read_paths([FIXTURES / "mooncake.jsonl"])
    ideal = replay_unbounded(trace.requests)
    assert ideal.cached == [0.0, 1024.0, 0.0, 1536.0]
    assert ideal.prompt_tokens == 5348
    assert ideal.hit_rate == pytest.approx(2560 / 5348)
    assert ideal.request_hit_rate(trace.requests) == pytest.approx((1024 / 1500 + 1536 / 2048) / 4)
    assert ideal.unique_keys == 7


def test_measured_none_and_gap() -> None:
    """Measured is None without reports, and compares against the ideal on the same requests."""
    reqs = [block_request(0, [1, 2]), block_request(1, [1, 2, 3])]
    ideal = replay_unbounded(reqs)
    assert measured(reqs, ideal) is None
    reqs[1].cached_tokens = 10
    m = measured(reqs, ideal)
    assert m is not None and m.requests == 1
    assert m.hit_rate == pytest.approx(10 / 30)
    assert m.gap == pytest.approx(20 / 30 - 10 / 30)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), max_size=40))
def test_leading_run_matches_linear_scan(flags: list[bool]) -> None:
    """Binary search finds the same leading run as a scan, for prefix-closed sets."""
    run = next((i for i, f in enumerate(flags) if not f), len(flags))
    keys = list(range(len(flags)))
    present = set(keys[:run])
    assert leading_run(keys, present) == run


@settings(max_examples=80, deadline=None)
@given(prefix_traces(), st.integers(1, 40))
def test_lru_matches_reference_uniform(requests: list[TraceRequest], blocks: int) -> None:
    """The fast LRU agrees with a plain list LRU on random prefix traces (uniform blocks)."""
    fast, _ = simulate_lru(requests, blocks * 10.0)
    assert fast == pytest.approx(reference_lru(requests, blocks * 10.0))


@settings(max_examples=80, deadline=None)
@given(prefix_traces(weighted=True), st.floats(1.0, 120.0))
def test_lru_matches_reference_weighted(requests: list[TraceRequest], capacity: float) -> None:
    """The fast LRU agrees with a plain list LRU when keys have different token weights."""
    fast, _ = simulate_lru(requests, capacity)
    assert fast == pytest.approx(reference_lru(requests, capacity))


@settings(max_examples=60, deadline=None)
@given(prefix_traces())
def test_capacity_curve_rises_to_ideal(requests: list[TraceRequest]) -> None:
    """Hit rate never falls as the cache grows and reaches the ideal at the footprint."""
    ideal = replay_unbounded(requests)
    curve = capacity_curve(requests, ideal)
    rates = [p.hit_rate for p in curve.points]
    assert all(a <= b + 1e-12 for a, b in itertools.pairwise(rates))
    if curve.points:
        assert rates[-1] == pytest.approx(ideal.hit_rate)
        assert curve.points[-1].capacity_tokens == round(ideal.footprint_tokens)
    if curve.tokens_for_90pct is not None:
        got, _ = simulate_lru(requests, curve.tokens_for_90pct)
        assert got >= 0.9 * ideal.hit_rate - 1e-9


def test_default_capacities_double_up_to_footprint() -> None:
    """Default sizes are log-spaced (doubling) and end at the footprint."""
    caps = default_capacities(1024.0, points=11)
    assert caps == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert default_capacities(0.0) == []


def test_shared_prefixes_planted_groups() -> None:
    """Planted groups are found with their sizes, and their savings add up to the ideal."""
    a = list(range(100, 110))  # 10 blocks shared by five requests
    b = list(range(200, 204))  # 4 blocks shared by three requests
    reqs = [
        block_request(0, [*a, 1]),
        block_request(1, [*a, 2]),
        block_request(2, [*a, 11, 12, 13, 14, 15, 3]),
        block_request(3, [*a, 11, 12, 13, 14, 15, 4]),
        block_request(4, [*a, 5]),
        block_request(5, [*b, 6]),
        block_request(6, [*b, 7]),
        block_request(7, [*b]),
        block_request(8, [300, 301]),
    ]
    ideal = replay_unbounded(reqs)
    tree = shared_prefixes(reqs, ideal)
    found = {(g.requests, g.prefix_tokens, g.shared_tokens, g.tokens_saved) for g in tree.groups}
    assert found == {(5, 100, 100, 400), (3, 40, 40, 80), (2, 150, 50, 50)}
    assert tree.total_saved_tokens == round(ideal.cached_tokens)
    assert tree.groups[0].requests == 5


def test_timeline_buckets() -> None:
    """Hit rate over time is token-weighted per bucket and skips empty buckets."""
    reqs = [block_request(0, [1, 2]), block_request(0.5, [1, 2]), block_request(10, [9])]
    buckets = timeline(reqs, replay_unbounded(reqs), buckets=4)
    assert [b.requests for b in buckets] == [2, 1]
    assert buckets[0].ideal_hit_rate == pytest.approx(0.5)
    assert buckets[0].measured_hit_rate is None
