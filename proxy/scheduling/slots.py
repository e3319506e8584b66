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

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from proxy.backends.slot_cache import (
    SOURCE_RAM,
    CachedPrompt,
    Pick,
    PromptQuery,
    RamCache,
    ServerRules,
    SlotView,
    TokenCounter,
    launch,
    pick,
    probe_of,
    restorable,
)
from proxy.fingerprint import common_blocks
from proxy.log import get_logger
from proxy.scheduling.rates import Rates
from proxy.scheduling.slot_state import (
    FOREIGN_GRACE_S,
    RECENT_STATES,
    RETURNS,
    SLOT_BUSY,
    SLOT_CLIENT,
    SLOT_COPY,
    SLOT_FANOUT,
    SLOT_FOREIGN,
    SLOT_HIT,
    SLOT_PARALLEL,
    SLOT_PLACE,
    SLOT_QUEUE,
    SLOT_RAM,
    SLOT_REASONS,
    SLOT_SERVER,
    SLOT_UNPINNED,
    Continuations,
    Prefills,
    RecentPrompts,
    Slot,
    SlotChoice,
    SlotRequest,
    SlotTask,
    _remaining,
)

# What callers import from here; defined in ``slot_state``.
__all__ = [
    "FOREIGN_GRACE_S",
    "RECENT_STATES",
    "RETURNS",
    "SLOT_BUSY",
    "SLOT_CLIENT",
    "SLOT_COPY",
    "SLOT_FANOUT",
    "SLOT_FOREIGN",
    "SLOT_HIT",
    "SLOT_PARALLEL",
    "SLOT_PLACE",
    "SLOT_QUEUE",
    "SLOT_RAM",
    "SLOT_REASONS",
    "SLOT_SERVER",
    "SLOT_UNPINNED",
    "Continuations",
    "Prefills",
    "Slot",
    "SlotChoice",
    "SlotRequest",
    "SlotTable",
    "SlotTask",
]


_log = get_logger()


def _lru(slot: Slot) -> tuple[float, int]:
    return slot.last_used, slot.id


class SlotTable:
    """One replica's slots as this proxy knows them."""

    def __init__(
        self,
        n_slots: int,
        ctx_per_slot: int | None = None,
        *,
        rules: ServerRules | None = None,
        detect_unified: bool = True,
    ) -> None:
        self.slots = [Slot(id=i) for i in range(n_slots)]
        self.ctx_per_slot = ctx_per_slot
        self.unplaced: list[SlotTask] = []
        """Requests sent unpinned that have not been seen on a slot yet."""
        self._unplaced_since_poll = 0
        self.rules = rules or ServerRules()
        self.ram = RamCache(self.rules)
        """The server's RAM prompt cache as the model has it (``llamacpp_cache``)."""
        self.counter = TokenCounter()
        self.continuations = Continuations()
        self.recent = RecentPrompts(RECENT_STATES)
        """The latest prompts sent, whether the server still holds them or not."""
        self.detect_unified = detect_unified
        self._choosing = False
        self._crowd: tuple[float, bool] | None = None
        self._emptied_seen = 0
        """Whether ``/slots`` showing idle slots emptied may switch the model to unified KV."""
        self._incoming: tuple[PromptQuery, CachedPrompt] | None = None
        """The request being weighed, as the state it would leave (``eviction_s``), during one
        ``choose``."""
        self._pending_launch: tuple[Slot, SlotTask, float, Pick] | None = None
        """The launch placed with ``later`` and not applied to the model yet (``settle``)."""

    def settle(self) -> None:
        """Apply the launch ``place`` left for later. Every public method of the table calls
        this first (``place`` too, so one launch at most is pending; ``first_token`` only when
        it moves the task, its stamp needing no launch applied), and so does whatever
        reads or writes the slots from outside (``Scheduler._table``, and ``FanOut`` after each
        of its awaits, before it sets a slot's state): nothing sees or changes the model
        without it. A launch that fails (a bug in the model) is logged and dropped here, so
        that it costs the model one launch, not another request its answer."""
        if self._pending_launch is None:
            return
        (slot, task, now, outcome), self._pending_launch = self._pending_launch, None
        try:
            self._start(slot, task, now, outcome)
        except Exception:
            _log.exception("slot_model_error", slot=slot.id)

    def set_rules(self, rules: ServerRules) -> None:
        """Correct what the model believes of the server's flags."""
        self.settle()
        self.rules = rules
        self.ram.rules = rules
        self.ram.trim()

    def _busy(self, now: float) -> list[bool]:
        """Each slot's ``not Slot.idle(now)``, in order."""
        return [bool(s.tasks) or s.foreign_until > now for s in self.slots]

    def _views(self, busy: Sequence[bool]) -> list[SlotView]:
        """What the cache model sees of the slots, ``busy`` as ``_busy`` gives it."""
        return [SlotView(s.state, b, s.last_used) for s, b in zip(self.slots, busy, strict=True)]

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
        self.settle()
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

    def matched_tokens(
        self,
        req: SlotRequest,
        content: Sequence[int],
        state: CachedPrompt | None = None,
        query: PromptQuery | None = None,
    ) -> float:
        """Prompt tokens of ``req`` (as ``query``, when the caller has it) a slot holding
        ``content`` (or ``state``) would serve."""
        self.settle()
        if state is not None:
            return self._capped(self.counter.cached(state, query or req.query()))
        tokens = common_blocks(req.hashes, content) * req.tokens_per_block
        tokens = min(tokens, max(req.prompt_tokens - 1.0, 0.0))  # one token is always evaluated
        return self._capped(tokens)

    # -- the decision --------------------------------------------------------------------------

    def choose(
        self, req: SlotRequest, rates: Rates, now: float, *, useful_tokens: float
    ) -> SlotChoice:
        """The slot ``req`` is expected to end soonest on (``_choose``)."""
        self.settle()
        query = req.query()
        self._choosing, self._crowd = True, None  # crowded(now), once per choice
        try:
            with self.counter.scope(query):
                return self._choose(req, query, rates, now, useful_tokens=useful_tokens)
        finally:
            self._choosing, self._crowd, self._incoming = False, None, None

    def _choose(
        self,
        req: SlotRequest,
        query: PromptQuery,
        rates: Rates,
        now: float,
        *,
        useful_tokens: float,
    ) -> SlotChoice:
        """The slot ``req`` is expected to end soonest on (see the module docstring).

        On an idle slot the tokens a request reuses are what the server's cache model says a
        launch there gives (its slot, or a prompt restored from its RAM cache, or nothing:
        ``llamacpp_cache.pick``), and the slot's current content counts as a cost when it is
        lost for good (``eviction_s``). Leaving the choice to the server is a candidate too,
        taken only when it reuses strictly more (with similarity off, only its own LRU path
        restores from RAM). ``useful_tokens``: a match shorter than this is not called a hit.
        """
        p, t = rates.prefill_s, rates.tpot_s
        # The requests prefilling now, once a candidate's end is weighed (not for a request
        # that finds every slot busy and none holding its prefix: the server places it).
        prefilling: Prefills | None = None
        decode_s = req.decode_tokens * t
        best: tuple[tuple[float, ...], SlotChoice] | None = None
        holder_seen = False
        slots = self.slots
        busy = self._busy(now)
        any_idle = not all(busy)
        views = self._views(busy) if any_idle else []  # (when some slot is idle: else none asks)
        # What placing on an idle slot costs depends only on the tokens it leaves to prefill,
        # which few slots differ in: computed once per distinct value, not once per slot.
        idle_costs: dict[float, tuple[float, float]] = {}
        # A busy slot sharing not even the first block holds well under ``useful_tokens``.
        quick_reject = useful_tokens > 2.0 * req.tokens_per_block

        def prefills() -> Prefills:
            nonlocal prefilling
            if prefilling is None:
                prefilling = self._prefilling(now, rates)
            return prefilling

        def idle_cost(uncached: float) -> tuple[float, float]:
            known = idle_costs.get(uncached)
            if known is None:
                running = prefills()
                shared, imposed = running.shared(uncached), running.imposed(uncached)
                known = idle_costs[uncached] = (shared, imposed * p)
            return known

        # Every empty idle slot weighs the same (nothing reused, nothing lost): only the one
        # the ties go to, the least recently used, is weighed.
        empty = min(
            (s for s, b in zip(slots, busy, strict=True) if not b and s.state is None),
            key=_lru,
            default=None,
        )
        for slot, slot_busy in zip(slots, busy, strict=True):
            if not slot_busy:
                if slot.state is None and slot is not empty:
                    continue
                outcome = pick(
                    views, self.ram, query, self.counter, pinned=slot.id, rules=self.rules
                )
                matched = self._capped(outcome.cached_tokens)
                uncached = req.prompt_tokens - matched
                shared_s, imposed_s = idle_cost(uncached)
                end = now + (shared_s + uncached) * p + decode_s
                cost = end + imposed_s + self.eviction_s(slot, outcome, query, now, rates)
                key = (cost, -matched, 1.0 if slot.content else 0.0, slot.last_used, float(slot.id))
                if best is not None and not key < best[0]:
                    continue  # (the choice is built only for a slot that leads)
                if matched < useful_tokens:
                    reason = SLOT_PLACE
                else:
                    reason = SLOT_RAM if outcome.source == SOURCE_RAM else SLOT_HIT
                choice = SlotChoice(slot.id, reason, matched, uncached, end - now, pick=outcome)
                best = (key, choice)
            else:
                held = slot.holds_after_queue()
                if quick_reject and (not held or not req.hashes or held[0] != req.hashes[0]):
                    continue  # under one block shared: no prefix worth waiting for
                matched = self.matched_tokens(req, held, slot.state_after_queue(), query)
                if matched < useful_tokens:
                    continue  # waiting is worth it only for a prefix; the server places the rest
                holder_seen = True
                uncached = req.prompt_tokens - matched
                end = self.free_at(slot, now, rates, prefills()) + uncached * p + decode_s
                key = (end, -matched, 1.0 if slot.content else 0.0, slot.last_used, float(slot.id))
                if best is None or key < best[0]:
                    best = (key, SlotChoice(slot.id, SLOT_QUEUE, matched, uncached, end - now))
        if any_idle and best is not None:
            server = pick(views, self.ram, query, self.counter, pinned=None, rules=self.rules)
            if server.slot is not None:
                slot = self.slots[server.slot]
                matched = self._capped(server.cached_tokens)
                uncached = req.prompt_tokens - matched
                shared_s, imposed_s = idle_cost(uncached)
                end = now + (shared_s + uncached) * p + decode_s
                cost = end + imposed_s + self.eviction_s(slot, server, query, now, rates)
                if cost < best[0][0] or self._leave_to_server(best[1], query):
                    choice = SlotChoice(
                        slot.id, SLOT_SERVER, matched, uncached, end - now, False, server
                    )
                    best = ((cost,), choice)
        if best is None:  # every slot busy, none holding the prefix: the server picks
            # (its end is not estimated: nothing weighs it against another choice)
            return SlotChoice(None, SLOT_BUSY, 0.0, req.prompt_tokens, None)
        choice = best[1]
        if choice.reason == SLOT_PLACE and holder_seen:
            choice = replace(choice, reason=SLOT_PARALLEL)
        if choice.reason == SLOT_QUEUE and not any_idle:
            # Every slot is busy. Waiting for a particular one must beat taking the first to free.
            unpinned_end = self._first_free(now, rates, prefilling) + req.prompt_tokens * p
            unpinned_end += decode_s
            assert choice.expected_end_s is not None  # a queue's end is always estimated
            if unpinned_end <= now + choice.expected_end_s:
                return SlotChoice(None, SLOT_BUSY, 0.0, req.prompt_tokens, unpinned_end - now)
        return choice

    def _leave_to_server(self, best: SlotChoice, query: PromptQuery) -> bool:
        """Whether the server's own choice is to be taken over pinning ``best`` at equal cost.

        With similarity off the server's LRU path saves the slot it takes and restores the best
        cached prompt, so no conversation is ever lost, whereas a pinned request never consults
        the RAM cache there: pinning is kept for what only a pin does, queueing behind a busy
        slot holding the prefix and the next turn of the very state an idle slot holds.
        """
        if self.rules.similarity != 0.0 or best.reason == SLOT_QUEUE or best.slot is None:
            return False
        held = self.slots[best.slot].state
        return held is None or not self.counter.shared(held, query).continues

    def _pin_disturbs(self, slot: Slot, query: PromptQuery) -> bool:
        """Whether pinning onto busy ``slot`` would make the server swap its running content.

        With similarity on, a request pinned to a processing slot is checked against nothing
        (the slot is skipped), so ``f_keep`` is 0 and the server saves the running slot and
        loads the best cached prompt into it before it defers the request; a cached prompt
        beating the running one for this request would replace the sequence being generated.
        """
        if self.rules.similarity == 0.0 or not self.rules.cache_ram or not slot.tasks:
            return False
        running = slot.tasks[0].state
        return running is not None and self.ram.best(running, query, self.counter) is not None

    def live_conversations(self, now: float) -> float:
        """Prompts sent lately that no later request has continued yet: the conversations
        the slots are asked to hold at once, each weighed by how likely its application is to
        continue. Lately: within twice the prompt's own pace when it has one, else a minute."""
        self.settle()
        return self._live_sum(now, math.inf)

    def _live_sum(self, now: float, limit: float) -> float:
        """``live_conversations(now)``, or a partial sum of it as soon as that exceeds
        ``limit`` (every term is positive: the whole sum exceeds it too)."""
        live = 0.0
        rates: dict[int, float] = {}  # per application: few of them among the recent prompts
        for state in self.recent.states():
            if state.continued:
                continue
            gap = state.gap_s
            if now - state.t_used <= (2.0 * gap if gap else 60.0):
                anchor = state.fp.anchor if state.fp is not None else 0
                rate = rates.get(anchor)
                if rate is None:
                    rate = rates[anchor] = self.continuations.rate_of(anchor)
                live += rate  # a one-shot question weighs little
                if live > limit:
                    break
        return live

    def crowded(self, now: float) -> bool:
        """Whether more conversations are live than there are slots
        (``live_conversations(now) > len(self.slots)``).

        Every remembered prompt counted at its application's rate bounds the live ones from
        above (the live are some of them), and that bound is a sum over a few applications:
        when it is under the slots, the prompts are not walked at all (one-shot traffic, whose
        rate is low). Else the walk stops as soon as its sum passes the slots. Once per choice.
        """
        self.settle()
        if self._choosing and self._crowd is not None and self._crowd[0] == now:
            return self._crowd[1]
        n = float(len(self.slots))
        rate_of = self.continuations.rate_of
        bound = sum(rate_of(anchor) * count for anchor, count in self.recent.applications())
        # (the margin covers the rounding of summing the same rates one by one)
        crowded = bound + 1e-9 > n and self._live_sum(now, n) > n
        if self._choosing:
            self._crowd = (now, crowded)
        return crowded

    def _capped(self, tokens: float) -> float:
        if self.ctx_per_slot:
            return min(tokens, float(self.ctx_per_slot))
        return tokens

    def eviction_s(
        self, slot: Slot, outcome: Pick, query: PromptQuery, now: float, rates: Rates
    ) -> float:
        """What losing ``slot``'s content to ``query`` is expected to cost later, in seconds.

        The tokens of its content the new request does not share are lost for good unless the
        server can restore them from its RAM cache (``restorable``). They are weighed by how
        likely a prompt of its application is to be continued (``Continuations``: a chat or an
        agent loop comes back turn after turn, a one-shot question never), by how soon its
        conversation is due (at its own pace: due now 1, a whole gap away 1/2), and by the
        turns a lost history is recomputed on (``RETURNS``): spreading conversations over the
        slots costs one prefill of their shared prefix, once, where herding them onto one slot
        recomputes each history on every turn.
        """
        self.settle()
        held = slot.state
        if held is None or (outcome.loaded is None and self.counter.shared(held, query).continues):
            return 0.0  # nothing there, or the request extends what is there
        last = self._incoming
        if last is None or last[0] is not query:  # one per choice, whichever slot is weighed
            incoming = CachedPrompt(
                hashes=query.hashes, prompt_tokens=query.prompt_tokens, fp=query.fp
            )
            self._incoming = (query, incoming)
        else:
            incoming = last[1]
        kept = self.counter.cached(incoming, probe_of(held))
        lost = max(held.tokens - kept, 0.0)
        if lost <= 0.0:
            return 0.0
        if restorable(
            held,
            incoming,
            self.ram,
            self.counter,
            rules=self.rules,
            saved_now=outcome.update,
            shared=kept,
        ):
            return 0.0
        if self.rules.similarity != 0.0 and self.crowded(now):
            # More conversations than slots and a server that cannot swap them back in from
            # RAM: every placement loses some history, spreading only moves the loss. Take
            # what reuses most now, as the server itself would. (Checked last: it walks the
            # recent prompts, and every earlier answer is 0 too.)
            return 0.0
        likely = self.continuations.rate(held)
        if held.gap_s is not None and held.gap_s > 0.0:
            wait = max(held.t_used + held.gap_s - now, 0.0)
            likely /= 1.0 + wait / held.gap_s
        return lost * likely * RETURNS * rates.prefill_s

    def place(
        self,
        task: SlotTask,
        slot_id: int | None,
        now: float,
        outcome: Pick | None = None,
        *,
        later: bool = False,
    ) -> None:
        """Record that ``task`` was sent to ``slot_id`` (None: unpinned, slot unknown).

        ``outcome``: the cache model's ``pick`` for an idle ``slot_id`` (``SlotChoice.pick``),
        reused for the launch; one is computed when it is missing or stale. ``later``: the
        slot is taken at once (``task.pick`` is ``outcome``), and the model's launch with that
        outcome is applied by the next ``settle``, so that the request can be on its way first.
        """
        self.settle()
        if task.state is None:
            fp = task.query.fp if task.query is not None else None
            task.state = CachedPrompt(
                hashes=task.hashes, prompt_tokens=task.prompt_tokens, fp=fp, t_used=now
            )
        if slot_id is None or not self.slots:
            task.pinned = False
            self.unplaced.append(task)
            self._unplaced_since_poll += 1
            return
        slot = self.slots[slot_id % len(self.slots)]
        task.slot = slot.id
        if not slot.tasks:
            if later and outcome is not None and outcome.slot == slot.id:
                # ``_start``, its launch left to ``settle``: nothing changes the table before
                # that, every other method settling first.
                task.t_start, task.pick = now, outcome
                self._pending_launch = (slot, task, now, outcome)
            else:
                self._start(slot, task, now, outcome)
        slot.tasks.append(task)
        slot.touched = True
        slot.last_used = now

    def _query(self, task: SlotTask) -> PromptQuery:
        if task.query is not None:
            return task.query
        per_block = task.prompt_tokens / max(len(task.hashes), 1)
        return PromptQuery(task.hashes, task.prompt_tokens, per_block)

    def _start(self, slot: Slot, task: SlotTask, now: float, outcome: Pick | None = None) -> None:
        """``task`` begins on the idle ``slot``: apply what the server does at a launch."""
        task.t_start = now
        query = self._query(task)
        with self.counter.scope(query):  # pick, launch and the match ask of the same states
            self._launch(slot, task, query, now, outcome)

    def _launch(
        self, slot: Slot, task: SlotTask, query: PromptQuery, now: float, outcome: Pick | None
    ) -> None:
        views = self._views(self._busy(now))
        views[slot.id].busy = False
        if outcome is None or outcome.slot != slot.id:
            # A request that waited unpinned for any slot takes the server's unpinned path (its
            # LRU choice saves and restores); the slot that freed is the one it gets.
            if task.pinned:
                outcome = pick(
                    views, self.ram, query, self.counter, pinned=slot.id, rules=self.rules
                )
            else:  # the only idle slot, as the server sees it then
                only = [
                    v if i == slot.id else SlotView(v.state, True, v.last_used)
                    for i, v in enumerate(views)
                ]
                outcome = pick(only, self.ram, query, self.counter, pinned=None, rules=self.rules)
            if outcome.slot != slot.id:
                outcome = pick(
                    views, self.ram, query, self.counter, pinned=slot.id, rules=self.rules
                )
        held = launch(views, self.ram, outcome, rules=self.rules)
        for view, each in zip(views, self.slots, strict=True):
            if each is not slot:
                each.state = view.state
        slot.state = held
        task.pick = outcome
        if outcome.matched is not None:
            task.shared = self.counter.shared(outcome.matched, query)
            if task.shared.continues and task.state is not None:
                task.state.gap_s = max(task.t_sent - outcome.matched.t_used, 0.0)
        # Which earlier prompt does this request continue, held by the server or lost: an
        # application whose prompts come back turn after turn is worth keeping apart on the slots.
        other = self.recent.continued_by(query, exclude=task.state)
        if other is not None:
            if not other.continued:
                other.continued = True
                self.continuations.observe(other, continued=True)
            if task.state is not None and task.state.gap_s is None:
                task.state.gap_s = max(task.t_sent - other.t_used, 0.0)
        if task.state is not None:
            self.recent.append(task.state)
            self.continuations.observe(task.state, continued=False)

    def first_token(self, task: SlotTask, now: float, reported_slot: int | None = None) -> None:
        """The backend answered ``task``'s first token (and said which slot, if it did).

        Only stamps the task when it is where the model put it: a launch left for later stays
        pending (``settle``), so that the token reaches its client before that work is done
        (``Scheduler.settle``, a moment after, or the table's next use)."""
        if task.t_first_token is None:
            task.t_first_token = now
        if reported_slot is None or not self.slots or task.slot == reported_slot:
            return
        self.settle()
        self._detach(task, now)
        slot = self.slots[reported_slot % len(self.slots)]
        task.slot = slot.id
        task.t_start = task.t_start if task.t_start is not None else task.t_sent
        slot.tasks.insert(0, task)
        slot.last_used = now

    def end(self, task: SlotTask, now: float, *, ok: bool) -> None:
        """``task`` ended (``ok``: it succeeded); its slot now holds its prompt."""
        self.settle()
        if task.slot is None:
            if task in self.unplaced:
                self.unplaced.remove(task)
            return
        slot = self.slots[task.slot]
        was_head = bool(slot.tasks) and slot.tasks[0] is task
        if task not in slot.tasks:
            return
        started = was_head or task.t_first_token is not None
        if started:
            if (ok or task.t_first_token is not None) and task.state is not None:
                task.state.t_used = now
                slot.state = task.state
            else:
                slot.state = None  # stopped mid-prefill: what the slot holds is not known
            slot.last_used = now
            slot.last_end = now
        self._detach(task, now)
        slot.touched = True
        if not slot.tasks and self.unplaced:
            # The server hands a freed slot to a request that was waiting for any slot.
            waiting = self.unplaced.pop(0)
            waiting.slot = slot.id
            self._start(slot, waiting, now)
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
            nxt = slot.tasks.pop(0)
            self._start(slot, nxt, now)
            slot.tasks.insert(0, nxt)

    def measured(
        self,
        task: SlotTask,
        *,
        prompt_tokens: int | None,
        completion_tokens: int | None,
        cached_tokens: int | None,
    ) -> None:
        """The backend's figures for ``task``: the state it left is measured, and the model
        learns where its matches end, how much of an answer a next turn repeats, and that its
        RAM cache is smaller than believed when a predicted restore did not happen."""
        self.settle()
        if task.state is not None:
            task.state.measure(prompt_tokens, completion_tokens)
        outcome = task.pick
        if outcome is None or cached_tokens is None or not prompt_tokens:
            return
        if task.shared is not None and outcome.matched is not None:
            self.counter.learn(task.shared, outcome.matched, float(cached_tokens), prompt_tokens)
        predicted = outcome.cached_tokens
        if outcome.source != SOURCE_RAM:
            return
        floor = float(self.ctx_per_slot or 4096) * len(self.slots)
        if cached_tokens < 0.5 * predicted:
            # The restored entry was gone: the cache holds less than the model thought.
            limit = max(self.ram.tokens() * 0.8, floor)
            if limit < self.rules.ram_tokens:
                self.set_rules(replace(self.rules, ram_tokens=limit))
        elif math.isfinite(self.rules.ram_tokens):
            self.set_rules(replace(self.rules, ram_tokens=self.rules.ram_tokens * 1.25))

    def reconcile(
        self, observed: Iterable[Mapping[str, Any]], now: float, *, hold_s: float
    ) -> bool:
        """Fold a ``GET /slots`` answer in; True when it shows traffic from elsewhere.

        A slot busy with nothing of ours on it, or that ran a task we did not send since the
        last look, holds something this proxy does not know: its content is forgotten and it
        counts as busy for ``hold_s``. A busy slot may also be one of our unpinned requests,
        which is then placed there.
        """
        self.settle()
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
                self._start(slot, waiting, now)
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
            if (
                not busy
                and not slot.tasks
                and slot.state is not None
                and entry.get("n_prompt_tokens") == 0
            ):
                # Idle and empty though it held a prompt: the server clears idle slots when a
                # task starts (unified KV). Pinning onto such a slot skips the RAM cache.
                slot.state = None
                self._emptied_seen += 1
                if self.detect_unified and not self.rules.unified and self._emptied_seen >= 2:
                    self.set_rules(replace(self.rules, unified=True))
            if (busy and not ours_now) or ran_other:
                foreign = True
                slot.state = None
                if busy:
                    slot.foreign_until = now + hold_s
            slot.last_id_task = id_task
            slot.touched = False
        self._unplaced_since_poll = 0
        return foreign
