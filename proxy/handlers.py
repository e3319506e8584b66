"""Request handlers: inference routes, transparent pass-through, liveness and readiness.

An inference request goes: read and parse the body → canonicalize → fingerprint and look up the
prefix index → choose a replica → let the dialect prepare the body → relay. Whatever happens, one
``RequestRecord`` is written when it ends, and the index and statistics learn from it in the
background.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.backends import CHAT, COMPLETIONS, NATIVE_COMPLETION
from proxy.canonical import CanonicalResult
from proxy.errors import BadRequest, PayloadTooLarge, ProxyError, UnsupportedMediaType
from proxy.prefixes import PrefixView
from proxy.records import Observation, monotonic, utc_now_iso
from proxy.relay import CLIENT_CLOSED, Exchange, relay_inference, relay_passthrough
from proxy.state import REQUEST_ID, STATE, T_START, TENANT, ProxyState
from proxy.store import DEFAULT_NAMESPACE

# Paths served as inference, and the route (dialect and fingerprint vocabulary) each one is.
INFERENCE_PATHS = {
    "/v1/chat/completions": CHAT,
    "/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/completions": COMPLETIONS,
    "/completion": NATIVE_COMPLETION,
}


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, bounded by ``limit`` (413 above it)."""
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is {request.content_length} bytes; limit {limit}")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes") from exc


def parse_object(body: bytes, content_type: str) -> dict[str, Any]:
    """Parse a JSON object body; anything else is the client's error (400/415)."""
    if content_type.startswith("multipart/"):
        raise UnsupportedMediaType(f"expected application/json, got {content_type}")
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(obj).__name__}")
    return obj


async def inference(request: web.Request) -> web.StreamResponse:
    """POST chat / completions / native completion: the observed, cache-aware path."""
    state = request.app[STATE]
    route = INFERENCE_PATHS[request.path]
    obs = Observation(t_start=request[T_START])
    ex = Exchange(request_id=request[REQUEST_ID], route=route, upstream_path=request.path, obs=obs)
    ts = utc_now_iso()
    model: str | None = None
    view: PrefixView | None = None
    replica = None
    body: dict[str, Any] | None = None
    fired: list[str] = []
    canonical: CanonicalResult | None = None
    tenant = request.get(TENANT)
    namespace = tenant or DEFAULT_NAMESPACE
    try:
        raw = await read_body(request, state.settings.max_body_bytes)
        obs.t_body_read = monotonic()
        body = parse_object(raw, request.content_type)
        ex.stream = body.get("stream") is True
        model = body["model"] if isinstance(body.get("model"), str) else None
        canonical = state.canonicalizer.apply(route, body)
        changed = canonical.body is not body
        body = canonical.body
        fired = list(canonical.fired)
        replicas = [r.url for r in state.fleet.replicas]
        view = await state.tracker.lookup(
            route, body, replicas, namespace=namespace, salt=tenant or ""
        )
        replica = state.fleet.choose(dict(view.matched_blocks))
        if model is None and replica.info is not None:
            model = replica.info.model
        ex.backend_url = replica.url
        ex.dialect = replica.dialect
        if tenant is not None and ex.dialect.partition_cache(body, tenant):
            changed = True
        ex.strip_usage = ex.dialect.prepare(route, body, stream=ex.stream)
        ex.upstream_body = orjson.dumps(body) if changed or ex.strip_usage else raw
        replica.in_flight += 1
        try:
            resp = await relay_inference(
                request,
                state.session,
                ex,
                timeouts=state.settings.timeouts,
                backend_api_key=state.settings.backend_api_key,
            )
        finally:
            replica.in_flight -= 1
        if fired:
            resp.headers.setdefault("X-Prefixgate-Canonical", ",".join(fired))
        return resp
    except ProxyError as exc:
        ex.status, ex.error = exc.status, exc.type
        return exc.to_response(request_id=ex.request_id)
    except asyncio.CancelledError:
        ex.status, ex.error = CLIENT_CLOSED, "client_disconnected"
        raise
    finally:
        if obs.t_end is None:
            obs.t_end = monotonic()
        record = state.builder.build(
            obs,
            ts=ts,
            request_id=ex.request_id,
            route=request.path,
            model=model,
            backend=ex.backend_url or None,
            dialect=ex.dialect.name if replica else None,
            stream=ex.stream,
            status=ex.status or 500,
            error=ex.error,
        )
        record.canonical_rules = fired
        record.tenant = tenant
        if canonical is not None:
            if canonical.dry_run_fired:
                record.extra["canonical_dry_run_rules"] = list(canonical.dry_run_fired)
            if canonical.stable_bytes_gained:
                record.extra["canonical_stable_bytes"] = canonical.stable_bytes_gained
        if view is not None and replica is not None:
            state.tracker.annotate(record, view, replica.url)
        if state.settings.log_prompts and body is not None:
            record.extra["body"] = state.redactor.value(body)
        state.writer.emit(record)
        if replica is not None:
            state.writer.spawn(
                state.tracker.learn(
                    record,
                    view,
                    replica=replica.url,
                    capacity_tokens=replica.capacity_tokens(state.settings.capacity_tokens),
                )
            )


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Every other path: forwarded to the (first healthy) backend untouched."""
    state = request.app[STATE]
    body = (
        await read_body(request, state.settings.max_body_bytes) if request.can_read_body else None
    )
    replica = state.fleet.choose()
    return await relay_passthrough(
        request,
        state.session,
        url=replica.url + request.path,
        body=body,
        request_id=request[REQUEST_ID],
        timeouts=state.settings.timeouts,
        backend_api_key=state.settings.backend_api_key,
    )


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the proxy's event loop answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: at least one backend answers its health check."""
    state: ProxyState = request.app[STATE]
    results = await asyncio.gather(*(_backend_healthy(state, r.url) for r in state.fleet.replicas))
    backends = {r.url: ok for r, ok in zip(state.fleet.replicas, results, strict=True)}
    ready = any(results)
    return web.json_response(
        {"status": "ready" if ready else "unavailable", "backends": backends},
        status=200 if ready else 503,
    )


async def _backend_healthy(state: ProxyState, url: str) -> bool:
    timeout = aiohttp.ClientTimeout(total=2.0)
    for path in ("/health", "/v1/models"):
        try:
            async with state.session.get(url + path, timeout=timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    return True
                if resp.status != 404:
                    return False
        except (aiohttp.ClientError, TimeoutError):
            return False
    return False
