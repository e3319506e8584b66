"""Small inline SVG line charts for the HTML report: no scripts, no external resources.

One function draws every plot of the report: a frame with ticks, optional log x axis, any
number of series (solid or dashed) and labelled horizontal reference lines.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

PALETTE = ("#2563eb", "#f97316", "#16a34a", "#9333ea", "#dc2626")


@dataclass(frozen=True, slots=True)
class Series:
    """One line of a chart."""

    name: str
    points: Sequence[tuple[float, float]]
    color: str = PALETTE[0]
    dashed: bool = False
    markers: bool = True


@dataclass(frozen=True, slots=True)
class Chart:
    """A chart's axes and reference lines."""

    x_label: str
    y_label: str
    x_format: Callable[[float], str]
    y_format: Callable[[float], str]
    x_log: bool = False
    x_time: bool = False  # x in seconds: ticks on round minutes and hours
    y_min: float = 0.0
    y_max: float | None = None
    references: list[tuple[float, str]] = field(default_factory=list)
    width: int = 640
    height: int = 300


_LEFT, _RIGHT, _TOP, _BOTTOM = 58, 16, 14, 44


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    ticks = []
    t = first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


_TIME_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600)


def _time_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    raw = (hi - lo) / count
    step = next((float(s) for s in _TIME_STEPS if s >= raw), 86400.0 * math.ceil(raw / 86400))
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 1)]


def _log_ticks(lo: float, hi: float) -> list[float]:
    start, stop = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for mantissas in ((1.0,), (1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)):
        ticks = [
            m * 10.0**e
            for e in range(start, stop + 1)
            for m in mantissas
            if lo <= m * 10.0**e <= hi
        ]
        if len(ticks) >= 3:
            return ticks
    return [lo, hi]


def line_chart(chart: Chart, series: Sequence[Series]) -> str:
    """The chart as an ``<svg>`` element (with a legend) ready to inline in HTML."""
    pts = [p for s in series for p in s.points if not chart.x_log or p[0] > 0]
    if not pts:
        return '<p class="empty">No data to plot.</p>'
    xs = [p[0] for p in pts]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = (x_lo / 2, x_hi * 2) if chart.x_log else (x_lo - 1, x_hi + 1)
    y_hi = chart.y_max
    if y_hi is None:
        y_hi = max([p[1] for p in pts] + [r[0] for r in chart.references]) * 1.08 or 1.0
    y_lo = chart.y_min
    w, h = chart.width, chart.height
    plot_w, plot_h = w - _LEFT - _RIGHT, h - _TOP - _BOTTOM

    def sx(x: float) -> float:
        if chart.x_log:
            frac = (math.log10(x) - math.log10(x_lo)) / (math.log10(x_hi) - math.log10(x_lo))
        else:
            frac = (x - x_lo) / (x_hi - x_lo)
        return _LEFT + frac * plot_w

    def sy(y: float) -> float:
        frac = (min(max(y, y_lo), y_hi) - y_lo) / (y_hi - y_lo) if y_hi > y_lo else 0.0
        return _TOP + (1 - frac) * plot_h

    out = [
        # Inline SVG in HTML needs no namespace declaration: the page names no URL at all.
        f'<svg class="chart" viewBox="0 0 {w} {h}" role="img" font-size="11">',
        f'<rect x="{_LEFT}" y="{_TOP}" width="{plot_w}" height="{plot_h}" class="plot"/>',
    ]
    for ty in _nice_ticks(y_lo, y_hi):
        y = sy(ty)
        out.append(
            f'<line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
        )
        out.append(
            f'<text x="{_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
            f"{escape(chart.y_format(ty))}</text>"
        )
    if chart.x_log:
        x_ticks = _log_ticks(x_lo, x_hi)
    elif chart.x_time:
        x_ticks = _time_ticks(x_lo, x_hi)
    else:
        x_ticks = _nice_ticks(x_lo, x_hi, 6)
    for tx in x_ticks:
        x = sx(tx)
        out.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{_TOP}" y2="{_TOP + plot_h}" class="grid"/>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{_TOP + plot_h + 16}" text-anchor="middle">'
            f"{escape(chart.x_format(tx))}</text>"
        )
    for value, label in chart.references:
        y = sy(value)
        # Labels sit at the left: curves usually rise to the right, towards their reference.
        out.append(
            f'<line x1="{_LEFT}" x2="{_LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}" class="ref"/>'
            f'<text x="{_LEFT + 6}" y="{y - 4:.1f}" class="reflabel">{escape(label)}</text>'
        )
    for s in series:
        points = [(sx(x), sy(y)) for x, y in s.points if not chart.x_log or x > 0]
        if not points:
            continue
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="2"{dash}>'
            f"<title>{escape(s.name)}</title></polyline>"
        )
        if s.markers and len(points) <= 60:
            out.extend(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.6" fill="{s.color}"/>' for x, y in points
            )
    out.append(
        f'<text x="{_LEFT + plot_w / 2}" y="{h - 8}" text-anchor="middle" class="axis">'
        f"{escape(chart.x_label)}</text>"
        f'<text transform="translate(14 {_TOP + plot_h / 2}) rotate(-90)" text-anchor="middle" '
        f'class="axis">{escape(chart.y_label)}</text></svg>'
    )
    legend = "".join(
        f'<span class="key"><i style="background:{s.color}"></i>{escape(s.name)}</span>'
        for s in series
        if s.points
    )
    return f"<figure>{''.join(out)}<figcaption>{legend}</figcaption></figure>"
