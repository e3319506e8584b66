"""The one percentile definition (nearest rank) shared by the analyzer, the simulator and the
benchmarks, and its agreement with the proxy's histogram percentiles."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from analyzers.quantile import percentile
from proxy.store.stats import LATENCY_BOUNDS_MS, Tally, latency_bucket


def test_nearest_rank_values() -> None:
    """The sample of rank ceil(q * n): never a value between two samples."""
    assert percentile([], 0.5) is None
    assert percentile([1.0, 2.0], 0.5) == 1.0
    assert percentile([1.0, 2.0], 0.99) == 2.0
    hundred = [float(i) for i in range(1, 101)]
    assert [percentile(hundred, q) for q in (0.5, 0.9, 0.99, 1.0)] == [50.0, 90.0, 99.0, 100.0]
    assert percentile(hundred, 0.0) == 1.0


@given(
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=200),
    st.floats(0.01, 1.0),
)
def test_nearest_rank_definition(values: list[float], q: float) -> None:
    """The result is a sample; at least a share q of the samples is at or below it, and fewer
    than a share q strictly below it."""
    ordered = sorted(values)
    got = percentile(ordered, q)
    assert got in ordered
    n = len(ordered)
    assert sum(v <= got for v in ordered) >= q * n - 1e-9
    assert sum(v < got for v in ordered) < q * n


@given(st.lists(st.floats(0.5, 100_000.0), min_size=1, max_size=300))
def test_histogram_percentiles_land_in_the_bucket_of_the_nearest_rank(
    values: list[float],
) -> None:
    """/stats' interpolated p50/p90/p99 fall in the histogram bucket holding the analyzer's."""
    tally = Tally()
    for v in values:
        tally.add(f"ttft:h{latency_bucket(v)}", 1)
    ordered = sorted(values)
    for q in (0.5, 0.9, 0.99):
        exact = percentile(ordered, q)
        assert exact is not None
        i = latency_bucket(exact)
        lo = LATENCY_BOUNDS_MS[i - 1] if i > 0 else 0.0
        hi = LATENCY_BOUNDS_MS[i] if i < len(LATENCY_BOUNDS_MS) else math.inf
        assert lo - 1e-9 <= (tally.percentile("ttft", q) or 0.0) <= hi + 1e-9


def test_simulator_and_goodput_use_it() -> None:
    """The simulator's and the analyzer's p99 come from the same function."""
    from analyzers import goodput, simulate

    assert simulate.percentile is percentile and goodput.percentile is percentile
    lat = goodput.latency([3.0, 1.0, 2.0, 4.0])
    assert (lat.p50, lat.p90, lat.p99) == (2.0, 4.0, 4.0)
    assert lat.p50 == pytest.approx(percentile([1.0, 2.0, 3.0, 4.0], 0.5))
