"""The backend replicas behind the proxy: who they are, what they hold, whether they answer.

Each ``Replica`` carries its dialect (detected at start-up from ``/props`` / ``/version`` or
forced by configuration), what the server said about itself (slots, context size) and the
proxy's own count of requests in flight to it. A replica that could not be reached at start-up
is probed again in the background until it answers, so the proxy can start before its backend.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from proxy.backends import BackendInfo, Dialect, detect_dialect, dialect_named
from proxy.config import BackendSpec
from proxy.log import get_logger

log = get_logger()

DEFAULT_CAPACITY_TOKENS = 131_072


@dataclass(slots=True)
class Replica:
    """One backend server."""

    spec: BackendSpec
    dialect: Dialect = field(default_factory=Dialect)
    info: BackendInfo | None = None
    detected: bool = False
    in_flight: int = 0

    @property
    def url(self) -> str:
        return self.spec.url

    def capacity_tokens(self, configured: int | None) -> int:
        """Prefix-index capacity: configured, else what the server reports, else a default."""
        if configured:
            return configured
        if self.info is not None and self.info.capacity_tokens:
            return self.info.capacity_tokens
        return DEFAULT_CAPACITY_TOKENS


class Fleet:
    """All replicas, with start-up detection and background re-probing."""

    def __init__(self, specs: Sequence[BackendSpec], *, dialect: str = "auto") -> None:
        self._forced = None if dialect == "auto" else dialect
        self.replicas = [Replica(spec=s) for s in specs]
        if self._forced is not None:
            for r in self.replicas:
                r.dialect = dialect_named(self._forced)
        self._probe_task: asyncio.Task[None] | None = None

    async def start(self, session: aiohttp.ClientSession, *, retry_s: float = 2.0) -> None:
        """Detect every replica once now; keep probing the unreachable ones in the background."""
        await asyncio.gather(*(self._detect(session, r) for r in self.replicas))
        if not all(r.detected for r in self.replicas):
            self._probe_task = asyncio.create_task(self._probe_until_detected(session, retry_s))

    async def _detect(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        dialect = (
            dialect_named(self._forced)
            if self._forced is not None
            else await detect_dialect(session, replica.url)
        )
        if dialect is None:
            log.warning("backend_unreachable_at_startup", backend=replica.url)
            return
        replica.dialect = dialect
        replica.info = await dialect.describe(session, replica.url)
        replica.detected = True
        log.info(
            "backend_detected",
            backend=replica.url,
            dialect=dialect.name,
            slots=replica.info.slots,
            ctx_per_slot=replica.info.ctx_per_slot,
            model=replica.info.model,
        )

    async def _probe_until_detected(self, session: aiohttp.ClientSession, retry_s: float) -> None:
        while not all(r.detected for r in self.replicas):
            await asyncio.sleep(retry_s)
            await asyncio.gather(
                *(self._detect(session, r) for r in self.replicas if not r.detected)
            )

    async def aclose(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe_task
            self._probe_task = None

    def choose(self, matched_blocks: dict[str, int] | None = None) -> Replica:
        """The replica for the next request.

        With one replica this is that replica. With several: the one holding the longest
        prefix, ties broken by fewest requests in flight (prefix-aware routing with load
        gating is its own module).
        """
        if len(self.replicas) == 1:
            return self.replicas[0]
        matched = matched_blocks or {}
        return max(
            self.replicas,
            key=lambda r: (matched.get(r.url, 0), -r.in_flight / max(r.spec.weight, 1e-9)),
        )
