"""The one percentile definition of the analyzer, the fleet simulator and the benchmarks.

Nearest rank: the ``q`` quantile of ``n`` sorted samples is the sample of rank ``ceil(q * n)``,
the smallest observed value with at least a share ``q`` of the samples at or below it. It is
always a value that was measured (no interpolation between two requests), and it is what the
proxy's histogram percentiles approximate (``proxy.store.stats``: the latency at which the
cumulative count reaches ``q * n``), so a p99 read from ``/stats``, the analyzer's goodput, the
simulator and a benchmark table mean the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ascending ``sorted_values`` by nearest rank; None for none."""
    n = len(sorted_values)
    if n == 0:
        return None
    return sorted_values[min(n, max(1, math.ceil(q * n))) - 1]
