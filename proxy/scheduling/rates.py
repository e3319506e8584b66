"""What one replica costs: prefill per uncached token, time per output token, answer length.

Every decision weighs a prefill the request would save against a wait it would take, both in
seconds, so both come from the backend's own measurements: ``backend_prefill_ms`` over the
uncached prompt tokens, and ``tpot_ms``, of finished requests.

A measurement taken while other requests shared the backend is larger than the backend's own
speed, and the decisions model sharing explicitly, so the estimates follow a faster observation
at once and a slower one only slowly (a low envelope rather than a mean). Until a replica has
been measured, conservative defaults apply: a cheap prefill and a slow decode, which pin only
where the saving is large and the wait short.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.records import RequestRecord

DEFAULT_PREFILL_MS_PER_TOKEN = 0.5
DEFAULT_TPOT_MS = 20.0
DEFAULT_COMPLETION_TOKENS = 256.0
MIN_PREFILL_SAMPLE_TOKENS = 32


def _envelope(old: float | None, new: float, *, down: float = 0.5, up: float = 0.05) -> float:
    """A running low envelope: quick to follow a faster measurement, slow to a slower one."""
    if old is None:
        return new
    return old + (down if new < old else up) * (new - old)


@dataclass(slots=True)
class Rates:
    """One replica's measured speeds (None until measured)."""

    prefill_ms_per_token: float | None = None
    tpot_ms: float | None = None
    completion_tokens: float | None = None

    @property
    def prefill_s(self) -> float:
        """Seconds to prefill one uncached prompt token, on an otherwise idle backend."""
        ms = self.prefill_ms_per_token
        return (ms if ms is not None else DEFAULT_PREFILL_MS_PER_TOKEN) / 1000.0

    @property
    def tpot_s(self) -> float:
        """Seconds per output token."""
        ms = self.tpot_ms
        return (ms if ms is not None else DEFAULT_TPOT_MS) / 1000.0

    @property
    def typical_completion(self) -> float:
        """Output tokens of a request that did not say (``max_tokens`` absent)."""
        n = self.completion_tokens
        return n if n is not None else DEFAULT_COMPLETION_TOKENS

    def observe(self, record: RequestRecord) -> None:
        """Fold one successful request's measurements in."""
        if record.status >= 400 or record.error is not None:
            return
        prompt, cached = record.prompt_tokens, record.cached_tokens
        prefill_ms = record.backend_prefill_ms
        if prompt is not None and cached is not None and prefill_ms:
            uncached = prompt - cached
            if uncached >= MIN_PREFILL_SAMPLE_TOKENS:
                self.prefill_ms_per_token = _envelope(
                    self.prefill_ms_per_token, prefill_ms / uncached
                )
        if record.tpot_ms is not None and record.tpot_ms > 0:
            self.tpot_ms = _envelope(self.tpot_ms, record.tpot_ms)
        if record.completion_tokens:
            n = float(record.completion_tokens)
            old = self.completion_tokens
            self.completion_tokens = n if old is None else old + 0.1 * (n - old)
