"""Typed application state: one ``ProxyState`` under one ``AppKey``, and per-request keys."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from proxy.attribution import MissAttributor
from proxy.canonical import Canonicalizer
from proxy.config import Settings
from proxy.exchange import Exchange
from proxy.fleet import Fleet
from proxy.lift import LiftLedger
from proxy.prefixes import PrefixTracker
from proxy.record_writer import RecordWriter
from proxy.records import RecordBuilder
from proxy.redact import Redactor
from proxy.scheduling import Scheduler
from proxy.store import PrefixStore
from proxy.tracing import RecordTracer
from proxy.wire import BackendPool


@dataclass(slots=True)
class ProxyState:
    """Everything the handlers share, opened and closed with the application."""

    settings: Settings
    session: aiohttp.ClientSession
    """Pass-through paths and the backends' own endpoints (metrics, slots, health)."""
    wire: BackendPool
    """Inference requests (``proxy.wire``): the answer relayed from the connection's reads."""
    fleet: Fleet
    store: PrefixStore
    tracker: PrefixTracker
    writer: RecordWriter[Exchange]
    builder: RecordBuilder
    canonicalizer: Canonicalizer
    redactor: Redactor
    scheduler: Scheduler
    misses: MissAttributor
    """Attributes every request's uncached prompt tokens to causes (``proxy.attribution``)."""
    ledger: LiftLedger | None = None
    """The control group's per-conversation tallies (only with ``--control-share``)."""
    tracer: RecordTracer | None = None
    """Traces over OTLP (only when the environment configures an endpoint)."""
    after_first: asyncio.TimerHandle | None = None
    """The pending run of the work that waits for first tokens (``handlers._first_token``)."""
    awaiting_first: int = 0
    """Inference requests that arrived and have no token out yet: the proxy's work for them is
    their time to first token, and records wait for them (``RecordWriter.hold_while``)."""


STATE = web.AppKey("prefixgate_state", ProxyState)
PROXY_APP = web.AppKey("prefixgate_proxy_app", web.Application)
"""On the admin application: the traffic application whose state it reports."""
REQUEST_ID = web.RequestKey("prefixgate_request_id", str)
T_START = web.RequestKey("prefixgate_t_start", float)
TENANT = web.RequestKey("prefixgate_tenant", str)


def proxy_state(request: web.Request) -> ProxyState:
    """The proxy's state, from a handler of the traffic or of the admin application."""
    app = request.app.get(PROXY_APP, request.app)
    return app[STATE]
