"""Keep-alive connections to the backends, by origin (``proxy.wire``'s pool)."""

from __future__ import annotations

import asyncio
import base64
import ssl
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from proxy.wire.errors import WireConnectError, WireConnectTimeout

if TYPE_CHECKING:
    from proxy.wire.answering import Answering


class BackendConnection(asyncio.Protocol):
    """One keep-alive connection to a backend; one exchange at a time."""

    def __init__(self, pool: BackendPool, origin: str) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.closed_here = False  # closed by this side (an answer cut short, not ended)
        self.answering: Answering | None = None
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        answering = self.answering
        if answering is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        answering.received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self.pool.lost(self)
        answering = self.answering
        if answering is not None:
            answering.lost(exc)

    def close(self) -> None:
        """Close the connection (not reused); reading stops at once."""
        self.closed = self.closed_here = True
        if self.transport is not None:
            self.transport.close()


class BackendPool:
    """Keep-alive connections to the backends, by origin; no limit on their number."""

    def __init__(self, *, keepalive_s: float = 30.0) -> None:
        self.keepalive_s = keepalive_s
        self._idle: dict[str, list[BackendConnection]] = {}
        self._all: set[BackendConnection] = set()
        self._origins: dict[str, tuple[str, int, bool, bytes, bytes | None]] = {}
        self._tls: ssl.SSLContext | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def origin(self, url: str) -> tuple[str, str, bytes, bytes | None]:
        """``url``'s origin key, its request target (path and query), its ``Host`` line and the
        ``Authorization`` line its credentials make (``http://user:password@host``), if any."""
        scheme, sep, rest = url.partition("://")
        if not sep:
            raise WireConnectError(f"not an absolute URL: {url[:80]!r}")
        authority, slash, path = rest.partition("/")
        key = f"{scheme.lower()}://{authority}"
        known = self._origins.get(key)
        if known is None:
            parts = urlsplit(key)
            tls = parts.scheme == "https"
            try:
                port = parts.port or (443 if tls else 80)
            except ValueError as exc:
                raise WireConnectError(f"bad port in {key!r}") from exc
            if not parts.hostname or parts.scheme not in ("http", "https"):
                raise WireConnectError(f"not an http(s) origin: {key!r}")
            host = parts.hostname
            shown = f"[{host}]" if ":" in host else host
            host_header = shown if port == (443 if tls else 80) else f"{shown}:{port}"
            auth = None
            if parts.username is not None:
                pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
                token = base64.b64encode(pair.encode("utf-8")).decode("ascii")
                auth = f"Authorization: Basic {token}\r\n".encode("ascii")
            host_line = f"Host: {host_header}\r\n".encode("latin-1")
            known = (host, port, tls, host_line, auth)
            self._origins[key] = known
        return key, "/" + path if slash else "/", known[3], known[4]

    async def connect(self, key: str, connect_s: float | None) -> BackendConnection:
        """An idle connection to ``key`` (newest first), or a new one."""
        idle = self._idle.get(key)
        if idle:
            oldest = self.loop.time() - self.keepalive_s
            while idle:
                conn = idle.pop()
                if conn.idle_since < oldest:  # this one and all below it have expired
                    conn.close()
                    for stale in idle:
                        stale.close()
                    idle.clear()
                    break
                if not conn.closed:
                    return conn
        return await self.new_connection(key, connect_s)

    async def new_connection(self, key: str, connect_s: float | None) -> BackendConnection:
        if self._closed:
            raise WireConnectError("the proxy is shutting down")
        host, port, tls, _, _ = self._origins[key]
        context: ssl.SSLContext | None = None
        if tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            context = self._tls
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await self.loop.create_connection(
                    lambda: BackendConnection(self, key),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if tls else None,
                )
        except TimeoutError as exc:
            raise WireConnectTimeout("connecting timed out") from exc
        except (OSError, ssl.SSLError) as exc:
            raise WireConnectError(f"cannot connect: {exc.__class__.__name__}") from exc
        self._all.add(conn)
        return conn

    def put(self, conn: BackendConnection) -> None:
        """``conn`` is idle again, ready for another request to its origin."""
        if self._closed or conn.closed:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.origin, []).append(conn)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self.keepalive_s, self._close_expired)

    def _close_expired(self) -> None:
        """Close the connections idle for ``keepalive_s``; again later while any are idle."""
        self._sweep = None
        oldest = self.loop.time() - self.keepalive_s
        waiting = False
        for idle in self._idle.values():
            expired = [c for c in idle if c.idle_since <= oldest]
            for conn in expired:
                idle.remove(conn)
                conn.close()
            waiting = waiting or bool(idle)
        if waiting and not self._closed:
            self._sweep = self.loop.call_later(self.keepalive_s / 2, self._close_expired)

    def lost(self, conn: BackendConnection) -> None:
        """``conn`` has closed: it is forgotten."""
        self._all.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        """Close every connection (at shutdown)."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        await asyncio.sleep(0)
