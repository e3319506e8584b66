"""ISO 8601 UTC timestamps for the lines written per request, without a ``datetime`` each.

A record's ``ts`` and its line's ``logged_at`` are written for every request; the text of the
whole second is kept for the few seconds in use, and only the fraction is formatted. The
results are exactly ``datetime``'s ISO text, with ``Z`` for ``+00:00``: ``iso_ms`` of a float
as ``datetime.fromtimestamp`` has it (rounded to microseconds half to even), ``iso_us`` of the
clock's nanoseconds as ``datetime.now`` has them (rounded down), for years 1000 to 9999.
"""

from __future__ import annotations

import math
import time

_HEADS: dict[int, str] = {}
"""The text of each whole second asked for lately (a handful: cleared past ``_HEADS_MAX``)."""
_HEADS_MAX = 16


def iso_ms(epoch_s: float) -> str:
    """``epoch_s`` with milliseconds: ``isoformat(timespec="milliseconds")``."""
    frac, whole = math.modf(epoch_s)
    us = round(frac * 1e6)  # (as ``datetime.fromtimestamp`` rounds it, then carries)
    second = int(whole)
    if us >= 1_000_000:
        second, us = second + 1, us - 1_000_000
    elif us < 0:
        second, us = second - 1, us + 1_000_000
    return f"{_head(second)}.{us // 1000:03d}Z"


def iso_us(epoch_ns: int) -> str:
    """``epoch_ns`` (``time.time_ns()``) as ``datetime.now(UTC).isoformat()`` writes the same
    instant (structlog's ``TimeStamper`` too): microseconds rounded down, none when they are
    zero."""
    second, us = divmod(epoch_ns // 1000, 1_000_000)
    return f"{_head(second)}.{us:06d}Z" if us else f"{_head(second)}Z"


def _head(second: int) -> str:
    """The whole second's ``YYYY-MM-DDTHH:MM:SS``."""
    head = _HEADS.get(second)
    if head is None:
        if len(_HEADS) >= _HEADS_MAX:
            _HEADS.clear()
        head = _HEADS[second] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
    return head
