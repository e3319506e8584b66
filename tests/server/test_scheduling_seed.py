"""When a slot is seeded with a copy of another (``FanOut.seed_source``), as pure decisions."""

from __future__ import annotations

import asyncio

from proxy.backends.slot_cache import CachedPrompt, ServerRules
from proxy.scheduling import Rates, SlotRequest, SlotTable, SlotTask
from proxy.scheduling.fanout import FanOut

CPU = Rates(prefill_ms_per_token=6.0, tpot_ms=20.0)  # SmolLM2 on two cores
TPB = 64.0


def chain(prefix: int, n: int, tail: int = 0, tail_blocks: int = 0) -> tuple[int, ...]:
    return tuple(prefix * 1000 + i for i in range(n)) + tuple(
        tail * 1_000_000 + i for i in range(tail_blocks)
    )


def request(hashes: tuple[int, ...]) -> SlotRequest:
    return SlotRequest(hashes, len(hashes) * TPB + 10, 16.0, TPB)


def held(hashes: tuple[int, ...]) -> CachedPrompt:
    return CachedPrompt(hashes=hashes, prompt_tokens=len(hashes) * TPB, measured=True)


def table_with(*states: CachedPrompt | None) -> SlotTable:
    table = SlotTable(len(states), 8192, rules=ServerRules(similarity=0.0))
    for slot, state in zip(table.slots, states, strict=True):
        slot.state = state
    return table


def seed(table: SlotTable, req: SlotRequest, fanout: FanOut | None = None) -> object:
    choice = table.choose(req, CPU, 10.0, useful_tokens=256)
    return (fanout or FanOut()).seed_source(table, choice, req, 10.0, CPU, min_tokens=256)


def test_a_new_conversation_copies_the_shared_prefix_into_the_empty_slot() -> None:
    """Slot 0 holds the shared prefix and another conversation; slot 1 is empty."""
    table = table_with(held(chain(1, 16, tail=2, tail_blocks=2)), None)
    got = seed(table, request(chain(1, 16, tail=3, tail_blocks=2)))
    assert got is not None
    source, target, tokens = got  # type: ignore[misc]
    assert (source.id, target.id) == (0, 1) and tokens >= 16 * TPB - 1


def test_never_into_a_slot_holding_something_even_if_the_ram_cache_should_have_it() -> None:
    """A restore overwrites without saving; the model cannot be sure the RAM cache kept it."""
    other = held(chain(9, 16))
    table = table_with(held(chain(1, 16, tail=2, tail_blocks=2)), other)
    table.ram.save(other)
    assert seed(table, request(chain(1, 16, tail=3, tail_blocks=2))) is None


def test_no_copy_when_it_costs_more_than_half_the_prefill_it_saves() -> None:
    """A copy measured slow (a large model on a fast accelerator) is not made."""
    table = table_with(held(chain(1, 16, tail=2, tail_blocks=2)), None)
    slow = FanOut(copy_s_per_token=CPU.prefill_s)  # as slow as recomputing
    assert seed(table, request(chain(1, 16, tail=3, tail_blocks=2)), slow) is None


def test_no_copy_for_a_short_prefix() -> None:
    """Under ``min_prefix_tokens`` shared: nothing worth copying."""
    table = table_with(held(chain(1, 2, tail=2, tail_blocks=10)), None)
    assert seed(table, request(chain(1, 2, tail=3, tail_blocks=10))) is None


async def test_no_copy_while_requests_wait_for_any_slot_or_another_copy_runs() -> None:
    """An unplaced request may be running on a slot the model believes idle; a copy under way
    holds the snapshot file."""
    table = table_with(held(chain(1, 16, tail=2, tail_blocks=2)), None)
    req = request(chain(1, 16, tail=3, tail_blocks=2))
    waiting = SlotTask(req.hashes, req.prompt_tokens, req.prompt_tokens, 16.0, 9.0, pinned=False)
    table.unplaced.append(waiting)
    assert seed(table, req) is None
    table.unplaced.clear()
    busy = FanOut()
    async with busy.lock:  # held by another copy
        assert seed(table, req, busy) is None
    assert seed(table, req, busy) is not None


def test_the_next_turn_of_the_slots_own_conversation_is_never_copied() -> None:
    """A request continuing what a slot holds belongs on that slot: no copy."""
    state = held(chain(1, 16, tail=2, tail_blocks=2))
    table = table_with(state, None)
    assert seed(table, request(chain(1, 16, tail=2, tail_blocks=4))) is None


class HeldSave:
    """A slot endpoint whose save waits for ``release`` (a copy under way), counting restores."""

    save_supported = True

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.saving = asyncio.Event()
        self.restores: list[int] = []

    async def save(self, slot: int, filename: str, *, limit_s: float = 10.0) -> bool:
        self.saving.set()
        await self.release.wait()
        return True

    async def restore(self, slot: int, filename: str, *, limit_s: float = 10.0) -> bool:
        self.restores.append(slot)
        return True


async def test_a_launch_placed_while_a_copy_is_saved_is_applied_before_the_copy_is_judged() -> None:
    """Under unified KV a launch clears the idle slots. Another request placed (its launch left
    for later) while the copy's save is awaited empties the source: the copy is given up and
    the request placed afresh, never restored into a slot the model then believes empty."""
    table = SlotTable(3, 8192, rules=ServerRules(similarity=0.0, unified=True))
    source = held(chain(1, 16, tail=2, tail_blocks=2))
    other = held(chain(7, 8))
    table.slots[0].state, table.slots[2].state = source, other
    req = request(chain(1, 16, tail=3, tail_blocks=2))
    choice = table.choose(req, CPU, 10.0, useful_tokens=256)
    task = SlotTask(req.hashes, req.prompt_tokens, choice.uncached_tokens, 16.0, 10.0)
    endpoint = HeldSave()
    fanout = FanOut()
    seeding = asyncio.ensure_future(
        fanout.seed(endpoint, table, req, choice, task, CPU, min_tokens=256)  # type: ignore[arg-type]
    )
    await endpoint.saving.wait()
    # The next turn of the conversation on slot 2 is placed meanwhile, its launch pending.
    turn = request(chain(7, 8, tail=8, tail_blocks=2))
    theirs = table.choose(turn, CPU, 10.5, useful_tokens=256)
    assert theirs.slot == 2
    mine = SlotTask(turn.hashes, turn.prompt_tokens, theirs.uncached_tokens, 16.0, 10.5)
    table.place(mine, theirs.slot, 10.5, theirs.pick, later=True)
    assert table._pending_launch is not None and table.slots[0].state is source
    endpoint.release.set()
    made, _ = await seeding
    assert endpoint.restores == []  # the source was emptied: nothing to copy from
    assert table._pending_launch is None and table.slots[0].state is None
    assert made.slot is not None and task in table.slots[made.slot].tasks
