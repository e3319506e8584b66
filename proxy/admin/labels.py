"""Which labelled children one request's record updates: label values capped, and one
(model, backend)'s children held for ``ProxyMetrics.observe`` (``proxy.admin.metrics``)."""

from __future__ import annotations

from typing import Any

from proxy.store.stats import MISS_CAUSES, UNKNOWN

OTHER = "other"


class LabelCap:
    """Keeps the first ``limit`` distinct values of a label; later ones become ``other``."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str | None) -> str:
        label = value or UNKNOWN
        if label in self._seen:
            return label
        if len(self._seen) < self._limit:
            self._seen.add(label)
            return label
        return OTHER


_BY_MODEL_BACKEND = frozenset(
    {
        "prompt_tokens",
        "cached_tokens",
        "cached_reported_prompt_tokens",
        "predicted_cached_tokens",
        "completion_tokens",
        "slo_met",
        "slo_evaluated",
        "saved_prefill_seconds",
        "saved_usd",
        "ttft",
        "ttfvt",
        "tpot",
        "duration",
    }
)
"""``ProxyMetrics``' metrics labelled (model, backend) alone: ``Series`` holds their children."""


class Series:
    """One (model, backend)'s children of the metrics a record updates, each made the first
    time it is used (a series appears once it has something to count, as with ``labels``):
    a record then reaches them by attribute, with no label tuple built or looked up."""

    __slots__ = (
        "_metrics",
        "backend",
        "input_usage",
        "model",
        "output_usage",
        "status",
        "uncached",
        *sorted(_BY_MODEL_BACKEND),
    )

    def __init__(self, metrics: Any, model: str, backend: str) -> None:
        self._metrics = metrics
        self.model = model
        self.backend = backend
        self.status: dict[int, Any] = {}

    def __getattr__(self, name: str) -> Any:  # an unset slot: its child, made now
        m = self._metrics
        child: Any
        if name in _BY_MODEL_BACKEND:
            child = getattr(m, name).labels(self.model, self.backend)
        elif name == "input_usage" or name == "output_usage":
            child = m.token_usage.labels(name.removesuffix("_usage"), self.model)
        elif name == "uncached":
            child = tuple(
                m.uncached_tokens.labels(self.model, self.backend, cause) for cause in MISS_CAUSES
            )
        else:
            raise AttributeError(name)
        setattr(self, name, child)
        return child
