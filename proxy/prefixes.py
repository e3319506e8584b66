"""Prefix tracking: what each replica has cached, what a request should hit, what it did hit.

On the request path: fingerprint the body (chained block hashes) and ask the store, in one round
trip, how many leading blocks each replica holds, how many requests each has in flight (from
every proxy) and how much of the prompt recent traffic shares (``PrefixView``: what the router
needs). The chosen replica's match, converted to tokens with the model's measured
tokens-per-byte, is the *predicted* cached tokens. Right after routing, ``claim`` records the
request's blocks for the chosen replica, so related requests arriving before it finishes follow
it: at once in this proxy's own memory (``RecentClaims``, which the next lookup reads even before
the store write has landed: a burst of related requests arriving together lands together), and
in the store in the background for every other proxy; ``in_flight`` keeps this proxy's load
count, and the shared one with Redis. After the response: record the blocks again (the backend
now holds them), learn the tokens-per-byte ratio from the backend's ``prompt_tokens``, count the
request in the traffic window and fold the finished record into the statistics — all in the
background.

When the store does not answer the lookup, the view falls back to this proxy's own numbers: its
recent claims as matches, its local in-flight counts, a shared depth of 0.

A request that has one replica to go to needs none of the store's numbers to be routed (the
router answers ``single`` whatever they are), only to be recorded and learned from. With a
store a round trip away (``remote_store``) its lookup is then sent and the request goes on
without waiting for it (``PrefixView.pending``); the answer is folded into the view before the
record is built (``settled``), or awaited by whatever needs it earlier (``answered``). When
nothing will await it (``deferred``), the lookup goes with the store's queued writes, ahead of
them (``WriteBehind.lookup``): with the batch, ``delay_s`` after its first write (after the
first token of a request that has one sooner), or at the request's end, whichever comes first.
With the embedded store (in this process, its writes queued) such a lookup is read after the
request is on its way: a moment after its first token is written, or at its end
(``answer_local``), and always before a batch of queued writes, the request's own claim among
them, is applied.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import field
from typing import Any

from proxy.fingerprint import ChainMemo, Fingerprint, fingerprint_with_data
from proxy.log import get_logger
from proxy.recent_claims import RecentClaims
from proxy.records import RequestRecord
from proxy.routing import TRAFFIC_MAX_BLOCKS, RoutingConfig, TrafficDepth, route_key
from proxy.store import DEFAULT_NAMESPACE, LookupResult, PrefixStore, StatsSample
from proxy.store.write_behind import WriteBehind
from proxy.values import value

_log = get_logger()

DEFAULT_TOKENS_PER_BYTE = 0.25  # English prose and code average ~4 bytes per token
MAX_SEGMENTS_LOGGED = 512


@value
class PrefixView:
    """What the store says about one request: everything the router needs."""

    fp: Fingerprint
    namespace: str
    matched_blocks: Mapping[str, int]
    """Leading blocks of the request each replica's index holds (``{}`` when unavailable)."""
    loads: Mapping[str, float] = field(default_factory=dict)
    """Requests in flight per replica from every proxy, never below this proxy's own count."""
    shared_blocks: int = 0
    """Leading blocks carried by most recent traffic (``TrafficDepth``)."""
    available: bool = True
    """False when the store did not answer and the numbers are this proxy's own."""
    affinity_key: int | None = None
    """The client's own conversation key, hashed (``proxy.hosted``); None when it sent none."""
    rendered: bytes = field(default=b"", repr=False)
    """The bytes ``fp`` hashed, kept for the request's lifetime only (the slot model compares
    them with a slot's last prompt); never logged or stored."""
    pending: asyncio.Future[PrefixView] | None = field(default=None, repr=False, compare=False)
    """The view with the store's answer, still on its way (a lookup not waited for); until it
    comes, the numbers above are this proxy's own (``settled``, ``answered``)."""

    def matched_for(self, replica: str) -> int:
        return self.matched_blocks.get(replica, 0)

    def load_for(self, replica: str) -> float:
        return self.loads.get(replica, 0.0)

    @property
    def key(self) -> int:
        """The key the router breaks ties by (``route_key``: the first block hash past the
        traffic-shared depth, 0 without blocks)."""
        return route_key(self.fp.block_hashes, self.shared_blocks)


def settled(view: PrefixView) -> PrefixView:
    """``view`` with the store's answer folded in. Without one yet, this proxy's own numbers,
    marked unavailable as for a store that failed; the lookup runs on to its own deadline, so
    that a store too slow to answer is still noticed (its breaker) and not left half-read."""
    task = view.pending
    if task is None:
        return view
    if not task.done() or task.cancelled() or task.exception() is not None:
        return dataclasses.replace(view, available=False, pending=None)
    found = task.result()
    if found.affinity_key == view.affinity_key and found.fp is view.fp:
        return found  # (the answer is this view's, with the store's numbers: no copy to make)
    return dataclasses.replace(
        view,
        matched_blocks=found.matched_blocks,
        loads=found.loads,
        shared_blocks=found.shared_blocks,
        available=found.available,
        pending=None,
    )


_LocalLookup = tuple[
    asyncio.Future[PrefixView],
    Callable[[LookupResult], PrefixView],
    str,
    Sequence[str],
    Sequence[int],
]
"""A deferred lookup of a store in this process: where its view goes, how the store's answer
makes it, and what to look up (namespace, replicas, block hashes)."""


def _fold(
    pending: asyncio.Future[PrefixView],
    view: Callable[[LookupResult], PrefixView],
    found: asyncio.Future[LookupResult],
) -> None:
    """``found``'s outcome as ``pending``'s, the answer made a view (a callback: no task)."""
    if pending.done():
        return
    if found.cancelled():
        pending.cancel()
        return
    error = found.exception()
    if error is None:
        try:
            pending.set_result(view(found.result()))
            return
        except Exception as exc:  # (a bug in folding: logged by ``_answered``)
            error = exc
    pending.set_exception(error)


async def answered(view: PrefixView) -> PrefixView:
    """``view`` once the store has answered (at once for a lookup that was waited for)."""
    if view.pending is None:
        return view
    await asyncio.wait((view.pending,))
    return settled(view)


LABEL_CHARS = 80


def prefix_label(body: Mapping[str, Any], redact: Callable[[str], str]) -> str | None:
    """A short human-readable name for a request's application prefix: the start of its first
    message's text (a chat's system prompt, typically) or of its prompt, whitespace collapsed.

    Prompt text: only for operators who opted in to logging prompts. ``redact`` runs on a
    window four times the label's length before the label is cut, and the cut falls on
    whitespace, so a secret is either redacted whole or not in the label at all."""
    text: Any = None
    messages = body.get("messages")
    if messages is None:
        messages = body.get("input")  # the Responses API's conversation
    system = body.get("instructions", body.get("system"))  # Responses, Anthropic Messages
    if system is not None:
        messages = [{"role": "system", "content": system}]
    if isinstance(messages, str):
        text = messages
    elif isinstance(messages, list) and messages and isinstance(messages[0], Mapping):
        text = messages[0].get("content")
        if isinstance(text, list):  # content parts: the first text part
            text = next(
                (
                    p.get("text")
                    for p in text
                    if isinstance(p, Mapping) and p.get("type") in ("text", "input_text")
                ),
                None,
            )
    else:
        text = body.get("prompt")
        if isinstance(text, list) and text:
            text = text[0]
    if not isinstance(text, str):
        return None
    window = text[: LABEL_CHARS * 4]
    label = " ".join(redact(window).split())
    if len(label) > LABEL_CHARS or len(window) < len(text):
        cut = label[: LABEL_CHARS + 1].rfind(" ")
        label = label[:cut] if cut > 0 else ""
    return label or None


class TokensPerByte:
    """Running tokens-per-byte ratio per model, learned from the backend's prompt_tokens."""

    def __init__(self, *, alpha: float = 0.1) -> None:
        self._alpha = alpha
        self._ratio: dict[str, float] = {}

    def get(self, model: str | None) -> float:
        return self._ratio.get(model or "", DEFAULT_TOKENS_PER_BYTE)

    def observe(self, model: str | None, prompt_tokens: int | None, prompt_bytes: int) -> None:
        if not prompt_tokens or prompt_bytes < 64:
            return
        key = model or ""
        ratio = prompt_tokens / prompt_bytes
        old = self._ratio.get(key)
        self._ratio[key] = ratio if old is None else old + self._alpha * (ratio - old)


class PrefixTracker:
    """Fingerprints requests, predicts their cache hits and keeps the index and statistics."""

    def __init__(
        self,
        store: PrefixStore,
        *,
        block_bytes: int,
        log_prompt_labels: bool = False,
        routing: RoutingConfig | None = None,
        write_delay_s: float | None = None,
        remote_store: bool = False,
        count_traffic: bool = True,
        share_in_flight: bool = True,
    ) -> None:
        self.store = store
        self.remote_store = remote_store
        """The store is a round trip away (Redis): a lookup nothing routes by is not waited for."""
        self.count_traffic = count_traffic
        """Requests are counted in the store's traffic window (the router's ``TrafficDepth``).
        Off where nothing reads the counts: one replica, and a store of this process's own
        (the proxy builds it so; with Redis, other proxies route by what this one counts)."""
        self.share_in_flight = share_in_flight
        """Requests in flight are counted in the store too, for every proxy sharing it. Off
        for a store of this process's own: its count would be this proxy's, a moment late, and
        a load is never read below this proxy's own count (``_view``)."""
        self.writes = None if write_delay_s is None else WriteBehind(store, delay_s=write_delay_s)
        """With ``write_delay_s``: the store writes batched and sent that much later
        (``proxy.store.write_behind``); ``in_flight``, ``claim`` and ``learn`` then queue them
        and return None. Without: they return the writes, to run in the background."""
        self._lookup_now: Callable[[str, Sequence[str], Sequence[int]], LookupResult] | None = None
        """A store in this process that answers in the caller's step (``EmbeddedStore``), and
        whose writes are queued: a deferred lookup is answered later (``answer_local``)."""
        if self.writes is not None and not remote_store:
            self._lookup_now = getattr(store, "lookup_now", None)
            if self._lookup_now is not None:
                self.writes.before_apply = self.answer_local
        self._local: list[_LocalLookup] = []
        """Deferred lookups of a store in this process, not answered yet."""
        self.block_bytes = block_bytes
        self.tokens_per_byte = TokensPerByte()
        self.depth = TrafficDepth.from_config(routing or RoutingConfig())
        self._labels = log_prompt_labels
        self._local_in_flight: dict[str, int] = {}
        self.recent = RecentClaims()
        self.chains = ChainMemo()
        """Recent long prompts' chains: a prompt resending one's prefix hashes only the rest."""
        self._lookups: set[asyncio.Future[PrefixView]] = set()
        """Lookups not waited for (``remote_store``), until they end (each within its deadline)."""

    async def lookup(
        self,
        route: str,
        body: Mapping[str, Any],
        replicas: Sequence[str],
        *,
        namespace: str = DEFAULT_NAMESPACE,
        salt: str = "",
        deferred: bool = False,
    ) -> PrefixView:
        """Fingerprint ``body``; read matches, loads and the shared depth (one round trip).

        With one replica and a remote store the round trip is not waited for: the view returned
        has this proxy's own numbers and the store's answer ``pending`` (module docstring).
        ``deferred``: nothing will await that answer before the request's first token (only its
        record needs it), so it may go with the queued writes (``WriteBehind.lookup``).
        """
        fp, rendered = fingerprint_with_data(
            route, body, block_bytes=self.block_bytes, salt=salt, memo=self.chains
        )
        hashes = fp.block_hashes
        lookup_now = self._lookup_now
        if lookup_now is not None and deferred and len(replicas) == 1:
            # A store in this process, nothing waiting for its answer: read it after the
            # request is on its way (``answer_local``), not before.
            return self._not_waited(fp, namespace, rendered, replicas, None)
        if self.remote_store and len(replicas) == 1:
            writes = self.writes
            found = (
                writes.lookup(namespace, replicas, hashes)
                if writes is not None and deferred
                else self.store.lookup(namespace, replicas, hashes)
            )
            return self._not_waited(fp, namespace, rendered, replicas, found)
        answer = await self.store.lookup(namespace, replicas, hashes)
        local = self._local_in_flight
        matched: Mapping[str, int] = answer.matched
        if len(self.recent):  # this proxy's claims the store may not have yet
            matched = self._with_recent(namespace, replicas, hashes, answer.matched)
        own = {r: float(local.get(r, 0)) for r in replicas}
        return self._view(fp, namespace, rendered, answer, matched, own)

    def _view(
        self,
        fp: Fingerprint,
        namespace: str,
        rendered: bytes,
        found: LookupResult,
        matched: Mapping[str, int],
        local: Mapping[str, float],
    ) -> PrefixView:
        """The store's answer with this proxy's matches (``matched``) and in-flight counts
        (``local``, never undercut by the shared count) folded in."""
        return PrefixView(
            fp=fp,
            namespace=namespace,
            matched_blocks=matched,
            rendered=rendered,
            loads={r: max(found.loads.get(r, 0.0), n) for r, n in local.items()},
            shared_blocks=self.depth.shared_blocks(found.window_requests, found.hash_counts),
            available=found.available,
        )

    def _not_waited(
        self,
        fp: Fingerprint,
        namespace: str,
        rendered: bytes,
        replicas: Sequence[str],
        found: Awaitable[LookupResult] | None,
    ) -> PrefixView:
        """The view at once, with this proxy's numbers as the request found them (before its
        own claim joins them); the store's answer folded in when it comes (``pending``).
        ``found`` None: the store is in this process, and ``answer_local`` reads it."""
        hashes = fp.block_hashes
        recent = self._with_recent(namespace, replicas, hashes, {}) if len(self.recent) else {}
        local = {r: float(self._local_in_flight.get(r, 0)) for r in replicas}

        def view(got: LookupResult) -> PrefixView:
            matched = got.matched
            if recent:
                matched = {r: max(got.matched.get(r, 0), m) for r, m in recent.items()}
            return self._view(fp, namespace, rendered, got, matched, local)

        pending: asyncio.Future[PrefixView]
        if found is None:
            # Answered in one of this process's own steps (``answer_local``, which logs a
            # failure): never left running, so neither tracked nor called back.
            pending = asyncio.get_running_loop().create_future()
            self._local.append((pending, view, namespace, replicas, hashes))
        elif isinstance(found, asyncio.Future):  # queued with the writes: folded in as it comes
            pending = asyncio.get_running_loop().create_future()
            found.add_done_callback(functools.partial(_fold, pending, view))
        else:

            async def answer() -> PrefixView:
                return view(await found)

            pending = asyncio.ensure_future(answer())
        if found is not None:  # a store a round trip away: tracked until it answers
            self._lookups.add(pending)
            pending.add_done_callback(self._answered)
        return PrefixView(
            fp=fp,
            namespace=namespace,
            matched_blocks=recent,
            rendered=rendered,
            loads=local,
            pending=pending,
        )

    def _answered(self, task: asyncio.Future[PrefixView]) -> None:
        self._lookups.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.error("lookup_failed", exc_info=task.exception())

    def _with_recent(
        self,
        namespace: str,
        replicas: Sequence[str],
        hashes: Sequence[int],
        stored: Mapping[str, int],
    ) -> dict[str, int]:
        """The store's matches, raised by this proxy's recent claims (a full match needs none)."""
        now, full, out = time.monotonic(), len(hashes), {}
        for r in replicas:
            m = stored.get(r, 0)
            out[r] = m if m >= full else max(m, self.recent.matched(namespace, r, hashes, now))
        return out

    def local_in_flight(self, replica: str) -> int:
        """Requests this proxy has in flight to ``replica``."""
        return self._local_in_flight.get(replica, 0)

    def in_flight(
        self, view: PrefixView | None, replica: str, delta: int
    ) -> Coroutine[Any, Any, None] | None:
        """Count ``delta`` requests in flight to ``replica`` (+1 before sending, -1 at the end).

        This proxy's own count changes now; the shared count in the store is queued (write
        behind), or the returned coroutine, to run in the background (``RecordWriter.spawn``);
        None also where nothing is shared (``share_in_flight``).
        """
        count = self._local_in_flight.get(replica, 0) + delta
        if count > 0:
            self._local_in_flight[replica] = count
        else:
            self._local_in_flight.pop(replica, None)
        if not self.share_in_flight:
            return None
        namespace = view.namespace if view is not None else DEFAULT_NAMESPACE
        if self.writes is not None:
            self.writes.add_in_flight(namespace, replica, delta)
            return None
        return self.store.add_in_flight(namespace, replica, delta)

    def capacity_blocks(self, capacity_tokens: int, model: str | None) -> int:
        """A replica's cache size in blocks, at the model's token density."""
        ratio = self.tokens_per_byte.get(model)
        return max(int(capacity_tokens / ratio / self.block_bytes), 1)

    def claim(
        self, view: PrefixView, replica: str, capacity_tokens: int, model: str | None = None
    ) -> Coroutine[Any, Any, None] | None:
        """Record the request's blocks for the replica it was just routed to.

        This proxy's next lookups see the claim at once (``RecentClaims``), so related requests
        arriving together follow the first one; the returned coroutine writes it to the store
        for every proxy (run it in the background right after choosing). It also counts the
        request in the traffic window at arrival (as the fleet simulator does), so a burst
        sharing a system prompt is seen as shared traffic while it is still arriving (where
        the counts are read: ``count_traffic``).

        With write behind, the store's writes are queued and None is returned: the traffic
        count then lands with the batch (``--store-write-delay-ms`` later)."""
        hashes = view.fp.block_hashes
        if hashes:
            self.recent.add(view.namespace, replica, hashes, time.monotonic())
        writes = self.writes
        if writes is None:
            return self._claim(view, replica, capacity_tokens, model)
        if hashes:
            if self.count_traffic:
                writes.observe_traffic(view.namespace, hashes[:TRAFFIC_MAX_BLOCKS])
            capacity = self.capacity_blocks(capacity_tokens, model)
            writes.record_prefix(view.namespace, replica, hashes, capacity)
        return None

    def unclaim(self, view: PrefixView, replica: str) -> None:
        """Forget this proxy's in-memory claim for a replica that failed before serving the
        request (a retry goes elsewhere). The store's copy stays: it ages out with the index,
        and the replica may well hold the prefix from earlier traffic anyway."""
        self.recent.forget(view.namespace, replica, view.fp.block_hashes)

    async def _claim(
        self, view: PrefixView, replica: str, capacity_tokens: int, model: str | None
    ) -> None:
        if view.fp.block_hashes:
            if self.count_traffic:
                await self.store.observe_traffic(
                    view.namespace, view.fp.block_hashes[:TRAFFIC_MAX_BLOCKS]
                )
            await self.store.record_prefix(
                view.namespace,
                replica,
                view.fp.block_hashes,
                self.capacity_blocks(capacity_tokens, model),
            )

    def predicted_tokens(self, view: PrefixView, replica: str, model: str | None) -> int:
        """Predicted cached tokens on ``replica``: matched bytes at the model's token density."""
        matched_bytes = view.matched_for(replica) * self.block_bytes
        return int(matched_bytes * self.tokens_per_byte.get(model))

    def learn(
        self,
        record: RequestRecord,
        view: PrefixView | None,
        *,
        replica: str,
        capacity_tokens: int,
        label: str | None = None,
    ) -> Coroutine[Any, Any, None] | None:
        """After the response: update the token ratio now, and the index and the statistics
        in the store: queued (write behind, None returned), or the returned coroutine."""
        chain: tuple[str, Sequence[int], int] | None = None
        if view is not None and record.status < 400 and record.error is None:
            self.tokens_per_byte.observe(record.model, record.prompt_tokens, view.fp.total_bytes)
            if view.fp.block_hashes:
                capacity = self.capacity_blocks(capacity_tokens, record.model)
                chain = (view.namespace, view.fp.block_hashes, capacity)
        namespace = view.namespace if view is not None else DEFAULT_NAMESPACE
        sample = StatsSample.from_record(
            record,
            namespace=namespace,
            ts=time.time(),
            prefix_label=label if self._labels else None,
        )
        writes = self.writes
        if writes is None:
            return self._learned(replica, chain, sample)
        if chain is not None:
            writes.record_prefix(chain[0], replica, chain[1], chain[2])
        writes.add_stats(sample)
        return None

    async def _learned(
        self, replica: str, chain: tuple[str, Sequence[int], int] | None, sample: StatsSample
    ) -> None:
        if chain is not None:
            await self.store.record_prefix(chain[0], replica, chain[1], chain[2])
        await self.store.add_stats(sample)

    def answer_local(self) -> None:
        """Answer the deferred lookups of a store in this process, from the store as it is now:
        a moment after a request's first token (``handlers._after_first_token``) or at its
        end, whichever comes first, and always before a batch of queued writes (their own claims
        among them) is applied. Never raises."""
        if not self._local:
            return  # (asked after first tokens and at every end)
        local, self._local = self._local, []
        lookup_now = self._lookup_now
        for pending, view, namespace, replicas, hashes in local:
            if pending.done() or lookup_now is None:
                continue
            try:  # folded into the view at once: the caller may settle it next
                pending.set_result(view(lookup_now(namespace, replicas, hashes)))
            except Exception as exc:  # (a bug: the view settles as unavailable, logged)
                pending.set_exception(exc)
                _log.error("lookup_failed", exc_info=pending.exception())

    async def flush(self) -> None:
        """Let the lookups not waited for end (each within its deadline), then apply the store
        writes queued (write behind; nothing to apply without it). Lookups queued with the
        writes are sent first, with them (else they would wait for the writes' timer)."""
        self.answer_local()
        if self.writes is not None:
            self.writes.hurry()
        if self._lookups:
            await asyncio.wait(list(self._lookups))
        if self.writes is not None:
            await self.writes.flush()


def logged_segments(fp: Fingerprint) -> list[list[Any]]:
    """The record's ``prefix_segments``: the fingerprint's segment table, its head at most."""
    table = fp.segment_table()
    if len(table) > MAX_SEGMENTS_LOGGED:  # keep the head: that is where prefixes are shared
        table = table[:MAX_SEGMENTS_LOGGED]
    return table
