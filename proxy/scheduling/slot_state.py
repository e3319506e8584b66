"""What the slot table keeps and answers: a request, a task on a slot, a slot, the choice made
for a request, the prefills running on a replica, and how likely an application's prompts are
to be continued, and the recent prompts by which a next turn is recognised.
``proxy.scheduling.slots`` weighs these to place a request."""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from proxy.backends.slot_cache import (
    CachedPrompt,
    Pick,
    PromptQuery,
    Shared,
)
from proxy.fingerprint import Fingerprint
from proxy.scheduling.rates import Rates
from proxy.values import value

SLOT_HIT = "slot_hit"
SLOT_QUEUE = "slot_queue"
SLOT_PLACE = "slot_place"
SLOT_PARALLEL = "slot_parallel"
SLOT_BUSY = "slot_busy"
SLOT_CLIENT = "slot_client"
SLOT_FOREIGN = "slot_foreign"
SLOT_FANOUT = "slot_fanout"
SLOT_COPY = "slot_copy"  # the slot taken was first seeded with a copy of an idle slot's prefix
SLOT_RAM = "slot_ram"
SLOT_SERVER = "slot_server"
SLOT_UNPINNED = "slot_unpinned"  # a control-group request: the server chooses, the table follows
SLOT_REASONS = (
    SLOT_RAM,
    SLOT_SERVER,
    SLOT_HIT,
    SLOT_QUEUE,
    SLOT_PLACE,
    SLOT_PARALLEL,
    SLOT_BUSY,
    SLOT_CLIENT,
    SLOT_FOREIGN,
    SLOT_FANOUT,
    SLOT_COPY,
    SLOT_UNPINNED,
)

FOREIGN_GRACE_S = 1.0  # a slot seen busy this soon after our request on it ended is still ours
RETURNS = 8.0  # later turns a conversation's lost history is expected to be recomputed on
RECENT_STATES = 64  # prompts remembered to recognise a next turn, cached on the server or not


class Continuations:
    """How often a prompt of each application (fingerprint anchor) is continued by a next turn.

    Counted from the proxy's own traffic: every prompt sent is one seen, every request that
    continues an earlier prompt counts one continued for that prompt's application. The rate is
    ``(continued + 1) / (seen + 2)`` (1/2 with nothing seen), over counts that decay so it follows
    a change of traffic; bounded in the applications it keeps.
    """

    DECAY = 0.98

    def __init__(self, *, max_anchors: int = 1024) -> None:
        self._counts: dict[int, list[float]] = {}
        self._max = max_anchors

    @staticmethod
    def _anchor(state: CachedPrompt) -> int:
        return state.fp.anchor if state.fp is not None else 0

    def rate(self, state: CachedPrompt) -> float:
        return self.rate_of(self._anchor(state))

    def rate_of(self, anchor: int) -> float:
        """The rate of the application ``anchor`` names (``rate`` of any of its prompts)."""
        seen, continued = self._counts.get(anchor, (0.0, 0.0))
        return (continued + 1.0) / (seen + 2.0)

    def observe(self, state: CachedPrompt, *, continued: bool) -> None:
        counts = self._counts.setdefault(self._anchor(state), [0.0, 0.0])
        if continued:
            counts[1] = min(counts[1] + 1.0, counts[0])
        else:
            counts[0] = counts[0] * self.DECAY + 1.0
            counts[1] *= self.DECAY
        if len(self._counts) > self._max:
            self._counts.pop(next(iter(self._counts)))


@dataclass(slots=True, eq=False)
class SlotRequest:
    """What the table needs to know of a request to place it (not a ``value``: it keeps the
    query it is asked as, built at the first ask)."""

    hashes: tuple[int, ...]
    prompt_tokens: float
    decode_tokens: float
    tokens_per_block: float
    fp: Fingerprint | None = None
    """The request's fingerprint (segment hashes: a conversation's next turn is recognised)."""
    data: bytes = field(default=b"", repr=False)
    """The bytes ``fp`` hashed (``PromptQuery.data``)."""
    _query: PromptQuery | None = field(default=None, init=False, repr=False)

    def query(self) -> PromptQuery:
        """The request as the cache model asks of it: one object per request, so that a match
        computed for it once (``TokenCounter.scope``) serves every later question alike."""
        query = self._query
        if query is None:
            query = self._query = PromptQuery(
                self.hashes, self.prompt_tokens, self.tokens_per_block, self.fp, self.data
            )
        return query


@dataclass(slots=True, eq=False)
class SlotTask:
    """One request this proxy sent to the replica."""

    hashes: tuple[int, ...]
    prompt_tokens: float
    uncached_tokens: float
    decode_tokens: float
    t_sent: float
    slot: int | None = None
    t_start: float | None = None
    """When the backend began it (it became the first on its slot)."""
    t_first_token: float | None = None
    state: CachedPrompt | None = None
    """The prompt state the request leaves in its slot (measured once its answer reports)."""
    query: PromptQuery | None = None
    pick: Pick | None = None
    """What the server was expected to do with it when it started (the cache model's view)."""
    shared: Shared | None = None
    """How its cached tokens were expected to come about (for learning from the answer)."""
    pinned: bool = True
    """Sent with ``id_slot`` (False: the server chose, or will choose, its slot)."""


@dataclass(slots=True)
class Slot:
    """One slot: what it holds, what is queued on it."""

    id: int
    state: CachedPrompt | None = None
    """The prompt state the slot holds (None: empty, or nothing known)."""
    tasks: list[SlotTask] = field(default_factory=list)
    last_used: float = 0.0
    last_end: float = -1e9
    foreign_until: float = 0.0
    """Busy with a request that did not come through this proxy, until about then."""
    last_id_task: int | None = None
    touched: bool = False
    """This proxy sent a request to it, or one of its requests there ended, since the last look."""

    @property
    def content(self) -> tuple[int, ...]:
        """Block hashes of the prompt the slot holds (empty: nothing known)."""
        return self.state.hashes if self.state is not None else ()

    def holds_after_queue(self) -> tuple[int, ...]:
        """The prompt the slot will hold once everything queued on it has run."""
        return self.tasks[-1].hashes if self.tasks else self.content

    def state_after_queue(self) -> CachedPrompt | None:
        """The state the slot will hold once everything queued on it has run."""
        if self.tasks:
            return self.tasks[-1].state
        return self.state

    def idle(self, now: float) -> bool:
        return not self.tasks and self.foreign_until <= now


def least_recently_used(slots: Iterable[Slot]) -> Slot | None:
    """The least recently used of ``slots`` (taken in id order: of equal ``last_used``, the
    lowest id), or None for none; a plain loop, no key function called per slot."""
    chosen: Slot | None = None
    for slot in slots:
        if chosen is None or slot.last_used < chosen.last_used:
            chosen = slot
    return chosen


@value
class SlotChoice:
    """Where a request goes: a slot (pinned) or None (the server chooses)."""

    slot: int | None
    reason: str
    matched_tokens: float
    uncached_tokens: float
    expected_end_s: float | None
    """Expected seconds from now until the request ends; None when not estimated (every slot
    busy and none holding the prefix: the server picks, and no other choice is weighed)."""
    pinned: bool = True
    """False: ``slot`` is where the server is expected to put it unpinned (``slot_server``)."""
    pick: Pick | None = None
    """The cache model's expectation for an idle slot (what a launch there does)."""


def _remaining(task: SlotTask, now: float, rates: Rates, sharers: int) -> tuple[float, float]:
    """(prompt tokens still to prefill, output tokens still to come) of a running task."""
    p, t = rates.prefill_s, rates.tpot_s
    if task.t_first_token is not None:
        decoded = (now - task.t_first_token) / t
        return 0.0, max(task.decode_tokens - decoded, 1.0)
    start = task.t_start if task.t_start is not None else task.t_sent
    rem = task.uncached_tokens - (now - start) / p / max(sharers, 1)
    if rem > 0:
        return rem, task.decode_tokens
    # Past its expected prefill with no first token seen (a non-streamed answer): decoding.
    over_s = -rem * p * max(sharers, 1)
    return 0.0, max(task.decode_tokens - over_s / t, 1.0)


class Prefills:
    """The prompt tokens left to prefill of every request prefilling now, for quick sums.

    ``shared(x)`` is the sum over them of ``min(left, x)`` (how much of ``x`` tokens of new
    prefill runs alongside them) and ``imposed(x)`` the same weighted by ``1 + queued behind``
    (how much the new prefill delays them and whoever waits for them): both by bisection over the
    requests sorted by tokens left, so weighing every slot stays linear in the number of slots.
    """

    __slots__ = ("_cum_left", "_cum_weight", "_cum_weighted", "_left")

    def __init__(self, entries: Iterable[tuple[float, int]]) -> None:
        ordered = sorted(entries)
        self._left = [left for left, _ in ordered]
        self._cum_left = [0.0]
        self._cum_weighted = [0.0]
        self._cum_weight = [0.0]
        for left, behind in ordered:
            self._cum_left.append(self._cum_left[-1] + left)
            self._cum_weighted.append(self._cum_weighted[-1] + left * (1 + behind))
            self._cum_weight.append(self._cum_weight[-1] + 1 + behind)

    def __len__(self) -> int:
        return len(self._left)

    def shared(self, x: float) -> float:
        k = bisect_right(self._left, x)
        return self._cum_left[k] + x * (len(self._left) - k)

    def imposed(self, x: float) -> float:
        k = bisect_right(self._left, x)
        return self._cum_weighted[k] + x * (self._cum_weight[-1] - self._cum_weight[k])


def _unindex(
    index: dict[tuple[int, int], list[tuple[int, CachedPrompt]]],
    lengths: Counter[int],
    key: tuple[int, int],
    seq: int,
) -> None:
    """Take remembered prompt ``seq`` out of ``index`` (under ``key``) and its length count."""
    bucket = index.get(key)
    if bucket is not None:
        if len(bucket) == 1 and bucket[0][0] == seq:  # the usual: a key of its own
            del index[key]
        else:
            bucket[:] = [item for item in bucket if item[0] != seq]
            if not bucket:
                del index[key]
    n = key[0]
    left = lengths[n] - 1
    if left > 0:
        lengths[n] = left
    else:
        del lengths[n]


class RecentPrompts:
    """The latest prompts sent (at most ``maxlen``), and which of them a new prompt continues.

    ``continued_by`` answers what scanning them newest first with ``TokenCounter.shared(...)
    .continues`` answers, with dictionary lookups instead of a comparison per prompt: a prompt
    continues a state when its hash at the state's last segment (or, without segments on both
    sides, its last block) is the state's own, so each state is indexed under that length and
    hash, and a query probes only the lengths the remembered states have.
    """

    def __init__(self, maxlen: int) -> None:
        self._maxlen = maxlen
        self._items: deque[tuple[int, CachedPrompt]] = deque()
        self._seq = 0
        self._by_segment: dict[tuple[int, int], list[tuple[int, CachedPrompt]]] = {}
        self._by_block: dict[tuple[int, int], list[tuple[int, CachedPrompt]]] = {}
        self._segment_lengths: Counter[int] = Counter()
        self._block_lengths: Counter[int] = Counter()
        self._anchors: Counter[int] = Counter()
        """The remembered states of each application (fingerprint anchor; 0 without one)."""

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[CachedPrompt]:
        return (state for _, state in self._items)

    def states(self) -> list[CachedPrompt]:
        """The remembered states, oldest first (a list: cheaper to walk than ``iter``)."""
        return [state for _, state in self._items]

    def applications(self) -> Iterable[tuple[int, int]]:
        """(anchor, remembered states of that application): a few, where the states are many."""
        return self._anchors.items()

    @staticmethod
    def _anchor(state: CachedPrompt) -> int:
        return state.fp.anchor if state.fp is not None else 0

    @staticmethod
    def _keys(state: CachedPrompt) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        fp = state.fp
        seg = (len(fp.segment_hashes), fp.segment_hashes[-1]) if fp and fp.segment_hashes else None
        block = (len(state.hashes), state.hashes[-1]) if state.hashes else None
        return seg, block

    def append(self, state: CachedPrompt) -> None:
        if len(self._items) >= self._maxlen:
            self._forget(*self._items.popleft())
        self._seq += 1
        item = (self._seq, state)
        self._items.append(item)
        self._anchors[self._anchor(state)] += 1
        seg, block = self._keys(state)
        if seg is not None:
            self._by_segment.setdefault(seg, []).append(item)
            self._segment_lengths[seg[0]] += 1
        if block is not None:
            self._by_block.setdefault(block, []).append(item)
            self._block_lengths[block[0]] += 1

    def _forget(self, seq: int, state: CachedPrompt) -> None:
        anchor = self._anchor(state)
        self._anchors[anchor] -= 1
        if self._anchors[anchor] <= 0:
            del self._anchors[anchor]
        seg, block = self._keys(state)
        if seg is not None:
            _unindex(self._by_segment, self._segment_lengths, seg, seq)
        if block is not None:
            _unindex(self._by_block, self._block_lengths, block, seq)

    def continued_by(
        self, query: PromptQuery, exclude: CachedPrompt | None = None
    ) -> CachedPrompt | None:
        """The newest remembered state ``query`` continues (``exclude`` aside), if any."""
        best: tuple[int, CachedPrompt] | None = None

        def consider(bucket: list[tuple[int, CachedPrompt]] | None, segmented: bool | None) -> None:
            nonlocal best
            for item in reversed(bucket or ()):  # newest first
                if best is not None and item[0] < best[0]:
                    return
                state = item[1]
                if state is exclude:
                    continue
                has_segments = state.fp is not None and bool(state.fp.segment_hashes)
                if segmented is None or has_segments == segmented:
                    best = item
                    return

        qfp = query.fp
        if qfp is not None and qfp.segment_hashes:
            hashes = qfp.segment_hashes
            for n in self._segment_lengths:
                if 0 < n < len(hashes):
                    consider(self._by_segment.get((n, hashes[n - 1])), True)
            segmented: bool | None = False  # states without segments compare by blocks
        else:
            segmented = None  # every state compares by blocks
        hashes = query.hashes
        for n in self._block_lengths:
            if 0 < n < len(hashes):
                consider(self._by_block.get((n, hashes[n - 1])), segmented)
        return best[1] if best is not None else None
