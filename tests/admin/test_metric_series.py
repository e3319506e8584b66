"""The lock-free metric series expose what prometheus_client's own would, update for update."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import metrics as prom_metrics

from proxy.admin.metrics import TTFT_BUCKETS_S
from proxy.admin.series import LoopCounter, LoopHistogram

LABELS = st.sampled_from([("m1", "b1"), ("m2", "b1"), ("m1", "b2")])
AMOUNT = st.one_of(
    st.floats(min_value=0.0, max_value=200.0, allow_nan=False),
    st.sampled_from([*TTFT_BUCKETS_S, 0.0, math.inf]),  # on a bound: ``le`` is inclusive
    st.integers(min_value=0, max_value=10**7).map(float),
)
OBSERVED = st.one_of(  # a histogram also takes negatives and -inf (the counter refuses them)
    AMOUNT, st.floats(max_value=0.0, allow_nan=False), st.sampled_from([-math.inf, -0.0])
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("inc"), LABELS, AMOUNT),
        st.tuples(st.sampled_from(["observe", "observe_bare"]), LABELS, OBSERVED),
    ),
    max_size=60,
)


def _pair(counter_cls: Any, histogram_cls: Any) -> tuple[CollectorRegistry, Any, Any, Any]:
    reg = CollectorRegistry(auto_describe=False)
    counter = counter_cls("x_requests", "requests", ("model", "backend"), registry=reg)
    hist = histogram_cls(
        "x_ttft_seconds", "ttft", ("model", "backend"), registry=reg, buckets=TTFT_BUCKETS_S
    )
    bare = histogram_cls("x_overhead_seconds", "overhead", (), registry=reg, buckets=(0.1, 1.0))
    return reg, counter, hist, bare


def _without_created(text: str) -> str:
    """The exposition with each ``_created`` value blanked (a clock reading at first use)."""
    return re.sub(r"(_created(?:\{[^}]*\})?) \S+", r"\1 T", text)


Op = tuple[str, tuple[str, str], float]


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_same_exposition_as_prometheus_client(ops: list[Op]) -> None:
    """Any sequence of updates: the same exposition, line for line (``_created`` aside)."""
    ours = _pair(LoopCounter, LoopHistogram)
    theirs = _pair(Counter, Histogram)
    for _, counter, hist, bare in (ours, theirs):
        for op, labels, amount in ops:
            if op == "inc":
                counter.labels(*labels).inc(amount)
            elif op == "observe":
                hist.labels(*labels).observe(amount)
            else:
                bare.observe(amount)
    assert _without_created(generate_latest(ours[0]).decode()) == _without_created(
        generate_latest(theirs[0]).decode()
    )


def test_nan_lands_in_no_bucket_as_in_prometheus_client() -> None:
    """A NaN observation counts in no bucket and makes the sum NaN, as prometheus_client's."""
    ours, theirs = _pair(LoopCounter, LoopHistogram), _pair(Counter, Histogram)
    for _, _, hist, _ in (ours, theirs):
        hist.labels("m", "b").observe(math.nan)
        hist.labels("m", "b").observe(0.5)
    assert _without_created(generate_latest(ours[0]).decode()) == _without_created(
        generate_latest(theirs[0]).decode()
    )


def test_negative_increment_refused() -> None:
    """A counter never goes down: a negative increment raises, as prometheus_client's does."""
    _, counter, _, _ = _pair(LoopCounter, LoopHistogram)
    with pytest.raises(ValueError, match="non-negative"):
        counter.labels("m", "b").inc(-1)


def test_created_series_follow_prometheus_clients_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PROMETHEUS_DISABLE_CREATED_SERIES`` (prometheus_client's switch) drops ``_created``."""
    monkeypatch.setattr(prom_metrics, "_use_created", False)
    reg, counter, hist, _ = _pair(LoopCounter, LoopHistogram)
    counter.labels("m", "b").inc()
    hist.labels("m", "b").observe(0.2)
    assert "_created" not in generate_latest(reg).decode()
