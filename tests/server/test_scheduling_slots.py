"""The slot table's cost model and bookkeeping, as pure functions of a clock and rates."""

from __future__ import annotations

import pytest

from proxy.records import RequestRecord
from proxy.scheduling import Rates, SlotRequest, SlotTable, SlotTask, common_blocks

CPU = Rates(prefill_ms_per_token=6.0, tpot_ms=20.0)  # SmolLM2 on two cores
GPU = Rates(prefill_ms_per_token=0.1, tpot_ms=20.0)  # prefill a hundred times cheaper per token
TPB = 64.0  # tokens per block


def chain(prefix: int, n: int, tail: int = 0, tail_blocks: int = 0) -> tuple[int, ...]:
    """Block hashes of ``n`` shared blocks (``prefix`` names the prefix) then a private tail."""
    return tuple(prefix * 1000 + i for i in range(n)) + tuple(
        tail * 1_000_000 + i for i in range(tail_blocks)
    )


def request(hashes: tuple[int, ...], output: float = 16.0) -> SlotRequest:
    return SlotRequest(
        hashes=hashes,
        prompt_tokens=len(hashes) * TPB + 10,
        decode_tokens=output,
        tokens_per_block=TPB,
    )


def send(table: SlotTable, req: SlotRequest, rates: Rates, now: float) -> tuple[str, int | None]:
    """Choose for ``req`` and record it where it went, as the scheduler does."""
    choice = table.choose(req, rates, now, useful_tokens=256)
    task = SlotTask(
        hashes=req.hashes,
        prompt_tokens=req.prompt_tokens,
        uncached_tokens=choice.uncached_tokens,
        decode_tokens=req.decode_tokens,
        t_sent=now,
    )
    table.place(task, choice.slot, now)
    return choice.reason, choice.slot


def test_common_blocks_counts_the_shared_lead() -> None:
    """Chained hashes: the shared prefix is where the sequences first differ."""
    assert common_blocks(chain(1, 5), chain(1, 5)) == 5
    assert common_blocks(chain(1, 5, 2, 3), chain(1, 5, 3, 3)) == 5
    assert common_blocks(chain(1, 5), chain(2, 5)) == 0
    assert common_blocks((), chain(1, 3)) == 0


def test_burst_sharing_a_new_prefix_queues_behind_the_first() -> None:
    """Four requests with one new long prefix and short answers all go to the first one's slot."""
    table = SlotTable(4, 4096)
    got = [send(table, request(chain(7, 20, tail=i, tail_blocks=1)), CPU, 0.0) for i in range(4)]
    assert got[0] == ("slot_place", 0)
    assert got[1:] == [("slot_queue", 0)] * 3


def test_long_answers_run_side_by_side_where_prefill_is_cheap() -> None:
    """Where prefill is cheap next to decoding, a long answer does not wait behind another."""
    table = SlotTable(4, 4096)
    reasons = [
        send(table, request(chain(7, 20, tail=i, tail_blocks=1), output=256), GPU, 0.0)
        for i in range(4)
    ]
    assert reasons[0][0] == "slot_place"
    assert [r for r, _ in reasons[1:]] == ["slot_parallel"] * 3
    assert len({s for _, s in reasons}) == 4


def test_long_answers_still_queue_where_prefill_dominates() -> None:
    """On a CPU, where prefilling the prefix costs more than waiting for an answer, they queue."""
    table = SlotTable(4, 4096)
    reasons = [
        send(table, request(chain(7, 20, tail=i, tail_blocks=1), output=256), CPU, 0.0)
        for i in range(4)
    ]
    assert reasons[1] == ("slot_queue", 0)


def test_unrelated_prompts_spread_over_idle_slots() -> None:
    """Prompts sharing nothing each get their own idle slot, as the server would give them."""
    table = SlotTable(4, 4096)
    got = [send(table, request(chain(i + 1, 20)), CPU, 0.0) for i in range(4)]
    assert [r for r, _ in got] == ["slot_place"] * 4
    assert sorted(s for _, s in got if s is not None) == [0, 1, 2, 3]


def test_idle_slot_holding_the_prefix_is_a_hit() -> None:
    """Once the first request ended, its slot serves the next request sharing the prefix."""
    table = SlotTable(2, 4096)
    send(table, request(chain(1, 20)), CPU, 0.0)
    table.end(table.slots[0].tasks[0], 10.0, ok=True)
    assert table.slots[0].content == chain(1, 20)
    assert send(table, request(chain(1, 20, tail=9, tail_blocks=2)), CPU, 11.0) == ("slot_hit", 0)


def test_new_prompt_goes_to_an_empty_slot_before_a_held_one() -> None:
    """A prompt with nothing to reuse overwrites the emptiest, then least recently used, slot."""
    table = SlotTable(3, 4096)
    for i in range(2):
        send(table, request(chain(i + 1, 10)), CPU, float(i))
        table.end(table.slots[i].tasks[0], float(i) + 0.5, ok=True)
    assert send(table, request(chain(9, 10)), CPU, 5.0) == ("slot_place", 2)
    table.end(table.slots[2].tasks[0], 6.0, ok=True)
    assert send(table, request(chain(8, 10)), CPU, 7.0) == ("slot_place", 0)


def test_of_the_empty_slots_the_least_recently_used_is_taken() -> None:
    """Empty idle slots weigh the same (one is weighed for all): the least recently used wins,
    then the lowest id; a held slot that would keep its content for good loses to them."""
    table = SlotTable(4, 4096)
    for sid, used in ((0, 4.0), (1, 2.0), (3, 2.0)):
        table.slots[sid].last_used = used
    send(table, request(chain(1, 10)), CPU, 1.0)  # slot 2: never used
    assert table.slots[2].tasks
    table.end(table.slots[2].tasks[0], 1.5, ok=True)
    assert send(table, request(chain(2, 10)), CPU, 5.0) == ("slot_place", 1)
    assert send(table, request(chain(3, 10)), CPU, 5.0) == ("slot_place", 3)
    assert send(table, request(chain(4, 10)), CPU, 5.0) == ("slot_place", 0)


def test_all_slots_busy_without_a_match_goes_unpinned_and_takes_the_first_freed() -> None:
    """With every slot busy and nothing to reuse, the server picks; the table follows it."""
    table = SlotTable(2, 4096)
    for i in range(2):
        send(table, request(chain(i + 1, 10), output=64), CPU, 0.0)
    assert send(table, request(chain(5, 10)), CPU, 0.1) == ("slot_busy", None)
    assert len(table.unplaced) == 1
    table.end(table.slots[1].tasks[0], 3.0, ok=True)
    assert not table.unplaced and table.slots[1].tasks[0].hashes == chain(5, 10)


def test_busy_holder_is_worth_waiting_for_even_with_idle_slots_elsewhere() -> None:
    """A slot prefilling the prefix right now is preferred to prefilling it again alongside."""
    table = SlotTable(2, 4096)
    send(table, request(chain(3, 30)), CPU, 0.0)
    reason, slot = send(table, request(chain(3, 30, tail=1, tail_blocks=1)), CPU, 0.5)
    assert (reason, slot) == ("slot_queue", 0)


def test_failed_prefill_forgets_the_slot_content() -> None:
    """A request that failed before its first token leaves the slot's content unknown."""
    table = SlotTable(1, 4096)
    send(table, request(chain(1, 10)), CPU, 0.0)
    table.end(table.slots[0].tasks[0], 1.0, ok=True)
    send(table, request(chain(2, 10)), CPU, 2.0)
    table.end(table.slots[0].tasks[0], 2.1, ok=False)
    assert table.slots[0].content == ()


def test_deferred_request_cancelled_leaves_the_slot_alone() -> None:
    """A queued request that never started does not change what its slot holds."""
    table = SlotTable(1, 4096)
    send(table, request(chain(1, 10)), CPU, 0.0)
    send(table, request(chain(1, 10, tail=2, tail_blocks=1)), CPU, 0.1)
    queued = table.slots[0].tasks[1]
    table.end(queued, 0.2, ok=False)
    assert table.slots[0].tasks == [table.slots[0].tasks[0]] and table.slots[0].content == ()


def test_reported_slot_places_an_unpinned_request() -> None:
    """A native response's ``id_slot`` tells the table where an unpinned request ran."""
    table = SlotTable(2, 4096)
    task = SlotTask(hashes=chain(4, 5), prompt_tokens=330, uncached_tokens=330,
                    decode_tokens=8, t_sent=0.0)  # fmt: skip
    table.place(task, None, 0.0)
    table.first_token(task, 0.5, reported_slot=1)
    assert task.slot == 1 and not table.unplaced and table.slots[1].tasks == [task]
    table.end(task, 1.0, ok=True)
    assert table.slots[1].content == chain(4, 5)


def test_reconcile_marks_slots_busy_with_traffic_from_elsewhere() -> None:
    """``/slots`` showing a slot busy with nothing of ours: its content is forgotten, it waits."""
    table = SlotTable(2, 4096)
    send(table, request(chain(1, 10)), CPU, 0.0)
    table.end(table.slots[0].tasks[0], 1.0, ok=True)
    observed = [
        {"id": 0, "is_processing": True, "id_task": 7},
        {"id": 1, "is_processing": False},
    ]
    assert table.reconcile(observed, 5.0, hold_s=4.0)
    assert table.slots[0].content == () and not table.slots[0].idle(6.0)
    assert send(table, request(chain(1, 10)), CPU, 6.0) == ("slot_place", 1)


def test_reconcile_sees_a_task_run_elsewhere_between_two_looks() -> None:
    """A slot whose task id moved while the proxy sent it nothing was overwritten."""
    table = SlotTable(1, 4096)
    send(table, request(chain(1, 10)), CPU, 0.0)
    table.end(table.slots[0].tasks[0], 1.0, ok=True)
    assert not table.reconcile([{"id": 0, "is_processing": False, "id_task": 3}], 5.0, hold_s=4.0)
    assert table.slots[0].content == chain(1, 10)
    assert table.reconcile([{"id": 0, "is_processing": False, "id_task": 9}], 7.0, hold_s=4.0)
    assert table.slots[0].content == ()


def test_reconcile_places_our_unpinned_request_instead_of_calling_it_foreign() -> None:
    """A busy slot explained by one of our unpinned requests is not traffic from elsewhere."""
    table = SlotTable(1, 4096)
    task = SlotTask(hashes=chain(4, 5), prompt_tokens=330, uncached_tokens=330,
                    decode_tokens=8, t_sent=0.0)  # fmt: skip
    table.place(task, None, 0.0)
    assert not table.reconcile([{"id": 0, "is_processing": True, "id_task": 1}], 3.0, hold_s=4.0)
    assert task.slot == 0


def test_rates_follow_faster_measurements_quickly_and_slower_ones_slowly() -> None:
    """A measurement under contention barely moves the estimate; a faster one moves it at once."""
    rates = Rates()
    assert rates.prefill_ms_per_token is None and rates.prefill_s == pytest.approx(0.0005)

    def record(prompt: int, cached: int, prefill_ms: float, tpot: float) -> RequestRecord:
        return RequestRecord(
            ts="",
            request_id="r",
            route="/v1/chat/completions",
            model=None,
            backend="b",
            stream=True,
            status=200,
            prompt_tokens=prompt,
            cached_tokens=cached,
            backend_prefill_ms=prefill_ms,
            tpot_ms=tpot,
            completion_tokens=10,
        )

    rates.observe(record(1000, 0, 6000.0, 20.0))
    assert rates.prefill_ms_per_token == pytest.approx(6.0)
    rates.observe(record(1000, 0, 24000.0, 80.0))
    assert rates.prefill_ms_per_token == pytest.approx(6.9)
    rates.observe(record(1000, 990, 5.0, 20.0))  # too few uncached tokens to measure prefill
    assert rates.prefill_ms_per_token == pytest.approx(6.9)
    assert rates.tpot_ms is not None and rates.tpot_ms < 24.0
