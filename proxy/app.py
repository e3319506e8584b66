"""The aiohttp applications: middlewares, routes, and the resources opened with them.

Two applications, on two listeners: the traffic application (``build_app``) serves the inference
routes and passes every other path through to a backend untouched; its admin application
(``proxy.admin.build_admin_app``, under ``ADMIN_APP``) serves the proxy's own routes on
``--admin-port``, so none of them can shadow a path of the backend's.

Resources (the upstream ``ClientSession``, the store, backend detection) are opened and closed
in one ``cleanup_ctx`` context manager; handlers reach them through the typed ``STATE`` key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy import handlers, passthrough
from proxy.admin import ADMIN_APP, ADMIN_PATHS, build_admin_app
from proxy.attribution import MissAttributor
from proxy.auth import KeysFileError, auth_middleware, load_keys, refuse_ambiguous_paths
from proxy.canonical import Canonicalizer, config_from_mapping
from proxy.canonical.forms import FormMemory
from proxy.config import ConfigError, Settings
from proxy.errors import ProxyError, error_response
from proxy.exchange import Exchange, learn
from proxy.fleet import Fleet
from proxy.lift import LiftLedger
from proxy.log import get_logger
from proxy.prefixes import PrefixTracker
from proxy.record_writer import RecordWriter
from proxy.records import RecordBuilder, monotonic
from proxy.redact import Redactor
from proxy.scheduling import Scheduler
from proxy.state import REQUEST_ID, STATE, T_START, ProxyState
from proxy.store import StoreOptions, StoreTimeouts, open_store
from proxy.tracing import RecordTracer
from proxy.upstream import upstream_session
from proxy.wire import BackendPool

log = get_logger()
_REQUEST_ID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Routes of the traffic application served without a client API key, by template (the route
# the router matched, never a path prefix): none. The probes and the admin routes are on the
# admin listener (their own token, --admin-token).
OPEN_ROUTES: tuple[str, ...] = ()


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Stamp arrival time and request id; turn stray failures into OpenAI-shaped errors."""
    request[T_START] = monotonic()
    given = request.headers.get("X-Request-Id", "")
    rid = given if _REQUEST_ID_OK.match(given) else os.urandom(16).hex()  # 32 hex digits
    request[REQUEST_ID] = rid
    structlog.contextvars.bind_contextvars(request_id=rid)
    try:
        resp = await handler(request)
    except ProxyError as exc:
        resp = exc.to_response(request_id=rid)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        resp = error_response(exc.status, exc.reason, type_="invalid_request_error", request_id=rid)
    except Exception:
        log.exception("unhandled_error", path=request.path)
        if request.writer.output_size > 0:
            # A response has started: another one after it would be read as its body. The
            # connection is closed instead (aiohttp does, with the exception raised on).
            raise
        resp = error_response(500, "internal proxy error", type_="server_error", request_id=rid)
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
    if not resp.prepared:
        resp.headers["X-Request-Id"] = rid
    return resp


def build_canonicalizer(settings: Settings) -> Canonicalizer:
    """The canonicalizer from the ``[canonical]`` TOML table and the global switches.

    ``--no-canonicalize`` (or ``enabled = false`` in the table) turns it off;
    ``--canonical-dry-run`` (or ``dry_run = true``) only records what would change.
    Raises ``ConfigError`` on a bad table, at start-up.
    """
    config = config_from_mapping(settings.canonical)
    return Canonicalizer(
        dataclasses.replace(
            config,
            enabled=config.enabled and settings.canonicalize,
            dry_run=config.dry_run or settings.canonical_dry_run,
        ),
        forms=FormMemory(),
    )


def build_app(
    settings: Settings, *, writer: RecordWriter[Exchange] | None = None
) -> web.Application:
    """The proxy as an aiohttp application (not yet started)."""
    canonicalizer = build_canonicalizer(settings)
    # request_context first (request id, errors in the OpenAI shape), then the path check,
    # before authentication and any handler.
    middlewares: list[Middleware] = [request_context, refuse_ambiguous_paths]
    try:
        keys = load_keys(settings.api_keys, settings.api_keys_file)
    except KeysFileError as exc:
        raise ConfigError(str(exc)) from exc
    if keys.enabled or settings.tenant_header:
        middlewares.append(
            auth_middleware(keys, tenant_header=settings.tenant_header, open_routes=OPEN_ROUTES)
        )
    if keys.enabled and not settings.admin_token:
        log.warning(
            "admin_routes_unauthenticated",
            routes=list(ADMIN_PATHS),
            message=(
                "client API keys are required on the inference routes, but /stats, /metrics and "
                "/dashboard on the admin port are open to anyone who can reach it (every "
                "tenant's statistics included); set --admin-token (or PREFIXGATE_ADMIN_TOKEN, or "
                "admin_token in the TOML file) to require a token on them"
            ),
        )
    try:
        redactor = Redactor.build(settings.redact_patterns, defaults=settings.redact_defaults)
    except re.error as exc:
        raise ConfigError(f"bad --redact-pattern: {exc}") from exc
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    record_writer: RecordWriter[Exchange] = writer or RecordWriter(
        logger=get_logger("prefixgate.records")
    )
    # What the proxy learns from a finished request, with the stages it was built from.
    record_writer.add_learner(lambda record, ex: learn(app[STATE], record, ex))
    record_writer.hold_while(lambda: app[STATE].awaiting_first > 0)
    ledger: LiftLedger | None = None
    if settings.control.enabled:
        ledger = lift = LiftLedger(share=settings.control.share)
        record_writer.add_learner(lambda record, ex: lift.observe(record, ex.control_key))

    async def resources(app: web.Application) -> AsyncIterator[None]:
        session = upstream_session(limit=0, keepalive_timeout=30.0)
        pool = BackendPool(keepalive_s=30.0)
        t = settings.timeouts
        store = open_store(
            redis_url=settings.redis_url,
            options=StoreOptions(
                stats_retention_s=settings.stats_retention_s,
                traffic_window_s=settings.traffic_window_s,
                traffic_max_hashes=settings.traffic_max_hashes,
                timeouts=StoreTimeouts.for_lookup(t.store),
            ),
        )
        tracer = RecordTracer.from_env()
        if canonicalizer.notes is not None:  # the note memory shares the store's memory
            canonicalizer.notes.store = store
        try:  # from here on, a start step that fails still closes the session and the store
            fleet = Fleet.from_settings(settings)
            tracker = PrefixTracker(
                store,
                block_bytes=settings.block_bytes,
                log_prompt_labels=settings.log_prompts,
                routing=settings.routing,
                remote_store=settings.redis_url is not None,
                # (one replica, a store of its own: no routing decision reads the traffic)
                count_traffic=settings.redis_url is not None or len(fleet.replicas) > 1,
                share_in_flight=settings.redis_url is not None,
                write_delay_s=(
                    settings.store_write_delay_ms / 1000.0
                    if settings.store_write_delay_ms > 0
                    else None
                ),
            )
            record_writer.add_flusher(tracker.flush)
            state = ProxyState(
                settings=settings,
                session=session,
                wire=pool,
                fleet=fleet,
                store=store,
                tracker=tracker,
                writer=record_writer,
                builder=RecordBuilder(slo=settings.slo, pricing=settings.pricing),
                canonicalizer=canonicalizer,
                redactor=redactor,
                scheduler=Scheduler(
                    settings.scheduling, tokens_per_byte=tracker.tokens_per_byte.get
                ),
                misses=MissAttributor(
                    dry_run=canonicalizer.config.enabled and canonicalizer.config.dry_run,
                    healthy=fleet.is_healthy,
                ),
                ledger=ledger,
                tracer=tracer,
            )
            app[STATE] = state
            if canonicalizer.forms is not None:  # learned forms are shared through the store
                canonicalizer.forms.bind(store)
            if canonicalizer.spans is not None:  # so are learned volatile spans
                canonicalizer.spans.bind(store)
            try:
                # Off every request's deadline: the first prefixes learned are not lost to a
                # cold connection (bounded; a Redis that is down only leaves the store degraded).
                await store.warm()
                if tracer is not None:
                    record_writer.add_learner(tracer.observe)
                await fleet.start(session)
                state.scheduler.start(
                    session, fleet.replicas, backend_api_key=settings.backend_api_key
                )
                log.info(
                    "proxy_ready",
                    backends=[b.url for b in settings.backends],
                    store="redis" if settings.redis_url else "embedded",
                )
                yield
            finally:
                if state.after_first is not None:  # (each request's end did its work)
                    state.after_first.cancel()
                await state.scheduler.aclose()
                await fleet.aclose()
                await record_writer.drain(final=True)
                if canonicalizer.forms is not None:
                    await canonicalizer.forms.drain()
                if canonicalizer.spans is not None:
                    await canonicalizer.spans.drain()
                if tracer is not None:  # flushes what is queued; blocking, so in a thread
                    await asyncio.to_thread(tracer.shutdown)
        finally:
            await pool.close()
            await session.close()
            await store.aclose()

    app.cleanup_ctx.append(resources)
    for path in handlers.INFERENCE_PATHS:
        app.router.add_post(path, handlers.inference)
    app.router.add_route("*", "/{tail:.*}", passthrough.passthrough)
    build_admin_app(
        app,
        settings,
        record_writer,
        probes=(("/healthz", handlers.healthz), ("/readyz", handlers.readyz)),
        middlewares=(request_context, refuse_ambiguous_paths),
    )
    return app


def admin_app(app: web.Application) -> web.Application:
    """The admin application of a traffic application built by ``build_app``."""
    return app[ADMIN_APP]
