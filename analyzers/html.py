"""The self-contained HTML report: one file, inline CSS and SVG, nothing loaded from anywhere.

Sections mirror the terminal report: headline figures, the capacity curve, hit rate over
time, TTFT for hits and misses, then the tables (shared prefixes, cache breakers, provider
rules, goodput). Every string from the inputs is escaped.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

from analyzers import formatting as fmt
from analyzers.analysis import Analysis
from analyzers.goodput import Latency
from analyzers.svg import PALETTE, Chart, Series, line_chart

_CSS = """
:root{--fg:#0f172a;--muted:#64748b;--line:#e2e8f0;--bg:#f8fafc;--card:#fff;--accent:#2563eb}
*{box-sizing:border-box}body{margin:0;font:14px/1.5 system-ui,-apple-system,"Segoe UI",
Roboto,sans-serif;color:var(--fg);background:var(--bg)}main{max-width:1100px;margin:0 auto;
padding:28px 24px 60px}h1{font-size:24px;margin:0 0 4px}h2{font-size:17px;margin:34px 0 10px}
.sub{color:var(--muted);margin:0 0 18px}.cards{display:grid;gap:12px;
grid-template-columns:repeat(auto-fit,minmax(170px,1fr))}.card{background:var(--card);
border:1px solid var(--line);border-radius:10px;padding:12px 14px}.card b{display:block;
font-size:24px;font-weight:650}.card span{color:var(--muted);font-size:12px}
.grid2{display:grid;gap:16px;grid-template-columns:repeat(auto-fit,minmax(440px,1fr))}
figure{margin:0;background:var(--card);border:1px solid var(--line);border-radius:10px;
padding:10px 10px 6px}figure h3{margin:2px 6px 4px;font-size:14px}svg.chart{width:100%;
height:auto}svg .plot{fill:#fff;stroke:var(--line)}svg .grid{stroke:#eef2f7}svg text{fill:#475569}
svg .axis{fill:var(--muted)}svg .ref{stroke:#94a3b8;stroke-dasharray:3 3}
svg .reflabel{fill:#64748b}figcaption{padding:2px 8px 4px;color:var(--muted);font-size:12px}
.key{margin-right:14px}.key i{display:inline-block;width:10px;height:10px;border-radius:2px;
margin-right:5px;vertical-align:-1px}table{width:100%;border-collapse:collapse;
background:var(--card);border:1px solid var(--line);border-radius:10px;overflow:hidden}
th,td{padding:7px 10px;border-bottom:1px solid var(--line);text-align:left;vertical-align:top}
th{background:#f1f5f9;font-weight:600;font-size:12px;color:#334155}td.n,th.n{text-align:right;
font-variant-numeric:tabular-nums}code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;
background:#f1f5f9;border-radius:4px;padding:1px 4px;word-break:break-all}.rule{color:#7c3aed;
font-weight:600}.diff{font:12px ui-monospace,Menlo,monospace;white-space:pre-wrap;
word-break:break-all}.diff .a{color:#b91c1c}.diff .b{color:#15803d}.empty,.note{color:var(--muted)}
"""


def _card(value: str, label: str) -> str:
    return f'<div class="card"><b>{escape(value)}</b><span>{escape(label)}</span></div>'


def _table(headers: list[str], rows: list[list[str]], numeric: set[int]) -> str:
    if not rows:
        return '<p class="empty">Nothing found.</p>'
    head = "".join(
        f'<th class="n">{escape(h)}</th>' if i in numeric else f"<th>{escape(h)}</th>"
        for i, h in enumerate(headers)
    )
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _charts(a: Analysis) -> str:
    ideal = a.ideal.hit_rate
    capacity = line_chart(
        Chart(
            "cache capacity (tokens, log scale)",
            "hit rate",
            fmt.tokens,
            lambda v: fmt.percent(v, 0),
            x_log=True,
            y_max=max(ideal * 1.1, 0.05),
            references=[(ideal, f"ideal {fmt.percent(ideal)}"), (0.9 * ideal, "90% of ideal")],
        ),
        [
            Series(
                "LRU hit rate (tokens)", [(p.capacity_tokens, p.hit_rate) for p in a.curve.points]
            ),
            Series(
                "LRU hit rate (requests)",
                [(p.capacity_tokens, p.request_hit_rate) for p in a.curve.points],
                PALETTE[1],
                dashed=True,
            ),
        ],
    )
    over_time = line_chart(
        Chart(
            "time since first request",
            "hit rate",
            fmt.seconds,
            lambda v: fmt.percent(v, 0),
            x_time=True,
            y_max=1.0,
        ),
        [
            Series("ideal (unbounded cache)", [(b.start, b.ideal_hit_rate) for b in a.timeline]),
            Series(
                "measured",
                [
                    (b.start, b.measured_hit_rate)
                    for b in a.timeline
                    if b.measured_hit_rate is not None
                ],
                PALETTE[2],
            ),
        ],
    )
    g = a.goodput
    ttft = line_chart(
        Chart(
            "TTFT (ms, log scale)",
            "share of requests",
            fmt.ms,
            lambda v: fmt.percent(v, 0),
            x_log=True,
            y_max=1.0,
        ),
        [
            Series(f"hits ({g.ttft_hit.count})", _cdf(g.ttft_hit), PALETTE[2], markers=False),
            Series(f"misses ({g.ttft_miss.count})", _cdf(g.ttft_miss), PALETTE[4], markers=False),
        ],
    )
    return (
        '<div class="grid2">'
        f"<figure><h3>Capacity curve (LRU over prefix blocks)</h3>{capacity}</figure>"
        f"<figure><h3>Hit rate over time (token-weighted)</h3>{over_time}</figure>"
        f"<figure><h3>TTFT, cache hits vs misses (CDF)</h3>{ttft}</figure>"
        "</div>"
    )


def _cdf(lat: Latency) -> list[tuple[float, float]]:
    n = len(lat.sample)
    return [(v, (i + 1) / n) for i, v in enumerate(lat.sample)] if n else []


def _sections(a: Analysis, top: int) -> str:
    prefixes = _table(
        ["requests", "prefix", "shared here", "tokens saved", "covers", "first seen in"],
        [
            [
                f"{g.requests:,}",
                fmt.tokens(g.prefix_tokens),
                fmt.tokens(g.shared_tokens),
                fmt.tokens(g.tokens_saved),
                escape(g.kinds or "blocks"),
                escape(g.source),
            ]
            for g in a.tree.groups[:top]
        ],
        {0, 1, 2, 3},
    )
    breakers = _table(
        ["rule", "where", "seen", "tokens lost", "earlier request → this request"],
        [
            [
                f'<span class="rule">{escape(b.rule)}</span>'
                + (f'<br><span class="note">{escape(b.hint)}</span>' if b.hint else ""),
                escape(b.where),
                f"{b.occurrences:,}",
                fmt.tokens(b.tokens_lost),
                (
                    f'<div class="diff"><span class="a">{escape(b.earlier)}</span><br>'
                    f'<span class="b">{escape(b.later)}</span></div>'
                    if b.earlier
                    else escape(b.label)
                ),
            ]
            for b in a.breakers[:top]
        ],
        {2, 3},
    )
    p = a.providers
    spread = _table(
        ["application prompt", "requests", "backends", "prompt tokens", "extra prefill"],
        [
            [
                f"<code>{escape(s.app)}</code>",
                f"{s.requests:,}",
                escape(", ".join(f"{k} ({v})" for k, v in s.backends.items())),
                fmt.tokens(s.stable_tokens),
                fmt.tokens(s.extra_prefill_tokens),
            ]
            for s in p.spread
        ],
        {1, 3, 4},
    )
    g = a.goodput
    latency = _table(
        ["", "requests", "p50", "p90", "p99"],
        [
            [name, f"{lat.count:,}", fmt.ms(lat.p50), fmt.ms(lat.p90), fmt.ms(lat.p99)]
            for name, lat in (
                ("TTFT, hits", g.ttft_hit),
                ("TTFT, misses", g.ttft_miss),
                ("TPOT, hits", g.tpot_hit),
                ("TPOT, misses", g.tpot_miss),
            )
        ],
        {1, 2, 3, 4},
    )
    return (
        f"<h2>Shared prefixes</h2>{prefixes}"
        f"<h2>Cache breakers</h2>{breakers}"
        "<h2>Provider rules</h2>"
        f"<p>Minimum cacheable prefix {p.min_cacheable_tokens:,} tokens: "
        f"{p.short_prefix_requests:,} requests' hits are shorter "
        f"({fmt.tokens(p.short_prefix_tokens)} tokens); {p.short_prompt_requests:,} prompts are "
        f"below it; ideal hit rate under the minimum {fmt.percent(p.hit_rate_with_minimum)}.</p>"
        f"{spread}"
        f"<h2>Goodput</h2><p>SLO met: {fmt.percent(g.slo_share)} of {g.slo_requests:,} requests "
        f"with an SLO. Hit means ≥ half the prompt cached ({escape(g.basis)}).</p>{latency}"
    )


def render_html(a: Analysis, *, top: int = 10) -> str:
    """The whole report page."""
    m = a.measured
    t = a.trace
    cards = "".join(
        [
            _card(f"{len(t.requests):,}", "requests"),
            _card(fmt.tokens(a.ideal.prompt_tokens), "prompt tokens"),
            _card(fmt.percent(a.ideal.hit_rate), "ideal hit rate (tokens)"),
            _card(fmt.percent(a.ideal_request_hit_rate), "ideal hit rate (per request)"),
            _card(fmt.percent(m.hit_rate if m else None), "measured hit rate (tokens)"),
            _card(fmt.percent(m.gap if m else None), "gap to ideal, where measured"),
            _card(fmt.tokens(a.curve.tokens_for_90pct), "cache size for 90% of ideal"),
        ]
    )
    inputs = ", ".join(f"{Path(p).name} ({f})" for p, f in t.formats.items())
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in t.notes)
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width,initial-scale=1">'
        f"<title>prefixgate analyze</title><style>{_CSS}</style></head><body><main>"
        "<h1>Prefix cache report</h1>"
        f'<p class="sub">{escape(inputs)}</p>'
        f'<div class="cards">{cards}</div>{notes}'
        f"<h2>Where the cache stands</h2>{_charts(a)}"
        f"{_sections(a, top)}"
        "</main></body></html>"
    )


def write_html(a: Analysis, path: Path, *, top: int = 10) -> None:
    """Write the report page to ``path``."""
    path.write_text(render_html(a, top=top), encoding="utf-8")
