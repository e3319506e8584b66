"""prometheus_client's ``Counter`` and ``Histogram``, with plain numbers for values.

prometheus_client keeps every value (a counter, each histogram bucket, a histogram's sum) in an
object guarded by a ``threading.Lock``, so that threads may update one metric at once: about
1.5 µs an update, and one finished request makes two dozen of them (``ProxyMetrics.observe``).
The proxy updates its metrics from its event loop only, so these subclasses keep the values as
floats: the same names, labels, ``_created`` series and exposition (prometheus_client's own code
writes them), a few hundred nanoseconds an update. Only label children are updated (the proxy
always goes through ``labels()``, or has no labels; exemplars and prometheus_client's
multiprocess mode are not supported). ``tests/admin/test_metric_series.py`` feeds
the same updates to both and compares the expositions.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable

from prometheus_client import Counter, Histogram
from prometheus_client import metrics as _metrics
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString


class LoopCounter(Counter):
    """A ``Counter`` updated from one thread (the event loop)."""

    def _metric_init(self) -> None:
        self._total = 0.0
        self._created = time.time()

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        if exemplar:
            raise ValueError("exemplars are not kept")
        self._total += amount

    def reset(self) -> None:
        self._total = 0.0
        self._created = time.time()

    def _child_samples(self) -> Iterable[Sample]:
        total = Sample("_total", {}, self._total, None, None)
        if not _created_series():
            return (total,)
        return (total, Sample("_created", {}, self._created, None, None))


class LoopHistogram(Histogram):
    """A ``Histogram`` updated from one thread (the event loop)."""

    def _metric_init(self) -> None:
        self._counts = [0.0] * len(self._upper_bounds)
        self._total_sum = 0.0
        self._created = time.time()
        self._les = [floatToGoString(b) for b in self._upper_bounds]  # type: ignore[no-untyped-call]  # untyped upstream

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar:
            raise ValueError("exemplars are not kept")
        self._total_sum += amount
        if amount == amount:  # NaN falls in no bucket (every ``amount <= bound`` is false)
            # The first bound at or above ``amount``; the last is +Inf.
            self._counts[bisect_left(self._upper_bounds, amount)] += 1.0

    def _child_samples(self) -> Iterable[Sample]:
        samples = []
        acc = 0.0
        for le, count in zip(self._les, self._counts, strict=True):
            acc += count
            samples.append(Sample("_bucket", {"le": le}, acc, None, None))
        samples.append(Sample("_count", {}, acc, None, None))
        if self._upper_bounds[0] >= 0:
            samples.append(Sample("_sum", {}, self._total_sum, None, None))
        if _created_series():
            samples.append(Sample("_created", {}, self._created, None, None))
        return tuple(samples)


def _created_series() -> bool:
    """prometheus_client's switch (``PROMETHEUS_DISABLE_CREATED_SERIES``, or
    ``disable_created_metrics()``), as its own metrics read it."""
    return bool(getattr(_metrics, "_use_created", True))
