"""How a slot table weighs its slots for a new request (``SlotWeighing``, the choosing half of
``SlotTable``).

llama-server keeps one prompt cache per slot: a request reuses only what *its* slot last held
(the longest common prefix of tokens). Left to itself the server puts a request on an idle slot
(the most similar one, else the least recently used), so requests that arrive together carrying
the same new prefix land on different slots and each prefills it. ``id_slot`` pins a request to a
slot; a request pinned to a busy slot is deferred by the server until that slot is free.

``choose`` weighs every slot for a new request by the time the request is expected to end there:

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
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from proxy.backends.slot_cache import (
    SOURCE_RAM,
    CachedPrompt,
    Pick,
    PromptQuery,
    RamCache,
    ServerRules,
    SlotView,
    TokenCounter,
    pick,
    probe_of,
    restorable,
)
from proxy.fingerprint import common_blocks
from proxy.scheduling.rates import Rates
from proxy.scheduling.slot_state import (
    RETURNS,
    SLOT_BUSY,
    SLOT_HIT,
    SLOT_PARALLEL,
    SLOT_PLACE,
    SLOT_QUEUE,
    SLOT_RAM,
    SLOT_SERVER,
    Continuations,
    Prefills,
    RecentPrompts,
    Slot,
    SlotChoice,
    SlotRequest,
    _remaining,
    least_recently_used,
)


class SlotWeighing:
    """The estimates and the choice of a ``SlotTable``, which holds the state they read (declared
    here) and applies what is placed (``settle`` first, as every public method does)."""

    slots: list[Slot]
    ctx_per_slot: int | None
    rules: ServerRules
    ram: RamCache
    counter: TokenCounter
    continuations: Continuations
    recent: RecentPrompts
    _choosing: bool
    _crowd: tuple[float, bool] | None
    _incoming: tuple[PromptQuery, CachedPrompt] | None

    if TYPE_CHECKING:

        def settle(self) -> None: ...

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
        empty = least_recently_used(
            [s for s, b in zip(slots, busy, strict=True) if not b and s.state is None]
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
                if self._pin_disturbs(slot, query):
                    continue  # pinned there, the server would swap the running sequence out
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
