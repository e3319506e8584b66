"""The proxy's picture of one llama.cpp replica's slots, and where the next request should go.

llama-server keeps one prompt cache per slot: a request reuses only what *its* slot last held
(the longest common prefix of tokens). Left to itself the server puts a request on an idle slot
(the most similar one, else the least recently used), so requests that arrive together carrying
the same new prefix land on different slots and each prefills it. ``id_slot`` pins a request to a
slot; a request pinned to a busy slot is deferred by the server until that slot is free.

``SlotTable`` remembers, per slot, the block hashes of the prompt it holds and the requests this
proxy has sent to it (the running one first, the deferred ones behind it), and ``choose`` weighs
every slot for a new request by the time the request is expected to end there:

* an idle slot: the prefill of what the slot does not hold, shared with the prefills already
  running on the backend (its compute is shared: two prefills of x tokens take about 2x), plus
  the answer; the delay the extra prefill imposes on the requests already prefilling is added to
  its cost, since they pay it too;
* a busy slot, only when what it will hold by then shares a useful prefix with the request: the
  time until everything queued on it ends, plus the prefill of what the request does not share,
  plus the answer. Waiting is for reuse only; unrelated requests are never queued behind each
  other by the proxy, which would trade the server's parallel decoding for nothing.

The cheapest slot wins; ties go to the emptiest, then least recently used, slot (so a hot prefix
is the last to be overwritten). When every slot is busy and no slot's content makes waiting for
it worthwhile, the request goes unpinned, and the server gives it whichever slot frees first; the
table assumes the first slot of its own to free.

Times are ``time.perf_counter`` seconds; every estimate comes from ``Rates``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.fingerprint import common_blocks
from proxy.scheduling.rates import Rates

SLOT_HIT = "slot_hit"
SLOT_QUEUE = "slot_queue"
SLOT_PLACE = "slot_place"
SLOT_PARALLEL = "slot_parallel"
SLOT_BUSY = "slot_busy"
SLOT_CLIENT = "slot_client"
SLOT_FOREIGN = "slot_foreign"
SLOT_FANOUT = "slot_fanout"
SLOT_REASONS = (
    SLOT_HIT,
    SLOT_QUEUE,
    SLOT_PLACE,
    SLOT_PARALLEL,
    SLOT_BUSY,
    SLOT_CLIENT,
    SLOT_FOREIGN,
    SLOT_FANOUT,
)

FOREIGN_GRACE_S = 1.0  # a slot seen busy this soon after our request on it ended is still ours


@dataclass(frozen=True, slots=True)
class SlotRequest:
    """What the table needs to know of a request to place it."""

    hashes: tuple[int, ...]
    prompt_tokens: float
    decode_tokens: float
    tokens_per_block: float


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


@dataclass(slots=True)
class Slot:
    """One slot: what it holds, what is queued on it."""

    id: int
    content: tuple[int, ...] = ()
    """Block hashes of the prompt the slot last held (empty: nothing known)."""
    tasks: list[SlotTask] = field(default_factory=list)
    last_used: float = 0.0
    last_end: float = -1e9
    foreign_until: float = 0.0
    """Busy with a request that did not come through this proxy, until about then."""
    last_id_task: int | None = None
    touched: bool = False
    """This proxy sent a request to it, or one of its requests there ended, since the last look."""

    def holds_after_queue(self) -> tuple[int, ...]:
        """The prompt the slot will hold once everything queued on it has run."""
        return self.tasks[-1].hashes if self.tasks else self.content

    def idle(self, now: float) -> bool:
        return not self.tasks and self.foreign_until <= now


@dataclass(frozen=True, slots=True)
class SlotChoice:
    """Where a request goes: a slot (pinned) or None (the server chooses)."""

    slot: int | None
    reason: str
    matched_tokens: float
    uncached_tokens: float
    expected_end_s: float
    """Expected seconds from now until the request ends."""


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


class SlotTable:
    """One replica's slots as this proxy knows them."""

    def __init__(self, n_slots: int, ctx_per_slot: int | None = None) -> None:
        self.slots = [Slot(id=i) for i in range(n_slots)]
        self.ctx_per_slot = ctx_per_slot
        self.unplaced: list[SlotTask] = []
        """Requests sent unpinned that have not been seen on a slot yet."""
        self._unplaced_since_poll = 0

    # -- estimates -----------------------------------------------------------------------------

    def _prefilling(self, now: float, rates: Rates) -> Prefills:
        """Every request prefilling now: prompt tokens left, requests queued behind it."""
        heads = [s.tasks for s in self.slots if s.tasks and s.tasks[0].t_first_token is None]
        sharers = len(heads)
        out = []
        for tasks in heads:
            rem, _ = _remaining(tasks[0], now, rates, sharers)
            if rem > 0:
                out.append((rem, len(tasks) - 1))
        return Prefills(out)

    def free_at(
        self,
        slot: Slot,
        now: float,
        rates: Rates,
        prefilling: Prefills | None = None,
    ) -> float:
        """When everything queued on ``slot`` is expected to have ended.

        ``prefilling``: ``_prefilling(now, rates)`` when the caller already has it.
        """
        p, t = rates.prefill_s, rates.tpot_s
        end = now
        if slot.tasks:
            if prefilling is None:
                prefilling = self._prefilling(now, rates)
            rem, dec = _remaining(slot.tasks[0], now, rates, len(prefilling))
            if rem > 0:
                end += prefilling.shared(rem) * p
            end += dec * t
            for task in slot.tasks[1:]:
                end += task.uncached_tokens * p + task.decode_tokens * t
        return max(end, slot.foreign_until)

    def _first_free(self, now: float, rates: Rates, prefilling: Prefills | None = None) -> float:
        if prefilling is None:
            prefilling = self._prefilling(now, rates)
        return min((self.free_at(s, now, rates, prefilling) for s in self.slots), default=now)

    def matched_tokens(self, req: SlotRequest, content: Sequence[int]) -> float:
        """Prompt tokens of ``req`` a slot holding ``content`` would serve from its cache."""
        tokens = common_blocks(req.hashes, content) * req.tokens_per_block
        tokens = min(tokens, max(req.prompt_tokens - 1.0, 0.0))  # one token is always evaluated
        if self.ctx_per_slot:
            tokens = min(tokens, float(self.ctx_per_slot))
        return tokens

    # -- the decision --------------------------------------------------------------------------

    def choose(
        self, req: SlotRequest, rates: Rates, now: float, *, useful_tokens: float
    ) -> SlotChoice:
        """The slot ``req`` is expected to end soonest on (see the module docstring).

        ``useful_tokens``: a match shorter than this is not called a hit in the reason.
        """
        p, t = rates.prefill_s, rates.tpot_s
        prefilling = self._prefilling(now, rates)
        decode_s = req.decode_tokens * t
        best: tuple[tuple[float, ...], SlotChoice] | None = None
        holder_seen = False
        any_idle = False
        # What placing on an idle slot costs depends only on the tokens it leaves to prefill,
        # which few slots differ in: computed once per distinct value, not once per slot.
        idle_costs: dict[float, tuple[float, float]] = {}
        for slot in self.slots:
            matched = self.matched_tokens(req, slot.holds_after_queue())
            uncached = req.prompt_tokens - matched
            if slot.idle(now):
                any_idle = True
                known = idle_costs.get(uncached)
                if known is None:
                    shared, imposed = prefilling.shared(uncached), prefilling.imposed(uncached)
                    known = idle_costs[uncached] = (shared, imposed * p)
                end = now + (known[0] + uncached) * p + decode_s
                cost = end + known[1]
                reason = SLOT_HIT if matched >= useful_tokens else SLOT_PLACE
            elif matched >= useful_tokens:
                holder_seen = True
                end = self.free_at(slot, now, rates, prefilling) + uncached * p + decode_s
                cost = end
                reason = SLOT_QUEUE
            else:
                continue  # waiting is worth it only for a prefix; the server places the rest
            key = (cost, -matched, 1.0 if slot.content else 0.0, slot.last_used, float(slot.id))
            choice = SlotChoice(slot.id, reason, matched, uncached, end - now)
            if best is None or key < best[0]:
                best = (key, choice)
        if best is None:  # every slot busy, none holding the prefix: the server picks
            unpinned_end = self._first_free(now, rates, prefilling) + req.prompt_tokens * p
            unpinned_end += decode_s
            return SlotChoice(None, SLOT_BUSY, 0.0, req.prompt_tokens, unpinned_end - now)
        choice = best[1]
        if choice.reason == SLOT_PLACE and holder_seen:
            choice = SlotChoice(
                choice.slot,
                SLOT_PARALLEL,
                choice.matched_tokens,
                choice.uncached_tokens,
                choice.expected_end_s,
            )
        if choice.reason == SLOT_QUEUE and not any_idle:
            # Every slot is busy. Waiting for a particular one must beat taking the first to free.
            unpinned_end = self._first_free(now, rates, prefilling) + req.prompt_tokens * p
            unpinned_end += decode_s
            if unpinned_end <= now + choice.expected_end_s:
                return SlotChoice(None, SLOT_BUSY, 0.0, req.prompt_tokens, unpinned_end - now)
        return choice

    # -- bookkeeping ---------------------------------------------------------------------------

    def place(self, task: SlotTask, slot_id: int | None, now: float) -> None:
        """Record that ``task`` was sent to ``slot_id`` (None: unpinned)."""
        if slot_id is None or not self.slots:
            self.unplaced.append(task)
            self._unplaced_since_poll += 1
            return
        slot = self.slots[slot_id % len(self.slots)]
        task.slot = slot.id
        slot.tasks.append(task)
        slot.touched = True
        slot.last_used = now
        if len(slot.tasks) == 1:
            task.t_start = now

    def first_token(self, task: SlotTask, now: float, reported_slot: int | None = None) -> None:
        """The backend answered ``task``'s first token (and said which slot, if it did)."""
        if task.t_first_token is None:
            task.t_first_token = now
        if reported_slot is None or not self.slots or task.slot == reported_slot:
            return
        self._detach(task, now)
        slot = self.slots[reported_slot % len(self.slots)]
        task.slot = slot.id
        task.t_start = task.t_start if task.t_start is not None else task.t_sent
        slot.tasks.insert(0, task)
        slot.last_used = now

    def end(self, task: SlotTask, now: float, *, ok: bool) -> None:
        """``task`` ended (``ok``: it succeeded); its slot now holds its prompt."""
        if task.slot is None:
            if task in self.unplaced:
                self.unplaced.remove(task)
            return
        slot = self.slots[task.slot]
        was_head = bool(slot.tasks) and slot.tasks[0] is task
        if task not in slot.tasks:
            return
        started = was_head or task.t_first_token is not None
        self._detach(task, now)
        if started:
            if ok or task.t_first_token is not None:
                slot.content = task.hashes
            else:
                slot.content = ()  # stopped mid-prefill: what the slot holds is not known
            slot.last_used = now
            slot.last_end = now
        slot.touched = True
        if not slot.tasks and self.unplaced:
            # The server hands a freed slot to a request that was waiting for any slot.
            waiting = self.unplaced.pop(0)
            waiting.slot = slot.id
            waiting.t_start = now
            slot.tasks.append(waiting)

    def _detach(self, task: SlotTask, now: float) -> None:
        if task.slot is None:
            if task in self.unplaced:
                self.unplaced.remove(task)
            return
        slot = self.slots[task.slot]
        was_head = bool(slot.tasks) and slot.tasks[0] is task
        if task in slot.tasks:
            slot.tasks.remove(task)
        if was_head and slot.tasks and slot.tasks[0].t_start is None:
            slot.tasks[0].t_start = now

    def reconcile(
        self, observed: Iterable[Mapping[str, Any]], now: float, *, hold_s: float
    ) -> bool:
        """Fold a ``GET /slots`` answer in; True when it shows traffic from elsewhere.

        A slot busy with nothing of ours on it, or that ran a task we did not send since the
        last look, holds something this proxy does not know: its content is forgotten and it
        counts as busy for ``hold_s``. A busy slot may also be one of our unpinned requests,
        which is then placed there.
        """
        foreign = False
        for entry in observed:
            sid = entry.get("id")
            if not isinstance(sid, int) or not 0 <= sid < len(self.slots):
                continue
            slot = self.slots[sid]
            busy = entry.get("is_processing") is True
            id_task = entry.get("id_task")
            id_task = id_task if isinstance(id_task, int) else None
            ours_now = bool(slot.tasks) or now - slot.last_end < FOREIGN_GRACE_S
            if busy and not ours_now and self.unplaced:
                waiting = self.unplaced.pop(0)
                waiting.slot = slot.id
                waiting.t_start = waiting.t_sent
                slot.tasks.append(waiting)
                ours_now = True
            ran_other = (
                id_task is not None
                and slot.last_id_task is not None
                and id_task != slot.last_id_task
                and not slot.touched
                and not ours_now
                and self._unplaced_since_poll == 0
            )
            if (busy and not ours_now) or ran_other:
                foreign = True
                slot.content = ()
                if busy:
                    slot.foreign_until = now + hold_s
            slot.last_id_task = id_task
            slot.touched = False
        self._unplaced_since_poll = 0
        return foreign
