"""The backend replicas behind the proxy: who they are, whether they answer, where a request goes.

Each ``Replica`` carries its dialect (detected at start-up, ``proxy.backends.detect_dialect``, or
forced by configuration), what the server said about itself (slots, context size), the proxy's
own count of requests in flight to it, its health and, where the server reports it, its own load.

Health. A background monitor checks every replica on ``HealthChecks.interval_s`` at its
dialect's ``Capabilities.health_path`` (``GET /v1/models`` for a generic OpenAI-compatible
server); a 200 within the timeout passes, and so does a 401 or 403 (the server is up, and wants
an API key the proxy was not given: ``--backend-api-key``; the probes and load reads send it
when it is).
``HealthChecks.failures`` consecutive failures eject the replica, and so does a connection error
seen by live traffic (``report_failure``); one passing check brings it back. A replica that could
not be reached at start-up starts ejected and is detected again by the same monitor, so the proxy
can start before its backends. The same round reads each healthy backend's own load
(``proxy.backend_metrics``), so nothing on the request path waits for a backend's metrics.

Background work leaves the backend as it is. A server that can sleep when idle may be woken,
or kept awake, by some background reads (a slot list, for one). A dialect whose server says
whether it sleeps without waking names where (``Capabilities.sleep_state_path``), and each round
reads it: while the server says it sleeps the replica is left alone (no load read, no slot
read; its load is zero), and such a replica is *quiet* (``Replica.load_paused``) once a load read
found nothing running or queued while this proxy had nothing in flight to it: its load is then
not read again until the proxy sends it a request or it reports work. The scheduler's slot reads
follow the same rule (``Replica.may_poll_slots``), except that they go on while this proxy
counts a request in flight to it (from its admission to its end: the server is awake for it).
The cost: traffic that reaches a quiet server from elsewhere is seen at the first round after
this proxy next sends it a request. A server that does not say whether it sleeps is always read.

Routing. ``route`` turns what the prefix index said about a request (matched blocks per replica,
shared in-flight counts, the traffic-shared depth) plus health, weights and loads into
``Candidate`` s, and lets ``proxy.routing.Router`` choose. The load compared is the largest of
the shared in-flight count (every proxy on the store), this proxy's own count (always current,
even before a background store write lands) and the backend's own running + queued requests
(which also sees traffic that bypasses the proxies, but is as old as the last poll).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import aiohttp

from proxy.backend_metrics import BackendLoad, LoadReader
from proxy.backends import (
    BackendInfo,
    Dialect,
    detect_dialect,
    dialect_named,
    probe_json,
)
from proxy.config import BackendSpec, HealthChecks, Settings
from proxy.log import get_logger
from proxy.prefixes import PrefixView
from proxy.routing import ROUND_ROBIN, Candidate, Decision, Router, RoutingConfig

log = get_logger()

DEFAULT_CAPACITY_TOKENS = 131_072
UP_BUT_PROTECTED = frozenset({401, 403})


@dataclass(slots=True)
class Replica:
    """One backend server."""

    spec: BackendSpec
    dialect: Dialect = field(default_factory=Dialect)
    info: BackendInfo | None = None
    detected: bool = False
    in_flight: int = 0
    """Requests this proxy has in flight to it."""
    healthy: bool = True
    """False while ejected: not chosen while a healthy replica exists."""
    failures: int = 0
    """Consecutive failed health checks (or the ejection threshold after a live failure)."""
    last_error: str | None = None
    backend_load: BackendLoad | None = None
    """The backend's own load at the last poll; None when it does not report one."""
    load_reader: LoadReader = field(default_factory=LoadReader)
    asleep: bool = False
    """Its server said it sleeps at the last round: background reads leave it be."""
    load_paused: bool = False
    """Quiet at the last round (nothing running there, nothing in flight from this proxy)."""
    protected: bool = False
    """It refused a probe for want of an API key: up, behind ``--api-key``."""

    @property
    def may_poll_slots(self) -> bool:
        """Whether a background slot read leaves the server as it is (module docstring): not
        while it sleeps; while it is quiet only when this proxy counts a request in flight to
        it (the read then keeps nothing awake that the request does not, and the slot of a
        request the server placed is learned while it runs)."""
        return not self.asleep and (self.in_flight > 0 or not self.load_paused)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def health_path(self) -> str:
        return self.dialect.capabilities.health_path

    def capacity_tokens(self, configured: int | None) -> int:
        """Prefix-index capacity: configured, else what the server reports, else a default."""
        if configured:
            return configured
        if self.info is not None and self.info.capacity_tokens:
            return self.info.capacity_tokens
        return DEFAULT_CAPACITY_TOKENS

    def load(self, shared: float | None = None) -> float:
        """The load the router compares: the largest of the three counts it can know."""
        own = self.backend_load.total if self.backend_load is not None else 0.0
        return max(float(self.in_flight), shared or 0.0, own)


class Fleet:
    """All replicas: detection, health, load polling and the routing decision."""

    def __init__(
        self,
        specs: Sequence[BackendSpec],
        *,
        dialect: str = "auto",
        routing: RoutingConfig | None = None,
        health: HealthChecks | None = None,
        backend_api_key: str | None = None,
    ) -> None:
        self._forced = None if dialect == "auto" else dialect
        self.replicas = [Replica(spec=s) for s in specs]
        if self._forced is not None:
            for r in self.replicas:
                r.dialect = dialect_named(self._forced)
        self._by_url = {r.url: r for r in self.replicas}
        self.router = Router(routing)
        # The control group's balancer: what a plain load balancer does, nothing of the index.
        self.plain_router = Router(RoutingConfig(policy=ROUND_ROBIN))
        self.health = health or HealthChecks()
        self._headers = {"Authorization": f"Bearer {backend_api_key}"} if backend_api_key else {}
        self._session: aiohttp.ClientSession | None = None
        self._monitor: asyncio.Task[None] | None = None
        self.rounds = 0  # completed check rounds; ``round_done`` is set after each
        self.round_done = asyncio.Event()

    @classmethod
    def from_settings(cls, settings: Settings) -> Fleet:
        return cls(
            settings.backends,
            dialect=settings.dialect,
            routing=settings.routing,
            health=settings.health,
            backend_api_key=settings.backend_api_key,
        )

    def __getitem__(self, url: str) -> Replica:
        return self._by_url[url]

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Detect and check every replica once now, then keep checking them in the background.

        At start-up there is no history to be patient with: a replica that fails its first
        check starts ejected.
        """
        self._session = session
        await asyncio.gather(*(self._check(r, first=True) for r in self.replicas))
        self._monitor = asyncio.create_task(self._run_monitor())

    async def aclose(self) -> None:
        """Stop the monitor; safe to call more than once."""
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
            self._monitor = None

    async def _run_monitor(self) -> None:
        while True:
            await asyncio.sleep(self.health.interval_s)
            try:
                await self.check_all()
            except Exception:  # the monitor must outlive any one bad answer
                log.exception("health_check_failed")

    async def check_all(self) -> None:
        """One round: check every replica's health and read the healthy ones' own load."""
        await asyncio.gather(*(self._check(r) for r in self.replicas))
        self.rounds += 1
        self.round_done.set()

    # -- detection and health ------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Fleet.start() was not called")
        return self._session

    async def _detect(self, replica: Replica) -> None:
        session = self._client()
        dialect = (
            dialect_named(self._forced)
            if self._forced is not None
            else await detect_dialect(session, replica.url, headers=self._headers)
        )
        if dialect is None:
            if replica.failures == 0:  # once per incident, not every round
                log.warning("backend_unreachable_at_startup", backend=replica.url)
            return
        replica.dialect = dialect
        replica.info = await dialect.describe(session, replica.url, headers=self._headers)
        replica.detected = True
        if replica.info.protected:
            self._note_protected(replica)
        log.info(
            "backend_detected",
            backend=replica.url,
            dialect=dialect.name,
            slots=replica.info.slots,
            ctx_per_slot=replica.info.ctx_per_slot,
            model=replica.info.model,
        )

    async def _check(self, replica: Replica, *, first: bool = False) -> None:
        if not replica.detected:
            await self._detect(replica)
        error = await self._probe(replica) if replica.detected else "unreachable"
        if error is not None:
            replica.backend_load = None
            if first:
                self._eject(replica, error)
            else:
                self._fail(replica, error)
            return
        self._pass(replica)
        await self._read_sleep(replica)
        caps = replica.dialect.capabilities
        if replica.asleep and caps.sleep_state_path is not None:
            replica.backend_load = BackendLoad(0.0, 0.0, caps.sleep_state_path)
            return
        if not self.health.backend_load or replica.protected:  # a protected one refuses them
            replica.load_paused = replica.in_flight == 0
            return
        last = replica.backend_load
        quiet = replica.in_flight == 0 and last is not None and last.total == 0
        if quiet and caps.sleep_state_path is not None:
            replica.load_paused = True  # quiet: the last read is still true; ask no more
            return
        replica.load_paused = False
        replica.backend_load = await replica.load_reader.read(
            self._client(),
            replica.url,
            replica.dialect,
            timeout_s=self.health.timeout_s,
            headers=self._headers,
        )

    async def _read_sleep(self, replica: Replica) -> None:
        """Whether the server sleeps, from where it says so without waking it."""
        path = replica.dialect.capabilities.sleep_state_path
        if path is None or replica.protected:
            # Protected without its key: the sleep state would be refused every round (and
            # logged by the server), and nothing else in the background reads it anyway.
            replica.asleep = False
            return
        status, props = await probe_json(
            self._client(), replica.url + path, self.health.timeout_s, headers=self._headers
        )
        if status in UP_BUT_PROTECTED:
            self._note_protected(replica)
        asleep = status == 200 and replica.dialect.is_sleeping(props)
        if asleep != replica.asleep:
            log.info("backend_sleeping" if asleep else "backend_awake", backend=replica.url)
        replica.asleep = asleep

    def _note_protected(self, replica: Replica) -> None:
        if not replica.protected:
            log.warning(
                "backend_protected",
                backend=replica.url,
                message=(
                    "the backend asks for an API key the proxy was not given: it is served, "
                    "but what it would say about itself (slots, load) is unknown; set "
                    "--backend-api-key (PREFIXGATE_BACKEND_API_KEY)"
                ),
            )
        replica.protected = True

    async def _probe(self, replica: Replica) -> str | None:
        """One health check: None when it passed, else what went wrong."""
        timeout = aiohttp.ClientTimeout(total=self.health.timeout_s)
        try:
            async with self._client().get(
                replica.url + replica.health_path, headers=self._headers, timeout=timeout
            ) as resp:
                await resp.read()
                if resp.status in UP_BUT_PROTECTED:
                    self._note_protected(replica)
                    return None
                return (
                    None if resp.status == 200 else f"{replica.health_path} answered {resp.status}"
                )
        except TimeoutError:
            return f"{replica.health_path} timed out"
        except aiohttp.ClientError as exc:
            return f"{replica.health_path} failed: {exc.__class__.__name__}"

    def _pass(self, replica: Replica) -> None:
        if not replica.healthy:
            log.info("backend_restored", backend=replica.url, after=replica.last_error)
        replica.healthy = True
        replica.failures = 0
        replica.last_error = None

    def _fail(self, replica: Replica, error: str) -> None:
        replica.failures += 1
        replica.last_error = error
        if replica.healthy and replica.failures >= self.health.failures:
            self._eject(replica, error)

    def _eject(self, replica: Replica, reason: str) -> None:
        replica.failures = max(replica.failures, self.health.failures)
        replica.last_error = reason
        if replica.healthy:
            replica.healthy = False
            log.warning("backend_ejected", backend=replica.url, reason=reason)

    def report_failure(self, replica: Replica, reason: str) -> None:
        """Live traffic saw a connection-level failure: eject ``replica`` until a check passes."""
        self._eject(replica, reason)

    # -- routing -------------------------------------------------------------------------------

    def candidate(self, replica: Replica, view: PrefixView | None) -> Candidate:
        """What the router knows of ``replica`` for the request described by ``view``."""
        matched = view.matched_for(replica.url) if view is not None else 0
        shared = view.loads.get(replica.url) if view is not None else None
        return Candidate(
            replica=replica.url,
            matched_blocks=matched,
            load=replica.load(shared),
            weight=replica.spec.weight,
            healthy=replica.healthy,
        )

    def route(self, view: PrefixView | None) -> Decision:
        """The replica for a request (``view``: what the index said about it; None for none)."""
        candidates = [self.candidate(r, view) for r in self.replicas]
        return self._choose(candidates, view)

    def route_plain(self, *, tried: Collection[str] = ()) -> Decision | None:
        """The replica a plain balancer would choose (round-robin over the healthy replicas
        not in ``tried``), for a request of the control group; None when ``tried`` leaves none.
        """
        candidates = [self.candidate(r, None) for r in self.replicas if r.url not in tried]
        if tried:
            candidates = [c for c in candidates if c.healthy]
        if not candidates:
            return None
        return self.plain_router.choose(candidates, key=0, shared_blocks=0)

    def has_alternative(self, replica: Replica) -> bool:
        """Whether a healthy replica other than ``replica`` exists (a retry could go there)."""
        return any(r.healthy and r is not replica for r in self.replicas)

    def reroute(self, view: PrefixView | None, *, tried: Collection[str]) -> Decision | None:
        """Another healthy replica for a request that ``tried`` could not serve, or None."""
        candidates = [
            self.candidate(r, view) for r in self.replicas if r.healthy and r.url not in tried
        ]
        if not candidates:
            return None
        return self._choose(candidates, view)

    def _choose(self, candidates: Sequence[Candidate], view: PrefixView | None) -> Decision:
        if view is None:
            return self.router.choose(candidates, key=0, shared_blocks=0)
        return self.router.choose(
            candidates,
            key=view.key,
            shared_blocks=view.shared_blocks,
            affinity_key=view.affinity_key,
        )

    def passthrough_order(self) -> list[Replica]:
        """Replicas for a non-inference request: healthy ones first, in configured order."""
        return sorted(self.replicas, key=lambda r: not r.healthy)

    def is_healthy(self, url: str) -> bool:
        """Whether the replica at ``url`` passes its health checks (False: not one of ours)."""
        return any(r.url == url and r.healthy for r in self.replicas)

    def readiness(self) -> dict[str, bool]:
        """Health per replica, as ``/readyz`` reports it."""
        return {r.url: r.healthy for r in self.replicas}
