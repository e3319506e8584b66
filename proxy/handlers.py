"""Request handlers: the inference routes, liveness and readiness.

The liveness and readiness probes are served on the admin listener (``proxy.admin``); every
other path passes through (``proxy.passthrough``).

An inference request goes: read and parse the body → canonicalize → fingerprint and look up the
prefix index → choose a replica (``Fleet.route``) → claim it in the index and count it in flight →
let the dialect prepare the body → relay. A replica that fails before the client received a byte
(connection failure, or a 502/503 status line) is ejected or passed over and the request is sent
once to another healthy replica. Whatever happens, one ``RequestRecord`` is built from the
exchange when it ends (with the replica, ``route_reason`` and ``retried_from``; a moment
later, together with those of the requests that end meanwhile: ``RecordWriter.submit``), and
the record writer's learner (``proxy.exchange.learn``) updates the scheduler, the index and
the statistics from it.

A request of the control group (``proxy.control``, with ``--control-share``) skips the
canonicalizer, is routed round-robin (``Fleet.route_plain``) and left to the server's own slot
choice; it is looked up, claimed, recorded and learned from like any other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from aiohttp import web

from proxy.backends import CHAT, COMPLETIONS, MESSAGES, NATIVE_COMPLETION, RESPONSES
from proxy.canonical import CanonicalResult
from proxy.control import conversation_key
from proxy.errors import (
    BackendBadAnswer,
    BackendUnavailable,
    ProxyError,
    anthropic_error_response,
)
from proxy.exchange import Exchange, Outgoing, Target, build_record, settle_view
from proxy.log import get_logger
from proxy.prefixes import PrefixView
from proxy.records import Observation, RequestRecord, monotonic
from proxy.relay import BackendConnectTimeout, NotStarted, relay_inference, send_answer
from proxy.routing import RETRY_REASON, Decision
from proxy.scheduling import Ticket
from proxy.state import REQUEST_ID, STATE, T_START, TENANT, ProxyState, proxy_state
from proxy.store import DEFAULT_NAMESPACE
from proxy.stream_relay import CLIENT_CLOSED
from proxy.validation import parse_object, read_body, validate_inference

log = get_logger()

# Paths served as inference, and the route (dialect and fingerprint vocabulary) each one is.
INFERENCE_PATHS = {
    "/v1/chat/completions": CHAT,
    "/chat/completions": CHAT,
    "/v1/completions": COMPLETIONS,
    "/completions": COMPLETIONS,
    "/completion": NATIVE_COMPLETION,
    "/v1/responses": RESPONSES,
    "/responses": RESPONSES,
    "/v1/messages": MESSAGES,
}

AFTER_FIRST_TOKEN_S = 0.001
"""How long after a first token is relayed the work that waited for it runs. Not at once: a
client on the same cores is woken by the token, and would otherwise wait for that work to end
before it reads it (at one stream, a tenth of a millisecond of its time to first token)."""


def _target(state: ProxyState, view: PrefixView, decision: Decision) -> Target:
    replica = state.fleet[decision.replica]
    load = state.fleet.candidate(replica, view).load
    return Target(replica=replica, reason=decision.reason, load=load)


async def inference(request: web.Request) -> web.StreamResponse:
    """POST chat / completions / native completion: the observed, cache-aware path.

    Each stage leaves its result in the exchange; the record is built from it once the
    request has ended (``proxy.exchange.build_record``), whatever way it ended.
    """
    state = request.app[STATE]
    route = INFERENCE_PATHS[request.path]
    obs = Observation(t_start=request[T_START])
    ex = Exchange(request_id=request[REQUEST_ID], route=route, upstream_path=request.path, obs=obs)
    ex.send_timeout_s = state.settings.timeouts.client
    ex.tenant = tenant = request.get(TENANT)
    if state.tracer is not None:
        ex.trace = state.tracer.begin(request.headers)
        ex.upstream_headers = ex.trace.upstream_headers
    namespace = tenant or DEFAULT_NAMESPACE
    state.awaiting_first += 1
    ex.awaiting_first = True
    try:
        raw = await read_body(
            request, state.settings.max_body_bytes, idle_s=state.settings.timeouts.client
        )
        obs.t_body_read = monotonic()
        ex.body = body = parse_object(raw, request.content_type)
        validate_inference(route, body)
        ex.stream = body.get("stream") is True
        ex.model = body["model"] if isinstance(body.get("model"), str) else None
        # The client's conversation key chooses the replica and nothing else (not the salt).
        ex.affinity = state.settings.hosted.affinity_key(body, request.headers, tenant)
        control = state.settings.control
        if control.enabled:
            ex.control_key = conversation_key(route, body, ex.affinity, tenant)
            ex.control = control.is_control(ex.control_key)
        if ex.control:  # forwarded as the client sent it
            ex.canonical = canonical = CanonicalResult(body)
        else:
            ex.canonical = canonical = await state.canonicalizer.canonicalize(
                route, body, namespace=namespace
            )
        obs.t_canonical = monotonic()
        changed = canonical.body is not body
        ex.body = body = canonical.body
        if canonical.fired:
            ex.response_headers["X-Prefixgate-Canonical"] = ",".join(canonical.fired)
        fleet = state.fleet.replicas
        replicas = [r.url for r in fleet]
        # One replica: the store's answer is only recorded, unless the scheduler waits for it.
        deferred = len(fleet) == 1 and not state.scheduler.awaits_lookup(fleet[0])
        view = await state.tracker.lookup(
            route, body, replicas, namespace=namespace, salt=tenant or "", deferred=deferred
        )
        ex.lookup_queued = (
            deferred
            and view.pending is not None
            and state.tracker.writes is not None
            and state.tracker.remote_store
        )
        obs.t_lookup = monotonic()
        if ex.affinity is not None:
            view = dataclasses.replace(view, affinity_key=ex.affinity.value)
        ex.view = view
        decision = state.fleet.route_plain() if ex.control else state.fleet.route(view)
        assert decision is not None  # with nothing tried, some replica is always chosen
        ex.target = target = _target(state, view, decision)
        obs.t_routed = monotonic()
        if ex.model is None and target.replica.info is not None:
            ex.model = target.replica.info.model
        ex.outgoing = out = Outgoing(
            body=body, raw=raw, changed=changed, tenant=tenant, model=ex.model
        )
        retry = state.fleet.has_alternative(target.replica)
        try:
            resp = await _attempt(request, state, ex, view, target, out, retry=retry)
        except NotStarted as failed:
            resp = await _retry(request, state, ex, view, target, out, failed)
        if ex.error == "backend_disconnected":
            state.fleet.report_failure(target.replica, "connection lost mid-stream")
        return resp
    except ProxyError as exc:
        ex.status, ex.error = exc.status, exc.type
        if (
            ex.target is not None
            and isinstance(exc, BackendUnavailable | BackendConnectTimeout)
            and not isinstance(exc, BackendBadAnswer)
        ):
            state.fleet.report_failure(ex.target.replica, exc.message)
        if route == MESSAGES:
            return anthropic_error_response(exc, request_id=ex.request_id)
        return exc.to_response(request_id=ex.request_id)
    except asyncio.CancelledError:
        ex.status, ex.error = CLIENT_CLOSED, "client_disconnected"
        raise
    finally:
        _first_out(state, ex)
        if obs.t_end is None:
            obs.t_end = monotonic()
        cut_short = False
        state.tracker.answer_local()  # (a deferred lookup in this process: answered by now)
        if ex.lookup_queued:
            try:
                await _lookup_answered(state, ex)
            except asyncio.CancelledError:  # while waiting (shutdown): the record still goes
                cut_short = True
        state.writer.submit(functools.partial(_record, state, ex), ex, at_once=cut_short)
        if cut_short:
            raise asyncio.CancelledError


def _record(state: ProxyState, ex: Exchange) -> RequestRecord:
    """The ended request's record (built when ``RecordWriter.submit`` says)."""
    settle_view(ex)
    return build_record(
        ex,
        builder=state.builder,
        tracker=state.tracker,
        redactor=state.redactor,
        log_prompts=state.settings.log_prompts,
        misses=state.misses,
    )


async def _attempt(
    request: web.Request,
    state: ProxyState,
    ex: Exchange,
    view: PrefixView,
    target: Target,
    out: Outgoing,
    *,
    retry: bool,
) -> web.StreamResponse:
    """Send the request to ``target`` and relay its answer.

    The dialect adjusts a copy of the canonical body (dialects only set top-level keys), so a
    retry on a replica of another dialect starts from the same body. The replica is claimed in
    the index and counted in flight before anything else, the scheduler's wait included: this
    proxy's next lookup finds the claim at once (a burst of related requests arriving together
    lands together), and every proxy on the store sees the claim (and, with Redis, the load).
    """
    replica = target.replica
    ex.backend_url = replica.url
    ex.dialect = replica.dialect
    capacity = replica.capacity_tokens(state.settings.capacity_tokens)
    replica.in_flight += 1
    # This proxy sees the claim and the count at once (``PrefixTracker.claim``). The store's
    # writes are queued with the others and applied a moment later, the +1 (Redis only:
    # ``share_in_flight``) before the -1 of the ``finally`` below (``proxy.store.write_behind``).
    # Without write behind they are one background task, the count first (a task's first step
    # runs before any task spawned after it), and the claim's walk over every block waits until
    # the request is on its way.
    tracker = state.tracker
    forwarded: asyncio.Event | None = None
    if tracker.writes is not None:  # queued, written together a moment later
        tracker.in_flight(view, replica.url, +1)
        tracker.claim(view, replica.url, capacity, out.model)
    else:
        ex.forwarded = forwarded = asyncio.Event()
        count = tracker.in_flight(view, replica.url, +1)
        claim = tracker.claim(view, replica.url, capacity, out.model)
        assert claim is not None
        later = _after(forwarded, claim)
        state.writer.spawn(later if count is None else _in_order(count, later))
    ex.ticket = ticket = Ticket()  # held before the scheduler may wait (see ``learn``)
    admitted = False
    try:
        body = dict(out.body)
        edited = out.changed
        if out.tenant is not None and ex.dialect.partition_cache(body, out.tenant, ex.route):
            edited = True
        out.stripped = state.settings.hosted.strip(ex.dialect.name, body)
        edited = edited or bool(out.stripped)
        ex.strip_usage = ex.dialect.prepare(ex.route, body, stream=ex.stream)
        # Where on the replica it goes (llama.cpp slot) and when (coalescing); may wait. A
        # route on which the server ignores a slot id is not placed (the server chooses).
        placed = view if ex.dialect.carries_slot(ex.route) else None
        await state.scheduler.admit(
            ticket,
            replica,
            placed,
            body,
            model=out.model,
            stream=ex.stream,
            plain=ex.control is True,
        )
        ex.obs.t_admitted = monotonic()
        admitted = True
        ex.on_first_token = _first_token(state, ex)
        edited = edited or ticket.body_changed
        ex.upstream_body = out.encode(body, edited=edited or ex.strip_usage)
        out.sent = body
        return await relay_inference(
            request,
            state.wire,
            ex,
            timeouts=state.settings.timeouts,
            backend_api_key=state.settings.backend_api_key,
            retry=retry,
        )
    finally:
        # The callback holds the exchange that holds it: dropped here, the exchange (its body,
        # its rendered prompt) is freed by reference counting once its record is written,
        # not at the cyclic collector's next pass over an older generation.
        ex.on_first_token = None
        if forwarded is not None:
            forwarded.set()  # not forwarded after all: the claim is written now
        if admitted:
            ticket.end(ok=200 <= ex.status < 400 and ex.error is None, usage=ex.obs)
        else:  # cut short while the scheduler held it: its place is given up now, not when
            ticket.end(ok=False)  # its record is written (``learn``), which may be later
        replica.in_flight -= 1
        done = tracker.in_flight(view, replica.url, -1)
        if done is not None:
            state.writer.spawn(done)


def _first_token(state: ProxyState, ex: Exchange) -> Callable[[Mapping[str, Any]], None]:
    """What the relay calls at the first token, once it is on its way to the client: the
    scheduler learns it, the request no longer holds the records back (``_first_out``), and
    the work that waited for a first token is due (``_after_first_token``)."""
    ticket = ex.ticket
    assert ticket is not None

    def first_token(event: Mapping[str, Any]) -> None:
        ticket.first_token(event, ex.obs.t_first_token)  # (read then, maybe called a moment on)
        _first_out(state, ex)
        if state.after_first is None:
            loop = asyncio.get_running_loop()
            state.after_first = loop.call_later(AFTER_FIRST_TOKEN_S, _after_first_token, state)

    return first_token


def _after_first_token(state: ProxyState) -> None:
    """What waited for the first tokens written since the last time: the slot model's launches
    (``Scheduler.settle``) and the lookups left for after them (``answer_local``); both also run
    at their next use, and at every request's end, whichever comes first."""
    state.after_first = None
    try:
        state.scheduler.settle()
    finally:
        state.tracker.answer_local()


def _first_out(state: ProxyState, ex: Exchange) -> None:
    """``ex``'s first token is out, or it ended without one: it no longer waits on the proxy
    for its time to first token (the records wait while any request does:
    ``RecordWriter.hold_while``)."""
    if ex.awaiting_first:
        ex.awaiting_first = False
        state.awaiting_first -= 1


async def _lookup_answered(state: ProxyState, ex: Exchange) -> None:
    """A request can end before the queued writes its lookup rides with are sent: they go now.
    When its answer has been sent in full (every success: the relay writes it before the
    handler ends), the record waits for the store's answer at most the store's lookup deadline;
    an error answer, sent only after this, and a client gone do not wait."""
    view, writes = ex.view, state.tracker.writes
    if view is None or view.pending is None or view.pending.done() or writes is None:
        return
    writes.hurry()
    if ex.error is None:
        await asyncio.wait((view.pending,), timeout=state.settings.timeouts.store)


async def _after(event: asyncio.Event, work: Awaitable[None]) -> None:
    """``work`` once ``event`` is set and the request's own writes had their turn: the body
    goes out right after the event, at once on a kept-alive connection and otherwise once a
    new one is made (``proxy.wire.send``); one more turn of the loop lets the first go first."""
    try:
        await event.wait()
        await asyncio.sleep(0)
    except BaseException:
        if isinstance(work, Coroutine):
            work.close()  # cancelled first (shutting down): never started
        raise
    await work


async def _in_order(first: Awaitable[None], then: Awaitable[None]) -> None:
    """Background work in one task: ``then`` runs even when ``first`` fails."""
    try:
        await first
    finally:
        await then


async def _retry(
    request: web.Request,
    state: ProxyState,
    ex: Exchange,
    view: PrefixView,
    target: Target,
    out: Outgoing,
    failed: NotStarted,
) -> web.StreamResponse:
    """``target`` failed before the client saw a byte: once more on another healthy replica.

    ``target`` is updated in place to the replica that served (reason ``retry``). With no other
    healthy replica left, the client gets the first replica's answer or error.
    """
    first = target.replica
    state.tracker.unclaim(view, first.url)
    if failed.connection_failed:
        state.fleet.report_failure(first, failed.reason)
    if ex.control:
        decision = state.fleet.route_plain(tried={first.url})
    else:
        decision = state.fleet.reroute(view, tried={first.url})
    if decision is None:
        if failed.answer is not None:
            return await send_answer(request, ex, failed.answer)
        failure = failed.failure or BackendUnavailable(failed.reason)
        # Raised while ``failed`` is handled, the failure gets it as its context, and the raise's
        # traceback this frame: neither may lead back to the failure (``failed`` held it, as its
        # cause too), or the request's objects wait for the cyclic collector.
        failed.failure = failed.__cause__ = None
        del failed
        try:
            raise failure
        finally:
            del failure
    again = _target(state, view, decision)
    log.info("request_retried", backend=again.replica.url, failed=first.url, why=failed.reason)
    target.replica, target.reason, target.load = again.replica, RETRY_REASON, again.load
    target.retried_from = first.url
    ex.status, ex.error = 0, None
    t_forward = ex.obs.t_forward  # the proxy's own overhead ends when it first forwarded
    try:
        return await _attempt(request, state, ex, view, target, out, retry=False)
    finally:
        ex.obs.t_forward = t_forward


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the proxy's event loop answers."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: at least one backend passes its health checks (an ejected one does not)."""
    state = proxy_state(request)
    backends = state.fleet.readiness()
    ready = any(backends.values())
    return web.json_response(
        {"status": "ready" if ready else "unavailable", "backends": backends},
        status=200 if ready else 503,
    )
