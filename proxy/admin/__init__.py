"""The proxy's admin routes: ``/stats`` (JSON), ``/dashboard`` (HTML) and ``/metrics`` (Prometheus).

Module map::

    stats.py       GET /stats: a window of store statistics as ``prefixgate.stats/v1`` JSON
    metrics.py     GET /metrics: per-application registry, record sink, scrape-time gauges
    dashboard.py   GET /dashboard and its static assets (static/)
    auth.py        the optional admin bearer token, compared in constant time

``install`` wires them into an application; ``build_app`` calls it before the catch-all
pass-through route, so these paths are answered by the proxy, not forwarded to a backend.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from proxy.admin.auth import require_admin
from proxy.admin.dashboard import DashboardFiles
from proxy.admin.metrics import ProxyMetrics
from proxy.admin.stats import SCHEMA, build_stats, stats
from proxy.config import Settings
from proxy.records import RecordWriter
from proxy.state import STATE

METRICS = web.AppKey("prefixgate_metrics", ProxyMetrics)
ADMIN_PATHS = ("/stats", "/metrics", "/dashboard")

__all__ = ["ADMIN_PATHS", "METRICS", "SCHEMA", "ProxyMetrics", "build_stats", "install"]


def install(app: web.Application, settings: Settings, writer: RecordWriter) -> ProxyMetrics:
    """Add the admin routes to ``app`` and feed its metrics from ``writer``'s records."""
    metrics = ProxyMetrics(state=lambda: app.get(STATE))
    app[METRICS] = metrics
    writer.add_sink(metrics.observe)
    files = DashboardFiles()
    token = settings.admin_token
    app.router.add_get("/stats", require_admin(token, stats))
    app.router.add_get("/metrics", require_admin(token, make_aiohttp_handler(metrics.registry)))
    app.router.add_get("/dashboard", require_admin(token, files.page))
    app.router.add_get("/dashboard/", files.slash)
    app.router.add_get("/dashboard/{asset}", require_admin(token, files.asset))
    return metrics
