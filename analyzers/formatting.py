"""Numbers as people read them, shared by the terminal and HTML reports."""

from __future__ import annotations


def tokens(n: float | None) -> str:
    """A token count in short form: 950, 12.3k, 4.56M, 1.2B."""
    if n is None:
        return "-"
    value = float(n)
    for limit, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            scaled = value / limit
            return f"{scaled:.3g}{suffix}" if scaled < 100 else f"{scaled:.0f}{suffix}"
    return f"{value:.0f}"


def percent(rate: float | None, digits: int = 1) -> str:
    """A share as a percentage, or a dash when unknown."""
    return "-" if rate is None else f"{rate * 100:.{digits}f}%"


def ms(value: float | None) -> str:
    """Milliseconds, or a dash when unknown."""
    if value is None:
        return "-"
    return f"{value:,.0f} ms" if value >= 100 else f"{value:.1f} ms"


def seconds(value: float) -> str:
    """A duration: 42 s, 12.5 min, 3.2 h."""
    if value < 120:
        return f"{value:.0f} s"
    if value < 7200:
        return f"{value / 60:.3g} min"
    return f"{value / 3600:.3g} h"


def clip(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"
