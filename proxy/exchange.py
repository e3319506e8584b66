"""One inference request's way through the proxy, and the record built from it once.

Each stage of an inference request hands its typed result on in the ``Exchange``: the
canonicalizer its ``CanonicalResult``, the prefix tracker its ``PrefixView``, the router its
``Target``, the scheduler its ``Ticket``, the relay what it observed. When the request has ended,
``build_record`` builds the ``RequestRecord`` from them in one place, and the record writer hands
it to its sinks (the log line, metrics) and to ``learn`` (the scheduler's rates, the prefix index
and the statistics), which reads the stage results the record was built from.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from proxy.backends import Dialect
from proxy.fingerprint import hex64
from proxy.hosted import PROMPT_CACHE_KEY
from proxy.prefixes import logged_segments, prefix_label, settled
from proxy.records import Observation, RecordBuilder, RequestRecord
from proxy.timestamps import iso_ms
from proxy.wire import Body

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Mapping

    from proxy.attribution import MissAttributor
    from proxy.canonical import CanonicalResult
    from proxy.fleet import Replica
    from proxy.hosted import AffinityKey
    from proxy.prefixes import PrefixTracker, PrefixView
    from proxy.redact import Redactor
    from proxy.scheduling import Ticket
    from proxy.state import ProxyState
    from proxy.tracing import TraceContext


@dataclass(slots=True)
class Target:
    """Where an inference request goes: the replica, why it was chosen, how loaded it was."""

    replica: Replica
    reason: str
    load: float
    retried_from: str | None = None


@dataclass(slots=True)
class Outgoing:
    """The request as canonicalized, before any replica's dialect adjusts it."""

    body: dict[str, Any]
    raw: bytes
    changed: bool
    tenant: str | None
    model: str | None
    sent: dict[str, Any] | None = None
    stripped: tuple[str, ...] = ()
    """Hosted-only fields removed for the replica's dialect (``proxy.hosted``)."""

    def encode(self, body: dict[str, Any], *, edited: bool) -> Body:
        """What goes upstream for ``body`` (this request as the replica's dialect and the
        scheduler left it; ``edited``: they changed it): the client's bytes when nothing
        changed them, those bytes and the fields added when fields were only added
        (``added_fields``), else ``body`` serialized."""
        if not edited:
            return self.raw
        spliced = None if self.changed else added_fields(self.raw, self.body, body)
        return orjson.dumps(body) if spliced is None else spliced


def added_fields(raw: bytes, original: dict[str, Any], body: dict[str, Any]) -> Body | None:
    """The client's bytes with the top-level fields ``body`` adds to ``original`` appended
    (a slot id, a usage request), or None when ``body`` also drops or replaces a field.

    A request no rule rewrote then reaches the backend as the client wrote it, plus only what
    the proxy adds; re-serializing would change its spacing and escapes. The fields added come
    as a second part after the client's bytes (``proxy.wire.Body``), so a large body is never
    copied to append them.
    """
    if not original or any(
        key not in body or body[key] is not value for key, value in original.items()
    ):
        return None
    # Where the object closes: found in the last bytes (``rstrip`` of the whole would copy
    # it), or, past a long run of trailing space, in the whole after all.
    start = max(len(raw) - 64, 0)
    end = start + len(raw[start:].rstrip(_JSON_SPACE))
    if end == start and start:
        end = len(raw.rstrip(_JSON_SPACE))
    if raw[end - 1 : end] != b"}":
        return None
    extra = b",".join(
        orjson.dumps(key) + b":" + orjson.dumps(value)
        for key, value in body.items()
        if key not in original
    )
    if not extra:
        return raw
    return (memoryview(raw)[: end - 1], b"," + extra + b"}")


_JSON_SPACE = b" \t\r\n"


@dataclass(slots=True)
class Exchange:
    """One request's way through the proxy: what goes upstream and what came back.

    The relay reads and writes the first group of fields; the handler's stages fill the second
    with their results, which ``build_record`` reads.
    """

    request_id: str
    route: str
    upstream_path: str
    obs: Observation
    backend_url: str = ""
    dialect: Dialect = field(default_factory=Dialect)
    stream: bool = False
    strip_usage: bool = False
    status: int = 0
    error: str | None = None
    upstream_body: Body = b""
    on_first_token: Callable[[Mapping[str, Any]], None] | None = None
    """Told once, with the event (or whole answer) that carried the backend's first token."""
    forwarded: asyncio.Event | None = None
    """Set when the request is handed to the backend (work that can wait for it waits)."""
    awaiting_first: bool = False
    """Counted in ``ProxyState.awaiting_first`` (arrived, no token out yet)."""
    lookup_queued: bool = False
    """The store's lookup went with the queued writes (``PrefixTracker.lookup``, deferred):
    they are sent at the first token, or at once for an answer that is not streamed."""
    response_headers: dict[str, str] = field(default_factory=dict)
    """The proxy's own headers on the client's response (set before it starts)."""
    trace: TraceContext | None = None
    """The request's place in a trace (only with tracing on: ``proxy.tracing``)."""
    upstream_headers: dict[str, str] | None = None
    """Headers the proxy sets on the upstream request (``traceparent`` when tracing is on)."""
    send_timeout_s: float | None = None
    """Longest a client may leave a write unaccepted before it is cut off (None: forever)."""
    # The stages' results (None until the stage ran):
    t_wall: float = field(default_factory=time.time)
    """When the request arrived (the epoch's seconds: the record formats it, ``ts``)."""
    tenant: str | None = None
    model: str | None = None
    """The model the request named, else the chosen replica's."""
    body: dict[str, Any] | None = None
    """The parsed request body; once canonicalized, the canonical body."""
    canonical: CanonicalResult | None = None
    view: PrefixView | None = None
    affinity: AffinityKey | None = None
    target: Target | None = None
    outgoing: Outgoing | None = None
    ticket: Ticket | None = None
    """The scheduler's ticket of the latest attempt (set before the scheduler may wait)."""
    control: bool | None = None
    """In the control group (``proxy.control``); None: no control group is configured."""
    control_key: int | None = None
    """The conversation key the group was chosen by (``proxy.control.conversation_key``)."""


def build_record(
    ex: Exchange,
    *,
    builder: RecordBuilder,
    tracker: PrefixTracker,
    redactor: Redactor,
    log_prompts: bool,
    misses: MissAttributor | None = None,
) -> RequestRecord:
    """The request's record, from what every stage handed on in ``ex``.

    ``misses``: attributes the uncached prompt tokens to causes (``proxy.attribution``)."""
    target, view, canonical, ticket = ex.target, ex.view, ex.canonical, ex.ticket
    record = builder.build(
        ex.obs,
        ts=iso_ms(ex.t_wall),
        request_id=ex.request_id,
        route=ex.upstream_path,
        model=ex.model,
        backend=ex.backend_url or None,
        dialect=ex.dialect.name if target else None,
        stream=ex.stream,
        status=ex.status or 500,
        error=ex.error,
    )
    record.tenant = ex.tenant
    if canonical is not None:
        record.canonical_rules = list(canonical.fired)
        record.canonical_dry_run_rules = list(canonical.dry_run_fired) or None
        record.canonical_notes_restored = canonical.notes_restored or None
        record.canonical_note_values_omitted = canonical.note_values_omitted or None
        record.canonical_learned_spans = list(canonical.learned_spans) or None
        record.canonical_stable_bytes = canonical.stable_bytes_gained or None
    if ex.affinity is not None:
        record.affinity_key = ex.affinity.hashed
        record.affinity_source = ex.affinity.source
    record.control_group = ex.control
    if ex.outgoing is not None and ex.outgoing.stripped:
        record.hosted_fields_stripped = list(ex.outgoing.stripped)
    if target is not None:
        record.route_reason = target.reason
        info = target.replica.info
        if info is not None and info.template_clock is not None:
            record.template_clock = info.template_clock.kind
        record.replica_load = target.load
        record.retried_from = target.retried_from
        if view is not None:
            replica = target.replica.url
            fp = view.fp
            record.predicted_cached_tokens = tracker.predicted_tokens(view, replica, record.model)
            record.prefix_anchor = hex64(fp.anchor)
            record.prefix_blocks = len(fp.block_hashes)
            record.prompt_bytes = fp.total_bytes
            record.prefix_block_bytes = fp.block_bytes
            record.prefix_matched_blocks = view.matched_for(replica)
            record.prefix_segments = logged_segments(fp)
    if log_prompts and ex.body is not None:
        out = ex.outgoing
        sent = out.sent if out is not None and out.sent is not None else ex.body
        if ex.affinity is not None and PROMPT_CACHE_KEY in sent:  # its hash, never the value
            sent = {**sent, PROMPT_CACHE_KEY: ex.affinity.hashed}
        record.body = redactor.value(sent)
    if ticket is not None:
        if ticket.reason is not None:
            record.schedule_reason = ticket.reason
            record.held_ms = round(ticket.held_ms, 3)
            # Time held is a decision, not overhead: it shows in the TTFT.
            overhead = record.proxy_overhead_ms - ticket.held_ms
            record.proxy_overhead_ms = round(max(overhead, 0.0), 3)
            record.slot = ticket.slot
        if ticket.predicted_cached is not None:
            # The replica's cache model knows better than the prefix index what a slot or the
            # RAM cache holds.
            record.predicted_cached_tokens = round(ticket.predicted_cached)
            record.cache_source = ticket.cache_source
    if misses is not None:
        split = misses.attribute(ex, record, tracker.tokens_per_byte.get(record.model))
        if split is not None:
            record.miss_new_tokens = split.new
            record.miss_breaker_tokens = split.breaker
            record.miss_breaker_rules = list(split.breaker_rules) or None
            record.miss_routing_tokens = split.routing
            record.miss_routing_why = split.routing_why
            record.miss_evicted_tokens = split.evicted
            record.miss_unexplained_tokens = split.unexplained
    return record


def settle_view(ex: Exchange) -> None:
    """Fold the store's answer to a lookup not waited for into ``ex`` (``prefixes.settled``),
    before its record is built: the view, and the load the router would have seen with it
    (the largest of the counts it knew, the store's shared count now among them)."""
    if ex.view is None or ex.view.pending is None:
        return
    ex.view = view = settled(ex.view)
    if ex.target is not None:
        ex.target.load = max(ex.target.load, view.load_for(ex.target.replica.url))


def learn(state: ProxyState, record: RequestRecord, ex: Exchange) -> Awaitable[None] | None:
    """The record writer's learner: what the proxy learns from a finished request.

    The scheduler's picture and rates when the record is written (``RecordWriter.BATCH_DELAY_S``
    after the request ended, ``HOLD_MAX_S`` at most: a request arriving sooner is placed
    with the figures of the requests before it, which move by a fraction each); the prefix
    index, the token ratio and the statistics in the background (the returned coroutine). What
    a next request must see at once, the slot its predecessor leaves and the claims and counts
    in flight, is not learned here: the handler does it as the request ends.
    """
    state.scheduler.learn(record, ex.ticket)
    target = ex.target
    if target is None:
        return None
    label = None
    if state.settings.log_prompts and ex.body is not None:
        label = prefix_label(ex.body, state.redactor.text)
    return state.tracker.learn(
        record,
        ex.view,
        replica=target.replica.url,
        capacity_tokens=target.replica.capacity_tokens(state.settings.capacity_tokens),
        label=label,
    )
