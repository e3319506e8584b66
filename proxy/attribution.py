"""Miss attribution: why the prompt tokens a backend did not serve from cache were not.

Every inference request's uncached tokens (``prompt_tokens - cached_tokens``) are split into
causes that add up to them exactly, walking the prompt from the end of what the backend served:

1. ``evicted``: up to where the chosen replica held the prompt by its cache model (a llama.cpp
   slot or RAM cache; else the prefix index's entry for it), the backend served less
   (capacity, eviction, a server that restarted);
2. ``routing``: up to where the longest match of *another* replica goes, the chosen one held
   less; ``why`` names why it was passed over (``load_gate``, ``health``, ``round_robin``,
   ``min_affinity``, ``affinity_key``, ``slot`` ...);
3. ``evicted`` again: up to where the index says the chosen replica processed the prompt
   earlier, though its cache model says it no longer holds it (``routing`` with ``slot`` when
   the request was put on another slot than the holder);
4. ``breaker``: up to where an earlier request shared the prompt once the canonicalizer's
   rules in dry-run are applied, nobody held it (the rules named);
5. ``new``: beyond all of that, no earlier request in the index's window shared it;
6. ``unexplained``: what the walk could not place: a request whose index lookup failed, and a
   shortfall against the cache model smaller than one index block (the index's precision).

Positions are in tokens: block counts and byte offsets times the model's measured
tokens-per-byte (the ratio the predictions use), floored and clamped to
``[cached_tokens, prompt_tokens]``, so the parts are non-negative integers and their sum is
the uncached count by construction (``split``).

Where the canonicalizer runs in global dry-run, ``DryRunIndex`` keeps the chained block
hashes of the prompts the rules *would* have forwarded, in this process only, and answers
how far an earlier one shares the would-be prompt: that is how far the breaker span goes. A
rule in dry-run on its own (no would-be body is built) is measured by its stable-bytes gain
instead, bounded by the start of the newest message.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from proxy.fingerprint import Fingerprint, fingerprint
from proxy.routing import (
    KEY_AFFINITY,
    LEAST_LOADED_REASON,
    LOAD_GATE,
    MISS,
    RETRY_REASON,
    ROUND_ROBIN_REASON,
)
from proxy.scheduling.slot_state import SLOT_BUSY, SLOT_FOREIGN, SLOT_PARALLEL
from proxy.values import value

if TYPE_CHECKING:
    from proxy.exchange import Exchange
    from proxy.prefixes import PrefixView
    from proxy.records import RequestRecord

NEW = "new"
BREAKER = "breaker"
ROUTING = "routing"
EVICTED = "evicted"
UNEXPLAINED = "unexplained"
CAUSES: tuple[str, ...] = (NEW, BREAKER, ROUTING, EVICTED, UNEXPLAINED)
"""The causes an uncached token is attributed to, in the order the record and ``/stats`` list
them."""

# Why another replica's longer match was passed over (``MissAttribution.routing_why``).
WHY_LOAD_GATE = "load_gate"
WHY_HEALTH = "health"
WHY_ROUND_ROBIN = "round_robin"
WHY_LEAST_LOADED = "least_loaded"
WHY_MIN_AFFINITY = "min_affinity"
WHY_AFFINITY_KEY = "affinity_key"
WHY_RETRY = "retry"
WHY_SLOT = "slot"
WHY_STALE = "stale"
ROUTING_WHYS: tuple[str, ...] = (
    WHY_LOAD_GATE,
    WHY_HEALTH,
    WHY_ROUND_ROBIN,
    WHY_LEAST_LOADED,
    WHY_MIN_AFFINITY,
    WHY_AFFINITY_KEY,
    WHY_RETRY,
    WHY_SLOT,
    WHY_STALE,
)
_WHY_OF_REASON = {
    LOAD_GATE: WHY_LOAD_GATE,
    ROUND_ROBIN_REASON: WHY_ROUND_ROBIN,
    LEAST_LOADED_REASON: WHY_LEAST_LOADED,
    MISS: WHY_MIN_AFFINITY,
    KEY_AFFINITY: WHY_AFFINITY_KEY,
    RETRY_REASON: WHY_RETRY,
}
# Scheduler decisions that put a request on a slot other than the one holding its prefix.
SLOT_PASSED_OVER = frozenset({SLOT_BUSY, SLOT_FOREIGN, SLOT_PARALLEL})


@value
class MissAttribution:
    """One request's uncached prompt tokens by cause (they sum to the uncached count)."""

    new: int = 0
    breaker: int = 0
    routing: int = 0
    evicted: int = 0
    unexplained: int = 0
    breaker_rules: tuple[str, ...] = ()
    """The dry-run rules that would have fixed the breaker span (when it is not empty)."""
    routing_why: str | None = None
    """Why the replica (or slot) holding more was passed over (when ``routing`` > 0)."""

    @property
    def total(self) -> int:
        return self.new + self.breaker + self.routing + self.evicted + self.unexplained

    def tokens(self) -> dict[str, int]:
        """The parts by cause name (``CAUSES`` order)."""
        return {
            NEW: self.new,
            BREAKER: self.breaker,
            ROUTING: self.routing,
            EVICTED: self.evicted,
            UNEXPLAINED: self.unexplained,
        }


@value
class MissFacts:
    """What the stages said about one request, as token positions along its prompt.

    Each position is how far into the prompt (in tokens) something holds it; any value is
    accepted (negative, past the prompt, not finite) and clamped where it is used.
    """

    prompt_tokens: int
    cached_tokens: int
    known: bool = True
    """False when the prefix index did not answer: nothing can be placed."""
    chosen_held: float = 0.0
    """How far the chosen replica held it by its cache model (else its index match)."""
    chosen_index: float = 0.0
    """How far the prefix index says the chosen replica holds it."""
    slot_passed_over: bool = False
    """The scheduler put it on a slot other than the holder (busy, foreign, parallel)."""
    best_other: float = 0.0
    """The longest index match over the other replicas."""
    other_why: str | None = None
    """Why the replica of ``best_other`` was not chosen."""
    shared_with_rules: float = 0.0
    """How far an earlier request shares the prompt the dry-run rules would forward."""
    rules: tuple[str, ...] = ()
    """The dry-run rules behind ``shared_with_rules``."""
    precision: float = 0.0
    """One index block in tokens: a shortfall against the cache model within it is noise."""


def _at(position: float, lo: int, hi: int) -> int:
    """``position`` floored to a token index in ``[lo, hi]`` (``lo`` when not finite)."""
    if not math.isfinite(position):
        return lo
    return min(max(math.floor(position), lo), hi)


def split(facts: MissFacts) -> MissAttribution:
    """The uncached tokens of one request by cause; the parts sum to the uncached count."""
    prompt = max(facts.prompt_tokens, 0)
    cached = min(max(facts.cached_tokens, 0), prompt)
    if prompt == cached:
        return MissAttribution()
    if not facts.known:
        return MissAttribution(unexplained=prompt - cached)
    held = _at(facts.chosen_held, cached, prompt)
    index_end = max(held, _at(facts.chosen_index, cached, prompt))
    if index_end - cached <= facts.precision:  # within one block: not evidence of anything
        noise, evicted, start = index_end - cached, 0, index_end
    else:
        noise, evicted, start = 0, held - cached, held
    # What another replica held beyond what the chosen one held by its cache model.
    routing_end = max(start, _at(facts.best_other, cached, prompt))
    routing = routing_end - start
    # The rest of what the index says the chosen replica processed, which its cache model says
    # it no longer holds: on another slot than the holder (routing, ``slot``), else evicted.
    tail_end = max(routing_end, index_end)
    if facts.slot_passed_over:
        routing += tail_end - routing_end
    else:
        evicted += tail_end - routing_end
    breaker_end = max(tail_end, _at(facts.shared_with_rules, cached, prompt))
    breaker = breaker_end - tail_end
    why = None
    if routing:
        why = (facts.other_why or WHY_STALE) if routing_end > start else WHY_SLOT
    return MissAttribution(
        new=prompt - breaker_end,
        breaker=breaker,
        routing=routing,
        evicted=evicted,
        unexplained=noise,
        breaker_rules=facts.rules if breaker else (),
        routing_why=why,
    )


def template_order_bytes(fp: Fingerprint, blocks: int) -> int:
    """The bytes of a ``blocks``-block match that a chat template's order can reuse.

    The fingerprint hashes the tools before the system prompt; chat templates print the system
    prompt first and the tools after it. A match that stops short of the system prompt's end
    (by more than a block) therefore says less than its length: stopping inside the system
    prompt, only the system prompt's matched part is reusable (the tools come after the
    difference); stopping inside the tools, nothing is known to be. A match past the system
    prompt, or of a request without tools, is in the template's order already.
    """
    end = blocks * fp.block_bytes
    tools = next((i for i, seg in enumerate(fp.segments) if seg.kind == "tools"), None)
    if tools is None or end <= 0:
        return end
    ends = fp.segment_ends()
    first_message = next(
        (seg.start for seg in fp.segments if seg.kind not in ("model", "tools", "system")),
        fp.total_bytes,
    )
    if end > first_message - fp.block_bytes:
        return end
    tools_start, tools_end = fp.segments[tools].start, ends[tools]
    if end <= tools_end:
        return min(end, tools_start)
    return end - (tools_end - tools_start)


def why_passed_over(route_reason: str | None, *, healthy: bool) -> str:
    """Why the replica with the longest match was not chosen, from the router's reason."""
    if not healthy:
        return WHY_HEALTH
    return _WHY_OF_REASON.get(route_reason or "", WHY_STALE)


class DryRunIndex:
    """The block chains of the prompts the canonicalizer would have forwarded (dry-run).

    In process, per namespace, bounded to ``max_blocks`` hashes (the least recently seen go
    first). Chained hashes make a shared prefix a run of leading hashes, so a match is a
    binary search of membership.
    """

    __slots__ = ("_hashes", "_max_blocks")

    def __init__(self, *, max_blocks: int = 1 << 18) -> None:
        self._max_blocks = max_blocks
        self._hashes: OrderedDict[tuple[str, int], None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched(self, namespace: str, hashes: Sequence[int]) -> int:
        """Leading blocks of ``hashes`` that an earlier chain holds."""
        held = self._hashes
        lo, hi = 0, len(hashes)
        while lo < hi:  # the longest run of leading hashes present
            mid = (lo + hi + 1) // 2
            if (namespace, hashes[mid - 1]) in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, namespace: str, hashes: Sequence[int]) -> None:
        held = self._hashes
        for h in hashes:
            key = (namespace, h)
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
        while len(held) > self._max_blocks:
            held.popitem(last=False)


def would_be_chain(
    route: str,
    would_forward: Mapping[str, Any] | None,
    forwarded_hashes: Sequence[int],
    *,
    block_bytes: int,
    salt: str,
) -> Sequence[int]:
    """The block hashes of the prompt the dry-run rules would have forwarded.

    The forwarded prompt's own chain when the rules would change nothing (no second
    fingerprint); else a fingerprint of the would-be body."""
    if would_forward is None:
        return forwarded_hashes
    return fingerprint(route, would_forward, block_bytes=block_bytes, salt=salt).block_hashes


class MissAttributor:
    """Attributes each finished request's uncached tokens (``attribute``), in the record's
    builder, from the stage results the exchange already holds.

    ``dry_run``: the canonicalizer runs in global dry-run, so a ``DryRunIndex`` of the would-be
    prompts measures the breaker span. ``healthy``: whether a replica (by URL) passes its health
    checks, to say why one holding more was passed over.
    """

    def __init__(self, *, dry_run: bool, healthy: Callable[[str], bool]) -> None:
        self.dry_index = DryRunIndex() if dry_run else None
        self._healthy = healthy

    def attribute(
        self, ex: Exchange, record: RequestRecord, tokens_per_byte: float
    ) -> MissAttribution | None:
        """The attribution of ``record``'s uncached tokens; None where the backend did not
        report both prompt and cached tokens, or the request failed."""
        prompt, cached = record.prompt_tokens, record.cached_tokens
        if prompt is None or cached is None or record.status >= 400 or record.error:
            return None
        view, target = ex.view, ex.target
        if view is None or target is None:
            return split(MissFacts(prompt_tokens=prompt, cached_tokens=cached, known=False))
        fp, tpb = view.fp, tokens_per_byte
        chosen = target.replica.url
        chosen_index = template_order_bytes(fp, view.matched_for(chosen)) * tpb
        ticket = ex.ticket
        held = chosen_index
        slot_passed_over = False
        if ticket is not None and ticket.predicted_cached is not None:
            held = ticket.predicted_cached
        if ticket is not None and ticket.reason in SLOT_PASSED_OVER:
            held, slot_passed_over = 0.0, True
        best_url, best_blocks = None, 0
        for url, blocks in view.matched_blocks.items():
            if url != chosen and blocks > best_blocks:
                best_url, best_blocks = url, blocks
        other_why = None
        if best_url is not None:
            other_why = why_passed_over(target.reason, healthy=self._healthy(best_url))
        any_blocks = max(best_blocks, view.matched_for(chosen))
        shared, rules = self._shared_with_rules(ex, view, any_blocks)
        return split(
            MissFacts(
                prompt_tokens=prompt,
                cached_tokens=cached,
                known=view.available,
                chosen_held=held,
                chosen_index=chosen_index,
                slot_passed_over=slot_passed_over,
                best_other=template_order_bytes(fp, best_blocks) * tpb,
                other_why=other_why,
                shared_with_rules=shared * tpb,
                rules=rules,
                precision=fp.block_bytes * tpb,
            )
        )

    def _shared_with_rules(
        self, ex: Exchange, view: PrefixView, any_blocks: int
    ) -> tuple[int, tuple[str, ...]]:
        """How many bytes of the prompt an earlier request shares once the dry-run rules are
        applied, and those rules (0 and none without a dry-run rule that fired)."""
        canonical, fp = ex.canonical, view.fp
        dry = self.dry_index
        if dry is not None and canonical is not None and canonical.would_forward is not None:
            chain = would_be_chain(
                ex.route,
                canonical.would_forward,
                fp.block_hashes,
                block_bytes=fp.block_bytes,
                salt=ex.tenant or "",
            )
        else:
            chain = fp.block_hashes
        shared = 0
        if dry is not None:
            shared = template_order_bytes(fp, dry.matched(view.namespace, chain))
            dry.add(view.namespace, chain)
        if canonical is None or not canonical.dry_run_fired:
            return 0, ()
        gains = canonical.stable_bytes_gained
        # Largest gain first: the rule whose span starts earliest is the likeliest breaker.
        rules = tuple(
            sorted(
                (r for r in canonical.dry_run_fired if gains.get(r, 0) > 0),
                key=lambda r: -gains.get(r, 0),
            )
        )
        if dry is None or canonical.would_forward is None:
            # A rule in dry-run on its own: its gain past the shared prefix, at most up to the
            # newest message (new on every request anyway).
            gain = max((gains.get(r, 0) for r in rules), default=0)
            limit = fp.total_bytes
            if fp.segments and fp.segments[-1].kind in ("message", "system"):
                limit = fp.segments[-1].start
            shared = min(any_blocks * fp.block_bytes + gain, limit)
        return shared, rules or tuple(canonical.dry_run_fired)
