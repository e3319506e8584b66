"""Whether the store's backing service is usable: a circuit breaker with one log line per incident.

After a failed call the breaker opens: calls skip the service (and return their neutral result
at once) for ``breaker_s``. Then a single call is let through as a probe; its success closes
the breaker, its failure opens it again. ``store_degraded`` is logged when an incident starts
and ``store_recovered`` when it ends, never once per request; ``failures`` counts every failed
call for metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

_log = structlog.get_logger("prefixgate.store")


class StoreHealth:
    """Circuit breaker and incident log for one store."""

    def __init__(
        self, *, store: str, breaker_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store = store
        self._breaker_s = breaker_s
        self._clock = clock
        self._degraded = False
        self._since = 0.0
        self._retry_at = 0.0
        self._probing = False
        self._incident_failures = 0
        self.failures = 0
        """Failed calls since start-up."""
        self.skipped = 0
        """Calls answered without trying the service because the breaker was open."""

    @property
    def degraded(self) -> bool:
        return self._degraded

    def allow(self) -> bool:
        """Whether a call may go to the service now (False: answer with the neutral result)."""
        if not self._degraded:
            return True
        if not self._probing and self._clock() >= self._retry_at:
            self._probing = True
            return True
        self.skipped += 1
        return False

    def succeeded(self) -> None:
        """A call reached the service and got its answer."""
        if not self._degraded:
            return
        _log.warning(
            "store_recovered",
            store=self._store,
            down_s=round(self._clock() - self._since, 3),
            failures=self._incident_failures,
        )
        self._degraded = False
        self._probing = False

    def abandoned(self) -> None:
        """A call was cancelled before it could tell; if it was the probe, let another go."""
        self._probing = False

    def failed(self, op: str, exc: BaseException) -> None:
        """A call failed or timed out; open the breaker (log once per incident)."""
        self.failures += 1
        now = self._clock()
        self._retry_at = now + self._breaker_s
        self._probing = False
        if self._degraded:
            self._incident_failures += 1
            return
        self._degraded = True
        self._since = now
        self._incident_failures = 1
        _log.warning(
            "store_degraded",
            store=self._store,
            op=op,
            error=type(exc).__name__,
            detail=str(exc)[:200],
            retry_in_s=self._breaker_s,
        )
