"""The control group's statistics: ratio-of-sums and quantile intervals clustered by
conversation, the lift between the groups, and the ledger the proxy keeps."""

from __future__ import annotations

import math
import random

import pytest

from proxy.lift import (
    Z95,
    Estimate,
    LiftLedger,
    clustered_quantile,
    lift,
    quantile,
    ratio_of_sums,
)
from proxy.records import RequestRecord


def test_ratio_of_sums_is_the_delta_method_by_hand() -> None:
    """Three clusters: the point is sum(y)/sum(x), the variance n/(n-1) sum(e^2)/X^2."""
    pairs = [(10.0, 20.0), (30.0, 40.0), (5.0, 40.0)]
    est = ratio_of_sums(pairs)
    r = 45.0 / 100.0
    se = math.sqrt(3 / 2 * sum((y - r * x) ** 2 for y, x in pairs)) / 100.0
    assert est.value == pytest.approx(r)
    assert est.se == pytest.approx(se)
    assert est.low == pytest.approx(r - Z95 * se) and est.high == pytest.approx(r + Z95 * se)


def test_too_little_to_say() -> None:
    """No data: no value; one cluster: a value without an interval."""
    assert ratio_of_sums([]).value is None
    assert ratio_of_sums([(1.0, 0.0)]).value is None
    one = ratio_of_sums([(1.0, 2.0)])
    assert one.value == 0.5 and one.low is None
    assert clustered_quantile([], 0.5).value is None
    assert clustered_quantile([[3.0, 1.0]], 0.5) == Estimate(2.0)
    assert lift(Estimate(None), Estimate(1.0)).value is None


def _clustered_shares(rng: random.Random, clusters: int) -> list[tuple[float, float]]:
    """Conversations of 1-10 turns whose turns share one cache fate (strongly correlated)."""
    out = []
    for _ in range(clusters):
        p = rng.betavariate(1.0, 1.0)  # the conversation's cached share, mean 0.5
        turns = rng.randint(1, 10)
        x = [rng.randint(200, 2000) for _ in range(turns)]
        y = [xi * min(max(p + rng.gauss(0, 0.05), 0.0), 1.0) for xi in x]
        out.append((sum(y), float(sum(x))))
    return out


def test_the_clustered_interval_covers_the_truth_95_percent_of_the_time() -> None:
    """400 simulated experiments of 40 correlated conversations: about 95 % of the intervals
    hold the true share (0.5)."""
    rng = random.Random(5)
    covered = 0
    reps = 400
    for _ in range(reps):
        est = ratio_of_sums(_clustered_shares(rng, 40))
        assert est.low is not None and est.high is not None
        covered += est.low <= 0.5 <= est.high
    assert 0.90 <= covered / reps <= 0.985


def test_treating_turns_as_independent_would_be_far_too_narrow() -> None:
    """The same data split into one pair per turn gives a much narrower (wrong) interval."""
    rng = random.Random(9)
    conversations = []
    for _ in range(40):
        p = rng.random()
        conversations.append([(1000.0 * p, 1000.0)] * 8)
    clustered = ratio_of_sums([(sum(y for y, _ in c), sum(x for _, x in c)) for c in conversations])
    naive = ratio_of_sums([pair for c in conversations for pair in c])
    assert clustered.se is not None and naive.se is not None
    assert clustered.se > 2.5 * naive.se


def test_quantile_interpolates_between_order_statistics() -> None:
    """Linear interpolation, as numpy's default; the ends clamp."""
    values = [1.0, 2.0, 3.0, 4.0]
    assert quantile(values, 0.5) == 2.5
    assert quantile(values, 0.0) == 1.0 and quantile(values, 1.0) == 4.0
    assert quantile(values, -1.0) == 1.0 and quantile(values, 2.0) == 4.0


def test_woodruffs_interval_covers_the_median_of_clustered_latencies() -> None:
    """TTFTs of conversations on slower or faster paths (a shared factor per conversation):
    the clustered interval for the median holds the population median about 95 % of the time."""
    rng = random.Random(11)

    def sample(n: int) -> list[list[float]]:
        return [
            [math.exp(c + rng.gauss(0, 0.3)) for _ in range(rng.randint(2, 8))]
            for c in (rng.gauss(0, 0.6) for _ in range(n))
        ]

    population = sorted(v for c in sample(40_000) for v in c)
    truth = quantile(population, 0.5)
    reps, covered = 300, 0
    for _ in range(reps):
        est = clustered_quantile(sample(40), 0.5)
        assert est.low is not None and est.high is not None
        covered += est.low <= truth <= est.high
    assert 0.88 <= covered / reps <= 0.99


def test_the_lift_adds_the_groups_variances() -> None:
    """Independent groups: se(lift) = hypot(se_t, se_c), around treated - control."""
    t = Estimate(0.8, 0.7, 0.9, 0.05)
    c = Estimate(0.1, 0.05, 0.15, 0.02)
    est = lift(t, c)
    assert est.value == pytest.approx(0.7)
    assert est.se == pytest.approx(math.hypot(0.05, 0.02))
    assert est.low == pytest.approx(0.7 - Z95 * est.se)


def record(**fields: object) -> RequestRecord:
    base: dict[str, object] = {
        "ts": "2026-12-02T00:00:00.000Z",
        "request_id": "r",
        "route": "/v1/chat/completions",
        "model": "m",
        "backend": "http://b",
        "stream": True,
        "status": 200,
    }
    return RequestRecord(**{**base, **fields})  # type: ignore[arg-type]  # test data


def test_the_ledger_tallies_conversations_per_group() -> None:
    """Records land in their group's conversation; shares are cached over reported prompt
    tokens; a record without a group is not part of the comparison."""
    ledger = LiftLedger(share=0.5)
    for key, group, cached in ((1, False, 90), (1, False, 95), (2, True, 5), (3, False, 80)):
        ledger.observe(
            record(
                prompt_tokens=100,
                cached_tokens=cached,
                ttft_ms=10.0,
                slo_met=True,
                control_group=group,
            ),
            key,
        )
    ledger.observe(record(prompt_tokens=100, cached_tokens=0), 9)  # no group: ignored
    ledger.observe(record(prompt_tokens=100, control_group=True), 2)  # cached not reported
    summary = ledger.summary()
    treated, control = summary["groups"]["treated"], summary["groups"]["control"]
    assert (treated["conversations"], treated["requests"]) == (2, 3)
    assert (control["conversations"], control["requests"]) == (1, 2)
    assert treated["cached_share"]["value"] == pytest.approx(265 / 300, abs=1e-4)
    assert control["cached_share"]["value"] == 0.05
    assert control["prompt_tokens"] == 100
    assert summary["lift"]["cached_share"]["value"] == pytest.approx(265 / 300 - 0.05, abs=1e-4)
    assert summary["lift"]["cached_share"]["ci"] == [None, None]  # one control conversation
    assert summary["share"] == 0.5 and "delta method" in summary["method"]


def test_the_ledger_keeps_the_most_recent_conversations() -> None:
    """Bounded: past ``max_conversations`` the least recently seen conversation goes."""
    ledger = LiftLedger(share=0.1, max_conversations=3, max_samples=2)
    for key in (1, 2, 3, 1, 4):
        ledger.observe(record(ttft_ms=float(key), control_group=False), key)
    figures = ledger.figures("treated")
    assert figures.conversations == 3 and figures.requests == 4  # 2 went, 1 stayed (twice)
