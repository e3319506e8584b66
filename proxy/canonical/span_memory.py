"""What the proxy learned about volatile spans: observations, learned patterns, the shared copy.

``SpanMemory.observe`` is the learning side, called by the canonicalizer once per request,
before it relocates, with the stable texts it saw (tools' descriptions, the leading system
prompts), the values the detectors and the learned patterns already found there masked (so a
pattern a request completes applies to that request). It is cheap: a text seen before costs a
comparison with the place's recent texts, a changed one a bounded comparison with each
(``judge_pair``: a common prefix, then at most ``MAX_SPANS`` short resynchronisations); store
reads and writes run in the background. Per place
(namespace and JSON path) it keeps the last few distinct texts; a new text is compared with
them (``proxy.canonical.spans.judge_pair``), and every value the comparison finds becomes a
*candidate* pattern. A candidate is *learned* once it has matched ``min_requests`` requests of
that place with ``min_values`` distinct values among them. A text that shares no template with
the recent ones (new content) gives no candidate; a text that is the same as a recent one costs
a dict lookup.

The relocation reads ``detection(namespace)``: the learned patterns' detector and a detection
cache, rebuilt when the patterns change; no I/O.

Shared memory. The learned patterns of a namespace are kept in the store's small memory
(``PrefixStore.remember`` / ``recall``, kind ``span``, one key per namespace, ``ttl_s``), so
every proxy sharing a Redis relocates the same values: a proxy reads them on the first request
of a namespace (one bounded round trip) and again every ``refresh_s`` in the background, and
writes the union of the store's and its own when it learns one. Candidates are per proxy. A
store that is down costs only the sharing: each proxy learns from its own traffic.

Bounds: ``max_places`` places holding at most ``max_chars`` characters of text in all (the
least recently seen go), ``RECENT`` texts of at most ``max_text`` characters each and
``CANDIDATES`` candidates per place, ``max_patterns`` learned
patterns per namespace (the least recently used go), ``MAX_NAMESPACES`` namespaces; a pattern
unused for ``ttl_s`` is dropped at the next refresh.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from proxy.canonical.config import VOLATILE_LEARNED
from proxy.canonical.detectors import Detector, Found
from proxy.canonical.draft import Path
from proxy.canonical.relocation import DetectionCache
from proxy.canonical.slots import TextSlot
from proxy.canonical.spans import SpanPattern, finder, identify, judge_pair

if TYPE_CHECKING:
    from proxy.canonical.notes import NoteStore

log = structlog.get_logger("prefixgate.canonical")

STORE_KIND = "span"
STORE_KEY = "learned"
RECENT = 8
CANDIDATES = 8
MAX_VALUES = 16  # distinct values remembered per candidate (only their count matters)
MAX_NAMESPACES = 1024

Observed = tuple[Path, str, tuple[Found, ...]]
"""One stable text as the canonicalizer saw it: its path, its text, the values already found."""


def masked(text: str, finds: Iterable[Found]) -> str:
    """``text`` with each found value (overlaps resolved: the earlier, then longer) replaced
    by ``[[label_0]]``, so that values already handled are not learned again."""
    pieces: list[str] = []
    last = 0
    for f in sorted(finds, key=lambda f: (f.start, f.start - f.end)):
        if f.start < last:
            continue
        pieces += (text[last : f.start], f"[[{f.label}_0]]")
        last = f.end
    if not pieces:
        return text
    pieces.append(text[last:])
    return "".join(pieces)


@dataclass(slots=True)
class _Candidate:
    pattern: SpanPattern
    requests: int = 0
    values: set[str] = field(default_factory=set)


@dataclass(slots=True)
class _Place:
    recent: deque[str] = field(default_factory=deque)
    candidates: OrderedDict[str, _Candidate] = field(default_factory=OrderedDict)
    size: int = 0  # characters held in ``recent``


@dataclass(slots=True)
class LearnedSpan:
    """A learned pattern and how this proxy used it."""

    pattern: SpanPattern
    learned_at: float  # wall-clock seconds
    last_used: float
    origin: str  # "traffic" (this proxy learned it) or "store" (another proxy did)
    hits: int = 0  # requests whose value this proxy relocated (or would have, in dry-run)

    def as_stats(self) -> dict[str, Any]:
        """For ``/stats``: never the anchor's full text, only its hash and its last characters."""
        p = self.pattern
        return {
            "id": p.id,
            "label": p.label,
            "anchor": ("…" if len(p.left) > 8 else "") + p.left[-8:],
            "value_class": p.value_class,
            "line_end": p.eol,
            "origin": self.origin,
            "hits": self.hits,
            "learned_at": round(self.learned_at, 3),
        }


class _Namespace:
    __slots__ = ("detection", "learned", "refreshed", "version")

    def __init__(self) -> None:
        self.learned: OrderedDict[str, LearnedSpan] = OrderedDict()
        self.version = 0
        self.detection: tuple[int, Mapping[str, Sequence[Detector]], DetectionCache] | None = None
        self.refreshed: float | None = None  # monotonic time of the last store read


class SpanMemory:
    """Observations and learned patterns of volatile spans, per namespace."""

    def __init__(
        self,
        *,
        min_requests: int = 3,
        min_values: int = 3,
        max_patterns: int = 64,
        ttl_s: float = 7 * 24 * 3600.0,
        refresh_s: float = 30.0,
        max_places: int = 4096,
        max_text: int = 65_536,
        max_chars: int = 16 << 20,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.min_requests = min_requests
        self.min_values = min_values
        self.max_patterns = max_patterns
        self.ttl_s = ttl_s
        self.refresh_s = refresh_s
        self.max_places = max_places
        self.max_text = max_text
        self.max_chars = max_chars
        self._chars = 0  # characters held in every place's recent texts
        # Texts the same as a recent text of a place with no candidate: the fast path of a
        # stable application (a string caches its hash, so this is one set lookup per text;
        # the path is left out of the key, which would cost hashing it on every request).
        # Cleared when a candidate appears, so that every text counts for it.
        self._settled: set[tuple[str, str]] = set()
        self._clock = clock
        self._monotonic = monotonic
        self._places: OrderedDict[tuple[str, Path], _Place] = OrderedDict()
        self._namespaces: OrderedDict[str, _Namespace] = OrderedDict()
        self._store: NoteStore | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.store_failures = 0

    def bind(self, store: NoteStore | None) -> None:
        """Share learned patterns through ``store`` (None: this proxy's memory only)."""
        self._store = store

    # -- the request path -------------------------------------------------------------------

    def _ns(self, namespace: str, create: bool = True) -> _Namespace | None:
        ns = self._namespaces.get(namespace)
        if ns is None and create:
            ns = self._namespaces[namespace] = _Namespace()
            while len(self._namespaces) > MAX_NAMESPACES:
                self._namespaces.popitem(last=False)
        return ns

    def patterns(self, namespace: str) -> tuple[SpanPattern, ...]:
        """The patterns learned for ``namespace``."""
        ns = self._namespaces.get(namespace)
        return () if ns is None else tuple(s.pattern for s in ns.learned.values())

    def detection(
        self, namespace: str
    ) -> tuple[Mapping[str, Sequence[Detector]], DetectionCache] | None:
        """The learned patterns' detector and its cache, or None when nothing is learned."""
        ns = self._namespaces.get(namespace)
        if ns is None or not ns.learned:
            return None
        if ns.detection is None or ns.detection[0] != ns.version:
            patterns = [s.pattern for s in ns.learned.values()]
            dets = {VOLATILE_LEARNED: [finder(patterns)]}
            ns.detection = (ns.version, dets, DetectionCache(max_entries=256))
        return ns.detection[1], ns.detection[2]

    def used(self, namespace: str, text: str, finds: Iterable[Found]) -> list[str]:
        """The ids of the patterns whose values ``finds`` are; counts a hit for each."""
        ns = self._namespaces.get(namespace)
        if ns is None:
            return []
        patterns = [s.pattern for s in ns.learned.values()]
        ids: list[str] = []
        now = self._clock()
        for f in finds:
            pid = identify(patterns, text, f.start, f.end)
            if pid is not None and pid not in ids:
                ids.append(pid)
                span = ns.learned[pid]
                span.hits += 1
                span.last_used = now
        return ids

    def needs_first_read(self, namespace: str) -> bool:
        """Whether this proxy has never read ``namespace``'s shared patterns."""
        if self._store is None:
            return False
        ns = self._namespaces.get(namespace)
        return ns is None or ns.refreshed is None

    # -- learning --------------------------------------------------------------------------

    def observe_slots(
        self, namespace: str, slots: Sequence[TextSlot], finds: Mapping[int, tuple[Found, ...]]
    ) -> list[SpanPattern]:
        """``observe`` for the canonicalizer's text slots, ``finds`` keyed by ``id(slot)``;
        the texts already settled are passed over without building anything."""
        settled = self._settled
        todo = [
            (slot.path, slot.text, fs)
            for slot in slots
            if (fs := finds.get(id(slot), ())) or (namespace, slot.text) not in settled
        ]
        if not todo and self._store is None:
            return []
        return self.observe(namespace, todo)

    def observe(self, namespace: str, observed: Sequence[Observed]) -> list[SpanPattern]:
        """Learn from one request's stable texts (once per request); the patterns it taught
        (usually none)."""
        taught: list[SpanPattern] = []
        settled = self._settled
        for path, text, finds in observed:
            if len(text) > self.max_text or (not finds and (namespace, text) in settled):
                continue
            taught += self._observe_text(namespace, path, masked(text, finds), not finds)
        if taught:
            ns = self._ns(namespace)
            assert ns is not None
            now = self._clock()
            for pattern in taught:
                if pattern.id not in ns.learned:
                    ns.learned[pattern.id] = LearnedSpan(pattern, now, now, "traffic")
                    log.info(
                        "volatile_span_learned",
                        namespace=namespace,
                        pattern=pattern.id,
                        value_class=pattern.value_class,
                    )
            self._trim(ns)
            ns.version += 1
            self._background(self._share(namespace))
        elif self._store is not None:
            ns = self._ns(namespace)
            assert ns is not None
            if ns.refreshed is None or self._monotonic() - ns.refreshed >= self.refresh_s:
                ns.refreshed = self._monotonic()  # one refresh in flight at a time
                self._background(self.refresh(namespace))
        return taught

    def _observe_text(
        self, namespace: str, path: Path, text: str, plain: bool
    ) -> list[SpanPattern]:
        slot = (namespace, path)
        place = self._places.get(slot)
        if place is None:
            place = self._places[slot] = _Place()
        else:
            self._places.move_to_end(slot)
        if text in place.recent and not place.candidates:
            if plain:
                self._remember_settled((namespace, text))
            return []  # a stable text: the common case
        if text not in place.recent:
            for old in reversed(place.recent):
                found = judge_pair(old, text)
                if found:
                    for pattern in found:
                        self._candidate(place, pattern, old)
                    break
            place.recent.append(text)
            place.size += len(text)
            self._chars += len(text)
            if len(place.recent) > RECENT:
                dropped = len(place.recent.popleft())
                place.size -= dropped
                self._chars -= dropped
        self._evict()
        return self._count(namespace, place, text)

    def _evict(self) -> None:
        """The least recently seen places go beyond ``max_places`` or ``max_chars``."""
        while len(self._places) > 1 and (
            len(self._places) > self.max_places or self._chars > self.max_chars
        ):
            _, gone = self._places.popitem(last=False)
            self._chars -= gone.size

    def _remember_settled(self, key: tuple[str, str]) -> None:
        if len(self._settled) >= 4 * self.max_places:
            self._settled.clear()
        self._settled.add(key)

    def _candidate(self, place: _Place, pattern: SpanPattern, earlier: str) -> None:
        if pattern.id in place.candidates:
            return
        self._settled.clear()  # the texts of this place count again
        cand = place.candidates[pattern.id] = _Candidate(pattern)
        for start, end in pattern.values(earlier):  # the earlier request is one of its matches
            cand.values.add(earlier[start:end])
            cand.requests = 1
        while len(place.candidates) > CANDIDATES:
            place.candidates.popitem(last=False)

    def _count(self, namespace: str, place: _Place, text: str) -> list[SpanPattern]:
        ns = self._namespaces.get(namespace)
        taught: list[SpanPattern] = []
        for pid, cand in list(place.candidates.items()):
            if ns is not None and pid in ns.learned:
                del place.candidates[pid]
                continue
            values = [text[s:e] for s, e in cand.pattern.values(text)]
            if not values:
                continue
            cand.requests += 1
            for value in values:
                if len(cand.values) < MAX_VALUES:
                    cand.values.add(value)
            if cand.requests >= self.min_requests and len(cand.values) >= self.min_values:
                taught.append(cand.pattern)
                del place.candidates[pid]
        return taught

    def _trim(self, ns: _Namespace) -> None:
        while len(ns.learned) > self.max_patterns:
            oldest = min(ns.learned, key=lambda k: ns.learned[k].last_used)
            del ns.learned[oldest]

    # -- the shared memory -----------------------------------------------------------------

    async def _recall(self, namespace: str) -> list[SpanPattern] | None:
        store = self._store
        if store is None:
            return None
        try:
            (value,) = await store.recall(namespace, STORE_KIND, [STORE_KEY])
        except Exception:  # a store failure costs the sharing, never a request
            self.store_failures += 1
            log.warning("span_recall_failed", exc_info=True)
            return None
        if value is None:
            return []
        try:
            items = json.loads(value)["p"]
        except (ValueError, KeyError, TypeError):
            return []
        if not isinstance(items, list):
            return []
        return [p for p in (SpanPattern.from_json(i) for i in items) if p is not None]

    def _adopt(self, namespace: str, patterns: Sequence[SpanPattern]) -> bool:
        ns = self._ns(namespace)
        assert ns is not None
        now = self._clock()
        changed = False
        for pattern in patterns:
            if pattern.id not in ns.learned:
                ns.learned[pattern.id] = LearnedSpan(pattern, now, now, "store")
                changed = True
        for pid in [k for k, s in ns.learned.items() if now - s.last_used > self.ttl_s]:
            del ns.learned[pid]
            changed = True
        if changed:
            self._trim(ns)
            ns.version += 1
        return changed

    async def refresh(self, namespace: str) -> None:
        """Read the namespace's shared patterns and adopt the ones this proxy lacks."""
        ns = self._ns(namespace)
        assert ns is not None
        ns.refreshed = self._monotonic()
        theirs = await self._recall(namespace)
        if theirs is None:
            return
        self._adopt(namespace, theirs)
        ours = {s.pattern.id for s in ns.learned.values() if s.origin == "traffic"}
        if ours - {p.id for p in theirs}:  # a write lost to a race or a blip: write again
            await self._write(namespace, theirs)

    async def _share(self, namespace: str) -> None:
        theirs = await self._recall(namespace)
        if theirs is None:
            return
        self._adopt(namespace, theirs)
        await self._write(namespace, theirs)

    async def _write(self, namespace: str, theirs: Sequence[SpanPattern]) -> None:
        store = self._store
        ns = self._namespaces.get(namespace)
        if store is None or ns is None:
            return
        ordered = sorted(ns.learned.values(), key=lambda s: -s.last_used)
        mine = [s.pattern for s in ordered]
        ids = {p.id for p in mine}
        union = [*mine, *(p for p in theirs if p.id not in ids)][: self.max_patterns]
        value = json.dumps({"p": [p.as_json() for p in union]}, separators=(",", ":"))
        try:
            await store.remember(namespace, STORE_KIND, {STORE_KEY: value.encode()}, self.ttl_s)
        except Exception:
            self.store_failures += 1
            log.warning("span_remember_failed", exc_info=True)

    def _background(self, work: Any) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a synchronous caller (a library user, a test): local only
            work.close()
            return
        task = loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self) -> None:
        """Wait for the background reads and writes (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def stats(self, namespace: str) -> list[dict[str, Any]]:
        """The namespace's learned patterns for ``/stats``, most used first."""
        ns = self._namespaces.get(namespace)
        if ns is None:
            return []
        spans = sorted(ns.learned.values(), key=lambda s: (-s.hits, s.pattern.id))
        return [s.as_stats() for s in spans]
