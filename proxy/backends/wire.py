"""Reading values out of a server's JSON answers: a count, a number, a non-empty string.

A field of the wrong type (a string where a count belongs, ``true`` read as 1) reads as absent,
never as a wrong number.
"""

from __future__ import annotations

from typing import Any


def as_count(value: Any) -> int | None:
    """An integer field (booleans are not counts), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_number(value: Any) -> float | None:
    """A numeric field as a float, else None."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def nonempty(value: Any) -> bool:
    """Whether a field is a non-empty string."""
    return isinstance(value, str) and value != ""
