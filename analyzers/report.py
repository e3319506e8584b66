"""The terminal report: rich tables, one per finding, most useful first."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from analyzers import formatting as fmt
from analyzers.analysis import Analysis
from analyzers.misses import CAUSES

_BAR = 24


def _bar(share: float) -> str:
    filled = max(0, min(_BAR, round(share * _BAR)))
    return "█" * filled + "·" * (_BAR - filled)


def _headline(a: Analysis) -> Panel:
    t = a.trace
    m = a.measured
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    inputs = ", ".join(f"{escape(Path(p).name)} [dim]({f})[/]" for p, f in t.formats.items())
    table.add_row("inputs", inputs)
    table.add_row(
        "requests",
        f"{len(t.requests):,}  [dim]({t.errors:,} failed, {t.skipped:,} other lines; "
        f"{', '.join(sorted(t.granularity)) or '-'} granularity)[/]",
    )
    table.add_row("prompt tokens", fmt.tokens(a.ideal.prompt_tokens))
    table.add_row(
        "ideal hit rate",
        f"[bold green]{fmt.percent(a.ideal.hit_rate)}[/] of tokens, "
        f"{fmt.percent(a.ideal_request_hit_rate)} per request (unbounded cache)",
    )
    if m is None:
        table.add_row("measured", "[dim]no record reports cached tokens[/]")
    else:
        table.add_row(
            "measured hit rate",
            f"[bold]{fmt.percent(m.hit_rate)}[/] of tokens, {fmt.percent(m.request_hit_rate)} "
            f"per request over {m.requests:,} requests; ideal there {fmt.percent(m.ideal_hit_rate)}"
            f" → gap [bold yellow]{fmt.percent(m.gap)}[/]",
        )
    table.add_row(
        "cache for 90% of ideal",
        f"{fmt.tokens(a.curve.tokens_for_90pct)} tokens "
        f"[dim](all distinct prefixes: {fmt.tokens(a.curve.footprint_tokens)})[/]",
    )
    return Panel(table, title="prefix cache report", border_style="blue")


def _capacity(a: Analysis) -> Table:
    table = Table(title="Capacity curve (LRU over prefix blocks)", title_justify="left")
    table.add_column("capacity", justify="right")
    table.add_column("hit rate", justify="right")
    table.add_column("per request", justify="right")
    table.add_column("of ideal", justify="right")
    table.add_column("")
    ideal = a.ideal.hit_rate
    for p in a.curve.points:
        share = p.hit_rate / ideal if ideal else 0.0
        table.add_row(
            fmt.tokens(p.capacity_tokens),
            fmt.percent(p.hit_rate),
            fmt.percent(p.request_hit_rate),
            fmt.percent(share, 0),
            Text(_bar(share), style="green" if share >= 0.9 else "cyan"),
        )
    return table


def _prefixes(a: Analysis, top: int) -> Table:
    table = Table(
        title=f"Shared prefixes (top {top} of {a.tree.total_groups:,} groups by tokens saved)",
        title_justify="left",
    )
    for name in ("requests", "prefix", "shared here", "tokens saved"):
        table.add_column(name, justify="right")
    table.add_column("covers")
    table.add_column("first seen")
    table.add_column("in")
    for g in a.tree.groups[:top]:
        table.add_row(
            f"{g.requests:,}",
            fmt.tokens(g.prefix_tokens),
            fmt.tokens(g.shared_tokens),
            fmt.tokens(g.tokens_saved),
            Text(g.kinds or "blocks"),
            fmt.seconds(g.first_seen - a.trace.requests[0].ts),
            Text(g.source),
        )
    return table


def _breakers(a: Analysis, top: int) -> Table | Text:
    if not a.breakers:
        return Text("Cache breakers: none found.", style="dim")
    table = Table(title="Cache breakers (ranked by tokens lost)", title_justify="left")
    table.add_column("rule", style="magenta", max_width=34)
    table.add_column("where")
    table.add_column("seen", justify="right")
    table.add_column("tokens lost", justify="right")
    table.add_column("earlier request", style="red", max_width=40)
    table.add_column("this request", style="green", max_width=40)
    for b in a.breakers[:top]:
        rule = Text(b.rule)
        if b.hint:
            rule.append("\n" + b.hint, style="dim")
        table.add_row(
            rule,
            Text(b.where),
            f"{b.occurrences:,}",
            fmt.tokens(b.tokens_lost),
            Text(fmt.clip(b.earlier, 120) if b.earlier else b.label),
            Text(fmt.clip(b.later, 120)),
        )
    return table


def _providers(a: Analysis, top: int) -> Group:
    p = a.providers
    line = Text.from_markup(
        f"Provider minimum of {p.min_cacheable_tokens:,} tokens: "
        f"{p.short_prefix_requests:,} requests' hits are shorter "
        f"({fmt.tokens(p.short_prefix_tokens)} tokens), {p.short_prompt_requests:,} prompts are "
        f"below it; ideal under the minimum [bold]{fmt.percent(p.hit_rate_with_minimum)}[/]."
    )
    if not p.spread:
        return Group(line)
    table = Table(
        title=f"Application prompts on more than {p.max_backends_per_prompt} backend(s)",
        title_justify="left",
    )
    table.add_column("anchor")
    table.add_column("requests", justify="right")
    table.add_column("backends")
    table.add_column("extra prefill", justify="right")
    for s in p.spread[:top]:
        table.add_row(
            s.app,
            f"{s.requests:,}",
            Text(", ".join(f"{k} ({v})" for k, v in s.backends.items())),
            fmt.tokens(s.extra_prefill_tokens),
        )
    return Group(line, table)


def _misses(a: Analysis) -> Table:
    m = a.trace.misses
    table = Table(
        title=f"Why prompt tokens missed the cache ({m.requests:,} attributed requests, "
        f"{fmt.tokens(m.uncached)} uncached tokens)",
        title_justify="left",
    )
    table.add_column("cause", style="bold")
    table.add_column("tokens", justify="right")
    table.add_column("share", justify="right")
    table.add_column("")
    table.add_column("recommended fix", max_width=70)
    fixes = m.fixes()
    for cause in CAUSES:
        share = m.share(cause) or 0.0
        detail = ""
        if cause == "breaker" and m.breaker_rules:
            detail = " (" + ", ".join(f"{r} {fmt.tokens(n)}" for r, n in m.breaker_rules.items())
            detail += ")"
        if cause == "routing" and m.routing_why:
            detail = " (" + ", ".join(f"{w} {fmt.tokens(n)}" for w, n in m.routing_why.items())
            detail += ")"
        table.add_row(
            cause,
            fmt.tokens(m.tokens[cause]),
            fmt.percent(share),
            Text(_bar(share), style="yellow" if cause != "new" else "dim"),
            Text(fixes.get(cause, "-") + detail),
        )
    return table


def _goodput(a: Analysis) -> Table:
    g = a.goodput
    table = Table(
        title=f"Goodput: SLO met {fmt.percent(g.slo_share)} of {g.slo_requests:,} "
        f"(hit = at least half the prompt cached, {g.basis})",
        title_justify="left",
    )
    table.add_column("")
    for name in ("requests", "p50", "p90", "p99"):
        table.add_column(name, justify="right")
    for name, lat in (
        ("TTFT hits", g.ttft_hit),
        ("TTFT misses", g.ttft_miss),
        ("TPOT hits", g.tpot_hit),
        ("TPOT misses", g.tpot_miss),
    ):
        table.add_row(name, f"{lat.count:,}", fmt.ms(lat.p50), fmt.ms(lat.p90), fmt.ms(lat.p99))
    return table


def print_report(a: Analysis, console: Console, *, top: int = 10) -> None:
    """Print the whole report."""
    console.print(_headline(a))
    console.print(_capacity(a))
    console.print(_prefixes(a, top))
    console.print(_breakers(a, top))
    console.print(_providers(a, top))
    if a.trace.misses.requests:
        console.print(_misses(a))
    if a.goodput.ttft_hit.count or a.goodput.ttft_miss.count or a.goodput.slo_requests:
        console.print(_goodput(a))
    for note in a.trace.notes:
        console.print(Text(f"note: {note}", style="dim"))
