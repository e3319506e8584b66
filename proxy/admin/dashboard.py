"""``GET /dashboard``: one self-contained page that draws ``/stats`` and refreshes itself.

The page is plain HTML, CSS and JavaScript shipped as package data (``proxy/admin/static``) and
served by the proxy itself: no CDN, no font or script from anywhere else, so it works on a machine
without internet access, and the Content-Security-Policy below forbids the page from reaching
anything but this origin. Charts are drawn as SVG by ``dashboard.js``; every value from the store
is inserted as text, never as markup (prefix labels may carry prompt text).
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources

from aiohttp import web

# Only these files are served, whatever the URL asks for.
ASSETS: Mapping[str, str] = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
PAGE = "dashboard.html"
SECURITY_HEADERS: Mapping[str, str] = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def load_static(name: str) -> bytes:
    """One file of ``proxy/admin/static``, read from the installed package."""
    return resources.files("proxy.admin").joinpath("static", name).read_bytes()


class DashboardFiles:
    """The page and its assets, read once when the application is built."""

    def __init__(self) -> None:
        self._page = load_static(PAGE)
        self._assets = {name: load_static(name) for name in ASSETS}

    async def page(self, request: web.Request) -> web.Response:
        """GET /dashboard."""
        return web.Response(
            body=self._page, content_type="text/html", charset="utf-8", headers=SECURITY_HEADERS
        )

    async def slash(self, request: web.Request) -> web.Response:
        """GET /dashboard/: to the page (relative, so it also works under a path prefix)."""
        raise web.HTTPFound("../dashboard")

    async def asset(self, request: web.Request) -> web.Response:
        """GET /dashboard/<asset>: the page's script and stylesheet."""
        name = request.match_info["asset"]
        if name not in ASSETS:
            raise web.HTTPNotFound(reason=f"no dashboard asset {name!r}")
        return web.Response(
            body=self._assets[name],
            content_type=ASSETS[name],
            charset="utf-8",
            headers=SECURITY_HEADERS,
        )
