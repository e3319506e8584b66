"""The canonicalizer: the rules run in order over a parsed request body.

``Canonicalizer.apply(route, body)`` runs, in ``RULE_NAMES`` order:

1. ``stable_json``, then ``whitespace``: each a pure function ``(kind, body, rule config) ->
   RuleOutcome`` that returns a rewritten body (copy-on-write) and what it changed;
2. the volatile rules (``volatile_timestamps``, ``volatile_uuids``, ``volatile_hex_ids``,
   ``custom_patterns``, ``volatile_learned``): each a set of detectors over the stable segments;
   their values go through one relocation, so the model sees one note however many rules found
   something.

Learned spans. ``volatile_learned``'s detector is the patterns learned for the namespace
(``proxy.canonical.span_memory``). Each request's stable texts, with the values the detectors
and the learned patterns found in them, are observed once (a text seen before costs a lookup;
a changed one is compared with the place's recent texts), before relocating: a pattern the
request completes applies to that very request.

Learned forms. With a ``FormMemory`` (the proxy always has one) ``stable_json`` and
``whitespace`` rewrite a part only to the form first seen for it (``proxy.canonical.learned``):
the first request of a set, and an application that is already stable, pass untouched.
``canonicalize`` (async) also consults the store for forms other proxies learned.

Modes. A rule that is off does nothing. A rule in dry-run computes what it would change and
reports it (``dry_run_fired``, ``changes``, ``stable_bytes_gained``) but the next rule starts
from the body it was given. Global dry-run runs every rule as if it applied, so the report is
exactly what would happen, and then forwards the original body.

Routes. Chat routes get every rule; the Responses and Anthropic Messages APIs get the same
rules where their structure maps (``proxy.canonical.apis``: never across a ``cache_control``
breakpoint). Raw completion prompts get ``whitespace`` only if its
``raw_prompts`` option is on, and never a volatile rule: a raw prompt has no user message to
hold the note. Appending it to the end of the prompt would make the model continue *after* the
note (as if it had written it, inside whatever template the prompt ends in), and prepending it
would put the volatile value back at the front of the prefix; neither is safe, so nothing is
relocated. Other routes pass through untouched.

Guarantees: the input is never mutated; the same logical request gives the same bytes; the
output canonicalizes to itself; no JSON object body makes ``apply`` raise. A rule that hits a
value it does not expect skips that part; should a rule ever fail, the failure is counted, the
rule is reported skipped (reason ``error``) and the request goes on without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from functools import partial
from types import MappingProxyType
from typing import Any

from proxy.canonical.apis import (
    API_KINDS,
    MESSAGES_KIND,
    RESPONSES_KIND,
    api_stable_json,
    api_whitespace,
)
from proxy.canonical.apis import note_target as api_note_target
from proxy.canonical.apis import stable_slots as api_stable_slots
from proxy.canonical.config import (
    RULE_NAMES,
    STABLE_JSON,
    VOLATILE_LEARNED,
    VOLATILE_RULES,
    WHITESPACE,
    CanonicalConfig,
    RuleConfig,
)
from proxy.canonical.detectors import Found, build_detectors
from proxy.canonical.forms import FormMemory, FormView
from proxy.canonical.gain import GainMeter
from proxy.canonical.learned import (
    PartLister,
    chat_forms_hold,
    learned_rule,
    stable_json_parts,
    whitespace_parts,
)
from proxy.canonical.notes import NoteContext, NoteMemory
from proxy.canonical.outcome import Change, RuleOutcome, Skip
from proxy.canonical.relocation import (
    DetectionCache,
    Relocation,
    detect,
    placeholders_in,
    relocate,
    replace,
    settle,
    stable_slots,
)
from proxy.canonical.slots import TextSlot
from proxy.canonical.span_memory import SpanMemory
from proxy.canonical.stable_json import stable_json
from proxy.canonical.whitespace import whitespace
from proxy.fingerprint import (
    CHAT_ROUTES,
    COMPLETION_ROUTES,
    MESSAGES_ROUTES,
    RESPONSES_ROUTES,
    Segment,
)
from proxy.values import value

RewriteRule = Callable[[str, dict[str, Any], RuleConfig], RuleOutcome]
REWRITE_RULES: tuple[tuple[str, RewriteRule], ...] = (
    (STABLE_JSON, stable_json),
    (WHITESPACE, whitespace),
)


API_REWRITE_RULES: tuple[tuple[str, RewriteRule], ...] = (
    (STABLE_JSON, api_stable_json),
    (WHITESPACE, api_whitespace),
)
LEARNED_PARTS: Mapping[str, PartLister] = MappingProxyType(
    {STABLE_JSON: stable_json_parts, WHITESPACE: whitespace_parts}
)


def request_kind(route: str) -> str | None:
    """``chat``, ``completion``, ``responses``, ``messages`` or None (a route the
    canonicalizer leaves alone)."""
    if route in CHAT_ROUTES:
        return "chat"
    if route in COMPLETION_ROUTES:
        return "completion"
    if route in RESPONSES_ROUTES:
        return RESPONSES_KIND
    if route in MESSAGES_ROUTES:
        return MESSAGES_KIND
    return None


@value
class CanonicalResult:
    """What the canonicalizer did to one request.

    ``body`` is what to forward: the original object when nothing applied (or in global
    dry-run). ``fired`` lists the rules whose rewrite was applied, ``dry_run_fired`` those that
    would have rewritten the request but are in dry-run; both in ``RULE_NAMES`` order.
    ``stable_bytes_gained`` has, for each rule in either list, the rendered-prompt bytes it
    made (or would make) stable (see ``proxy.canonical.gain``). ``changes`` and ``skipped``
    describe every rewrite and every skip without prompt text.
    """

    body: dict[str, Any]
    fired: tuple[str, ...] = ()
    dry_run_fired: tuple[str, ...] = ()
    changes: tuple[Change, ...] = ()
    skipped: tuple[Skip, ...] = ()
    meter: GainMeter | None = field(default=None, repr=False, compare=False)
    learned: Mapping[str, bytes] = field(default_factory=dict, repr=False, compare=False)
    """Forms this request taught the proxy (first seen here), for ``FormMemory.settle``."""
    recall_notes: tuple[str, ...] = ()
    """Note-memory keys to recall before applying again (``apply(defer_notes=True)``)."""
    notes_restored: int = 0
    """Notes of earlier turns put back into the history."""
    note_values_omitted: int = 0
    """Values the new note leaves out because a restored note already states them."""
    would_forward: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    """In global dry-run, the body the rules would have forwarded (None when they would change
    nothing, or when not in global dry-run): what miss attribution measures breakers by."""
    learned_spans: tuple[str, ...] = ()
    """Ids of the learned span patterns whose values were relocated (or would be, dry-run)."""

    @property
    def stable_bytes_gained(self) -> dict[str, int]:
        """Rendered-prompt bytes each fired (or dry-run fired) rule made stable; measured on
        first use (a render of the prompt), so use it off the critical path."""
        return self.measure_gains()

    def measure_gains(
        self, segments: Sequence[Segment] | None = None, total_bytes: int = 0
    ) -> dict[str, int]:
        """``stable_bytes_gained``, reusing the forwarded prompt's layout when the caller has
        it (``Fingerprint.segments`` and ``Fingerprint.total_bytes`` of ``body``), which saves
        rendering the prompt again. The first call's answer is kept."""
        return {} if self.meter is None else self.meter.measured(segments, total_bytes)


class _Run:
    """The state of one ``apply`` call."""

    __slots__ = (
        "body",
        "changes",
        "deferred",
        "dry",
        "fired",
        "learned_ids",
        "meter",
        "notes",
        "observe",
        "skipped",
    )

    def __init__(self, route: str, body: dict[str, Any]) -> None:
        self.observe = True  # learn volatile spans from this pass (once per request)
        self.learned_ids: list[str] = []
        self.notes: NoteContext | None = None
        self.deferred = False
        self.body = body
        self.meter = GainMeter(route)
        self.fired: list[str] = []
        self.dry: list[str] = []
        self.changes: list[Change] = []
        self.skipped: list[Skip] = []


class Canonicalizer:
    """Rewrites request bodies so that their stable part is byte-identical every time."""

    def __init__(
        self,
        config: CanonicalConfig | None = None,
        *,
        forms: FormMemory | None = None,
        notes: NoteMemory | None = None,
        spans: SpanMemory | None = None,
    ) -> None:
        self.config = config if config is not None else CanonicalConfig()
        self.forms = forms
        """Learned forms (``proxy.canonical.learned``): with them ``stable_json`` and
        ``whitespace`` rewrite a part only to the form first seen for it; without, to their
        fixed normal form."""
        # The note memory (``proxy.canonical.notes``); its store is attached at start-up.
        self.notes = (
            (notes or NoteMemory(ttl_s=self.config.note_memory_ttl_s))
            if self.config.note_memory
            else None
        )
        learned = self.config.rule(VOLATILE_LEARNED)
        # Learned volatile spans (``proxy.canonical.span_memory``): fed by ``learn``.
        self.spans = (
            (
                spans
                or SpanMemory(
                    min_requests=learned.number("min_requests"),
                    min_values=learned.number("min_values"),
                    max_patterns=learned.number("max_patterns"),
                )
            )
            if learned.enabled
            else None
        )
        self._detectors = build_detectors(self.config)
        self._detection_cache = DetectionCache()
        self._fired = dict.fromkeys(RULE_NAMES, 0)
        self._dry = dict.fromkeys(RULE_NAMES, 0)
        self._skipped = dict.fromkeys(RULE_NAMES, 0)
        self._errors = dict.fromkeys(RULE_NAMES, 0)

    @property
    def counters(self) -> Mapping[str, int]:
        """Requests each rule rewrote."""
        return MappingProxyType(self._fired)

    @property
    def dry_run_counters(self) -> Mapping[str, int]:
        """Requests each rule would have rewritten, in dry-run."""
        return MappingProxyType(self._dry)

    @property
    def skipped_counters(self) -> Mapping[str, int]:
        """Requests in which each rule left something alone (see ``Skip.reason``)."""
        return MappingProxyType(self._skipped)

    @property
    def error_counters(self) -> Mapping[str, int]:
        """Requests in which a rule failed and was skipped: a bug, always worth a look."""
        return MappingProxyType(self._errors)

    def apply(
        self,
        route: str,
        body: dict[str, Any],
        *,
        namespace: str = "default",
        defer_notes: bool = False,
    ) -> CanonicalResult:
        """Canonicalize one request body (never mutated) for ``route``, with the forms and
        notes this proxy knows for ``namespace`` (the tenant).

        With ``defer_notes``, a request whose history needs note-memory entries not held in
        this process comes back unchanged with ``recall_notes`` naming them: recall them
        (``self.notes.recall``) and apply again. ``canonicalize`` does all of that.
        """
        result = self._apply(route, body, namespace, defer_notes)
        if not result.recall_notes:
            self._count(result)
        return result

    async def canonicalize(
        self, route: str, body: dict[str, Any], *, namespace: str = "default"
    ) -> CanonicalResult:
        """``apply``, with what other proxies sharing the store learned: notes of earlier
        turns this process does not hold, and forms of parts it has not seen, are looked up in
        the store (a bounded round trip each, only then), and the request is canonicalized
        again with them."""
        spans = self.spans
        if spans is not None and self.config.enabled and spans.needs_first_read(namespace):
            await spans.refresh(namespace)  # once per namespace: what other proxies learned
        result = self._apply(route, body, namespace, True)
        if result.recall_notes and self.notes is not None:
            await self.notes.recall(namespace, result.recall_notes)
            result = self._apply(route, body, namespace, False, observe=False)
        forms = self.forms
        if forms is not None and result.learned and await forms.settle(namespace, result.learned):
            result = self._apply(route, body, namespace, False, observe=False)
        self._count(result)
        return result

    def _count(self, result: CanonicalResult) -> None:
        for name in result.fired:
            self._fired[name] += 1
        for name in result.dry_run_fired:
            self._dry[name] += 1
        for name in {s.rule for s in result.skipped}:
            self._skipped[name] += 1

    def _apply(
        self,
        route: str,
        body: dict[str, Any],
        namespace: str,
        defer_notes: bool,
        *,
        observe: bool = True,
    ) -> CanonicalResult:
        config = self.config
        kind = request_kind(route)
        if not config.enabled or kind is None or type(body) is not dict:
            return CanonicalResult(body)
        run = _Run(route, body)
        run.observe = observe
        if self.notes is not None and kind == "chat":
            run.notes = NoteContext(self.notes, namespace, defer_notes)
        api = kind in API_KINDS
        view = self.forms.view(namespace) if self.forms is not None else None
        # Both learned rules would pass every part as it is (the common case): neither runs.
        forms_hold = view is not None and kind == "chat" and chat_forms_hold(view, body)
        for name, rule_fn in API_REWRITE_RULES if api else REWRITE_RULES:
            rule = config.rule(name)
            if rule.enabled and not (forms_hold and name in LEARNED_PARTS):
                if view is not None and name in LEARNED_PARTS:
                    rule_fn = self._learned(view, name, rule_fn, api)
                self._rewrite(run, name, rule, rule_fn, kind)
        if (kind == "chat" or api) and (self._detectors or self.spans is not None):
            try:
                self._relocate(run, kind, namespace)
            except Exception:  # a bug must cost the request its relocation, not its answer
                failed = [*self._detectors, *([VOLATILE_LEARNED] if self.spans else [])]
                for name in failed:
                    self._errors[name] += 1
                    run.skipped.append(Skip(name, "error"))
            if run.deferred:
                assert run.notes is not None
                return CanonicalResult(body, recall_notes=tuple(run.notes.missing))
        notes = run.notes
        if (
            run.body is body
            and not (run.fired or run.dry or run.changes or run.skipped or run.learned_ids)
            and (view is None or not view.learned)
            and (notes is None or not (notes.restored or notes.omitted))
        ):
            return CanonicalResult(body)  # nothing done, nothing learned: the usual answer
        run.meter.finish(run.body, forwarded=not config.dry_run)
        return CanonicalResult(
            body=body if config.dry_run else run.body,
            fired=tuple(run.fired),
            dry_run_fired=tuple(run.dry),
            changes=tuple(run.changes),
            skipped=tuple(run.skipped),
            # Gains are measured on the chat layout only (the other APIs' are not mapped yet).
            meter=run.meter if (run.fired or run.dry) and not api else None,
            learned=_learned(view),
            notes_restored=notes.restored if notes else 0,
            note_values_omitted=notes.omitted if notes else 0,
            would_forward=run.body if config.dry_run and run.body is not body else None,
            learned_spans=tuple(run.learned_ids),
        )

    def _learned(self, view: FormView, name: str, fixed: RewriteRule, api: bool) -> RewriteRule:
        """Rule ``name`` rewriting each part only to its first-seen form (``learned``)."""
        ws = self.config.rule(WHITESPACE)
        also = None
        if name == STABLE_JSON and ws.enabled:
            also = (api_whitespace if api else whitespace, ws)
        return partial(learned_rule, name, fixed, LEARNED_PARTS[name], view, also=also)

    def _rewrite(
        self, run: _Run, name: str, rule: RuleConfig, rule_fn: RewriteRule, kind: str
    ) -> None:
        try:
            outcome = rule_fn(kind, run.body, rule)
        except Exception:  # a bug must cost the request this rule, not its answer
            self._errors[name] += 1
            run.skipped.append(Skip(name, "error"))
            return
        run.skipped += outcome.skipped
        if outcome.body is run.body:
            return
        run.meter.rewrite(name, run.body, outcome.body)
        run.changes += outcome.changes
        if rule.dry_run:
            run.dry.append(name)
            return
        (run.dry if self.config.dry_run else run.fired).append(name)
        run.body = outcome.body

    def _relocate(self, run: _Run, kind: str, namespace: str) -> None:
        config = self.config
        api = kind in API_KINDS
        slots = api_stable_slots(kind, run.body) if api else stable_slots(run.body)
        finder = partial(api_note_target, kind) if api else None
        detected = detect(slots, self._detectors, self._detection_cache) if self._detectors else []
        spans = self.spans
        learned = spans.detection(namespace) if spans is not None else None
        found = detected if learned is None else _merged(detected, detect(slots, *learned))
        if spans is not None and run.observe and self._observe(namespace, slots, found):
            learned = spans.detection(namespace)  # this request taught a pattern: use it now
            if learned is not None:
                found = _merged(detected, detect(slots, *learned))
        if not found:
            return
        taken = placeholders_in(slots)
        enabled = [
            r
            for r in VOLATILE_RULES
            if r in self._detectors or (r == VOLATILE_LEARNED and learned is not None)
        ]
        active = [r for r in enabled if not config.rule(r).dry_run]
        ws = config.rule(WHITESPACE)
        before = run.body

        def relocate_spans(rules: list[str]) -> Relocation:
            return relocate(
                before,
                settle(found, rules, self._detectors, self._detection_cache),
                VOLATILE_RULES,
                placement=config.note_placement,
                note_format=config.note_format,
                normalise_note=ws.enabled and not ws.dry_run,
                taken=taken,
                find_target=finder,
                notes=notes,
            )

        notes = run.notes if not config.dry_run else None
        applied = relocate_spans(active)
        if applied.deferred:
            run.deferred = True
            return
        notes = None  # the dry-run pass below must not touch the memory
        run.skipped += applied.skipped
        if applied.rules:
            run.changes += applied.changes
            self._measure(run.meter, before, applied, applied.rules)
            (run.dry if config.dry_run else run.fired).extend(applied.rules)
            run.body = applied.body
            self._learned_used(run, namespace, applied)
        if len(active) == len(enabled):
            return
        would = relocate_spans(enabled)
        dry_rules = [r for r in would.rules if r not in active]
        run.skipped += [s for s in would.skipped if s.rule not in active]
        if dry_rules:
            run.changes += [c for c in would.changes if c.rule in dry_rules]
            self._measure(run.meter, before, would, dry_rules)
            run.dry += dry_rules
            run.dry.sort(key=RULE_NAMES.index)
            if VOLATILE_LEARNED in dry_rules:
                self._learned_used(run, namespace, would)

    def _observe(
        self,
        namespace: str,
        slots: Sequence[TextSlot],
        found: Sequence[tuple[TextSlot, list[Found]]],
    ) -> bool:
        """Teach the span memory this request's stable texts; whether it learned a pattern."""
        assert self.spans is not None
        finds = {id(slot): tuple(fs) for slot, fs in found} if found else {}
        try:
            return bool(self.spans.observe_slots(namespace, slots, finds))
        except Exception:  # a bug costs the learning, never the request
            self._errors[VOLATILE_LEARNED] += 1
            return False

    def _learned_used(self, run: _Run, namespace: str, reloc: Relocation) -> None:
        """The learned patterns whose values ``reloc`` relocated, counted and listed."""
        if self.spans is None or VOLATILE_LEARNED not in reloc.rules:
            return
        for slot, finds in reloc.spans:
            ours = [f for f in finds if f.rule == VOLATILE_LEARNED]
            if ours:
                for pid in self.spans.used(namespace, slot.text, ours):
                    if pid not in run.learned_ids:
                        run.learned_ids.append(pid)

    @staticmethod
    def _measure(
        meter: GainMeter, before: dict[str, Any], reloc: Relocation, rules: Sequence[str]
    ) -> None:
        for rule in rules:
            # With one rule, replacing only its values is the relocation without the note.
            replaced: Callable[[], dict[str, Any]] = (
                partial(_same, reloc.without_note)
                if len(reloc.rules) == 1
                else partial(replace, before, reloc.spans, reloc.placeholders, only_rule=rule)
            )
            meter.relocation(
                rule, before, replaced, reloc.without_note, reloc.body, reloc.note_message
            )


def _merged(
    a: list[tuple[TextSlot, list[Found]]], b: list[tuple[TextSlot, list[Found]]]
) -> list[tuple[TextSlot, list[Found]]]:
    """Two slot-wise detections as one, in slot order (``b``'s slots are among ``a``'s or
    new)."""
    if not a:
        return b
    if not b:
        return a
    extra = {id(slot): finds for slot, finds in b}
    out = [(slot, [*finds, *extra.pop(id(slot), [])]) for slot, finds in a]
    return out + [(slot, finds) for slot, finds in b if id(slot) in extra]


def _same(body: dict[str, Any]) -> dict[str, Any]:
    return body


def _learned(view: FormView | None) -> Mapping[str, bytes]:
    return {} if view is None else view.learned
