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

Tokens. The proxy has no tokenizer on the request path. The model works on the request's
fingerprint (chained block hashes and cumulative per-segment hashes) and counts tokens with the
backend's own numbers once a response reports them: a prompt that *continues* a cached state
(every segment of the state is a leading segment of the prompt) shares exactly that state's
measured prompt tokens plus the share of its generated tokens that the next turn repeats
(``answer_reuse``, learned); any other match ends at a segment or block boundary, whose token
count is learned from the backend's measured ``cached_tokens`` the first time a request ends its
match there (``BoundaryTokens``), and estimated from the byte count until then. A match that runs
on inside a segment parts somewhere in the block after the last one both share. When that block
is among the state's last ~1 KB (``Fingerprint.tail``, where a next turn most often parts: a
grown or edited last message) the request's own bytes give the exact byte; otherwise the block's
middle is taken. Such a match is then counted back from the state's measured end when less of
the state is left than shared: its measured tokens, less the text after the match, less the
template's close of turn (``closing``, learned: 5 tokens in ChatML).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from proxy.fingerprint import SEGMENT_END, Fingerprint, common_blocks

_END_LEN = len(SEGMENT_END)
MAX_CLOSING = 16.0  # tokens: a chat template's close of turn and generation prompt, at most
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


@dataclass(slots=True, eq=False)
class CachedPrompt:
    """One prompt state the server holds, in a slot or in its RAM cache."""

    hashes: tuple[int, ...]
    prompt_tokens: float
    """The prompt's tokens: estimated from its bytes, then the backend's ``prompt_tokens``."""
    fp: Fingerprint | None = None
    generated: float = 0.0
    """Tokens generated after the prompt (the backend's ``completion_tokens``) that the KV keeps."""
    measured: bool = False
    t_used: float = 0.0
    gap_s: float | None = None
    """Seconds between the state this one continued and this one's request (a conversation's
    pace); None when it continued nothing seen."""
    continued: bool = False
    """A later request continued it (it is a turn of a conversation)."""

    @property
    def tokens(self) -> float:
        """What the KV holds: the prompt and the generated tokens but the last sampled one."""
        return self.prompt_tokens + max(self.generated - 1.0, 0.0)

    def measure(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        """The backend's figures for the request that left this state."""
        if prompt_tokens:
            self.prompt_tokens = float(prompt_tokens)
            self.measured = True
        if completion_tokens is not None:
            self.generated = float(completion_tokens)


@dataclass(frozen=True, slots=True)
class PromptQuery:
    """The request being placed, as the model needs it."""

    hashes: tuple[int, ...]
    prompt_tokens: float
    tokens_per_block: float
    fp: Fingerprint | None = None
    data: bytes = field(default=b"", repr=False)
    """The bytes ``fp`` hashed, while the request is being placed (empty otherwise): where it
    parts from a state inside the state's trailing partial block is then found to the byte."""


@dataclass(frozen=True, slots=True)
class Shared:
    """How much of a request a cached state holds, and where the match ends."""

    tokens: float
    key: int | None = None
    """The boundary the match ends at (``BoundaryTokens``), None when not a learnable one."""
    continues: bool = False
    """The request continues the whole state (a conversation's next turn)."""
    past_key: float = 0.0
    """Estimated tokens between ``key``'s boundary and where the match ends (a match running on
    inside a segment): what is learned for ``key`` is the measured count less this."""
    unshared: float | None = None
    """Estimated tokens of the state's text after the match (counted back from the state's
    measured end); None when the count was not taken that way."""
    exact: bool = False
    """Where the match ends was found to the byte (``_parting``): only such a match teaches the
    template's close of turn (``TokenCounter.closing``)."""


class BoundaryTokens:
    """Token counts of prompt prefixes that end at a known boundary, learned from the backend.

    A match between a request and a cached state ends at the last block, or segment, the two
    agree on; the hash there names the shared prefix exactly. The first time a request's match
    ends at a boundary, the backend's ``cached_tokens`` say how many tokens that prefix is; later
    requests ending their match there get that count instead of a byte estimate. Bounded, oldest
    out.
    """

    def __init__(self, *, max_entries: int = 4096) -> None:
        self._tokens: OrderedDict[int, float] = OrderedDict()
        self._max = max_entries

    def get(self, key: int | None) -> float | None:
        if key is None:
            return None
        value = self._tokens.get(key)
        if value is not None:
            self._tokens.move_to_end(key)
        return value

    def learn(self, key: int, tokens: float) -> None:
        self._tokens[key] = tokens
        self._tokens.move_to_end(key)
        while len(self._tokens) > self._max:
            self._tokens.popitem(last=False)

    def __len__(self) -> int:
        return len(self._tokens)


def _parting(sfp: Fingerprint, qfp: Fingerprint, data: bytes, blocks: int) -> int | None:
    """The byte offset where a request parts from a state, when that lies in the bytes the
    state's fingerprint keeps (``Fingerprint.tail``: its last ~1 KB) and the request's bytes
    are at hand; None otherwise. ``blocks``: the full blocks the two share."""
    tail = sfp.tail
    start = blocks * sfp.block_bytes
    tail_start = sfp.total_bytes - len(tail)
    if not tail or not data or start < tail_start or sfp.block_bytes != qfp.block_bytes:
        return None
    theirs = tail[start - tail_start :]
    ours = data[start : start + len(theirs)]
    lo, hi = 0, len(ours)
    if ours == theirs[:hi]:
        return start + hi
    while lo < hi:  # the longest common prefix of two short byte strings, by bisection
        mid = (lo + hi + 1) // 2
        if ours[:mid] == theirs[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return start + lo


def _common_segments(a: Fingerprint, b: Fingerprint) -> int:
    """Leading segments two fingerprints agree on (cumulative hashes chain like blocks)."""
    return common_blocks(a.segment_hashes, b.segment_hashes)


@dataclass(slots=True)
class TokenCounter:
    """Turns a match between a cached state and a request into tokens (see the module text)."""

    boundaries: BoundaryTokens = field(default_factory=BoundaryTokens)
    answer_reuse: float = 1.0
    """Share of a state's generated tokens the next turn repeats verbatim (1: a chat sending the
    answer back; near 0: scripted histories). Learned from continuations."""
    closing: float | None = None
    """Tokens a prompt ends with after its last message's text (the chat template's end of turn
    and generation prompt: 5 in ChatML). Learned from matches counted back from a state's end."""
    _scope: PromptQuery | None = None
    _memo: dict[int, Shared] = field(default_factory=dict)

    @contextmanager
    def scope(self, query: PromptQuery) -> Iterator[None]:
        """Within it, ``shared(state, query)`` is computed once per state: one placement asks
        it of the same states for every slot (the RAM cache's entries above all), and nothing
        the answer depends on changes meanwhile."""
        self._scope, self._memo = query, {}
        try:
            yield
        finally:
            self._scope, self._memo = None, {}

    def shared(self, state: CachedPrompt, query: PromptQuery) -> Shared:
        """Tokens of ``query`` that ``state`` holds (before the one-token cap)."""
        if query is self._scope:
            known = self._memo.get(id(state))
            if known is None:
                known = self._memo[id(state)] = self._shared(state, query)
            return known
        return self._shared(state, query)

    def _shared(self, state: CachedPrompt, query: PromptQuery) -> Shared:
        sfp, qfp = state.fp, query.fp
        if sfp is not None and qfp is not None and sfp.segment_hashes and qfp.segment_hashes:
            n = len(sfp.segment_hashes)
            if len(qfp.segment_hashes) > n and qfp.segment_hashes[n - 1] == sfp.segment_hashes[-1]:
                answer = self.answer_reuse * max(state.generated - 1.0, 0.0)
                return Shared(state.prompt_tokens + answer, continues=True)
            segs = _common_segments(sfp, qfp)
            if segs == len(qfp.segment_hashes):  # the request is all in the state
                return Shared(query.prompt_tokens)
            blocks = common_blocks(query.hashes, state.hashes)
            seg_end = qfp.segments[segs].start if segs else 0
            block_end = blocks * qfp.block_bytes
            density = query.prompt_tokens / max(qfp.total_bytes, 1)
            if state.measured and sfp.total_bytes:
                density = state.prompt_tokens / sfp.total_bytes
            # Compared to the byte only within one chain (same model and tenant salt: the model
            # segment agrees), so one tenant's bytes never predict another's.
            parts = _parting(sfp, qfp, query.data, blocks) if segs else None
            exact = parts is not None and parts > seg_end
            key: int | None
            if parts is not None and exact:  # found to the byte, inside a segment
                key = qfp.segment_hashes[segs - 1]
                boundary, shared_bytes = float(seg_end), float(parts)
            elif parts is None and block_end > seg_end + qfp.block_bytes:
                # The match runs on inside a segment and parts somewhere in the next block (or
                # the shorter one's tail): take its middle, which halves the expected error of
                # stopping at the block's start.
                key = query.hashes[blocks - 1]
                room = min(
                    qfp.block_bytes, qfp.total_bytes - block_end, sfp.total_bytes - block_end
                )
                boundary, shared_bytes = float(block_end), block_end + max(room, 0) / 2.0
            else:
                key = qfp.segment_hashes[segs - 1] if segs else None
                boundary = shared_bytes = float(max(seg_end, block_end))
            # Two ways to count what lies past the last boundary both share: forward from the
            # boundary's learned count, or back from the state's measured end (its text after
            # the match, then the template's close of turn). The one estimating fewer bytes is
            # taken.
            past = (shared_bytes - boundary) * density
            learned = self.boundaries.get(key)
            left = max(sfp.total_bytes - _END_LEN - shared_bytes, 0.0)
            back = state.measured and shared_bytes > seg_end and left < shared_bytes
            unshared = left * density if back else None
            if learned is not None and not (
                back and self.closing is not None and left < shared_bytes - boundary
            ):
                return Shared(learned + past, key, past_key=past, unshared=unshared, exact=exact)
            if unshared is not None and self.closing is not None:
                tokens = max(state.prompt_tokens - self.closing - unshared, 0.0)
                return Shared(tokens, key, past_key=past, unshared=unshared, exact=exact)
            return Shared(
                shared_bytes * density, key, past_key=past, unshared=unshared, exact=exact
            )
        blocks = common_blocks(query.hashes, state.hashes)
        if blocks and blocks == len(state.hashes) < len(query.hashes):
            answer = self.answer_reuse * max(state.generated - 1.0, 0.0)
            return Shared(state.prompt_tokens + answer, continues=True)
        key = query.hashes[blocks - 1] if blocks else None
        learned = self.boundaries.get(key)
        if learned is not None:
            return Shared(learned, key=key)
        return Shared(blocks * query.tokens_per_block, key=key)

    def lcp(self, state: CachedPrompt | None, query: PromptQuery) -> float:
        """The longest common prefix, in tokens, as the server's rules compare it (uncapped)."""
        if state is None:
            return 0.0
        return max(min(self.shared(state, query).tokens, state.tokens, query.prompt_tokens), 0.0)

    def cached(self, state: CachedPrompt | None, query: PromptQuery) -> float:
        """Tokens the server reuses for ``query`` from ``state`` (rule 8's cap included)."""
        return max(min(self.lcp(state, query), query.prompt_tokens - 1.0), 0.0)

    def learn(self, shared: Shared, state: CachedPrompt, measured: float, prompt: float) -> None:
        """Fold one measured ``cached_tokens`` in, for a request the model matched with ``state``.

        Only matches the backend did not cap (cached below ``prompt - 1``) say where they end.
        """
        if measured >= prompt - 1.0:
            return
        if shared.continues:
            extra = max(state.generated - 1.0, 0.0)
            if extra >= 1.0:
                seen = min(max((measured - state.prompt_tokens) / extra, 0.0), 1.0)
                self.answer_reuse += 0.3 * (seen - self.answer_reuse)
            return
        if shared.exact and shared.unshared is not None and state.measured and measured > 0:
            seen = min(max(state.prompt_tokens - measured - shared.unshared, 0.0), MAX_CLOSING)
            self.closing = seen if self.closing is None else self.closing + 0.5 * (
                seen - self.closing
            )
        if shared.key is not None and measured > 0:
            self.boundaries.learn(shared.key, max(measured - shared.past_key, 1.0))


@dataclass(slots=True)
class SlotView:
    """What the model needs of one slot."""

    state: CachedPrompt | None
    busy: bool
    last_used: float


@dataclass(frozen=True, slots=True)
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


MAX_RAM_ENTRIES = 64  # the model scans them for every idle slot on every placement


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
        self.rules = rules

    def tokens(self) -> float:
        return sum(e.tokens for e in self.entries)

    def holds(self, state: CachedPrompt) -> bool:
        """An entry holds all of ``state`` (its prompt is a prefix of the entry's)."""
        entries = self.entries
        for e in entries:  # the same state saved again (an idle slot, at every launch): cheap
            if e is state:
                return True
        return any(contains(e, state) for e in entries)

    def save(self, state: CachedPrompt | None) -> None:
        """``alloc``: skip a state already held; drop what it holds whole; evict oldest."""
        if state is None or not self.rules.cache_ram or self.holds(state):
            return
        self.entries = [e for e in self.entries if not contains(state, e)]
        self.entries.append(state)
        self.trim()

    def trim(self) -> None:
        """Oldest out past the size limit, and past ``MAX_RAM_ENTRIES`` (the model's own bound:
        each entry keeps a fingerprint, and every placement scans them)."""
        while len(self.entries) > MAX_RAM_ENTRIES:
            self.entries.pop(0)
        limit = self.rules.ram_tokens
        if math.isinf(limit):
            return
        total = self.tokens()
        while self.entries and total > limit:
            total -= self.entries.pop(0).tokens

    def best(
        self, current: CachedPrompt | None, query: PromptQuery, counter: TokenCounter
    ) -> CachedPrompt | None:
        """``load``: the entry to move into a slot holding ``current``, if any beats it."""
        base = counter.lcp(current, query)
        keep_best = base / current.tokens if current is not None and current.tokens else -1.0
        sim_best = base / max(query.prompt_tokens, 1.0)
        chosen = None
        first = query.hashes[0] if query.hashes else None
        for entry in self.entries:
            if first is not None and len(entry.hashes) >= 4 and entry.hashes[0] != first:
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
) -> Pick:
    """What ``get_available_slot`` does with ``query`` (rules 1-5, 8), without changing anything."""
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
        if threshold != 0.0:
            best = 0.0
            for i, view in enumerate(slots):
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
            for i, view in enumerate(slots):
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
            if chosen.loaded in ram.entries:
                ram.entries.remove(chosen.loaded)
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
) -> bool:
    """Whether ``evicted``'s next turn can come back from the RAM cache once ``replacing`` has
    taken its slot: it must be in the cache (or be saved by this launch: ``saved_now``), and the
    server must look there: always on the LRU path (similarity 0), else only when the slot
    holding ``replacing`` would keep less than half its tokens or fall below the similarity
    threshold (rule 4)."""
    if not rules.cache_ram or not (saved_now or ram.holds(evicted)):
        return False
    if rules.similarity == 0.0:
        return True
    probe = probe_of(evicted)
    shared = counter.cached(replacing, probe)
    return shared / max(replacing.tokens, 1.0) < SAVE_F_KEEP or (
        shared / probe.prompt_tokens <= rules.similarity
    )


def probe_of(state: CachedPrompt) -> PromptQuery:
    """A query standing for ``state``'s next turn (it continues the state)."""
    per_block = state.prompt_tokens / max(len(state.hashes), 1)
    return PromptQuery(state.hashes, max(state.tokens, 1.0), per_block, state.fp)


def states(views: Iterable[SlotView]) -> list[CachedPrompt]:
    """The states the slots hold."""
    return [v.state for v in views if v.state is not None]
