"""Reading a backend's own load, in the background: how many requests it runs and how many wait.

The proxy counts the requests it has in flight to each replica, but a backend may also serve
traffic that does not pass through this proxy (or any proxy), and it knows its queue better than
anyone. Where a server exposes those numbers (its dialect's ``Capabilities.load_sources``, tried
in order; ``proxy.backends`` says which server publishes what), the fleet reads them on the
health-check interval (never on the request path) and the router folds them into the load it
compares. A server with no source is routed on the proxy's own counts only.

A source that answered is asked first next time. Some sources have side effects on the server
(a scrape that resets windowed gauges, a read that wakes a sleeping server), which is why a
dialect orders them and the fleet reads none while a replica is asleep or quiet (``proxy.fleet``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import aiohttp

from proxy.backends import DIALECTS, Dialect, dialect_named
from proxy.backends.load import BackendLoad, LoadSource, prometheus_samples
from proxy.log import get_logger

log = get_logger()

MAX_BODY_BYTES = 4 * 1024 * 1024  # a large /metrics page (histograms) is a few hundred KB at most

SOURCES: Mapping[str, Sequence[LoadSource]] = {
    name: dialect.capabilities.load_sources
    for name, dialect in DIALECTS.items()
    if dialect.capabilities.load_sources
}
"""Each dialect's load sources by name (derived from the dialects' capabilities)."""

__all__ = [
    "MAX_BODY_BYTES",
    "SOURCES",
    "BackendLoad",
    "LoadReader",
    "LoadSource",
    "prometheus_samples",
]


class LoadReader:
    """Reads one replica's load, remembering which of its dialect's sources answers."""

    __slots__ = ("_preferred",)

    def __init__(self) -> None:
        self._preferred: LoadSource | None = None

    async def read(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        dialect: Dialect | str,
        *,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> BackendLoad | None:
        """The backend's load now, or None when it does not say (or did not answer).

        ``dialect``: the server's dialect (or its name), whose ``load_sources`` are tried.
        """
        if isinstance(dialect, str):
            dialect = dialect_named(dialect)
        sources = list(dialect.capabilities.load_sources)
        if self._preferred in sources:
            sources.remove(self._preferred)
            sources.insert(0, self._preferred)
        for source in sources:
            load = await _fetch(session, base_url + source.path, source, timeout_s, headers)
            if load is not None:
                self._preferred = source
                return load
        self._preferred = None
        return None


async def _fetch(
    session: aiohttp.ClientSession,
    url: str,
    source: LoadSource,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
) -> BackendLoad | None:
    try:
        async with session.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200 or (resp.content_length or 0) > MAX_BODY_BYTES:
                return None
            payload = await resp.read()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return source.read(payload)
