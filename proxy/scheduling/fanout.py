"""Fan-out: copying a slot that holds a hot prefix into idle slots (llama.cpp ``--slot-save-path``).

Requests pinned behind the slot that holds their prefix decode one after another. With fan-out
they wait instead for that slot's running request to end, then one takes the slot and the others
take copies of it in idle slots: ``POST /slots/{holder}?action=save`` once, then
``?action=restore`` into each idle slot. They decode side by side from a warm cache.

A save of a busy slot waits until the slot is idle, so the copy is made in the gap between two
requests: the request that takes the holder saves it first when others are waiting too, and a
copy is only restored from a snapshot of exactly the content wanted. Each slot's snapshot goes to
one file (``prefixgate-slot{N}.bin`` in the server's save path), overwritten by its next snapshot,
so the files never outnumber the slots.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from proxy.backends.slot_api import SlotEndpoint
from proxy.records import monotonic
from proxy.scheduling.slots import (
    SLOT_FANOUT,
    SLOT_HIT,
    SLOT_PLACE,
    Slot,
    SlotChoice,
    SlotRequest,
    SlotTable,
    SlotTask,
)

SNAPSHOT_FILE = "prefixgate-slot{slot}.bin"


@dataclass(slots=True)
class FanOut:
    """One replica's snapshots and the requests waiting to take a slot or a copy of it."""

    saved: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Per slot, the content its snapshot file holds."""
    waiting: dict[int, int] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def snapshot(self, endpoint: SlotEndpoint, slot: int, content: tuple[int, ...]) -> bool:
        """Make sure ``slot``'s snapshot file holds ``content`` (one save per content)."""
        if self.saved.get(slot) == content:
            return True
        if not await endpoint.save(slot, SNAPSHOT_FILE.format(slot=slot)):
            self.saved.pop(slot, None)
            return False
        self.saved[slot] = content
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
        if not any(s.idle(monotonic()) for s in table.slots if s is not holder):
            return None
        self.waiting[holder.id] = self.waiting.get(holder.id, 0) + 1
        try:
            await running.wait()
            content = holder.content
            if not content or table.matched_tokens(req, content) < min_tokens:
                return None
            async with self.lock:
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
                    if await endpoint.restore(target.id, filename):
                        target.state = holder.state
                    else:  # it runs there all the same, from whatever the slot holds
                        reason, matched = SLOT_PLACE, 0.0
        finally:
            self.waiting[holder.id] -= 1
        return SlotChoice(target.id, reason, matched, req.prompt_tokens - matched, 0.0)
