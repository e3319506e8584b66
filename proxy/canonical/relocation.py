"""Volatile-span relocation: values that change on every request move out of the prefix.

What the model sees
-------------------
A system prompt that embeds the current time, a session UUID or a request id differs on every
request, and the backend's prefix cache stops at the first differing byte: the system prompt,
the tools and the whole conversation after them are computed again each time. Relocation
replaces each such value in the *stable segments* (the leading system/developer messages and
the tool descriptions) by a placeholder, and restates the values in a short note placed next
to the newest user message, so the model still has them. For example, the request::

    system: "You are Aria, a scheduling assistant.\\n"
            "Current date: Monday, November 30, 2026\\n"
            "Session: 550e8400-e29b-41d4-a716-446655440000"
    user:   "What is on my calendar today?"

reaches the backend as::

    system: "You are Aria, a scheduling assistant.\\n"
            "Current date: [[date_1]]\\n"
            "Session: [[uuid_1]]"
    user:   "[[date_1]] = Monday, November 30, 2026\\n"
            "[[uuid_1]] = 550e8400-e29b-41d4-a716-446655440000\\n"
            "\\n"
            "What is on my calendar today?"

- A placeholder is ``[[<label>_<n>]]``; the label says what the value is (``date``,
  ``datetime``, ``time``, ``epoch``, ``uuid``, ``id``, or a custom pattern's name) and ``n``
  counts values of that label in order of first appearance (tools first, then the system
  messages, as the prompt is rendered). The same value always gets the same placeholder.
- The note has one line ``<placeholder> = <value>`` per placeholder, in that order, wrapped by
  ``note_format`` (``{entries}`` is replaced by those lines; the default is the lines alone).
- ``note_placement``:

  - ``user_prefix`` (default): the note, then a blank line, then the newest user message's
    text. When the content is a list of parts, the note (with the blank line) is a new text
    part inserted first; the other parts are not changed.
  - ``user_suffix``: the message's text, a blank line, then the note (a new last part for a
    content list). It caches more: on the next turn the application resends this message
    without the note, and the cache still covers the message's own text, which
    ``user_prefix`` gives up. In an agent loop, where tool results follow the user message
    on every request, the difference is the whole user message on every request.
  - ``last_suffix``: like ``user_suffix``, but on the newest message of the request when it is
    a user or a tool message (an agent loop's newest message is usually a tool result). The
    history before it, tool calls and results included, is then byte-identical from turn to
    turn, where ``user_suffix`` gives up everything after the user message that started the
    loop. The model reads the values at the end of the newest tool result instead of next to
    the user's words. A request whose newest message is from the assistant (a prefill to
    continue) is left alone: text appended there would become part of the answer.
  - ``system_suffix``: a blank line and the note appended to the last leading system message.
    The note then sits before the conversation: the system prompt and tools stay cached, but
    a value that changes between turns (a clock time) invalidates the whole history. It
    suits values that change rarely (the date) and are shared by all of a day's conversations.

  When the request has no user message (or, for ``system_suffix``, no leading system message),
  or that message's content is neither a string nor a list, nothing is relocated and the skip
  is reported: a value must never disappear from what the model sees.

What the cache keeps: the tools, the system prompt and the history are byte-identical from
request to request whatever the values are. The application never sees the rewrite, so on the
next turn it sends this user message again without the note, and the cache matches up to where
the note was: with ``user_prefix`` up to the start of that (now older) user message, with
``user_suffix`` up to its end. The note therefore only ever goes to the newest user message;
older ones always arrive, and stay, as the application wrote them.

The model reads the note as the placeholders' definitions and answers with the values; a small
model may now and then quote a placeholder instead. A ``note_format`` that says what the lines
are ("Placeholders in the instructions stand for:\n{entries}") helps it.

Idempotence: placeholders are never detected as values, nor are note lines (a line starting
``[[label_n]] = ``), and a value that only shows once its neighbour is a placeholder is
relocated in the same pass (see ``settle``), so canonicalizing a canonical request changes
nothing. A value never spans a line break.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from proxy.canonical.config import NotePlacement
from proxy.canonical.detectors import Detector, Found, ascii_view
from proxy.canonical.draft import Draft, Path, format_path
from proxy.canonical.notes import (
    NoteContext,
    NoteEntry,
    message_keys,
    restore_history,
    seed_of,
)
from proxy.canonical.outcome import Change, Skip
from proxy.canonical.slots import (
    TextSlot,
    leading_system_indexes,
    newest_user_index,
    system_slots,
    tool_slots,
)
from proxy.canonical.whitespace import normalise

PLACEHOLDER = re.compile(r"\[\[[a-z][a-z0-9_]*_[0-9]+\]\]")
_NOTE_LINE = re.compile(r"^\[\[[a-z][a-z0-9_]*_[0-9]+\]\] = .*$", re.MULTILINE)
NOTE_SEPARATOR = "\n\n"


class SlotFinds(NamedTuple):
    """The volatile values found in one text slot, overlaps resolved, in text order."""

    slot: TextSlot
    finds: tuple[Found, ...]


def _protected(text: str) -> list[tuple[int, int]]:
    """Ranges holding placeholders or note lines, which are never values."""
    if "[[" not in text:
        return []
    return [m.span() for m in _NOTE_LINE.finditer(text)] + [
        m.span() for m in PLACEHOLDER.finditer(text)
    ]


def stable_slots(body: dict[str, Any]) -> list[TextSlot]:
    """The text slots of the stable segments, in rendered order: tools, then system prompts."""
    return [*tool_slots(body), *system_slots(body, leading_only=True)]


class DetectionCache:
    """Values found per text, for texts seen again (tool descriptions, unchanged prompts).

    Keyed by the exact text; cleared when full. It only saves time: a text always gives the
    same values.
    """

    __slots__ = ("_entries", "max_entries", "max_length")

    def __init__(self, *, max_entries: int = 2048, max_length: int = 16384) -> None:
        self._entries: dict[str, list[Found]] = {}
        self.max_entries = max_entries
        self.max_length = max_length

    def find(self, text: str, detectors: Mapping[str, Sequence[Detector]]) -> list[Found]:
        """Every value each detector finds in ``text``, outside protected ranges."""
        cacheable = len(text) <= self.max_length
        if cacheable and (hit := self._entries.get(text)) is not None:
            return hit
        view = ascii_view(text)
        finds = [f for dets in detectors.values() for det in dets for f in det(text, view)]
        if finds and (protected := _protected(text)):
            finds = [f for f in finds if all(f.end <= lo or f.start >= hi for lo, hi in protected)]
        if cacheable:
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
            self._entries[text] = finds
        return finds


def detect(
    slots: Sequence[TextSlot],
    detectors: Mapping[str, Sequence[Detector]],
    cache: DetectionCache,
) -> list[tuple[TextSlot, list[Found]]]:
    """The values found in each slot (overlaps not yet resolved), for slots that have any."""
    out: list[tuple[TextSlot, list[Found]]] = []
    for slot in slots:
        finds = cache.find(slot.text, detectors)
        if finds:
            out.append((slot, finds))
    return out


def _resolve(finds: Iterable[Found], rank: Mapping[str, int]) -> list[Found]:
    """The finds of ranked rules without overlaps: the earlier, then longer, then the one
    whose rule ranks first wins."""
    kept: list[Found] = []
    ordered = sorted(
        (f for f in finds if f.rule in rank), key=lambda f: (f.start, f.start - f.end, rank[f.rule])
    )
    for f in ordered:
        if not kept or f.start >= kept[-1].end:
            kept.append(f)
    return kept


def _masked(text: str, finds: Sequence[Found]) -> tuple[str, list[tuple[int, int]]]:
    """``text`` with each find replaced by a placeholder of its label, and for each
    placeholder its start in the masked text and the shift it puts on what follows."""
    pieces: list[str] = []
    shifts: list[tuple[int, int]] = []
    last = at = shift = 0
    for f in finds:
        mask = f"[[{f.label}_0]]"
        pieces += (text[last : f.start], mask)
        at += f.start - last
        shift += (f.end - f.start) - len(mask)
        shifts.append((at, shift))
        at += len(mask)
        last = f.end
    pieces.append(text[last:])
    return "".join(pieces), shifts


def settle(
    found: Iterable[tuple[TextSlot, list[Found]]],
    rules: Sequence[str],
    detectors: Mapping[str, Sequence[Detector]],
    cache: DetectionCache,
    *,
    rounds: int = 3,
) -> list[SlotFinds]:
    """The values of ``rules`` to relocate in each slot, overlaps resolved.

    A value can hide another: a detector that wants a word boundary does not see a date glued
    to the end of another date until the first is a placeholder. So each slot is detected
    again with its values masked by placeholders, and what shows up joins the values, until
    nothing new does: the output then has nothing left to find, which makes canonicalizing
    idempotent. In practice the second round finds nothing, and its text (the prompt with
    placeholders) is the same on every request, so it comes from the cache.
    """
    rank = {rule: i for i, rule in enumerate(rules)}
    out: list[SlotFinds] = []
    for slot, finds in found:
        kept = _resolve(finds, rank)
        for _ in range(rounds):
            if not kept:
                break
            masked, shifts = _masked(slot.text, kept)
            extra = [f for f in cache.find(masked, detectors) if f.rule in rank]
            if not extra:
                break
            moved = []
            for f in extra:  # back to the slot text's offsets
                shift = next((s for at, s in reversed(shifts) if at < f.start), 0)
                moved.append(f._replace(start=f.start + shift, end=f.end + shift))
            kept = _resolve([*kept, *moved], rank)
        if kept:
            out.append(SlotFinds(slot, tuple(kept)))
    return out


def placeholders_in(slots: Iterable[TextSlot]) -> frozenset[str]:
    """The placeholder-shaped strings the prompt's own text already holds."""
    return frozenset(
        m.group() for slot in slots if "[[" in slot.text for m in PLACEHOLDER.finditer(slot.text)
    )


def assign_placeholders(
    spans: Sequence[SlotFinds], taken: frozenset[str] = frozenset()
) -> dict[tuple[str, str], str]:
    """A placeholder for every (label, value), numbered per label by first appearance.

    Numbers whose placeholder is ``taken`` (already in the prompt's own text) are passed over.
    """
    counters: dict[str, int] = {}
    out: dict[tuple[str, str], str] = {}
    for slot, finds in spans:
        for f in finds:
            key = (f.label, slot.text[f.start : f.end])
            if key in out:
                continue
            n = counters.get(f.label, 0)
            while True:
                n += 1
                placeholder = f"[[{f.label}_{n}]]"
                if placeholder not in taken:
                    break
            counters[f.label] = n
            out[key] = placeholder
    return out


def replace(
    body: dict[str, Any],
    spans: Sequence[SlotFinds],
    placeholders: Mapping[tuple[str, str], str],
    only_rule: str | None = None,
) -> dict[str, Any]:
    """``body`` with the values replaced by their placeholders (of one rule, if given)."""
    draft = Draft(body)
    for slot, finds in spans:
        text = slot.text
        pieces: list[str] = []
        last = 0
        for f in finds:
            if only_rule is not None and f.rule != only_rule:
                continue
            pieces += (text[last : f.start], placeholders[f.label, text[f.start : f.end]])
            last = f.end
        if pieces:
            pieces.append(text[last:])
            draft.set(slot.path, "".join(pieces))
    return draft.body


@dataclass(frozen=True, slots=True)
class NoteTarget:
    """Where the note goes: a message's content, before or after its text."""

    index: int  # the message's index
    content: str | list[Any]
    prefix: bool
    where: Path | None = None
    """The content's path when it is not ``messages[index].content`` (other APIs' layouts)."""
    part_type: str = "text"
    """The ``type`` of the text part the note becomes in a content list."""

    @property
    def path(self) -> Path:
        return self.where if self.where is not None else ("messages", self.index, "content")


TargetFinder = Callable[[dict[str, Any], NotePlacement], "NoteTarget | str"]


def note_target(body: dict[str, Any], placement: NotePlacement) -> NoteTarget | str:
    """Where ``placement`` puts the note in this request, or why it cannot go anywhere."""
    if placement == "system_suffix":
        indexes = leading_system_indexes(body)
        if not indexes:
            return "no_system_message"
        index = indexes[-1]
    elif placement == "last_suffix":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "no_user_message"
        last = messages[-1]
        if type(last) is not dict or last.get("role") not in ("user", "tool"):
            return "newest_message_not_user_or_tool"
        index = len(messages) - 1
    else:
        found = newest_user_index(body)
        if found is None:
            return "no_user_message"
        index = found
    content = body["messages"][index].get("content")
    if not isinstance(content, str | list):
        return "message_content_not_text"
    return NoteTarget(index, content, placement == "user_prefix")


def note_text(placeholders: Mapping[tuple[str, str], str], note_format: str) -> str:
    """The note: one ``placeholder = value`` line per placeholder, wrapped by ``note_format``."""
    entries = "\n".join(f"{ph} = {value}" for (_, value), ph in placeholders.items())
    return note_format.replace("{entries}", entries)


def place_note(body: dict[str, Any], target: NoteTarget, note: str) -> tuple[dict[str, Any], str]:
    """``body`` with the note placed at ``target``, and the note's path."""
    draft = Draft(body)
    content = target.content
    if isinstance(content, str):
        if not content:
            new: str | list[Any] = note
        else:
            new = (
                note + NOTE_SEPARATOR + content
                if target.prefix
                else content + NOTE_SEPARATOR + note
            )
        path = target.path
    else:
        text = note + NOTE_SEPARATOR if target.prefix else NOTE_SEPARATOR + note
        part = {"type": target.part_type, "text": text}
        new = [part, *content] if target.prefix else [*content, part]
        path = (*target.path, 0 if target.prefix else len(content))
    draft.set(target.path, new)
    return draft.body, format_path(path)


@dataclass(frozen=True, slots=True)
class Relocation:
    """The outcome of relocating one set of values."""

    body: dict[str, Any]  # placeholders and note; the input object when nothing was done
    without_note: dict[str, Any]  # placeholders only (for measuring where the note starts)
    spans: tuple[SlotFinds, ...]
    placeholders: Mapping[tuple[str, str], str]
    changes: tuple[Change, ...]
    skipped: tuple[Skip, ...]
    rules: tuple[str, ...]  # the rules whose values were relocated, in pipeline order
    note_message: int = -1  # index of the message that holds the note
    deferred: bool = False  # left alone until the note memory's missing entries are recalled


def relocate(
    body: dict[str, Any],
    spans: Sequence[SlotFinds],
    rule_order: Sequence[str],
    *,
    placement: NotePlacement,
    note_format: str,
    normalise_note: bool,
    taken: frozenset[str] = frozenset(),
    find_target: TargetFinder | None = None,
    notes: NoteContext | None = None,
) -> Relocation:
    """Replace the values of ``spans`` by placeholders and place the note, or skip entirely.

    ``taken``: placeholders the prompt already holds (see ``placeholders_in``).
    ``find_target``: where the note goes in this request's layout (default: ``note_target``,
    a chat request's).
    ``notes``: the note memory (``proxy.canonical.notes``): the notes of earlier turns are put
    back into the history and the new note states only the values that changed. With
    ``notes.defer_misses``, a request whose history needs entries not held locally is left
    alone (``Relocation.deferred``) until they are recalled.
    """
    rules = tuple(r for r in rule_order if any(f.rule == r for sf in spans for f in sf.finds))
    if not rules:
        return Relocation(body, body, (), {}, (), (), ())
    target = (find_target or note_target)(body, placement)
    if isinstance(target, str):
        skipped = tuple(Skip(rule, target) for rule in rules)
        return Relocation(body, body, (), {}, (), skipped, ())
    placeholders = assign_placeholders(spans, taken)
    replaced = replace(body, spans, placeholders)
    stated: Mapping[tuple[str, str], str] = placeholders
    remembered = notes is not None and placement != "system_suffix" and target.where is None
    if remembered:
        assert notes is not None
        seed = seed_of(notes.namespace, replaced, _stable_texts(replaced, spans))
        keys = message_keys(body, seed)
        restored = restore_history(replaced, keys, target.index, notes, _restore_note)
        if restored is None:
            return Relocation(body, body, (), {}, (), (), (), deferred=True)
        replaced, known = restored
        stated = {k: ph for k, ph in placeholders.items() if known.get(ph) != k[1]}
        notes.restated += len(stated)
        notes.omitted += len(placeholders) - len(stated)
    changes = [
        Change(f.rule, format_path(slot.path), "placeholder", n)
        for slot, finds in spans
        for f, n in _counts(finds)
    ]
    if stated:
        note = note_text(stated, note_format)
        if normalise_note and placement == "system_suffix":
            note = normalise(note, strip_end=True)[0]
        # The target message may itself be a slot (system_suffix): take its rewritten content.
        content = Draft(replaced).get(target.path)
        final, note_path = place_note(replaced, dataclasses.replace(target, content=content), note)
        changes += [Change(rule, note_path, "note", 1) for rule in rules]
    else:  # every value is already stated by a note in the history
        final, note = replaced, ""
    if remembered:
        assert notes is not None
        part_type = target.part_type
        values = tuple((ph, value) for (_, value), ph in stated.items())
        notes.memory.put(
            notes.namespace,
            keys[target.index],
            NoteEntry(note, target.prefix, part_type, values),
        )
    return Relocation(
        final, replaced, tuple(spans), placeholders, tuple(changes), (), rules, target.index
    )


def _stable_texts(body: dict[str, Any], spans: Sequence[SlotFinds]) -> list[str]:
    """The stable segments as forwarded (their values are placeholders), for the memory's key."""
    draft = Draft(body)
    texts = [str(draft.get(sf.slot.path)) for sf in spans]
    tools = body.get("tools")
    if tools is not None:
        texts.append(json.dumps(tools, sort_keys=True, ensure_ascii=False))
    return texts


def _restore_note(
    body: dict[str, Any], index: int, content: str | list[Any], entry: NoteEntry
) -> dict[str, Any]:
    """``body`` with a remembered note put back into message ``index``, where it was."""
    target = NoteTarget(index, content, entry.prefix, part_type=entry.part_type)
    return place_note(body, target, entry.note)[0]


def _counts(finds: Sequence[Found]) -> list[tuple[Found, int]]:
    """The first find of each rule in a slot, with how many that rule has there."""
    firsts: dict[str, Found] = {}
    counts: dict[str, int] = {}
    for f in finds:
        firsts.setdefault(f.rule, f)
        counts[f.rule] = counts.get(f.rule, 0) + 1
    return [(firsts[r], counts[r]) for r in firsts]
