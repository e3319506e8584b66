"""The per-request timestamps are exactly ``datetime``'s ISO text."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from proxy.timestamps import iso_ms, iso_us


def _ms(epoch_s: float) -> str:
    return (
        datetime.fromtimestamp(epoch_s, UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def _us(epoch_ns: int) -> str:
    """As ``datetime.now(UTC)`` holds the clock's nanoseconds (rounded down to microseconds)."""
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=epoch_ns // 1000)
    return moment.isoformat().replace("+00:00", "Z")


def test_the_timestamps_are_datetimes_own_text() -> None:
    """A record's ``ts`` as ``fromtimestamp`` writes it, a line's ``logged_at`` as ``now``."""
    rng = random.Random(7)
    values = [0.0, 1.0, 0.5, 1e-7, 0.9999995, 0.9999994, 1_796_693_525.9999996, 1_796_693_525.0]
    values += [rng.uniform(0, 4e9) for _ in range(20_000)]
    # Fractions at the microsecond's rounding edges, and whole seconds (no fraction written).
    values += [s + (k + 0.5) / 1e6 for s in (1_700_000_000, 1_800_000_123) for k in range(-3, 3)]
    values += [float(s) for s in range(1_796_693_500, 1_796_693_540)]
    for v in values:
        assert iso_ms(v) == _ms(v), v
    # The clock's nanoseconds: whole seconds, a microsecond's edges, and the seconds' ends.
    stamps = [rng.randrange(0, 4 * 10**18) for _ in range(20_000)]
    stamps += [1_796_693_525 * 10**9 + k for k in (0, 999, 1_000, 999_999_700, 999_999_999)]
    for ns in stamps:
        assert iso_us(ns) == _us(ns), ns
