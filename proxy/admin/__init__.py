"""The proxy's admin listener: ``/stats``, ``/dashboard``, ``/metrics``, ``/healthz``, ``/readyz``.

These routes live on their own application, served on ``--admin-port`` (default 8001), the way
Envoy and Traefik keep their admin apart from the traffic they carry: on the traffic port every
path the proxy does not serve as inference is the backend's, ``/metrics`` included.

Module map::

    stats.py       GET /stats: a window of store statistics as ``prefixgate.stats/v1`` JSON
    metrics.py     GET /metrics: per-application registry, record sink, scrape-time gauges
    dashboard.py   GET /dashboard and its static assets (static/)
    auth.py        the optional admin bearer token, compared in constant time

``build_admin_app`` builds that application for a traffic application (``proxy.app.build_app``
calls it and keeps it under ``ADMIN_APP``); its handlers read the traffic application's state
(``proxy.state.proxy_state``), so it is started after it and stopped before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

from proxy.admin.auth import Handler, require_admin
from proxy.admin.dashboard import DashboardFiles
from proxy.admin.metrics import ProxyMetrics
from proxy.admin.stats import SCHEMA, build_stats, stats
from proxy.config import Settings
from proxy.record_writer import RecordWriter
from proxy.state import PROXY_APP, STATE

METRICS = web.AppKey("prefixgate_metrics", ProxyMetrics)
ADMIN_APP = web.AppKey("prefixgate_admin_app", web.Application)
"""On the traffic application: its admin application (``build_admin_app``)."""
ADMIN_PATHS = ("/stats", "/metrics", "/dashboard")
HEALTH_PATHS = ("/healthz", "/readyz")

__all__ = [
    "ADMIN_APP",
    "ADMIN_PATHS",
    "HEALTH_PATHS",
    "METRICS",
    "SCHEMA",
    "ProxyMetrics",
    "build_admin_app",
    "build_stats",
]


def _current(writer: RecordWriter[Any], registry: CollectorRegistry) -> Handler:
    """The Prometheus page, with the records held for a moment (``RecordWriter.submit``)
    counted first: every request that has ended is in it."""
    page = make_aiohttp_handler(registry)

    async def metrics_page(request: web.Request) -> web.StreamResponse:
        writer.flush_ended()
        return await page(request)

    return metrics_page


def build_admin_app(
    proxy_app: web.Application,
    settings: Settings,
    writer: RecordWriter[Any],
    *,
    probes: Sequence[tuple[str, Handler]],
    middlewares: Sequence[Middleware] = (),
) -> web.Application:
    """The admin application of ``proxy_app``, its metrics fed from ``writer``'s records.

    ``probes`` are the liveness and readiness handlers (open, like a load balancer's probe);
    ``/stats``, ``/metrics`` and ``/dashboard`` need ``--admin-token`` when one is set.
    """
    admin = web.Application(middlewares=list(middlewares))
    admin[PROXY_APP] = proxy_app
    metrics = ProxyMetrics(state=lambda: proxy_app.get(STATE))
    proxy_app[METRICS] = metrics
    admin[METRICS] = metrics
    writer.add_sink(metrics.observe)
    files = DashboardFiles()
    token = settings.admin_token
    for path, handler in probes:
        admin.router.add_get(path, handler)
    admin.router.add_get("/stats", require_admin(token, stats))
    admin.router.add_get("/metrics", require_admin(token, _current(writer, metrics.registry)))
    admin.router.add_get("/dashboard", require_admin(token, files.page))
    admin.router.add_get("/dashboard/", files.slash)
    admin.router.add_get("/dashboard/{asset}", require_admin(token, files.asset))
    proxy_app[ADMIN_APP] = admin
    return admin
