"""The proxy's picture of one llama.cpp replica's slots: what each holds, what this proxy has
sent to it, and what the server's cache does when a request starts, ends or is observed.

``SlotTable`` remembers, per slot, the prompt it holds (block hashes, as ``CachedPrompt``) and
the requests this proxy has sent to it (the running one first, the deferred ones behind it),
with a model of the server's RAM prompt cache (``llamacpp_cache``). Where the next request
should go is the other half of the table (``slot_choice.SlotWeighing``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from proxy.backends.slot_cache import (
    SOURCE_RAM,
    CachedPrompt,
    Pick,
    PromptQuery,
    RamCache,
    ServerRules,
    TokenCounter,
    launch,
    pick,
)
from proxy.log import get_logger
from proxy.scheduling.slot_choice import SlotWeighing
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


class SlotTable(SlotWeighing):
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
                outcome = pick(
                    views,
                    self.ram,
                    query,
                    self.counter,
                    pinned=None,
                    rules=self.rules,
                    idle=slot.id,
                )
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

    def first_token(
        self,
        task: SlotTask,
        now: float,
        reported_slot: int | None = None,
        *,
        at: float | None = None,
    ) -> None:
        """The backend answered ``task``'s first token (and said which slot, if it did); ``at``:
        when the token was read, if before ``now``.

        Only stamps the task when it is where the model put it: a launch left for later stays
        pending (``settle``), so that the token reaches its client before that work is done
        (``Scheduler.settle``, a moment after, or the table's next use)."""
        if task.t_first_token is None:
            task.t_first_token = now if at is None else at
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
