"""Copies of a slot (llama.cpp ``--slot-save-path``): fan-out, and seeding the slot a request takes.

Requests pinned behind the slot that holds their prefix decode one after another. With fan-out
they wait instead for that slot's running request to end, then one takes the slot and the others
take copies of it in idle slots: ``POST /slots/{holder}?action=save`` once, then
``?action=restore`` into each idle slot. They decode side by side from a warm cache.

A save of a busy slot waits until the slot is idle, so the copy is made in the gap between two
requests: the request that takes the holder saves it first when others are waiting too, and a
copy is only restored from a snapshot of exactly the content wanted. Each slot's snapshot goes to
one file (``prefixgate-slot{N}.bin`` in the server's save path), overwritten by its next snapshot,
so the files never outnumber the slots.

Seeding (``slot_copy``, on by default; nothing happens on a server without a save path, which
refuses the first save): the slot a request is placed on would recompute a prefix that another
*idle* slot holds, typically a new conversation's shared system prompt and tools while the slot
holding them keeps another conversation's history. Pinning onto the holder would overwrite that
history, which the server never saves on a pinned launch, and a server's RAM cache holds an idle
slot only after a *later* launch has saved it, so the first time round nothing else can give
that prefix back. The holder is copied into the request's slot first (save, then restore), and
the request then runs there from the copy (``slot_copy``). Only a slot whose own content is
nothing, or is already in the server's RAM cache, is overwritten, and only when the copy is
expected to cost under half the prefill it saves: a copy's time per token is measured on each
copy (the KV cache of a large model on a fast accelerator can take longer to write and read back
than to recompute).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from proxy.backends.slot_api import SlotEndpoint
from proxy.backends.slot_cache import CachedPrompt
from proxy.records import monotonic
from proxy.scheduling.rates import Rates
from proxy.scheduling.slot_state import least_recently_used
from proxy.scheduling.slots import (
    SLOT_COPY,
    SLOT_FANOUT,
    SLOT_HIT,
    SLOT_PLACE,
    SLOT_QUEUE,
    Slot,
    SlotChoice,
    SlotRequest,
    SlotTable,
    SlotTask,
)

SNAPSHOT_FILE = "prefixgate-slot{slot}.bin"
COPY_S_PER_TOKEN = 5e-5  # before any copy is measured: 50 µs a token (a small model on a CPU)
COPY_MAX_COST = 0.5  # a seeding copy must cost under this share of the prefill it saves
COPY_MIN_LIMIT_S = 0.5  # a save or restore of a seeding copy is given up after this at least

Seed = tuple[Slot, Slot, float]
"""A seeding copy: the idle slot to copy, the empty idle slot to copy it into (where the request
runs), and the prompt tokens the copy gives the request (``FanOut.seed_source``)."""


@dataclass(slots=True)
class FanOut:
    """One replica's snapshots and the requests waiting to take a slot or a copy of it."""

    saved: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Per slot, the content its snapshot file holds."""
    waiting: dict[int, int] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    saved_states: dict[int, CachedPrompt] = field(default_factory=dict)
    """Per slot, the state its snapshot was taken of (block hashes alone miss a new tail)."""
    copy_s_per_token: float = COPY_S_PER_TOKEN
    """Seconds a seeding copy (save and restore) takes per token copied, as measured."""
    copies: int = 0
    """Seeding copies made (and measured)."""

    def seed_source(
        self,
        table: SlotTable,
        choice: SlotChoice,
        req: SlotRequest,
        now: float,
        rates: Rates,
        *,
        min_tokens: float,
    ) -> Seed | None:
        """``(source, target, tokens)``: the idle slot to copy, the idle slot to copy it into
        and run ``req`` on, and the prompt tokens the copy gives it; None when no copy is worth
        making against ``choice``.

        A copy is made when the source holds at least ``min_tokens`` more of the request than
        the choice gets, or when the choice is the source itself and would overwrite content
        whose expected cost of recomputing (``SlotTable.eviction_s``: another conversation's
        history) is more than the copy's. The target must hold nothing the model knows of (a
        restore overwrites without saving, and the model cannot be sure what the server's RAM
        cache still holds); the copy's expected time must be under ``COPY_MAX_COST`` of the
        prefill it saves. Not while requests wait for any slot (the server may start one on
        a slot the model believes idle) or another copy is being made.
        """
        table.settle()
        if choice.reason == SLOT_QUEUE or not table.slots or table.unplaced or self.lock.locked():
            return None
        idle = [s for s in table.slots if s.idle(now)]
        target = least_recently_used([s for s in idle if s.state is None])
        if target is None:
            return None
        query = req.query()
        best: Seed | None = None
        for source in idle:
            if source.state is None or source is target:
                continue
            tokens = table.matched_tokens(req, source.content, source.state, query)
            if tokens < min_tokens:
                continue
            cost_s = source.state.tokens * self.copy_s_per_token
            if source.id == choice.slot:
                # Pinned there, the request would overwrite what the slot holds: worth a copy
                # only when that is expected to cost more to recompute later than the copy
                # (never for the request's own conversation, which it continues).
                if choice.pick is None:
                    continue
                if table.eviction_s(source, choice.pick, query, now, rates) <= cost_s:
                    continue
                gain = tokens
            else:
                gain = tokens - choice.matched_tokens
                if gain < min_tokens:
                    continue
            if cost_s >= COPY_MAX_COST * gain * rates.prefill_s:
                continue
            if best is None or tokens > best[2]:
                best = (source, target, tokens)
        return best

    async def seed(
        self,
        endpoint: SlotEndpoint,
        table: SlotTable,
        req: SlotRequest,
        choice: SlotChoice,
        task: SlotTask,
        rates: Rates,
        *,
        min_tokens: float,
        found: Seed | None = None,
    ) -> tuple[SlotChoice, float] | None:
        """Copy the slot ``seed_source`` names (``found``, when the caller asked it already,
        with nothing awaited since) into its target and place ``task`` there: ``(the choice
        made, ms the request was held)``, or None when no copy is worth it (``task`` is then
        still to be placed). When the save fails, or the slots changed while it was made, the
        choice is made again and ``task`` placed by it. The whole copy holds the copy lock: no
        other copy overwrites the snapshot between its save and restore."""
        if found is None:
            found = self.seed_source(table, choice, req, monotonic(), rates, min_tokens=min_tokens)
        if found is None:
            return None
        source, target, tokens = found
        content, copied = source.content, source.state
        limit_s = self.copy_limit_s(source)
        async with self.lock:
            t0 = monotonic()
            saved = await self.snapshot(endpoint, source.id, content, state=copied, limit_s=limit_s)
            now = monotonic()
            task.t_sent = now
            table.settle()
            if not (saved and target.idle(now) and target.state is None and source.state is copied):
                again = table.choose(req, rates, now, useful_tokens=min_tokens)
                task.uncached_tokens = again.uncached_tokens
                table.place(task, again.slot, now, again.pick)
                return again, (now - t0) * 1000.0
            # The model holds the copy from now on, and the task is placed before the restore is
            # awaited, so no other request takes the slot meanwhile.
            target.state = copied
            table.place(task, target.id, now)
            filename = SNAPSHOT_FILE.format(slot=source.id)
            restored = await endpoint.restore(target.id, filename, limit_s=limit_s)
            now = monotonic()
            table.settle()  # (launches placed meanwhile go first, as they were sent first)
        if restored:
            self.measured(copied.tokens if copied is not None else 0.0, now - t0)
            reason = SLOT_COPY
        else:
            # It runs there all the same, from nothing (a failed restore clears the slot):
            # nothing is learned from a match the model expected.
            target.state = None
            task.pick, task.shared = None, None
            reason, tokens = SLOT_PLACE, 0.0
        task.uncached_tokens = req.prompt_tokens - tokens
        task.t_start = task.t_sent = now  # it reaches the server only now
        made = SlotChoice(target.id, reason, tokens, task.uncached_tokens, choice.expected_end_s)
        return made, (now - t0) * 1000.0

    def copy_limit_s(self, source: Slot) -> float:
        """How long one step of a seeding copy may take before it is given up."""
        tokens = source.state.tokens if source.state is not None else 0.0
        return max(COPY_MIN_LIMIT_S, 10.0 * tokens * self.copy_s_per_token)

    def measured(self, tokens: float, seconds: float) -> None:
        """One seeding copy of ``tokens`` took ``seconds`` (save and restore, no lock wait)."""
        if tokens < 1.0:
            return
        seen = seconds / tokens
        old = self.copy_s_per_token
        self.copy_s_per_token = seen if not self.copies else old + 0.3 * (seen - old)
        self.copies += 1

    async def snapshot(
        self,
        endpoint: SlotEndpoint,
        slot: int,
        content: tuple[int, ...],
        *,
        state: CachedPrompt | None = None,
        limit_s: float = 10.0,
    ) -> bool:
        """Make sure ``slot``'s snapshot file holds ``content`` (one save per content; with
        ``state``, per state: the same blocks with another tail are another snapshot)."""
        if self.saved.get(slot) == content and (
            state is None or self.saved_states.get(slot) is state
        ):
            return True
        if not await endpoint.save(slot, SNAPSHOT_FILE.format(slot=slot), limit_s=limit_s):
            self.saved.pop(slot, None)
            self.saved_states.pop(slot, None)
            return False
        self.saved[slot] = content
        if state is not None:
            self.saved_states[slot] = state
        else:
            self.saved_states.pop(slot, None)
        return True

    async def take_or_copy(
        self,
        endpoint: SlotEndpoint,
        table: SlotTable,
        req: SlotRequest,
        holder: Slot,
        task: SlotTask,
        *,
        running: asyncio.Event,
        min_tokens: float,
    ) -> SlotChoice | None:
        """Wait for ``holder``'s running request to end (``running``), then take it or a copy.

        Returns None to queue behind the holder instead (no idle slot to copy into, the holder
        no longer holds the prefix, no snapshot). Otherwise ``task`` has been placed on the slot
        returned, before any copy is awaited, so no other request takes that slot meanwhile.
        """
        table.settle()
        if not any(s.idle(monotonic()) for s in table.slots if s is not holder):
            return None
        self.waiting[holder.id] = self.waiting.get(holder.id, 0) + 1
        try:
            await running.wait()
            table.settle()
            content = holder.content
            if not content or table.matched_tokens(req, content) < min_tokens:
                return None
            async with self.lock:
                table.settle()
                others = self.waiting[holder.id] - 1
                if holder.idle(monotonic()) and holder.content == content:
                    if others:  # they need a copy once this request holds the slot
                        await self.snapshot(endpoint, holder.id, content)
                    target, reason = holder, SLOT_HIT
                else:
                    idle = [s for s in table.slots if s.idle(monotonic())]
                    if self.saved.get(holder.id) != content or not idle:
                        return None
                    target = min(idle, key=lambda s: (bool(s.content), s.last_used, s.id))
                    reason = SLOT_FANOUT
                matched = table.matched_tokens(req, content)
                task.uncached_tokens = req.prompt_tokens - matched
                table.place(task, target.id, monotonic())
                if reason == SLOT_FANOUT:
                    filename = SNAPSHOT_FILE.format(slot=holder.id)
                    restored = await endpoint.restore(target.id, filename)
                    table.settle()  # (launches placed meanwhile go first)
                    if restored:
                        target.state = holder.state
                    else:  # it runs there all the same, from whatever the slot holds
                        reason, matched = SLOT_PLACE, 0.0
        finally:
            self.waiting[holder.id] -= 1
        return SlotChoice(target.id, reason, matched, req.prompt_tokens - matched, 0.0)
