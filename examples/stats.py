"""Read prefixgate's statistics (GET /stats) from a script: hit rates, goodput, savings, prefixes.

    .venv/bin/python examples/stats.py [--admin-url URL] [--window 1h] [--model M] [--json]

/stats aggregates every proxy replica's requests (through Redis when the proxies share one), so
any replica gives the fleet's view. With --admin-token set on the proxy, pass the same token
(--admin-token or PREFIXGATE_ADMIN_TOKEN). /stats is on the proxy's admin listener: its URL
comes from --admin-url, else PREFIXGATE_ADMIN_URL, else http://localhost:8001 (--admin-port).
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any


def stats_url(admin_url: str, window: str, model: str | None, backend: str | None) -> str:
    root = admin_url.rstrip("/")
    query = {"window": window, **({"model": model} if model else {})}
    if backend:
        query["backend"] = backend
    return f"{root}/stats?{urllib.parse.urlencode(query)}"


def fetch(url: str, token: str | None) -> dict[str, Any]:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as resp:
        data = json.load(resp)
    if not isinstance(data, dict):
        raise ValueError("GET /stats did not answer a JSON object")
    return data


def pct(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, int | float) else "-"


def num(value: Any, fmt: str = ",.0f") -> str:
    return format(value, fmt) if isinstance(value, int | float) else "-"


def report(stats: dict[str, Any]) -> str:
    totals = stats.get("totals") or {}
    store = stats.get("store") or {}
    goodput = stats.get("goodput") or {}
    slo = goodput.get("slo") or {}
    lines = [
        f"prefixgate stats, window {stats.get('window')}  "
        f"(store: {store.get('kind', '?')}{', DEGRADED' if store.get('degraded') else ''})",
        f"requests        {num(totals.get('requests'))}   errors {num(totals.get('errors'))} "
        f"({pct(totals.get('error_rate'))})",
        f"prompt tokens   {num(totals.get('prompt_tokens'))}   cached "
        f"{num(totals.get('cached_tokens'))}",
        f"hit rate        measured {pct(totals.get('hit_rate_token_weighted'))}   "
        f"predicted {pct(totals.get('predicted_hit_rate'))}   "
        f"per-request mean {pct(totals.get('hit_rate_per_request_mean'))}",
        f"goodput         {pct(goodput.get('share', totals.get('goodput_share')))} within SLO "
        f"(ttft ≤ {num(slo.get('ttft_ms'))} ms, tpot ≤ {num(slo.get('tpot_ms'))} ms)",
        f"saved           prefill {num(totals.get('saved_prefill_ms'))} ms   "
        f"${num(totals.get('saved_usd'), ',.4f')}",
    ]
    latency = totals.get("latency_ms") or {}
    for kind in ("ttft", "ttfvt", "tpot", "e2e"):
        q = latency.get(kind) or {}
        if q.get("count"):
            lines.append(
                f"{kind:<6} ms      p50 {num(q.get('p50'), ',.1f')}  "
                f"p90 {num(q.get('p90'), ',.1f')}  p99 {num(q.get('p99'), ',.1f')}  "
                f"(n={q['count']})"
            )
    rules = totals.get("rules") or {}
    if rules:
        fired = ", ".join(f"{k} {v}" for k, v in sorted(rules.items(), key=lambda kv: -kv[1]))
        lines.append(f"canonical rules {fired}")
    backends = stats.get("backends") or {}
    if backends:
        lines.append("backends")
        for url, b in backends.items():
            state = "healthy" if b.get("healthy") else "UNHEALTHY"
            lines.append(
                f"  {url}  {state}  in flight {b.get('in_flight', 0)}  {b.get('dialect', '')}"
            )
    top = stats.get("top_prefixes") or []
    if top:
        lines.append("top prefixes (application prompts by prompt tokens)")
        for p in top[:10]:
            label = p.get("label") or ""
            lines.append(
                f"  {str(p.get('anchor'))[:16]:<16}  requests {num(p.get('requests')):>6}  "
                f"hit rate {pct(p.get('hit_rate')):>6}  {label}"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--admin-url",
        default=os.environ.get("PREFIXGATE_ADMIN_URL", "http://localhost:8001"),
        help="the proxy's admin listener (--admin-port)",
    )
    parser.add_argument("--window", default="1h", help="5m, 1h, 24h or 7d")
    parser.add_argument("--model")
    parser.add_argument("--backend", help="one backend replica's URL")
    parser.add_argument("--admin-token", default=os.environ.get("PREFIXGATE_ADMIN_TOKEN"))
    parser.add_argument("--json", action="store_true", help="print the raw JSON")
    args = parser.parse_args()
    url = stats_url(args.admin_url, args.window, args.model, args.backend)
    try:
        stats = fetch(url, args.admin_token)
    except urllib.error.HTTPError as exc:
        print(f"GET {url}: HTTP {exc.code} {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"GET {url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(stats, indent=2) if args.json else report(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
