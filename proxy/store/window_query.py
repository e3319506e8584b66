"""A ``query_stats`` call resolved to the buckets it reads, the same way in both stores."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proxy.store.base import DEFAULT_NAMESPACE
from proxy.store.window import BucketPlan, WindowBuilder, plan_buckets


@dataclass(frozen=True, slots=True)
class WindowQuery:
    """The namespace, the buckets and the filters of one statistics query."""

    namespace: str
    plan: BucketPlan
    model: str | None
    backend: str | None

    @classmethod
    def resolve(
        cls,
        since_s: float,
        until_s: float | None,
        clock: Callable[[], float],
        *,
        namespace: str | None,
        model: str | None,
        backend: str | None,
    ) -> WindowQuery:
        """The query of ``[since_s, until_s)``: no ``until_s`` is now, no namespace the default."""
        ns = namespace or DEFAULT_NAMESPACE
        plan = plan_buckets(since_s, clock() if until_s is None else until_s)
        return cls(ns, plan, model, backend)

    def builder(self) -> WindowBuilder:
        """A new, empty builder of this window."""
        return WindowBuilder(
            self.plan, namespace=self.namespace, model=self.model, backend=self.backend
        )
