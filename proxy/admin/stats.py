"""``GET /stats``: the statistics of a time window as one versioned JSON document.

Everything comes from the store (``query_stats`` for the window's buckets, ``top_prefixes`` for the
application-prefix ranking), so every proxy replica sharing one Redis serves the same numbers; only
``backends`` (this process's view of its replicas), ``control_group`` (this process's comparison
of the control group with the rest, ``proxy.lift``), ``canonical`` (the learned volatile spans,
shared through the store, with this process's hit counts) and ``generated_at`` are local. The
document is ``StatsWindow.to_json()`` (totals, the chart series, the breakdowns) plus what a
reader needs beside it: the window's name, goodput against the configured SLO, savings in the
units people reason in, the top prefixes and the store's state. Its JSON Schema is
``docs/schemas/stats-v1.schema.json``: a key added changes that file too, a key removed,
renamed or retyped also changes the version in ``SCHEMA``.

Query parameters: ``window`` (``5m``, ``1h`` (default), ``24h``, ``7d``), ``model``, ``backend``
(exact match), ``tenant`` (the statistics namespace; ``default`` unless tenants are in use),
``top`` (how many prefixes, 1..100, default 10). Anything else is a 400.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from proxy.errors import BadRequest
from proxy.fleet import Replica
from proxy.records import Slo
from proxy.state import ProxyState, proxy_state
from proxy.store import DEFAULT_NAMESPACE, StatsWindow, Tally

SCHEMA = "prefixgate.stats/v1"
WINDOWS: Mapping[str, int] = {"5m": 300, "1h": 3600, "24h": 86_400, "7d": 7 * 86_400}
DEFAULT_WINDOW = "1h"
DEFAULT_TOP = 10
MAX_TOP = 100
MAX_FILTER_CHARS = 512
PARAMS = frozenset({"window", "model", "backend", "tenant", "top"})


@dataclass(frozen=True, slots=True)
class StatsQuery:
    """A validated ``/stats`` request."""

    window: str = DEFAULT_WINDOW
    model: str | None = None
    backend: str | None = None
    tenant: str = DEFAULT_NAMESPACE
    top: int = DEFAULT_TOP

    @property
    def seconds(self) -> int:
        return WINDOWS[self.window]


def _filter(query: Mapping[str, str], name: str) -> str | None:
    if name not in query:
        return None
    value = query[name]
    if not value or len(value) > MAX_FILTER_CHARS or not value.isprintable():
        raise BadRequest(f"{name} must be 1 to {MAX_FILTER_CHARS} printable characters", param=name)
    return value


def parse_query(query: Mapping[str, str]) -> StatsQuery:
    """Validate the query string; a bad or unknown parameter is the client's error (400)."""
    unknown = sorted(set(query) - PARAMS)
    if unknown:
        raise BadRequest(
            f"unknown parameter {unknown[0]!r}; accepted: {', '.join(sorted(PARAMS))}",
            param=unknown[0],
        )
    window = query.get("window", DEFAULT_WINDOW)
    if window not in WINDOWS:
        raise BadRequest(
            f"window must be one of {', '.join(WINDOWS)}, not {window!r}", param="window"
        )
    top = DEFAULT_TOP
    if "top" in query:
        text = query["top"]
        if not text.isdigit() or not 1 <= int(text) <= MAX_TOP:
            raise BadRequest(f"top must be an integer from 1 to {MAX_TOP}", param="top")
        top = int(text)
    return StatsQuery(
        window=window,
        model=_filter(query, "model"),
        backend=_filter(query, "backend"),
        tenant=_filter(query, "tenant") or DEFAULT_NAMESPACE,
        top=top,
    )


def _ratio(num: float, den: float, digits: int = 4) -> float | None:
    return round(num / den, digits) if den else None


def goodput(window: StatsWindow, slo: Slo, elapsed_s: float) -> dict[str, Any]:
    """Share and rate of requests that met the SLO, with the SLO they were judged against."""
    met = window.total.get("slo_met")
    return {
        "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
        "share": _ratio(met, window.total.get("slo_evaluated")),
        "rate_per_s": _ratio(met, elapsed_s, 6),
        "met": round(met),
        "evaluated": round(window.total.get("slo_evaluated")),
    }


def savings(total: Tally, *, priced: bool) -> dict[str, Any]:
    """What the cache saved: prompt tokens not recomputed, prefill time, money (with prices)."""
    return {
        "cached_tokens": round(total.get("cached_tokens")),
        "prefill_s": round(total.get("saved_prefill_ms") / 1000.0, 3),
        "usd": round(total.get("saved_usd"), 6) if priced else None,
    }


def backends_view(state: ProxyState) -> dict[str, dict[str, Any]]:
    """This process's replicas: health, requests in flight, load, dialect, weight."""
    return {r.url: _replica_view(r) for r in state.fleet.replicas}


def _replica_view(replica: Replica) -> dict[str, Any]:
    return {
        "healthy": replica.healthy,
        "in_flight": replica.in_flight,
        "load": round(replica.load(), 3),
        "dialect": replica.dialect.name,
        "weight": replica.spec.weight,
        # The backend's template prints the date or time into every prompt: no rewrite helps.
        "template_clock": (
            replica.info.template_clock.as_dict()
            if replica.info is not None and replica.info.template_clock is not None
            else None
        ),
    }


def canonical_view(state: ProxyState, namespace: str) -> dict[str, Any]:
    """This process's learned volatile spans of ``namespace``: shared through the store, but
    the hit counts are this process's."""
    spans = state.canonicalizer.spans
    return {"learned_spans": spans.stats(namespace) if spans is not None else []}


async def build_stats(state: ProxyState, query: StatsQuery, *, now: float) -> dict[str, Any]:
    """The ``/stats`` document for ``query`` at ``now`` (epoch seconds).

    This proxy's held records and queued store writes are applied first: its own finished
    requests are all in."""
    await state.writer.settled(state.settings.timeouts.store)
    await state.tracker.flush()
    since = now - query.seconds
    window = await state.store.query_stats(
        since_s=since,
        until_s=now,
        model=query.model,
        backend=query.backend,
        namespace=query.tenant,
    )
    prefixes = await state.store.top_prefixes(
        since_s=since, limit=query.top, namespace=query.tenant
    )
    body = window.to_json()
    # Rates are averaged over the nominal window, so every replica computes the same figure.
    elapsed = float(query.seconds)
    settings = state.settings
    priced = settings.pricing.input_per_mtok is not None
    return {
        "schema": SCHEMA,
        "generated_at": round(now, 3),
        "window": query.window,
        "window_s": query.seconds,
        **body,
        "requests_per_s": _ratio(window.total.get("requests"), elapsed, 6),
        "goodput": goodput(window, settings.slo, elapsed),
        "savings": savings(window.total, priced=priced),
        "top_prefixes": [p.to_json() for p in prefixes],
        "backends": backends_view(state),
        "canonical": canonical_view(state, query.tenant),
        "store": {
            "kind": "redis" if settings.redis_url else "embedded",
            "degraded": state.store.degraded,
        },
        # This process's own, since it started (proxy.lift): not the window's, not the store's.
        "control_group": state.ledger.summary() if state.ledger is not None else None,
    }


async def stats(request: web.Request) -> web.Response:
    """GET /stats."""
    repeated = sorted({k for k in request.query if len(request.query.getall(k)) > 1})
    if repeated:
        raise BadRequest(f"parameter {repeated[0]!r} given more than once", param=repeated[0])
    query = parse_query(request.query)
    body = await build_stats(proxy_state(request), query, now=time.time())
    return web.Response(
        body=orjson.dumps(body),
        content_type="application/json",
        headers={"Cache-Control": "no-store"},
    )
