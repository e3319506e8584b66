"""llama-server's prompt cache as the server runs it: what its slots and its RAM cache hold.

A llama.cpp replica reuses a request's prompt only from the slot that serves it: the longest
common prefix (LCP) of tokens between the slot's KV cache and the new prompt. Beside the slots it
keeps a host-RAM prompt cache (``--cache-ram``, default 8 GiB) of whole slot states, which it can
load into the chosen slot. When it saves, when it loads and which entry it takes decide whether a
conversation's history survives other conversations passing through its slot. The rules below are
read from the server's source for the version this project builds (llama.cpp ``tools/server``)
and checked against ``/slots``, ``timings.cache_n`` and the server's log (BACKENDS.md §1.2, §1.3,
§1.11). Each rule names the function it comes from.

Slot choice, ``server_context::get_available_slot`` (``server-context.cpp``):

1. ``id_slot`` given: that slot, whatever it holds.
2. Similarity on (``--slot-prompt-similarity``, default 0.10; 0 turns it off): among idle slots
   *holding tokens*, the one with the largest ``f_sim = LCP / len(prompt)`` above the threshold
   (strictly larger wins, so ties go to the lowest id). A pinned request is checked against its
   own slot only.
3. Nothing chosen (all idle slots empty or below the threshold; never for a pinned request): the
   least recently used idle slot (``t_last_used <= t_last``: ties go to the highest id).
4. The chosen slot's state is saved to the RAM cache and the best cached prompt loaded into it
   (*update*) when it was chosen by LRU, or when ``f_keep = LCP / len(slot) < 0.5`` (the slot would
   lose more than half its tokens). A pinned slot that fails the threshold gives ``f_keep = 0``:
   update. A pinned slot that is **empty** gives ``0 / 0``, NaN, which is not ``< 0.5``: no update,
   the RAM cache is never consulted. With similarity 0 a pinned request never updates.

RAM cache, ``server_prompt_cache`` (``server-task.cpp``):

5. ``load``: over the entries oldest first, skip those the prompt would keep less than a quarter
   of (``lcp / len(entry) < 0.25``) and take an entry when both its ``f_keep`` and its ``f_sim``
   beat the best so far (starting from the slot's own content; an empty slot starts below any
   entry). The entry *moves* into the slot: it leaves the cache.
6. ``alloc`` (a save): skipped when an entry already holds the whole state; entries the new state
   holds whole are removed; the oldest go first past the size limit (``update``).
7. Idle slots (``--cache-idle-slots``, on by default with a RAM cache): whenever a task is
   launched, every idle slot is saved to the cache, and with a unified KV cache (``--kv-unified``,
   the default when the slot count is automatic, i.e. no ``-np``) also *cleared*
   (``process_single_task``, [TAG_IDLE_SLOT_CLEAR]).
8. A request reuses ``LCP(slot tokens, prompt)`` tokens, at most ``len(prompt) - 1``
   (``update_slots``: at least one token is evaluated). A slot's tokens are its last prompt and
   the tokens it generated after it.

What follows from them, and what placement must respect: with a long shared system prompt and
short histories every slot keeps at least half of its tokens for any request of the application
(``f_keep >= 0.5``), so with similarity on the server never swaps a conversation's history in from
RAM: the slot's other conversation is overwritten. Pinning onto a slot that unified KV cleared
skips the RAM cache altogether. With ``--slot-prompt-similarity 0`` an unpinned request always
takes the LRU path, which saves the slot it takes and restores the right conversation.

Tokens: ``llamacpp_tokens`` (prompt states, and how many tokens a match between two is).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter

from proxy.backends.llamacpp_tokens import CachedPrompt, PromptQuery, TokenCounter
from proxy.fingerprint import common_blocks
from proxy.values import value

SAVE_F_KEEP = 0.5  # get_available_slot: save and look for a better prompt below this f_keep
LOAD_MIN_F_KEEP = 0.25  # server_prompt_cache::load: entries kept less than this are not taken
DEFAULT_SIMILARITY = 0.10  # --slot-prompt-similarity

SOURCE_SLOT = "slot"
SOURCE_RAM = "ram"
SOURCE_NONE = "none"
SOURCES = (SOURCE_SLOT, SOURCE_RAM, SOURCE_NONE)


@dataclass(frozen=True, slots=True)
class ServerRules:
    """The llama-server flags that decide its cache behaviour, as the proxy believes them."""

    similarity: float = DEFAULT_SIMILARITY
    """``--slot-prompt-similarity`` (0 disables the similarity choice)."""
    cache_ram: bool = True
    """``--cache-ram`` is not 0 (the default is 8192 MiB)."""
    idle_slots: bool = True
    """``--cache-idle-slots`` (default on; needs the RAM cache)."""
    unified: bool = False
    """``--kv-unified``: idle slots are cleared when a task starts (with ``idle_slots``)."""
    ram_tokens: float = math.inf
    """The RAM cache's size in tokens; infinite until an eviction is observed."""


@dataclass(slots=True)
class SlotView:
    """What the model needs of one slot."""

    state: CachedPrompt | None
    busy: bool
    last_used: float


@value
class Pick:
    """What the server does with a request: the slot it takes and where its cache comes from."""

    slot: int | None
    """None: no idle slot, the server defers the request until one frees."""
    update: bool = False
    """The slot is saved to the RAM cache and the best cached prompt looked up (rule 4)."""
    loaded: CachedPrompt | None = None
    """The RAM entry loaded into the slot (rule 5)."""
    cached_tokens: float = 0.0
    source: str = SOURCE_NONE
    matched: CachedPrompt | None = None
    """The state the request's cached tokens come from."""


_TOKENS = attrgetter("tokens")

MAX_RAM_ENTRIES = 64  # the model scans them for every idle slot on every placement
SHORT_BLOCKS = 4
"""An entry of fewer blocks may be kept a quarter by a prompt it parts from in the first block."""


def contains(outer: CachedPrompt, inner: CachedPrompt) -> bool:
    """``outer`` holds the whole of ``inner``: every segment of ``inner`` leads ``outer`` (the
    partial last block included), or, without segments, all of its blocks and not fewer tokens.
    A prompt shorter than one block is never taken as held on its hashes alone."""
    if outer.hashes and inner.hashes and outer.hashes[0] != inner.hashes[0]:
        return False  # they part in the first block
    ofp, ifp = outer.fp, inner.fp
    if ofp is not None and ifp is not None and ifp.segment_hashes:
        n = len(ifp.segment_hashes)
        return (
            len(ofp.segment_hashes) >= n
            and ofp.segment_hashes[n - 1] == ifp.segment_hashes[-1]
            and outer.tokens >= inner.tokens
        )
    n = len(inner.hashes)
    return (
        bool(n)
        and common_blocks(inner.hashes, outer.hashes) == n
        and (outer.tokens >= inner.tokens)
    )


class RamCache:
    """The server's host-RAM prompt cache: entries oldest first (rules 5 and 6)."""

    def __init__(self, rules: ServerRules) -> None:
        self.entries: list[CachedPrompt] = []
        """Oldest first. Read freely; changed only by ``save``, ``trim`` and ``take``, which
        keep the counts below true."""
        self.rules = rules
        self._starts: dict[int, int] = {}
        """Entries by their first block hash: how many start with it."""
        self._short = 0
        """Entries of fewer than ``SHORT_BLOCKS`` blocks (none included)."""
        self._bare = 0
        """Entries without blocks."""

    def _counted(self, state: CachedPrompt, step: int) -> None:
        hashes = state.hashes
        if not hashes:
            self._bare += step
        else:
            first = hashes[0]
            left = self._starts.get(first, 0) + step
            if left:
                self._starts[first] = left
            else:
                del self._starts[first]
        if len(hashes) < SHORT_BLOCKS:
            self._short += step

    def take(self, state: CachedPrompt) -> None:
        """``state`` leaves the cache (loaded into a slot: rule 5), if it is there."""
        if state in self.entries:
            self.entries.remove(state)
            self._counted(state, -1)

    def tokens(self) -> float:
        """What the entries hold (``CachedPrompt.tokens`` summed, without a generator's frame:
        ``trim`` asks at every save once the cache's size is known)."""
        total: float = sum(map(_TOKENS, self.entries))
        return total

    def holds(self, state: CachedPrompt) -> bool:
        """An entry holds all of ``state`` (its prompt is a prefix of the entry's)."""
        entries = self.entries
        if state in entries:  # the same state saved again (an idle slot, at every launch)
            return True  # (states compare by identity: a scan in C)
        return any(contains(e, state) for e in self._same_start(state))

    def _same_start(self, state: CachedPrompt) -> list[CachedPrompt]:
        """The entries that may hold, or be held by, ``state``: a state whose blocks start
        otherwise holds no other whole (``contains``' first test), so only these are compared."""
        if not state.hashes:
            return self.entries
        first = state.hashes[0]
        if not self._bare and first not in self._starts:
            return []  # (counted: no scan for the prompt no entry starts like)
        return [e for e in self.entries if not e.hashes or e.hashes[0] == first]

    def save(self, state: CachedPrompt | None) -> None:
        """``alloc``: skip a state already held; drop what it holds whole; evict oldest."""
        if state is None or not self.rules.cache_ram or state in self.entries:
            return
        near = self._same_start(state)
        if any(contains(e, state) for e in near):
            return
        held = [e for e in near if contains(state, e)]
        if held:
            self.entries = [e for e in self.entries if e not in held]
            for e in held:
                self._counted(e, -1)
        self.entries.append(state)
        self._counted(state, +1)
        self.trim()

    def trim(self) -> None:
        """Oldest out past the size limit, and past ``MAX_RAM_ENTRIES`` (the model's own bound:
        each entry keeps a fingerprint, and every placement scans them)."""
        while len(self.entries) > MAX_RAM_ENTRIES:
            self._counted(self.entries.pop(0), -1)
        limit = self.rules.ram_tokens
        if math.isinf(limit):
            return
        total = self.tokens()
        while self.entries and total > limit:
            oldest = self.entries.pop(0)
            self._counted(oldest, -1)
            total -= oldest.tokens

    def best(
        self, current: CachedPrompt | None, query: PromptQuery, counter: TokenCounter
    ) -> CachedPrompt | None:
        """``load``: the entry to move into a slot holding ``current``, if any beats it."""
        first = query.hashes[0] if query.hashes else None
        if first is not None and not self._short and first not in self._starts:
            return None  # every entry would be skipped below (counted, not scanned)
        base = counter.lcp(current, query)
        keep_best = base / current.tokens if current is not None and current.tokens else -1.0
        sim_best = base / max(query.prompt_tokens, 1.0)
        chosen = None
        for entry in self.entries:
            if first is not None and len(entry.hashes) >= SHORT_BLOCKS and entry.hashes[0] != first:
                continue  # shares under one block of four or more: kept below a quarter
            lcp = counter.lcp(entry, query)
            keep = lcp / max(entry.tokens, 1.0)
            sim = lcp / max(query.prompt_tokens, 1.0)
            if keep < LOAD_MIN_F_KEEP:
                continue
            if keep_best < keep and sim_best < sim:
                keep_best, sim_best, chosen = keep, sim, entry
        return chosen


def pick(
    slots: Sequence[SlotView],
    ram: RamCache,
    query: PromptQuery,
    counter: TokenCounter,
    *,
    pinned: int | None,
    rules: ServerRules,
    idle: int | None = None,
) -> Pick:
    """What ``get_available_slot`` does with ``query`` (rules 1-5, 8), without changing anything.

    ``idle`` (unpinned only): the one slot the server finds idle, whatever the views say of the
    others (a request that waited for any slot gets the slot that freed)."""
    chosen: int | None = None
    update = False
    threshold = rules.similarity
    if pinned is not None:
        chosen = pinned % len(slots)
        view = slots[chosen]
        if threshold != 0.0:
            best = 0.0
            if not view.busy and view.state is not None:
                sim = counter.lcp(view.state, query) / max(query.prompt_tokens, 1.0)
                if sim > threshold:
                    best = sim
            if view.state is not None and view.state.tokens > 0:
                update = best * query.prompt_tokens / view.state.tokens < SAVE_F_KEEP
            # else: 0 / 0 is NaN, never below the bar: an empty pinned slot never updates
    else:
        order = range(len(slots)) if idle is None else (idle,)
        if threshold != 0.0:
            best = 0.0
            for i in order:
                view = slots[i]
                if view.busy or view.state is None:
                    continue
                sim = counter.lcp(view.state, query) / max(query.prompt_tokens, 1.0)
                if sim > best and sim > threshold:
                    best, chosen = sim, i
            if chosen is not None:
                state = slots[chosen].state
                assert state is not None
                update = best * query.prompt_tokens / max(state.tokens, 1.0) < SAVE_F_KEEP
        if chosen is None:
            t_last = -math.inf
            for i in order:
                view = slots[i]
                if view.busy:
                    continue
                if chosen is None or view.last_used <= t_last:
                    t_last, chosen = view.last_used, i
            update = chosen is not None
    if chosen is None:
        return Pick(slot=None)
    update = update and rules.cache_ram
    current = slots[chosen].state
    loaded = ram.best(current, query, counter) if update else None
    held = loaded if loaded is not None else current
    cached = counter.cached(held, query)
    if cached <= 0.0:
        return Pick(slot=chosen, update=update, loaded=loaded)
    source = SOURCE_RAM if loaded is not None else SOURCE_SLOT
    return Pick(chosen, update, loaded, cached, source, held)


def launch(
    slots: Sequence[SlotView], ram: RamCache, chosen: Pick, *, rules: ServerRules
) -> CachedPrompt | None:
    """Apply a launch to the model (rules 4-7); returns what the chosen slot holds after it.

    The caller marks the chosen slot busy with the new request; every other idle slot is saved
    to the RAM cache, and cleared under unified KV.
    """
    assert chosen.slot is not None
    slot = slots[chosen.slot]
    held = slot.state
    if chosen.update:
        ram.save(held)
        if chosen.loaded is not None:
            ram.take(chosen.loaded)
            held = chosen.loaded
    if rules.idle_slots and rules.cache_ram:
        for i, view in enumerate(slots):
            if i == chosen.slot or view.busy or view.state is None:
                continue
            ram.save(view.state)
            if rules.unified:
                view.state = None
    return held


def restorable(
    evicted: CachedPrompt,
    replacing: CachedPrompt,
    ram: RamCache,
    counter: TokenCounter,
    *,
    rules: ServerRules,
    saved_now: bool = False,
    shared: float | None = None,
) -> bool:
    """Whether ``evicted``'s next turn can come back from the RAM cache once ``replacing`` has
    taken its slot: it must be in the cache (or be saved by this launch: ``saved_now``), and the
    server must look there: always on the LRU path (similarity 0), else only when the slot
    holding ``replacing`` would keep less than half its tokens or fall below the similarity
    threshold (rule 4). ``shared``: ``counter.cached(replacing, probe_of(evicted))``, when the
    caller has it already."""
    if not rules.cache_ram or not (saved_now or ram.holds(evicted)):
        return False
    if rules.similarity == 0.0:
        return True
    if shared is None:
        shared = counter.cached(replacing, probe_of(evicted))
    return shared / max(replacing.tokens, 1.0) < SAVE_F_KEEP or (
        shared / max(evicted.tokens, 1.0) <= rules.similarity
    )


def probe_of(state: CachedPrompt) -> PromptQuery:
    """A query standing for ``state``'s next turn (it continues the state)."""
    per_block = state.prompt_tokens / max(len(state.hashes), 1)
    return PromptQuery(state.hashes, max(state.tokens, 1.0), per_block, state.fp)


def states(views: Iterable[SlotView]) -> list[CachedPrompt]:
    """The states the slots hold."""
    return [v.state for v in views if v.state is not None]
