"""The control group's measured lift: both groups side by side, with clustered intervals.

``LiftLedger`` is a learner of the record writer: every finished request of a proxy with a
control group (``proxy.control``) is added to its conversation's tally in its group. ``/stats``
(``control_group``), ``/metrics`` and the dashboard read ``LiftLedger.summary``: per group the
requests, the cached share of prompt tokens, TTFT p50 and p90 and goodput (the share of
requests that met the SLO), and the lift, treated minus control, of each, with a 95 % interval.

The intervals are clustered by conversation: the turns of one conversation are correlated (a
conversation whose system prompt is cached stays cached), so they are not independent
observations, and treating them as such would make the interval far too narrow. A share is a
ratio of sums over conversations (cached tokens over prompt tokens; SLO met over requests
judged), and its variance is the delta-method (linearization) estimate over conversations::

    R = sum(y_i) / sum(x_i),   var(R) = n / (n - 1) * sum((y_i - R * x_i) ** 2) / sum(x_i) ** 2

A TTFT quantile's interval is Woodruff's: the clustered interval of the empirical distribution
function at the quantile (the share of requests at or below it, a ratio of sums again),
mapped back through the quantile function. The two groups are independent samples, so the
variance of a lift is the sum of the groups' variances (a share's bounds are kept within 0..1,
a lift of shares within -1..1). These are closed forms computed in one pass, cheap enough for
every ``/stats`` read, unlike a bootstrap.

The ledger is this process's own, since it started: each proxy replica reports the requests it
served (the group of a conversation is the same on every replica). It keeps the most recent
``max_conversations`` conversations per group and the latest ``max_samples`` TTFTs of each.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.control import CONTROL, GROUPS, TREATED
from proxy.records import RequestRecord

Z95 = 1.959963984540054
"""The two-sided 95 % normal quantile."""
METHOD = (
    "95 % intervals clustered by conversation: delta method for the shares (ratio of sums), "
    "Woodruff's interval for the TTFT quantiles; lift = treated - control"
)

SHARE = (0.0, 1.0)
SHARE_LIFT = (-1.0, 1.0)


@dataclass(slots=True)
class Conversation:
    """What the ledger keeps of one conversation in one group."""

    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of the requests whose cached tokens the backend reported."""
    cached_tokens: int = 0
    slo_evaluated: int = 0
    slo_met: int = 0
    ttft_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Estimate:
    """A figure and its 95 % interval (``None`` bounds: too few conversations to say)."""

    value: float | None
    low: float | None = None
    high: float | None = None
    se: float | None = None

    def to_json(self, digits: int = 4) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, digits)

        return {"value": r(self.value), "ci": [r(self.low), r(self.high)]}


def _interval(value: float, se: float | None, clip: tuple[float, float] | None = None) -> Estimate:
    if se is None or not math.isfinite(se):
        return Estimate(value)
    low, high = value - Z95 * se, value + Z95 * se
    if clip is not None:  # a share's interval stays a share
        low, high = max(low, clip[0]), min(high, clip[1])
    return Estimate(value, low, high, se)


def ratio_of_sums(
    pairs: Sequence[tuple[float, float]], clip: tuple[float, float] | None = None
) -> Estimate:
    """``sum(y) / sum(x)`` over clusters ``(y_i, x_i)``, with its delta-method interval
    (its bounds kept within ``clip``, e.g. ``(0, 1)`` for a share).

    Clusters with ``x_i == 0`` add nothing to either sum but count as clusters; the interval
    needs at least two clusters with ``x_i > 0``.
    """
    used = [(y, x) for y, x in pairs if x > 0]
    total_x = sum(x for _, x in used)
    if not used or total_x <= 0:
        return Estimate(None)
    ratio = sum(y for y, _ in used) / total_x
    n = len(used)
    if n < 2:
        return Estimate(ratio)
    residuals = sum((y - ratio * x) ** 2 for y, x in used)
    return _interval(ratio, math.sqrt(n / (n - 1) * residuals) / total_x, clip)


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``sorted_values`` (linear interpolation between order statistics)."""
    if not sorted_values:
        raise ValueError("no values")
    q = min(max(q, 0.0), 1.0)
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def clustered_quantile(clusters: Sequence[Sequence[float]], q: float) -> Estimate:
    """The ``q`` quantile of every value of ``clusters``, with Woodruff's clustered interval."""
    values = sorted(v for c in clusters for v in c)
    if not values:
        return Estimate(None)
    point = quantile(values, q)
    used = [c for c in clusters if c]
    n = len(used)
    if n < 2:
        return Estimate(point)
    # The share of values at or below the quantile, a ratio of sums over the clusters.
    pairs = [(float(sum(1 for v in c if v <= point)), float(len(c))) for c in used]
    share = sum(y for y, _ in pairs) / len(values)
    residuals = sum((y - share * x) ** 2 for y, x in pairs)
    se_f = math.sqrt(n / (n - 1) * residuals) / len(values)
    low = quantile(values, q - Z95 * se_f)
    high = quantile(values, q + Z95 * se_f)
    return Estimate(point, low, high, (high - low) / (2 * Z95))


def lift(treated: Estimate, control: Estimate, clip: tuple[float, float] | None = None) -> Estimate:
    """``treated - control``, the groups independent (their variances add)."""
    if treated.value is None or control.value is None:
        return Estimate(None)
    value = treated.value - control.value
    if treated.se is None or control.se is None:
        return Estimate(value)
    return _interval(value, math.hypot(treated.se, control.se), clip)


@dataclass(frozen=True, slots=True)
class GroupFigures:
    """One group's figures over its conversations."""

    conversations: int
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    cached_share: Estimate
    ttft_p50_ms: Estimate
    ttft_p90_ms: Estimate
    goodput_share: Estimate

    @classmethod
    def of(cls, conversations: Iterable[Conversation]) -> GroupFigures:
        convs = list(conversations)
        ttfts = [c.ttft_ms for c in convs]
        return cls(
            conversations=len(convs),
            requests=sum(c.requests for c in convs),
            errors=sum(c.errors for c in convs),
            prompt_tokens=sum(c.prompt_tokens for c in convs),
            cached_tokens=sum(c.cached_tokens for c in convs),
            cached_share=ratio_of_sums([(c.cached_tokens, c.prompt_tokens) for c in convs], SHARE),
            ttft_p50_ms=clustered_quantile(ttfts, 0.5),
            ttft_p90_ms=clustered_quantile(ttfts, 0.9),
            goodput_share=ratio_of_sums([(c.slo_met, c.slo_evaluated) for c in convs], SHARE),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "conversations": self.conversations,
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_share": self.cached_share.to_json(),
            "ttft_p50_ms": self.ttft_p50_ms.to_json(3),
            "ttft_p90_ms": self.ttft_p90_ms.to_json(3),
            "goodput_share": self.goodput_share.to_json(),
        }


def compare(treated: GroupFigures, control: GroupFigures) -> dict[str, Estimate]:
    """The lift of each figure, treated minus control."""
    return {
        "cached_share": lift(treated.cached_share, control.cached_share, SHARE_LIFT),
        "ttft_p50_ms": lift(treated.ttft_p50_ms, control.ttft_p50_ms),
        "ttft_p90_ms": lift(treated.ttft_p90_ms, control.ttft_p90_ms),
        "goodput_share": lift(treated.goodput_share, control.goodput_share, SHARE_LIFT),
    }


def add_record(conv: Conversation, record: RequestRecord, max_samples: int) -> None:
    """Fold one finished request into its conversation's tally."""
    conv.requests += 1
    failed = record.error is not None or record.status >= 400
    conv.errors += failed
    if record.prompt_tokens and record.cached_tokens is not None:
        conv.prompt_tokens += record.prompt_tokens
        conv.cached_tokens += min(record.cached_tokens, record.prompt_tokens)
    if record.slo_met is not None:
        conv.slo_evaluated += 1
        conv.slo_met += record.slo_met
    if record.ttft_ms is not None and not failed:
        conv.ttft_ms.append(record.ttft_ms)
        if len(conv.ttft_ms) > max_samples:
            del conv.ttft_ms[0]


class LiftLedger:
    """Per group, the tallies of its most recent conversations (this process's, since start)."""

    def __init__(
        self, *, share: float, max_conversations: int = 10_000, max_samples: int = 512
    ) -> None:
        self.share = share
        self.max_conversations = max_conversations
        self.max_samples = max_samples
        self.since = time.time()
        self._groups: dict[str, OrderedDict[int, Conversation]] = {g: OrderedDict() for g in GROUPS}

    def observe(self, record: RequestRecord, key: int | None) -> None:
        """Add a finished request of conversation ``key`` (records without a group are not
        part of the comparison)."""
        if record.control_group is None or key is None:
            return
        group = self._groups[CONTROL if record.control_group else TREATED]
        conv = group.get(key)
        if conv is None:
            conv = group[key] = Conversation()
            if len(group) > self.max_conversations:
                group.popitem(last=False)
        else:
            group.move_to_end(key)
        add_record(conv, record, self.max_samples)

    def figures(self, group: str) -> GroupFigures:
        """One group's figures now."""
        return GroupFigures.of(self._groups[group].values())

    def summary(self) -> dict[str, Any]:
        """The ``control_group`` block of ``/stats``."""
        treated, control = self.figures(TREATED), self.figures(CONTROL)
        return {
            "share": self.share,
            "since": round(self.since, 3),
            "method": METHOD,
            "groups": {TREATED: treated.to_json(), CONTROL: control.to_json()},
            "lift": {
                name: est.to_json(3 if name.startswith("ttft") else 4)
                for name, est in compare(treated, control).items()
            },
        }
