"""The scheduler's pieces on their own: the in-flight prefix registry, the switches, the ticket."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from proxy.backends import CHAT, BackendInfo, dialect_named
from proxy.config import BackendSpec, ConfigError, resolve
from proxy.exchange import Exchange, build_record
from proxy.fingerprint import fingerprint
from proxy.fleet import Replica
from proxy.prefixes import PrefixTracker, PrefixView
from proxy.records import Observation, Pricing, RecordBuilder, RequestRecord, Slo
from proxy.redact import Redactor
from proxy.scheduling import Scheduler, SchedulingConfig, Ticket, requested_output
from proxy.scheduling.coalesce import InflightPrefixes, wait_for_leader
from proxy.store import EmbeddedStore


def replica(dialect: str, slots: int | None = 4) -> Replica:
    r = Replica(spec=BackendSpec(url=f"http://{dialect}:1"), dialect=dialect_named(dialect))
    r.info = BackendInfo(dialect=dialect, slots=slots, ctx_per_slot=4096)
    return r


def view_of(system: str, question: str = "q") -> PrefixView:
    body = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]
    }
    fp = fingerprint("/v1/chat/completions", body, block_bytes=256)
    return PrefixView(fp=fp, namespace="default", matched_blocks={})


def record(backend: str, **fields: object) -> RequestRecord:
    return RequestRecord(
        ts="", request_id="r", route="/v1/chat/completions", model=None, backend=backend,
        stream=False, status=200, **fields,  # type: ignore[arg-type]  # test records
    )  # fmt: skip


LONG = "policy text " * 400
SCHEDULE_FIELDS = ("schedule_reason", "held_ms", "slot")


def record_of(ticket: Ticket, backend: str, **observed: Any) -> RequestRecord:
    """The record the proxy builds for a request that carried ``ticket`` to ``backend``."""
    ex = Exchange(
        request_id="r",
        route=CHAT,
        upstream_path="/v1/chat/completions",
        obs=Observation(t_start=0.0, t_end=0.0, **observed),
        backend_url=backend,
        status=200,
        ticket=ticket,
    )
    return build_record(
        ex,
        builder=RecordBuilder(slo=Slo(), pricing=Pricing()),
        tracker=PrefixTracker(EmbeddedStore(), block_bytes=64),
        redactor=Redactor.build(),
        log_prompts=False,
    )


def schedule_fields(rec: RequestRecord) -> dict[str, Any]:
    """The scheduler's keys of the record's JSON line."""
    return {k: v for k, v in rec.as_dict().items() if k in SCHEDULE_FIELDS}


def test_registry_finds_the_run_of_blocks_in_flight() -> None:
    """The shared run starts at the first block a leader owns and ends where ownership does."""
    reg = InflightPrefixes()
    leader = reg.lead((1, 2, 3, 4), streamed=True, expected_prefill_s=1.0)
    assert leader is not None
    assert reg.shared((1, 2, 3, 9)) == (leader, 3)
    assert reg.shared((7, 8)) == (None, 0)
    second = reg.lead((1, 2, 3, 4, 5, 6), streamed=True, expected_prefill_s=1.0)
    assert second is not None and second.blocks == (5, 6)
    assert reg.shared((1, 2, 3, 4, 5, 6)) == (second, 6)
    reg.release(leader)
    assert reg.shared((1, 2, 3, 4, 5, 6)) == (second, 2)
    assert leader.done.is_set() and len(reg) == 2


async def test_waiting_ends_at_the_leaders_first_token() -> None:
    """A follower is released when the leader's blocks are cached, not at the bound."""
    reg = InflightPrefixes()
    leader = reg.lead((1, 2), streamed=True, expected_prefill_s=10.0)
    assert leader is not None
    waiter = asyncio.create_task(wait_for_leader(leader, 10.0))
    await asyncio.sleep(0)
    reg.release(leader)
    assert await waiter is True


async def test_waiting_is_bounded() -> None:
    """A leader that does not answer in time releases nobody; the follower goes at the bound."""
    reg = InflightPrefixes()
    leader = reg.lead((1,), streamed=True, expected_prefill_s=10.0)
    assert leader is not None
    assert await wait_for_leader(leader, 0.01) is False


async def test_non_streamed_leader_counts_as_cached_after_its_expected_prefill() -> None:
    """No first token is visible on a non-streamed answer: its expected prefill end stands in."""
    reg = InflightPrefixes()
    leader = reg.lead((1,), streamed=False, expected_prefill_s=0.01)
    assert leader is not None
    assert await wait_for_leader(leader, 5.0) is True


def test_which_feature_applies_to_which_replica() -> None:
    """Pinning: llama.cpp with two or more slots (one with ``on``); coalescing: the others."""
    auto = Scheduler(SchedulingConfig(), tokens_per_byte=lambda m: 0.25)
    assert auto.pins(replica("llamacpp")) and not auto.coalesces(replica("llamacpp"))
    assert not auto.pins(replica("llamacpp", slots=1))
    assert not auto.pins(replica("llamacpp", slots=None))
    assert auto.coalesces(replica("vllm")) and auto.coalesces(replica("openai"))
    assert not auto.pins(replica("vllm"))
    on = Scheduler(SchedulingConfig(slot_scheduling="on"), tokens_per_byte=lambda m: 0.25)
    assert on.pins(replica("llamacpp", slots=1))
    off = Scheduler(
        SchedulingConfig(slot_scheduling="off", coalesce=False), tokens_per_byte=lambda m: 0.25
    )
    assert not off.pins(replica("llamacpp")) and not off.coalesces(replica("vllm"))


def test_output_limit_spellings() -> None:
    """max_completion_tokens, max_tokens and llama.cpp's n_predict all bound the answer."""
    assert requested_output({"max_tokens": 16}) == 16.0
    assert requested_output({"max_completion_tokens": 32, "max_tokens": 16}) == 32.0
    assert requested_output({"n_predict": 8}) == 8.0
    assert requested_output({"n_predict": -1}) is None
    assert requested_output({"max_tokens": True}) is None


async def test_ticket_records_the_decision_and_frees_the_slot() -> None:
    """The record gets reason and slot; after the end the slot holds the request's prompt."""
    scheduler = Scheduler(SchedulingConfig(), tokens_per_byte=lambda m: 0.25)
    llama = replica("llamacpp")
    ticket = Ticket()
    body: dict[str, object] = {"max_tokens": 4}
    view = view_of(LONG)
    await scheduler.admit(ticket, llama, view, body, model=None, stream=False)
    assert body["id_slot"] == 0 and ticket.body_changed
    ticket.first_token({"id_slot": 0})
    ticket.end(ok=True)
    rec = record_of(
        ticket, llama.url, prompt_tokens=1200, cached_tokens=0, backend_prefill_ms=6000.0
    )
    scheduler.learn(rec, ticket)
    assert schedule_fields(rec) == {"schedule_reason": "slot_place", "held_ms": 0.0, "slot": 0}
    table = scheduler.state(llama.url).table
    assert table is not None and table.slots[0].content == view.fp.block_hashes
    assert scheduler.state(llama.url).rates.prefill_ms_per_token == pytest.approx(5.0)


async def test_request_to_an_unscheduled_replica_is_left_alone() -> None:
    """Scheduling off for a replica: no field in the body, nothing in the record."""
    scheduler = Scheduler(SchedulingConfig(slot_scheduling="off"), tokens_per_byte=lambda m: 0.25)
    ticket = Ticket()
    body: dict[str, object] = {}
    await scheduler.admit(
        ticket, replica("llamacpp"), view_of(LONG), body, model=None, stream=False
    )
    assert body == {} and not ticket.body_changed
    rec = record_of(ticket, "http://llamacpp:1")
    scheduler.learn(rec, ticket)
    assert schedule_fields(rec) == {}


def test_scheduling_options_resolve_from_flags_and_environment() -> None:
    """``--slot-scheduling``, ``--coalesce``, ``--coalesce-max-wait-ms``, ``--fanout``."""
    s = resolve({"backend": ["http://a:1"]}, environ={})
    assert s.scheduling == SchedulingConfig()
    s = resolve(
        {"backend": ["http://a:1"], "slot_scheduling": "on", "coalesce": "off"},
        environ={"PREFIXGATE_FANOUT": "on", "PREFIXGATE_COALESCE_MAX_WAIT_MS": "500"},
    )
    assert s.scheduling.slot_scheduling == "on" and not s.scheduling.coalesce
    assert s.scheduling.fanout and s.scheduling.coalesce_max_wait_ms == 500.0
    with pytest.raises(ConfigError, match="slot-scheduling"):
        resolve({"backend": ["http://a:1"], "slot_scheduling": "sometimes"}, environ={})
    with pytest.raises(ConfigError, match="coalescing wait"):
        resolve({"backend": ["http://a:1"], "coalesce_max_wait_ms": -1}, environ={})
