"""Cache breakers: where requests of one application prompt stop sharing their prefix, and why.

With request bodies (opt-in prompt logging, or OpenAI body files) each request is walked
against the earlier request of the same application it agrees with most. Requests whose system
prompt carries a timestamp share no anchor, so the application is recognised by a looser
*signature*: model, tenant, route, tools and leading system messages with object keys sorted,
line ends normalised and every word holding a digit masked. The candidates are the latest
request holding the longest cached prefix and the last few requests with the same signature.
The spans found are grouped by rule, place and the literal text before the value, and ranked
by tokens lost.

Without bodies only segment hashes are known. A request that leaves the already-seen prefix
tree *inside* a prompt seen before (not where an earlier prompt simply ended, and not at its
own first conversation message or newest message) has a changed segment there; the tokens
after it that an earlier request also had are the estimated loss. The rule cannot be named
without the text, so the report says where, and what the likely rule is.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat

import xxhash

from analyzers.divergence import Prompt, Span, canonical_json, dumps, normalise_lines, walk
from analyzers.ideal import IdealReplay
from analyzers.spans import (
    CUSTOM_PREFIX,
    RULE_LEARNED,
    RULE_NOTE,
    RULE_STABLE_JSON,
    RULE_WHITESPACE,
)
from analyzers.trace import PrefixKey, TraceRequest

POOL = 6  # recent requests of the same application walked against each request
MIN_LOSS_BYTES = 256  # less than a block: not worth a rule, and often chance agreement
UNKNOWN_RULE = "unknown: log request bodies to see the span"
_DIGIT_WORDS = re.compile(r"[\w-]*\d[\w-]*")
_DIGITS = re.compile(r"\d+")
NOTE_HINT = (
    "the value is in prefixgate's relocation note, which moves to each new user message, or "
    "is dropped when the application resends the message, and breaks the turns after it; the "
    '[canonical] defaults (note_placement = "last_suffix", note_memory = true) put the note '
    "after the newest message and restore earlier notes, so the history stays byte-identical"
)
LEARNED_HINT = (
    "a value no detector knows, between literal text the requests share: prefixgate learns it "
    "from traffic (volatile_learned, on by default) after three requests of the template with "
    "three distinct values, and relocates it from then on; the label is the pattern it learns"
)
_HINTS = {
    "tools": "tool schemas changed; stable_json if only key or tool order differs",
    "system": "system prompt changed; typically volatile_timestamps or volatile_uuids",
    "message": "an earlier turn was rewritten (history edited or a volatile value in it)",
}


@dataclass(slots=True)
class Breaker:
    """One kind of cache breaker, with its count, cost and a first example."""

    rule: str
    where: str  # segment kind: tools, system, message, prompt
    evidence: str  # "spans" (bodies) or "segments" (hashes only)
    label: str  # what groups occurrences: the literal context, the pattern, or the place
    occurrences: int = 0
    requests: set[int] = field(default_factory=set)
    tokens_lost: float = 0.0
    earlier: str = ""
    later: str = ""
    before: str = ""
    after: str = ""
    hint: str = ""

    def as_dict(self) -> dict[str, object]:
        """The breaker as a JSON-ready object."""
        return {
            "rule": self.rule,
            "where": self.where,
            "evidence": self.evidence,
            "label": self.label,
            "occurrences": self.occurrences,
            "requests": len(self.requests),
            "tokens_lost": round(self.tokens_lost),
            "example": {
                "earlier": self.earlier,
                "later": self.later,
                "before": self.before,
                "after": self.after,
            },
            "hint": self.hint,
        }


_HINT_BY_RULE = {RULE_NOTE: NOTE_HINT, RULE_LEARNED: LEARNED_HINT}


def find_breakers(requests: Sequence[TraceRequest], ideal: IdealReplay) -> list[Breaker]:
    """All breakers found, ranked by tokens lost."""
    found: dict[tuple[str, str, str, str], Breaker] = {}
    _from_bodies(requests, ideal, found)
    _from_segments(requests, ideal, found)
    return sorted(found.values(), key=lambda b: (-b.tokens_lost, -b.occurrences))


def _label(span: Span) -> str:
    rule = span.kind.rule
    if rule.startswith(CUSTOM_PREFIX):
        return rule[len(CUSTOM_PREFIX) :]
    if rule in (RULE_STABLE_JSON, RULE_WHITESPACE):
        return span.where
    if rule == RULE_LEARNED:  # the pattern the proxy learns: anchors and value class
        return span.kind.context
    # Digits in the context are often another volatile value: mask them so occurrences group.
    return _DIGITS.sub("#", span.kind.context.strip()) or span.where


def app_signature(r: TraceRequest) -> int:
    """A hash of what makes a request's application prompt, blind to volatile values."""
    body = r.body or {}
    tools = (body.get("tools"), body.get("functions"))
    parts: list[object] = [r.model, r.tenant, r.route]
    parts += [canonical_json(t, sort_tools=True) for t in tools]
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer"):
                break
            parts.append(normalise_lines(m.get("content")))
    text = dumps(parts).decode("utf-8", "replace")
    return xxhash.xxh3_64_intdigest(_DIGIT_WORDS.sub("#", text).encode())


def _from_bodies(
    requests: Sequence[TraceRequest],
    ideal: IdealReplay,
    found: dict[tuple[str, str, str, str], Breaker],
) -> None:
    @lru_cache(maxsize=4 * POOL)
    def prompt(index: int) -> Prompt:
        r = requests[index]
        assert r.body is not None and r.route is not None
        return Prompt.of(r.route, r.body)

    recent: dict[int, deque[int]] = {}
    app_of: dict[int, int] = {}
    owner: dict[PrefixKey, int] = {}  # block hash -> latest request holding it
    for idx, r in enumerate(requests):
        if r.body is None or r.route is None:
            continue
        keys = r.keys
        k = ideal.hit_keys[idx]
        app = app_of[idx] = app_signature(r)
        pool = recent.setdefault(app, deque(maxlen=POOL))
        if k < len(keys):
            candidates = list(pool)
            if k and app_of.get(holder := owner[keys[k - 1]]) == app:
                candidates.insert(0, holder)
            _walk_best(idx, prompt, list(dict.fromkeys(candidates)), r, found)
        pool.appendleft(idx)
        owner.update(zip(keys, repeat(idx)))


def _walk_best(
    idx: int,
    prompt: Callable[[int], Prompt],
    candidates: list[int],
    r: TraceRequest,
    found: dict[tuple[str, str, str, str], Breaker],
) -> None:
    if not candidates:
        return
    b = prompt(idx)
    best: tuple[int, list[Span]] | None = None
    for cand in candidates:
        spans, agreed = walk(prompt(cand), b)
        if best is None or agreed > best[0]:
            best = (agreed, spans)
    if best is None or sum(span.lost_bytes for span in best[1]) < MIN_LOSS_BYTES:
        return
    per_byte = r.prompt_tokens / len(b.data) if b.data else 0.0
    for span in best[1]:
        label = _label(span)
        key = (span.kind.rule, span.where, "spans", label)
        breaker = found.get(key)
        if breaker is None:
            breaker = found[key] = Breaker(
                rule=span.kind.rule,
                where=span.where,
                evidence="spans",
                label=label,
                earlier=span.earlier,
                later=span.later,
                before=span.kind.before,
                after=span.kind.after,
                hint=_HINT_BY_RULE.get(span.kind.rule, ""),
            )
        breaker.occurrences += 1
        breaker.requests.add(idx)
        breaker.tokens_lost += span.lost_bytes * per_byte


def _from_segments(
    requests: Sequence[TraceRequest],
    ideal: IdealReplay,
    found: dict[tuple[str, str, str, str], Breaker],
) -> None:
    ends: set[PrefixKey] = set()  # last keys of earlier prompts: leaving the tree there is growth
    reach: dict[PrefixKey, float] = {}  # key -> tokens of the latest prompt through it
    for idx, r in enumerate(requests):
        kinds = r.kinds
        if kinds is None or r.body is not None or not r.keys:
            continue
        keys = r.keys
        n, k = len(keys), ideal.hit_keys[idx]
        if 0 < k < n and keys[k - 1] not in ends and k != r.stable_keys:
            in_app = k < r.stable_keys
            if in_app or k < n - 1:
                upto = min(r.tokens_upto(n - 1), reach.get(keys[k - 1], 0.0))
                lost = upto - r.tokens_upto(k)
                if in_app:  # the changed segment itself would have been reused
                    lost = max(lost, r.tokens_upto(k + 1) - r.tokens_upto(k))
                where = kinds[k]
                place = "application prompt" if in_app else "conversation history"
                key = (UNKNOWN_RULE, where, "segments", place)
                breaker = found.get(key)
                if breaker is None:
                    breaker = found[key] = Breaker(
                        rule=UNKNOWN_RULE,
                        where=where,
                        evidence="segments",
                        label=f"{where} in the {place}",
                        hint=_HINTS.get(where, ""),
                    )
                breaker.occurrences += 1
                breaker.requests.add(idx)
                breaker.tokens_lost += max(lost, 0.0)
        ends.add(keys[-1])
        reach.update(zip(keys, repeat(r.prompt_tokens)))
