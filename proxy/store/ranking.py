"""Top application prefixes: which stable prompt heads served the most tokens.

Requests that share a fingerprint anchor (model, tools and leading system messages) come from
the same application prompt. Per namespace and hour, each store ranks anchors by prompt tokens
served and keeps per-anchor counters (``ANCHOR_FIELDS``); when more than
``cap + cap // 10`` anchors are ranked in one hour, the least used are dropped down to ``cap``
(the slack keeps a newcomer from being dropped on its first request). ``top_prefixes`` adds the
hours of a window up, so windows widen to whole hours.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from proxy.store.stats import StatsSample

# Per-anchor counters inside an hour: requests, prompt tokens, measured cached tokens and the
# prompt tokens of the requests whose cached tokens were reported. "t" (last seen, epoch s) and
# "l" (label) are kept alongside and are not sums.
ANCHOR_FIELDS = ("r", "p", "c", "cp")
LAST_SEEN = "t"
LABEL = "l"


def anchor_increments(sample: StatsSample) -> dict[str, float] | None:
    """The per-anchor counters one request adds, or None when it has no anchor."""
    if not sample.prefix_anchor:
        return None
    prompt = sample.prompt_tokens or 0
    inc = {"r": 1.0, "p": float(prompt), "c": 0.0, "cp": 0.0}
    if sample.cached_tokens is not None and sample.prompt_tokens is not None:
        inc["c"] = float(sample.cached_tokens)
        inc["cp"] = float(prompt)
    return inc


def trim_threshold(cap: int) -> int:
    """How many anchors an hour may rank before it is trimmed back to ``cap``."""
    return cap + cap // 10


@dataclass(slots=True)
class PrefixStat:
    """One application prefix over a window."""

    anchor: str
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_prompt_tokens: int = 0
    last_seen_s: float = 0.0
    label: str | None = None

    @property
    def hit_rate(self) -> float | None:
        """Measured token-weighted hit rate of this prefix's requests."""
        if not self.cached_prompt_tokens:
            return None
        return self.cached_tokens / self.cached_prompt_tokens

    def add(self, counters: dict[str, float], last_seen_s: float, label: str | None) -> None:
        """Fold one hour's counters in."""
        self.requests += round(counters.get("r", 0.0))
        self.prompt_tokens += round(counters.get("p", 0.0))
        self.cached_tokens += round(counters.get("c", 0.0))
        self.cached_prompt_tokens += round(counters.get("cp", 0.0))
        if last_seen_s >= self.last_seen_s:
            self.last_seen_s = last_seen_s
            self.label = label or self.label
        elif self.label is None:
            self.label = label

    def to_json(self) -> dict[str, Any]:
        hit = self.hit_rate
        return {
            "anchor": self.anchor,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": None if hit is None else round(hit, 4),
            "last_seen": self.last_seen_s,
            "label": self.label,
        }


def rank(stats: Iterable[PrefixStat], limit: int) -> list[PrefixStat]:
    """The ``limit`` prefixes with the most prompt tokens (then requests, then anchor)."""
    ordered = sorted(stats, key=lambda s: (-s.prompt_tokens, -s.requests, s.anchor))
    return ordered[: max(limit, 0)]
