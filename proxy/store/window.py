"""Time windows over statistics buckets: which buckets to read, and how to add them up.

Both stores keep the same buckets: one per (namespace, minute) and, as a rollup written at the
same time, one per (namespace, hour). Inside a bucket each counter is keyed
``<model>|<backend>|<field>`` (``bucket_field``), so a single bucket holds every model and
backend of a namespace and the filters and breakdowns are done while adding up.

Reading a window (``plan_buckets``): up to ``MINUTE_SERIES_MAX_S`` (6 h) the window is read minute
by minute and its time series has one point a minute (at most 360 buckets). Longer windows read
whole hours from the hourly rollups and only the ragged minutes at either end from the minute
buckets, with one series point an hour: a 7-day window is at most 168 + 118 buckets instead of
10,080. Windows widen to whole minutes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.store.stats import Tally

MINUTE_S = 60
HOUR_S = 3600
MINUTE_SERIES_MAX_S = 6 * HOUR_S
_SEP = "|"


def _escape(part: str) -> str:
    return part.replace("%", "%25").replace(_SEP, "%7C")


def _unescape(part: str) -> str:
    return part.replace("%7C", _SEP).replace("%25", "%")


def bucket_field(model: str, backend: str, name: str) -> str:
    """The key of one counter inside a bucket."""
    return f"{_escape(model)}{_SEP}{_escape(backend)}{_SEP}{name}"


def add_counters(into: dict[str, float], counters: Mapping[str, float]) -> None:
    """Add ``counters`` into ``into``, name by name (an application prefix's counters, in both
    stores; a sample's own go through ``proxy.store.stats.add_increments``)."""
    for name, value in counters.items():
        into[name] = into.get(name, 0.0) + value


def split_bucket_field(key: str) -> tuple[str, str, str] | None:
    """``(model, backend, field)`` of a bucket key, or None for a key of another shape."""
    parts = key.split(_SEP, 2)
    if len(parts) != 3:
        return None
    return _unescape(parts[0]), _unescape(parts[1]), parts[2]


@dataclass(frozen=True, slots=True)
class BucketRef:
    """One bucket to read: its size, its index (start // size) and the series point it feeds."""

    resolution_s: int
    index: int
    point_ts: int


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """The buckets covering a window, and the window widened to whole minutes."""

    since_s: int
    until_s: int
    resolution_s: int
    buckets: tuple[BucketRef, ...]
    points: tuple[int, ...]


def plan_buckets(since_s: float, until_s: float) -> BucketPlan:
    """Which minute and hour buckets add up to the window ``[since_s, until_s)``."""
    first = math.floor(since_s / MINUTE_S)
    last = math.ceil(until_s / MINUTE_S) - 1
    if last < first:
        return BucketPlan(first * MINUTE_S, first * MINUTE_S, MINUTE_S, (), ())
    since, until = first * MINUTE_S, (last + 1) * MINUTE_S
    if until - since <= MINUTE_SERIES_MAX_S:
        refs = tuple(BucketRef(MINUTE_S, m, m * MINUTE_S) for m in range(first, last + 1))
        return BucketPlan(since, until, MINUTE_S, refs, tuple(r.point_ts for r in refs))
    per_hour = HOUR_S // MINUTE_S
    first_full = -(-first // per_hour)  # the first hour that starts inside the window
    end_full = (last + 1) // per_hour  # hours before this one end inside the window
    refs_list = [
        BucketRef(MINUTE_S, m, (m // per_hour) * HOUR_S)
        for m in range(first, first_full * per_hour)
    ]
    refs_list += [BucketRef(HOUR_S, h, h * HOUR_S) for h in range(first_full, end_full)]
    refs_list += [
        BucketRef(MINUTE_S, m, (m // per_hour) * HOUR_S)
        for m in range(end_full * per_hour, last + 1)
    ]
    points = range((first // per_hour) * HOUR_S, last * MINUTE_S + 1, HOUR_S)
    return BucketPlan(since, until, HOUR_S, tuple(refs_list), tuple(points))


def hours_between(since_s: float, until_s: float) -> range:
    """Indexes of the hours that overlap ``[since_s, until_s)``."""
    first = math.floor(since_s / HOUR_S)
    last = math.ceil(until_s / HOUR_S) - 1
    return range(first, max(last, first - 1) + 1)


@dataclass(slots=True)
class StatsWindow:
    """Statistics of one namespace over a window: totals, a time series and breakdowns."""

    namespace: str
    since_s: int
    until_s: int
    resolution_s: int
    model: str | None = None
    backend: str | None = None
    total: Tally = field(default_factory=Tally)
    series: list[tuple[int, Tally]] = field(default_factory=list)
    by_model: dict[str, Tally] = field(default_factory=dict)
    by_backend: dict[str, Tally] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return self.total.requests

    @property
    def hit_rate_token_weighted(self) -> float | None:
        return self.total.hit_rate_token_weighted

    @property
    def hit_rate_per_request_mean(self) -> float | None:
        return self.total.hit_rate_per_request_mean

    @property
    def predicted_hit_rate(self) -> float | None:
        return self.total.predicted_hit_rate

    @property
    def prediction_mae_tokens(self) -> float | None:
        return self.total.prediction_mae_tokens

    @property
    def error_rate(self) -> float | None:
        return self.total.error_rate

    @property
    def goodput_share(self) -> float | None:
        return self.total.goodput_share

    def percentile(self, metric: str, q: float) -> float | None:
        """A latency quantile over the whole window (``metric``: ttft, ttfvt, tpot, e2e)."""
        return self.total.percentile(metric, q)

    def to_json(self) -> dict[str, Any]:
        """The window as served by ``GET /stats``."""
        return {
            "namespace": self.namespace,
            "since": self.since_s,
            "until": self.until_s,
            "resolution_s": self.resolution_s,
            "filters": {"model": self.model, "backend": self.backend},
            "totals": self.total.summary(),
            "series": [{"ts": ts, **tally.point()} for ts, tally in self.series],
            "by_model": {k: v.summary() for k, v in sorted(self.by_model.items())},
            "by_backend": {k: v.summary() for k, v in sorted(self.by_backend.items())},
        }


class WindowBuilder:
    """Adds raw buckets (``bucket_field`` keys) up into a ``StatsWindow``."""

    def __init__(
        self,
        plan: BucketPlan,
        *,
        namespace: str,
        model: str | None = None,
        backend: str | None = None,
    ) -> None:
        self._plan = plan
        self._window = StatsWindow(
            namespace=namespace,
            since_s=plan.since_s,
            until_s=plan.until_s,
            resolution_s=plan.resolution_s,
            model=model,
            backend=backend,
        )
        self._points: dict[int, Tally] = {ts: Tally() for ts in plan.points}

    def add_bucket(self, point_ts: int, counters: Iterable[tuple[str, float]]) -> None:
        """Fold one bucket's counters into the series point ``point_ts`` and the totals."""
        w = self._window
        point = self._points.setdefault(point_ts, Tally())
        for key, value in counters:
            parts = split_bucket_field(key)
            if parts is None:
                continue
            model, backend, name = parts
            if (w.model is not None and model != w.model) or (
                w.backend is not None and backend != w.backend
            ):
                continue
            point.add(name, value)
            w.total.add(name, value)
            w.by_model.setdefault(model, Tally()).add(name, value)
            w.by_backend.setdefault(backend, Tally()).add(name, value)

    def build(self) -> StatsWindow:
        """The finished window, its series in time order."""
        self._window.series = sorted(self._points.items())
        return self._window
