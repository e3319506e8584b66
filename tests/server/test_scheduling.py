"""Slot scheduling through the proxy, against a llama-server fake with one prompt cache per slot."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import aiohttp
import pytest
from fakes import Knobs, MakeProxy, ProxyClient, SlotLlamaFake, serve

from proxy import handlers
from proxy.scheduling import SchedulingConfig, SlotTable
from proxy.state import STATE

SYSTEM = " ".join(f"rule{i} keep answers short and cite policy section {i}." for i in range(60))
WORDS = len(SYSTEM.split()) + 4  # the system prompt plus role names and a short question


def chat(system: str, question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 4,
        **extra,
    }


async def post_all(client: ProxyClient, bodies: list[dict[str, Any]], path: str = "") -> None:
    async def one(body: dict[str, Any]) -> None:
        resp = await client.post(path or "/v1/chat/completions", json=body)
        assert resp.status == 200, await resp.text()
        await resp.read()

    await asyncio.gather(*(one(b) for b in bodies))


@pytest.fixture
async def slot_fake(aiohttp_server: Any) -> SlotLlamaFake:
    """A four-slot llama-server fake: 0.2 ms of prefill per prompt word, instant answers."""
    return await serve(SlotLlamaFake(Knobs(prefill_ms_per_token=0.2), slots=4), aiohttp_server)


async def test_burst_sharing_a_new_prefix_is_prefilled_once(
    slot_fake: SlotLlamaFake, make_proxy: MakeProxy
) -> None:
    """Four concurrent requests with one new system prompt share one slot: one prefill."""
    client, records, _ = await make_proxy(slot_fake.url)
    await post_all(client, [chat(SYSTEM, f"question {i}?") for i in range(4)])
    await records.wait(4)
    assert len(set(slot_fake.assigned)) == 1
    assert slot_fake.prompt_processed <= 1.5 * WORDS
    reasons = sorted(r.schedule_reason for r in records)
    assert reasons == ["slot_place", "slot_queue", "slot_queue", "slot_queue"]
    assert {r.slot for r in records} == set(slot_fake.assigned)
    assert all(b["id_slot"] == slot_fake.assigned[0] for b in slot_fake.requests)
    assert all(r.held_ms == 0.0 for r in records)


async def test_burst_without_scheduling_prefills_per_slot(
    slot_fake: SlotLlamaFake, make_proxy: MakeProxy
) -> None:
    """With ``--slot-scheduling off`` the server spreads the burst and prefills it four times."""
    client, records, _ = await make_proxy(
        slot_fake.url, scheduling=SchedulingConfig(slot_scheduling="off")
    )
    await post_all(client, [chat(SYSTEM, f"question {i}?") for i in range(4)])
    await records.wait(4)
    assert len(set(slot_fake.assigned)) == 4
    assert slot_fake.prompt_processed >= 3.5 * WORDS
    assert all("id_slot" not in b for b in slot_fake.requests)
    assert all(r.schedule_reason is None for r in records)


async def test_unrelated_burst_spreads_over_idle_slots(
    slot_fake: SlotLlamaFake, make_proxy: MakeProxy
) -> None:
    """Requests sharing nothing each get their own idle slot, as the server would give them."""
    client, records, _ = await make_proxy(slot_fake.url)
    await post_all(client, [chat(f"app{i} " + SYSTEM, "hello?") for i in range(4)])
    await records.wait(4)
    assert sorted(slot_fake.assigned) == [0, 1, 2, 3]
    assert [r.schedule_reason for r in records] == ["slot_place"] * 4


async def test_long_answers_run_in_parallel_when_decoding_dominates(
    slot_fake: SlotLlamaFake, make_proxy: MakeProxy
) -> None:
    """Where waiting for another's long answer costs more than a prefill, none waits."""
    client, records, app = await make_proxy(slot_fake.url)
    rates = app[STATE].scheduler.state(slot_fake.url).rates
    rates.prefill_ms_per_token, rates.tpot_ms = 0.05, 50.0
    await post_all(client, [chat(SYSTEM, f"question {i}?", max_tokens=512) for i in range(4)])
    await records.wait(4)
    assert len(set(slot_fake.assigned)) == 4
    reasons = sorted(r.schedule_reason for r in records)
    assert reasons == ["slot_parallel", "slot_parallel", "slot_parallel", "slot_place"]


async def test_next_request_hits_the_slot_holding_its_prefix(
    slot_fake: SlotLlamaFake, make_proxy: MakeProxy
) -> None:
    """A later request goes back to the idle slot that holds its prefix, not the LRU one."""
    client, records, _ = await make_proxy(slot_fake.url)
    await post_all(client, [chat(f"app{i} " + SYSTEM, "hello?") for i in range(3)])
    await post_all(client, [chat("app1 " + SYSTEM, "and again?")])
    last = await records.wait(4)
    assert last.schedule_reason == "slot_hit"
    assert last.slot == slot_fake.assigned[1]
    assert last.cached_tokens is not None and last.cached_tokens >= WORDS - 8


async def test_client_id_slot_is_kept(slot_fake: SlotLlamaFake, make_proxy: MakeProxy) -> None:
    """A client that pins a slot itself keeps its choice; the proxy records it."""
    client, records, _ = await make_proxy(slot_fake.url)
    await post_all(client, [chat(SYSTEM, "q?", id_slot=2)])
    rec = await records.wait(1)
    assert slot_fake.last_body is not None and slot_fake.last_body["id_slot"] == 2
    assert rec.schedule_reason == "slot_client" and rec.slot == 2
    await post_all(client, [chat(SYSTEM, "next?")])
    assert (await records.wait(2)).slot == 2


async def test_native_completion_learns_the_slot_the_server_chose(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """With every slot busy a request goes unpinned; the native answer's id_slot places it."""
    knobs = Knobs(tokens=["tok"] * 20, prefill_ms_per_token=0.1, token_delay_s=0.02)
    fake = await serve(SlotLlamaFake(knobs, slots=2), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)
    busy = [
        asyncio.create_task(post_all(client, [chat(f"app{i} " + SYSTEM, "long?", stream=True)]))
        for i in range(2)
    ]
    await fake.wait_requests(2)
    body = {"prompt": "unrelated text " * 40, "n_predict": 4}
    await post_all(client, [body], path="/completion")
    await asyncio.gather(*busy)
    records_by_route = {r.route: r for r in await _all(records, 3)}
    native = records_by_route["/completion"]
    assert native.schedule_reason == "slot_busy"
    assert "id_slot" not in fake.requests[-1]
    assert native.slot == fake.assigned[-1]


async def _all(records: Any, n: int) -> list[Any]:
    await records.wait(n)
    return list(records)


async def test_foreign_traffic_turns_pinning_off_in_auto_mode(
    slot_fake: SlotLlamaFake, make_proxy: MakeProxy
) -> None:
    """``/slots`` showing a request the proxy did not send: auto mode leaves slots to the server."""
    client, records, app = await make_proxy(slot_fake.url)
    await post_all(client, [chat(SYSTEM, "warm?")])
    await records.wait(1)
    scheduler = app[STATE].scheduler
    state = scheduler.state(slot_fake.url)
    slot_fake.slot_busy[3] = True  # a request from elsewhere is running on slot 3
    slot_fake.slot_task[3] = 99
    await scheduler.refresh(state)
    slot_fake.slot_busy[3] = False
    await post_all(client, [chat(SYSTEM, "next?")])
    rec = await records.wait(2)
    assert rec.schedule_reason == "slot_foreign" and rec.slot is None
    assert slot_fake.last_body is not None and "id_slot" not in slot_fake.last_body


async def test_foreign_traffic_does_not_stop_pinning_when_on(
    slot_fake: SlotLlamaFake, make_proxy: MakeProxy
) -> None:
    """``--slot-scheduling on`` keeps pinning; the foreign slot is only avoided."""
    client, records, app = await make_proxy(
        slot_fake.url, scheduling=SchedulingConfig(slot_scheduling="on")
    )
    scheduler = app[STATE].scheduler
    await post_all(client, [chat(SYSTEM, "warm?")])
    await records.wait(1)
    slot_fake.slot_busy[1], slot_fake.slot_task[1] = True, 99
    await scheduler.refresh(scheduler.state(slot_fake.url))
    slot_fake.slot_busy[1] = False
    await post_all(client, [chat(SYSTEM, "next?")])
    rec = await records.wait(2)
    assert rec.schedule_reason == "slot_hit"


async def test_fanout_copies_a_busy_slot_so_followers_decode_in_parallel(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """With fan-out, requests waiting for a busy slot's prefix get copies of it in idle slots."""
    fake = await serve(
        SlotLlamaFake(Knobs(prefill_ms_per_token=0.2, token_delay_s=0.02), slots=4, slot_save=True),
        aiohttp_server,
    )
    client, records, _ = await make_proxy(fake.url, scheduling=SchedulingConfig(fanout=True))
    await post_all(client, [chat(SYSTEM, f"question {i}?", max_tokens=8) for i in range(4)])
    await records.wait(4)
    reasons = sorted(r.schedule_reason for r in records)
    assert reasons.count("slot_fanout") >= 2, reasons
    assert fake.saves == 1 and fake.restores == reasons.count("slot_fanout")
    assert len(set(fake.assigned)) >= 3
    assert fake.prompt_processed <= 1.5 * WORDS
    held = [r.held_ms for r in records if r.schedule_reason == "slot_fanout"]
    assert all(h > 0 for h in held)


async def test_fanout_without_slot_save_path_falls_back_to_queueing(
    slot_fake: SlotLlamaFake, make_proxy: MakeProxy
) -> None:
    """A server without ``--slot-save-path`` refuses the save; requests queue as without fan-out."""
    client, records, _ = await make_proxy(slot_fake.url, scheduling=SchedulingConfig(fanout=True))
    await post_all(client, [chat(SYSTEM, f"question {i}?") for i in range(4)])
    await records.wait(4)
    assert len(set(slot_fake.assigned)) == 1
    assert slot_fake.prompt_processed <= 1.5 * WORDS


async def test_a_new_conversation_is_seeded_with_a_copy_of_the_shared_prefix(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """The second conversation's first request takes the idle empty slot, seeded with a copy of
    the slot holding the shared system prompt: the first conversation keeps its slot, and the
    shared prompt is not prefilled twice."""
    # 2 ms a token: a CPU's prefill, which the copy (50 µs a token before one is measured) beats
    fake = await serve(
        SlotLlamaFake(Knobs(prefill_ms_per_token=2.0), slots=2, slot_save=True), aiohttp_server
    )
    client, records, _ = await make_proxy(fake.url)
    await post_all(client, [chat(SYSTEM, "first conversation: rule one?")])
    await records.wait(1)
    before = fake.prompt_processed
    await post_all(client, [chat(SYSTEM, "second conversation: rule two?")])
    rec = await records.wait(2)
    assert rec.schedule_reason == "slot_copy", rec.schedule_reason
    assert fake.saves == 1 and fake.restores == 1
    assert fake.assigned[0] != fake.assigned[1]
    assert "first" in fake.slot_words[fake.assigned[0]]  # the first conversation's slot is intact
    assert fake.prompt_processed - before < 10  # only the new question was prefilled
    assert rec.held_ms > 0 and rec.cached_tokens is not None
    assert rec.predicted_cached_tokens == pytest.approx(rec.cached_tokens, rel=0.1)


async def test_seeding_without_slot_save_path_is_tried_once_and_turns_itself_off(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """A server without ``--slot-save-path`` refuses the first save; the request runs as it
    would have, and no copy is tried again."""
    slot_fake = await serve(SlotLlamaFake(Knobs(prefill_ms_per_token=2.0), slots=2), aiohttp_server)
    client, records, app = await make_proxy(slot_fake.url)
    for i in range(3):
        await post_all(client, [chat(SYSTEM, f"conversation {i}: rule {i}?")])
        await records.wait(i + 1)
    assert all(r.status == 200 for r in records)
    assert all(r.schedule_reason != "slot_copy" for r in records)
    state = app[STATE].scheduler.state(slot_fake.url)
    assert state.endpoint is not None and not state.endpoint.save_supported
    assert slot_fake.saves == 0 and records[1].schedule_reason == "slot_hit"


class _LosesSnapshots(SlotLlamaFake):
    """A save path whose files vanish between the save and the restore."""

    async def slot_action(self, request: Any) -> Any:
        if request.query.get("action") == "restore":
            self._files.clear()
        return await super().slot_action(request)


async def test_a_failed_restore_runs_the_request_from_nothing_and_says_so(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """The restore fails after the save: the request still runs on its slot, recorded as a
    placement with nothing predicted, and the model learns nothing from it."""
    fake = await serve(
        _LosesSnapshots(Knobs(prefill_ms_per_token=2.0), slots=2, slot_save=True), aiohttp_server
    )
    client, records, app = await make_proxy(fake.url)
    await post_all(client, [chat(SYSTEM, "first conversation: rule one?")])
    await records.wait(1)
    await post_all(client, [chat(SYSTEM, "second conversation: rule two?")])
    rec = await records.wait(2)
    assert rec.status == 200 and fake.saves == 1 and fake.restores == 0
    assert rec.schedule_reason == "slot_place" and rec.predicted_cached_tokens == 0
    table = app[STATE].scheduler.state(fake.url).table
    assert table is not None and table.counter.closing is None


async def _first_token_then(
    client: ProxyClient, body: dict[str, Any], wait_s: float
) -> aiohttp.ClientResponse:
    """Stream ``body``, read up to its first token (a non-empty content: the fake's first event
    carries only the role), then wait ``wait_s``."""
    resp = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert resp.status == 200
    read = b""
    while re.search(rb'"content":"[^"]', read) is None:
        if resp.content.at_eof():
            pytest.fail(f"the stream ended without a token: {read!r}")
        read += await resp.content.readany()
    await asyncio.sleep(wait_s)
    return resp


@pytest.mark.parametrize("delay_s", [0.001, 30.0])
async def test_the_model_work_a_first_token_waited_for_runs_a_moment_after_it(
    aiohttp_server: Any, make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch, delay_s: float
) -> None:
    """The first token is written before the slot model's launch is applied: that work runs
    ``AFTER_FIRST_TOKEN_S`` later (mid-answer here), or at the table's next use, whichever
    comes first; its end at the latest."""
    monkeypatch.setattr(handlers, "AFTER_FIRST_TOKEN_S", delay_s)
    fake = await serve(SlotLlamaFake(Knobs(token_delay_s=0.2), slots=4), aiohttp_server)
    # (no /slots read meanwhile: it would apply the launch too)
    client, records, app = await make_proxy(
        fake.url, scheduling=SchedulingConfig(slots_poll_s=60.0)
    )
    state = app[STATE]
    resp = await _first_token_then(client, chat(SYSTEM, "q?"), 0.05)
    table = state.scheduler.state(fake.url).table
    assert table is not None and not resp.content.at_eof()  # (mid-answer)
    if delay_s < 0.01:
        assert table._pending_launch is None and state.after_first is None
    else:
        assert table._pending_launch is not None and state.after_first is not None
        assert table._pending_launch[1].t_first_token is not None  # (stamped, not launched)
    await resp.read()
    record = await records.wait(1)
    assert table._pending_launch is None  # (the request's end applied it at the latest)
    assert record.schedule_reason == "slot_place" and record.slot == fake.assigned[0]
    assert table.slots[record.slot].state is not None


async def test_each_request_is_measured_into_the_cache_model_once(
    slot_fake: SlotLlamaFake, make_proxy: MakeProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's usage is learned once (at its end, before its slot is handed on), not again
    when its record is written: the model's running estimates move once per measurement."""
    measured: list[Any] = []
    original = SlotTable.measured

    def counted(self: SlotTable, task: Any, **figures: Any) -> None:
        measured.append(task)
        original(self, task, **figures)

    monkeypatch.setattr(SlotTable, "measured", counted)
    client, records, _ = await make_proxy(slot_fake.url)
    await post_all(client, [chat(SYSTEM, "first?")])
    resp = await client.post("/v1/chat/completions", json={**chat(SYSTEM, "next?"), "stream": True})
    assert resp.status == 200
    await resp.read()
    await records.wait(2)
    assert all(r.prompt_tokens for r in records)
    assert len(measured) == 2 and measured[0] is not measured[1]
