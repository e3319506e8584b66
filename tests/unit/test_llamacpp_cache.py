"""The model of llama-server's slots and RAM prompt cache, against the server's own rules."""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from proxy.backends.llamacpp_cache import (
    MAX_RAM_ENTRIES,
    SOURCE_NONE,
    SOURCE_RAM,
    SOURCE_SLOT,
    RamCache,
    ServerRules,
    SlotView,
    contains,
    launch,
    pick,
    probe_of,
    restorable,
)
from proxy.backends.llamacpp_tokens import CachedPrompt, PromptQuery, TokenCounter
from proxy.fingerprint import common_blocks, fingerprint, fingerprint_with_data, render
from proxy.scheduling import Rates, SlotChoice, SlotRequest, SlotTable, SlotTask

TPB = 64.0
CPU = Rates(prefill_ms_per_token=6.0, tpot_ms=20.0)


def chain(prefix: int, n: int, tail: int = 0, tail_blocks: int = 0) -> tuple[int, ...]:
    return tuple(prefix * 1000 + i for i in range(n)) + tuple(
        tail * 1_000_000 + i for i in range(tail_blocks)
    )


def state(hashes: tuple[int, ...], t: float = 0.0) -> CachedPrompt:
    return CachedPrompt(hashes=hashes, prompt_tokens=len(hashes) * TPB, t_used=t)


def query(hashes: tuple[int, ...]) -> PromptQuery:
    return PromptQuery(hashes, len(hashes) * TPB + 10, TPB)


def test_pinned_onto_an_empty_slot_never_looks_in_the_ram_cache() -> None:
    """f_keep of an empty slot is 0/0: the server skips its RAM cache (BACKENDS.md §1.11)."""
    rules = ServerRules()
    ram = RamCache(rules)
    ram.save(state(chain(1, 10)))
    slots = [SlotView(None, False, 0.0), SlotView(state(chain(2, 10)), False, 1.0)]
    got = pick(slots, ram, query(chain(1, 12)), TokenCounter(), pinned=0, rules=rules)
    assert (got.slot, got.update, got.cached_tokens, got.source) == (0, False, 0.0, SOURCE_NONE)


def test_unpinned_takes_the_lru_path_and_restores_when_no_slot_is_similar() -> None:
    """Nothing above the similarity threshold: LRU slot, saved, best RAM prompt loaded."""
    rules = ServerRules()
    ram = RamCache(rules)
    conv = state(chain(1, 10))
    ram.save(conv)
    slots = [SlotView(state(chain(2, 10)), False, 5.0), SlotView(state(chain(3, 10)), False, 1.0)]
    got = pick(slots, ram, query(chain(1, 12)), TokenCounter(), pinned=None, rules=rules)
    assert got.slot == 1 and got.update and got.loaded is conv
    assert got.source == SOURCE_RAM and got.cached_tokens == 10 * TPB


def test_a_request_waiting_for_any_slot_gets_the_one_that_freed() -> None:
    """``idle``: the server finds that slot idle and no other, whatever the views say (the
    similar slot and the least recently used one are both passed over)."""
    rules = ServerRules()
    ram = RamCache(rules)
    similar = state(chain(1, 10))
    slots = [
        SlotView(similar, False, 5.0),
        SlotView(state(chain(2, 10)), False, 1.0),
        SlotView(state(chain(3, 10)), False, 3.0),
    ]
    q = query(chain(1, 12))
    assert pick(slots, ram, q, TokenCounter(), pinned=None, rules=rules).slot == 0
    got = pick(slots, ram, q, TokenCounter(), pinned=None, rules=rules, idle=2)
    assert got.slot == 2 and got.update  # the LRU path on it: saved, nothing similar
    off = replace(rules, similarity=0.0)
    assert pick(slots, ram, q, TokenCounter(), pinned=None, rules=off).slot == 1
    assert pick(slots, ram, q, TokenCounter(), pinned=None, rules=off, idle=2).slot == 2


def test_a_slot_keeping_half_its_tokens_is_overwritten_without_a_restore() -> None:
    """Shared system prompt, short histories: f_keep >= 0.5, so the history is recomputed."""
    rules = ServerRules()
    ram = RamCache(rules)
    own = state(chain(1, 8, tail=7, tail_blocks=2))  # this conversation's history, in RAM
    ram.save(own)
    other = state(chain(1, 8, tail=8, tail_blocks=2))  # another conversation on the slot
    slots = [SlotView(other, False, 1.0)]
    q = query(chain(1, 8, tail=7, tail_blocks=3))
    got = pick(slots, ram, q, TokenCounter(), pinned=None, rules=rules)
    assert got.slot == 0 and not got.update and got.source == SOURCE_SLOT
    assert got.cached_tokens == 8 * TPB  # the shared prefix only
    # With similarity off the LRU path saves the slot and restores the conversation.
    off = replace(rules, similarity=0.0)
    got = pick(slots, ram, q, TokenCounter(), pinned=None, rules=off)
    assert got.update and got.loaded is own and got.cached_tokens == 10 * TPB
    # ...but a pinned request never updates with similarity off.
    got = pick(slots, ram, q, TokenCounter(), pinned=0, rules=off)
    assert not got.update and got.cached_tokens == 8 * TPB


def test_a_slot_losing_most_of_its_tokens_is_saved_and_the_best_prompt_loaded() -> None:
    """f_keep < 0.5 on the similarity path: save the slot, load the better cached prompt."""
    rules = ServerRules()
    ram = RamCache(rules)
    own = state(chain(1, 2, tail=7, tail_blocks=8))
    ram.save(own)
    other = state(chain(1, 2, tail=8, tail_blocks=8))
    slots = [SlotView(other, False, 1.0)]
    got = pick(
        slots, ram, query(chain(1, 2, tail=7, tail_blocks=9)), TokenCounter(), pinned=0, rules=rules
    )
    assert got.update and got.loaded is own and got.source == SOURCE_RAM


def test_ram_entries_kept_below_a_quarter_are_not_taken() -> None:
    """server_prompt_cache::load skips entries the prompt would keep less than 25 % of."""
    rules = ServerRules(similarity=0.0)
    ram = RamCache(rules)
    ram.save(state(chain(1, 2, tail=9, tail_blocks=20)))  # shares 2 of 22 blocks
    slots = [SlotView(None, False, 0.0)]
    got = pick(
        slots,
        ram,
        query(chain(1, 2, tail=5, tail_blocks=2)),
        TokenCounter(),
        pinned=None,
        rules=rules,
    )
    assert got.update and got.loaded is None and got.cached_tokens == 0.0


def test_launch_saves_idle_slots_and_clears_them_under_unified_kv() -> None:
    """--cache-idle-slots: idle slots go to the RAM cache at every launch; unified KV clears."""
    rules = ServerRules(unified=True)
    ram = RamCache(rules)
    idle = state(chain(2, 5))
    slots = [SlotView(None, False, 0.0), SlotView(idle, False, 1.0)]
    got = pick(slots, ram, query(chain(3, 4)), TokenCounter(), pinned=0, rules=rules)
    launch(slots, ram, got, rules=rules)
    assert ram.entries == [idle] and slots[1].state is None


def test_ram_save_drops_what_the_new_state_holds_and_skips_what_is_held() -> None:
    """alloc: an entry contained in the new state goes; a state already contained is skipped."""
    ram = RamCache(ServerRules())
    short, long = state(chain(1, 4)), state(chain(1, 8))
    ram.save(short)
    ram.save(long)
    assert ram.entries == [long]
    ram.save(state(chain(1, 6)))
    assert ram.entries == [long]


def test_a_full_slot_stays_restorable_with_similarity_off_only() -> None:
    """A conversation overwritten by one sharing most of it cannot come back from RAM while
    similarity is on (f_keep >= 0.5); with it off the LRU path always looks there."""
    conv = state(chain(1, 8, tail=7, tail_blocks=2))
    other = state(chain(1, 8, tail=8, tail_blocks=2))
    counter = TokenCounter()
    assert not restorable(conv, other, RamCache(ServerRules()), counter, rules=ServerRules())
    off = ServerRules(similarity=0.0)
    ram = RamCache(off)
    assert not restorable(conv, other, ram, counter, rules=off)  # never saved: lost
    ram.save(conv)
    assert restorable(conv, other, ram, counter, rules=off)


@given(
    prompt=st.floats(min_value=1.0, max_value=1e6),
    generated=st.floats(min_value=0.0, max_value=1e4),
    measured=st.tuples(st.integers(0, 10**6), st.none() | st.integers(0, 10**4)),
)
def test_a_states_tokens_follow_its_prompt_and_answer(
    prompt: float, generated: float, measured: tuple[int, int | None]
) -> None:
    """``tokens`` (a plain attribute the RAM cache sums) is the prompt plus the generated
    tokens but the last, at construction and after every ``measure``."""
    held = CachedPrompt(hashes=(1,), prompt_tokens=prompt, generated=generated)
    assert held.tokens == prompt + max(generated - 1.0, 0.0)
    held.measure(*measured)
    assert held.tokens == held.prompt_tokens + max(held.generated - 1.0, 0.0)
    held.generated = 3.0
    assert held.tokens == held.prompt_tokens + 2.0


def test_restorable_takes_the_shared_tokens_the_caller_counted() -> None:
    """Handed the evicted state's match in the replacing one (``SlotTable.eviction_s`` has it),
    ``restorable`` answers as it does counting it itself."""
    counter = TokenCounter()
    rules = ServerRules()
    ram = RamCache(rules)
    for conv, other in (
        (state(chain(1, 8, tail=7, tail_blocks=2)), state(chain(1, 8, tail=8, tail_blocks=2))),
        (state(chain(1, 2, tail=7, tail_blocks=8)), state(chain(1, 2, tail=8, tail_blocks=8))),
        (state(chain(1, 8)), state(chain(2, 8))),
    ):
        ram.save(conv)
        kept = counter.cached(other, probe_of(conv))
        assert restorable(conv, other, ram, counter, rules=rules, shared=kept) == restorable(
            conv, other, ram, counter, rules=rules
        )
    # A long conversation with a long answer, replaced by a short prompt sharing its first
    # block: the replacing slot keeps half (no save by f_keep), and what it shares is under the
    # similarity bar only as a share of all the evicted state holds, answer included.
    long = state(chain(1, 8))
    long.measure(512, 1000)
    short = state(chain(1, 1, tail=9, tail_blocks=1))
    ram.save(long)
    kept = counter.cached(short, probe_of(long))
    assert kept == 64.0 and kept / short.tokens == 0.5 and kept / long.prompt_tokens > 0.1
    assert restorable(long, short, ram, counter, rules=rules, shared=kept)
    assert restorable(long, short, ram, counter, rules=rules)


def test_next_turn_shares_the_measured_prompt_and_the_repeated_answer() -> None:
    """A request continuing a state shares its measured prompt tokens plus the answer."""
    first = {"model": "m", "messages": [{"role": "user", "content": "hello " * 200}]}
    fp1 = fingerprint("/v1/chat/completions", first, block_bytes=256)
    second = {
        "model": "m",
        "messages": [
            *first["messages"],
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "more"},
        ],
    }
    fp2 = fingerprint("/v1/chat/completions", second, block_bytes=256)
    held = CachedPrompt(hashes=fp1.block_hashes, prompt_tokens=300.0, fp=fp1)
    held.measure(211, 9)
    counter = TokenCounter()
    q = PromptQuery(fp2.block_hashes, 240.0, TPB, fp2)
    shared = counter.shared(held, q)
    assert shared.continues and shared.tokens == 211 + 8
    counter.learn(shared, held, measured=213.0, prompt=240.0)  # the answer was not repeated
    assert counter.answer_reuse < 1.0


def test_a_match_ending_at_a_boundary_learns_its_token_count() -> None:
    """The first measured cached count at a boundary replaces the byte estimate there."""
    counter = TokenCounter()
    held = state(chain(1, 8, tail=8, tail_blocks=2))
    q = query(chain(1, 8, tail=7, tail_blocks=3))
    shared = counter.shared(held, q)
    assert shared.tokens == 8 * TPB and shared.key is not None
    counter.learn(shared, held, measured=497.0, prompt=q.prompt_tokens)
    assert counter.shared(held, q).tokens == 497.0


def _send(table: SlotTable, hashes: tuple[int, ...], now: float) -> tuple[str, int | None, bool]:
    req = SlotRequest(
        hashes=hashes,
        prompt_tokens=len(hashes) * TPB + 10,
        decode_tokens=16.0,
        tokens_per_block=TPB,
    )
    choice = table.choose(req, CPU, now, useful_tokens=256)
    task = SlotTask(
        hashes=req.hashes,
        prompt_tokens=req.prompt_tokens,
        uncached_tokens=choice.uncached_tokens,
        decode_tokens=16.0,
        t_sent=now,
        query=req.query(),
    )
    table.place(task, choice.slot, now, choice.pick)
    table.end(task, now + 1.0, ok=True)
    return choice.reason, choice.slot, choice.pinned


def test_more_conversations_than_slots_are_swapped_through_the_ram_cache() -> None:
    """Three conversations on two slots with similarity off: after the first round every turn
    is left to the server's LRU path, which restores that conversation's history."""
    table = SlotTable(2, 4096, rules=ServerRules(similarity=0.0))
    histories = [1, 2, 3]
    now = 0.0
    reasons = []
    for turn in range(3):
        for c in histories:
            now += 2.0
            reasons.append(_send(table, chain(9, 8, tail=c, tail_blocks=turn + 2), now))
    later = reasons[3:]
    assert all(r == ("slot_server", r[1], False) for r in later), later


def test_with_similarity_on_conversations_are_not_herded_onto_one_slot() -> None:
    """Similarity on, shared system prompt: the second conversation takes the other slot
    rather than overwriting the first one's history (the slot that holds it is not free)."""
    table = SlotTable(2, 4096)
    now = 0.0
    slots = []
    for c in (1, 2):
        now += 2.0
        slots.append(_send(table, chain(9, 8, tail=c, tail_blocks=6), now)[1])
    assert slots[0] != slots[1]


def test_fleet_workload_is_shaped_like_production() -> None:
    """The fleet bodies: more conversations than slots, tool results last, tools reordered
    (in one order for the ceiling), the volatile values where the variant puts them."""
    from bench import workloads

    scale = workloads.Scale(fleet_conversations=3, fleet_turns=3, fleet_system_words=20)
    fixed = workloads.fleet_bodies(scale, "fixed")
    plain = workloads.fleet_bodies(scale, "plain")
    assert len(fixed) == len(plain) == 9
    assert all(b["messages"][-1]["role"] == "tool" for b in fixed[3:])
    orders = {tuple(t["function"]["name"] for t in b["tools"]) for b in fixed}
    assert len(orders) > 1
    assert len({tuple(t["function"]["name"] for t in b["tools"]) for b in plain}) == 1
    systems = [b["messages"][0]["content"] for b in fixed]
    assert systems[0] == systems[3] != systems[1]  # per conversation, stable across turns
    clock = [b["messages"][0]["content"] for b in workloads.fleet_bodies(scale, "clock")]
    assert clock[0] != clock[3]  # the clock moves on every request


def test_a_match_inside_a_growing_message_is_taken_to_end_mid_block() -> None:
    """A user message that grew between two requests differs somewhere in the block after the
    last shared one; the estimate takes its middle, so over many growths the error averages
    out instead of always undercounting by half a block."""
    errors = []
    for n in range(250, 330):
        head = "w" * n * 5
        extra = 40
        first = {"model": "m", "messages": [{"role": "user", "content": head}]}
        grown = {"model": "m", "messages": [{"role": "user", "content": head + "more " * extra}]}
        fp1 = fingerprint("/v1/chat/completions", first, block_bytes=256)
        fp2 = fingerprint("/v1/chat/completions", grown, block_bytes=256)
        held = CachedPrompt(hashes=fp1.block_hashes, prompt_tokens=float(fp1.total_bytes), fp=fp1)
        held.measure(fp1.total_bytes, 0)  # one token a byte: tokens read as bytes
        q = PromptQuery(fp2.block_hashes, float(fp2.total_bytes), 256.0, fp2)
        data1, data2 = fp1.total_bytes, fp2.total_bytes
        assert data2 > data1
        shared = TokenCounter().shared(held, q)
        assert not shared.continues and shared.key is not None
        start = common_blocks(fp1.block_hashes, fp2.block_hashes) * 256
        assert start <= shared.tokens <= min(start + 256, data1)
        d1 = render("/v1/chat/completions", first).data
        d2 = render("/v1/chat/completions", grown).data
        true = next(i for i, (a, b) in enumerate(zip(d1, d2, strict=False)) if a != b)
        errors.append(shared.tokens - true)
    assert abs(sum(errors) / len(errors)) < 64  # unbiased within a quarter block


def test_with_the_request_bytes_a_match_inside_the_last_message_is_found_to_the_byte() -> None:
    """With the request's own bytes at hand, the byte where it parts from a state's last ~1 KB
    is found exactly, and the tokens are counted back from the state's measured end: once the
    template's close of turn is learned (one measurement), the estimate is exact."""
    counter = TokenCounter()
    errors = []
    for n in range(250, 330):
        head = "w" * n * 5
        first = {"model": "m", "messages": [{"role": "user", "content": head + " tail words"}]}
        grown = {"model": "m", "messages": [{"role": "user", "content": head + " more " * 40}]}
        fp1, d1 = fingerprint_with_data("/v1/chat/completions", first, block_bytes=256)
        fp2, d2 = fingerprint_with_data("/v1/chat/completions", grown, block_bytes=256)
        assert len(fp1.tail) < 5 * 256 and d1.endswith(fp1.tail)
        held = CachedPrompt(hashes=fp1.block_hashes, prompt_tokens=float(fp1.total_bytes), fp=fp1)
        held.measure(fp1.total_bytes, 0)  # one token a byte: tokens read as bytes
        q = PromptQuery(fp2.block_hashes, float(fp2.total_bytes), 256.0, fp2, d2)
        true = next(i for i, (a, b) in enumerate(zip(d1, d2, strict=False)) if a != b)
        shared = counter.shared(held, q)
        assert shared.unshared is not None and not shared.continues
        errors.append(abs(shared.tokens - true))
        counter.learn(shared, held, measured=float(true), prompt=q.prompt_tokens)
    assert counter.closing == 2.0  # the rendered close of a segment, in these byte "tokens"
    assert max(errors[1:]) < 1e-9


def test_the_close_of_turn_is_learned_from_byte_exact_matches_only() -> None:
    """A match that parts outside the kept bytes is an estimate (the block's middle): it must
    not teach the close of turn, which the exact predictions rest on."""
    counter = TokenCounter()
    head = "w" * 5000
    first = {"model": "m", "messages": [{"role": "user", "content": head + "x" * 3000}]}
    grown = {"model": "m", "messages": [{"role": "user", "content": head + "y" * 3000}]}
    fp1, _ = fingerprint_with_data("/v1/chat/completions", first, block_bytes=256)
    fp2, d2 = fingerprint_with_data("/v1/chat/completions", grown, block_bytes=256)
    held = CachedPrompt(hashes=fp1.block_hashes, prompt_tokens=float(fp1.total_bytes), fp=fp1)
    held.measure(fp1.total_bytes, 0)
    q = PromptQuery(fp2.block_hashes, float(fp2.total_bytes), 256.0, fp2, d2)
    shared = counter.shared(held, q)
    assert not shared.exact  # parts ~3 KB before the end, outside the kept ~1 KB
    counter.learn(shared, held, measured=2000.0, prompt=q.prompt_tokens)
    assert counter.closing is None


def test_bytes_are_never_compared_across_tenants() -> None:
    """Two tenants (salts) with the same short prompt share no chain: the kept bytes of one
    never predict a match for the other."""
    body = {"model": "m", "messages": [{"role": "user", "content": "same words " * 40}]}
    fp_a, _ = fingerprint_with_data("/v1/chat/completions", body, block_bytes=256, salt="a")
    fp_b, d_b = fingerprint_with_data("/v1/chat/completions", body, block_bytes=256, salt="b")
    held = CachedPrompt(hashes=fp_a.block_hashes, prompt_tokens=float(fp_a.total_bytes), fp=fp_a)
    held.measure(fp_a.total_bytes, 0)
    q = PromptQuery(fp_b.block_hashes, float(fp_b.total_bytes), 256.0, fp_b, d_b)
    assert TokenCounter().shared(held, q).tokens == 0.0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 10), st.integers(0, 2), st.integers(0, 3)),
        max_size=40,
    )
)
def test_ram_save_compares_only_what_can_hold_or_be_held(
    saves: list[tuple[int, int, int, int]],
) -> None:
    """``save`` skips the entries whose first block differs (``contains`` says no at once):
    the cache ends as a comparison against every entry leaves it, in the same order."""

    def reference(entries: list[CachedPrompt], new: CachedPrompt) -> list[CachedPrompt]:
        if new in entries or any(contains(e, new) for e in entries):
            return entries
        return [e for e in entries if not contains(new, e)] + [new]

    ram = RamCache(ServerRules())
    expected: list[CachedPrompt] = []
    states = []
    for prefix, n, tail, tail_blocks in saves:
        s = state(chain(prefix, n, tail, tail_blocks))
        states.append(s)
        for new in (s, states[len(states) // 2]):  # a new state, and one saved again
            expected = reference(expected, new)[-MAX_RAM_ENTRIES:]
            ram.save(new)
            assert ram.entries == expected


def _best_by_scan(ram: RamCache, current: CachedPrompt | None, q: PromptQuery) -> Any:
    """``RamCache.best`` as a scan over every entry (what the counts spare)."""
    counter = TokenCounter()
    base = counter.lcp(current, q)
    keep_best = base / current.tokens if current is not None and current.tokens else -1.0
    sim_best, chosen = base / max(q.prompt_tokens, 1.0), None
    first = q.hashes[0] if q.hashes else None
    for entry in ram.entries:
        if first is not None and len(entry.hashes) >= 4 and entry.hashes[0] != first:
            continue
        lcp = counter.lcp(entry, q)
        keep, sim = lcp / max(entry.tokens, 1.0), lcp / max(q.prompt_tokens, 1.0)
        if keep >= 0.25 and keep_best < keep and sim_best < sim:
            keep_best, sim_best, chosen = keep, sim, entry
    return chosen


def _saved_by_scan(
    entries: list[CachedPrompt], new: CachedPrompt, *, limit: int, ram_tokens: float
) -> list[CachedPrompt]:
    """``RamCache.save`` as a comparison against every entry, then both size limits."""
    if new in entries or any(contains(e, new) for e in entries):
        return entries
    out = [e for e in entries if not contains(new, e)] + [new]
    out = out[-limit:]
    while out and sum(e.tokens for e in out) > ram_tokens:
        out.pop(0)
    return out


def _cached_state(prefix: int, n: int, tail: int, rendered: bool) -> CachedPrompt:
    """A hashes-only state, or a rendered chat prompt (64-byte blocks): one user message of
    ``prefix``, then, with ``tail``, an answer and a second message. With ``n`` 0 and no tail it
    is shorter than a block (segments, no blocks), and its continuation holds it whole."""
    if not rendered:
        return state(chain(prefix, n, tail, 1 if tail else 0))
    messages = [{"role": "system", "content": "Be brief."}]
    messages.append({"role": "user", "content": f"{prefix} " * (2 + 12 * n)})
    if tail:
        messages.append({"role": "assistant", "content": "ok"})
        messages.append({"role": "user", "content": f"{tail} " * 12})
    fp = fingerprint("/v1/chat/completions", {"model": "m", "messages": messages}, block_bytes=64)
    return CachedPrompt(hashes=fp.block_hashes, prompt_tokens=fp.total_bytes / 4.0, fp=fp)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["save", "save", "resave", "take", "best", "holds"]),
            st.integers(1, 4),  # the first block
            st.integers(0, 6),  # blocks (0: a prompt without any)
            st.integers(0, 2),  # the tail's prefix
            st.booleans(),  # a rendered prompt (segments: matched inside the first block)
        ),
        max_size=60,
    ),
    st.sampled_from([float("inf"), 600.0]),
)
def test_the_ram_caches_counts_answer_as_a_scan_of_its_entries(
    steps: list[tuple[str, int, int, int, bool]], ram_tokens: float
) -> None:
    """``best``, ``holds`` and ``save`` answer from the counts of first blocks when no entry
    can match; through saves, saves again, loads (``take``), the entry limit (three here) and the
    token limit, the counts stay those of the entries, and the entries and the answers those of
    scans. Rendered prompts share a system message shorter than a block: an entry of few blocks
    parting in the first one is still a match, and one without blocks is held by its
    continuation."""
    limit = 3
    ram = RamCache(ServerRules(ram_tokens=ram_tokens))
    expected: list[CachedPrompt] = []
    seen: list[CachedPrompt] = []
    with patch("proxy.backends.llamacpp_cache.MAX_RAM_ENTRIES", limit):
        for op, prefix, n, tail, rendered in steps:
            s = _cached_state(prefix, n, tail, rendered)
            if op == "resave" and seen:
                s, op = seen[n % len(seen)], "save"
            if op == "save":
                ram.save(s)
                expected = _saved_by_scan(expected, s, limit=limit, ram_tokens=ram_tokens)
                seen.append(s)
            elif op == "take" and seen:
                taken = seen[n % len(seen)]
                ram.take(taken)
                expected = [e for e in expected if e is not taken]
            elif op == "best":
                current = seen[n % len(seen)] if seen and tail else None  # (None: an empty slot)
                q = PromptQuery(s.hashes, s.prompt_tokens + 10, 16.0, s.fp)
                assert ram.best(current, q, TokenCounter()) is _best_by_scan(ram, current, q)
            elif op == "holds":
                held = s in ram.entries or any(contains(e, s) for e in ram.entries)
                assert ram.holds(s) == held
            assert ram.entries == expected
            starts: dict[int, int] = {}
            for e in ram.entries:
                if e.hashes:
                    starts[e.hashes[0]] = starts.get(e.hashes[0], 0) + 1
            assert ram._starts == starts
            assert ram._short == sum(len(e.hashes) < 4 for e in ram.entries)
            assert ram._bare == sum(not e.hashes for e in ram.entries)


def _placed(
    table: SlotTable, hashes: tuple[int, ...], now: float, *, later: bool
) -> tuple[SlotTask, SlotChoice]:
    """A request chosen for and placed as the scheduler does (``later``: its launch left)."""
    req = SlotRequest(hashes, len(hashes) * TPB + 10, 16.0, TPB)
    choice = table.choose(req, CPU, now, useful_tokens=256)
    task = SlotTask(hashes, req.prompt_tokens, choice.uncached_tokens, 16.0, now)
    task.query = req.query()
    table.place(task, choice.slot, now, choice.pick, later=later)
    return task, choice


@pytest.mark.parametrize("rules", [ServerRules(), ServerRules(unified=True, similarity=0.0)])
def test_a_launch_left_for_later_gives_the_model_the_same_picture(rules: ServerRules) -> None:
    """``place(later=True)`` applies the cache model's launch at the table's next use (the
    scheduler's way: the request is forwarded first): every choice, and the slots, RAM cache
    and recent prompts after it, are what launching at once gives. Six conversations on three
    slots; at every other request the answers before the latest are given (first token, end),
    so every other choice is made with a launch not yet applied."""

    def replay(later: bool) -> tuple[list[tuple[Any, ...]], SlotTable]:
        table = SlotTable(3, 4096, rules=rules)
        choices: list[tuple[Any, ...]] = []
        running: list[SlotTask] = []
        now = 0.0
        for turn in range(5):
            for conv in range(6):
                now += 0.05
                hashes = chain(conv + 1, 4 + 2 * turn)
                req = SlotRequest(hashes, len(hashes) * TPB + 10, 16.0, TPB)
                choice = table.choose(req, CPU, now, useful_tokens=256)
                task = SlotTask(
                    hashes=hashes,
                    prompt_tokens=req.prompt_tokens,
                    uncached_tokens=choice.uncached_tokens,
                    decode_tokens=16.0,
                    t_sent=now,
                    query=req.query(),
                )
                table.place(task, choice.slot, now, choice.pick, later=later)
                source = choice.pick.source if choice.pick is not None else None
                choices.append((choice.reason, choice.slot, choice.matched_tokens, source))
                running.append(task)
                while conv % 2 and len(running) > 1:  # every other request, the rest answer
                    done = running.pop(0)
                    table.first_token(done, now + 0.01)
                    table.end(done, now + 0.02, ok=True)
                    now += 0.02
        for task in running:
            table.end(task, now + 1.0, ok=True)
        return choices, table

    (at_once, a), (later, b) = replay(False), replay(True)
    assert later == at_once
    assert [s.content for s in b.slots] == [s.content for s in a.slots]
    assert [e.hashes for e in b.ram.entries] == [e.hashes for e in a.ram.entries]
    assert b.live_conversations(100.0) == a.live_conversations(100.0)
    assert b._pending_launch is None


def test_a_launch_left_for_later_is_applied_before_the_table_is_read() -> None:
    """Until it is applied the slot is taken (busy, the task's pick known) and the other
    slots are as they were; the first token only stamps the task (it reaches its client before
    the launch's work is done), and the next read of the table applies it: under unified KV
    the idle slot's prompt goes to the RAM cache and the slot is cleared."""
    table = SlotTable(2, 4096, rules=ServerRules(unified=True))
    first = _placed(table, chain(1, 6), 1.0, later=True)
    table.end(first[0], 1.5, ok=True)  # (its launch applied first)
    second = _placed(table, chain(2, 6), 2.0, later=True)
    assert first[1].slot is not None and second[1].slot is not None
    held, taken = table.slots[first[1].slot], table.slots[second[1].slot]
    assert held.state is not None and not table.ram.entries and table._pending_launch is not None
    assert not taken.idle(2.0) and second[0].pick is second[1].pick
    table.first_token(second[0], 2.02, at=2.01)  # (read at 2.01, told a moment on)
    assert second[0].t_first_token == 2.01 and table._pending_launch is not None
    table.live_conversations(2.02)
    assert table._pending_launch is None and held.state is None
    assert [e.hashes for e in table.ram.entries] == [chain(1, 6)]


@pytest.mark.parametrize("later", [False, True])
def test_a_choice_sees_the_launch_left_for_later(later: bool) -> None:
    """Unified KV, two slots: conversation A ended on one; B launched on the other clears it
    (A's prompt to the RAM cache). A's next turn, chosen before B's launch was applied, is
    chosen as after it: not a hit on the slot that no longer holds A."""
    table = SlotTable(2, 4096, rules=ServerRules(unified=True, similarity=0.0))
    a, _ = _placed(table, chain(1, 6), 1.0, later=later)
    table.end(a, 1.5, ok=True)
    _placed(table, chain(2, 6), 2.0, later=later)
    _, again = _placed(table, chain(1, 6, tail=1, tail_blocks=2), 2.1, later=later)
    assert again.reason != "slot_hit" and again.pick is not None
    assert again.pick.source == "ram"


def test_a_request_that_fails_before_its_launch_is_applied_leaves_the_model_as_before() -> None:
    """An error before the first token (the launch still pending): the end applies the launch
    first, then forgets what the slot held, as when it was launched at once."""
    tables = []
    for later in (False, True):
        table = SlotTable(2, 4096, rules=ServerRules(unified=True))
        for conv, ok in ((1, True), (2, False)):
            task, _ = _placed(table, chain(conv, 6), float(conv), later=later)
            table.end(task, conv + 0.5, ok=ok)
        tables.append(table)
    at_once, later = tables
    assert [s.content for s in later.slots] == [s.content for s in at_once.slots]
    assert [e.hashes for e in later.ram.entries] == [e.hashes for e in at_once.ram.entries]
    assert [e.hashes for e in later.ram.entries] == [chain(1, 6)]


def test_a_launch_that_fails_is_logged_and_dropped_not_raised_at_the_next_caller() -> None:
    table = SlotTable(2, 4096)
    task, _ = _placed(table, chain(1, 6), 0.0, later=True)
    table._start = None  # type: ignore[assignment,method-assign]  # a bug in the model
    with capture_logs() as logs:
        table.end(task, 0.5, ok=True)
    assert [e["event"] for e in logs] == ["slot_model_error"] and table._pending_launch is None


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.integers(0, 3),  # the application (its system prompt)
            st.integers(0, 5),  # the conversation within it
            st.floats(0.0, 40.0),  # seconds since the last request
            st.booleans(),  # ended before the next request
        ),
        min_size=1,
        max_size=90,
    ),
    slots=st.integers(1, 4),
)
def test_crowded_says_what_counting_the_live_conversations_says(
    steps: list[tuple[int, int, float, bool]], slots: int
) -> None:
    """``SlotTable.crowded`` (a bound over the applications first, then a walk that stops at
    the slot count) answers ``live_conversations(now) > slots`` at every request, over several
    applications, conversations that go on or stop, and gaps inside and outside the window."""
    table = SlotTable(slots, 4096)
    turns: dict[tuple[int, int], int] = {}
    now, open_tasks = 0.0, []
    for app, conv, gap, ends in steps:
        now += gap
        turn = turns[app, conv] = turns.get((app, conv), 0) + 1
        messages = [{"role": "system", "content": f"application {app} " * 40}]
        for t in range(turn):
            messages += [
                {"role": "user", "content": f"conversation {conv} turn {t}"},
                {"role": "assistant", "content": f"answer {t}"},
            ]
        body = {"model": "m", "messages": messages[:-1]}
        fp, data = fingerprint_with_data("/v1/chat/completions", body, block_bytes=256)
        req = SlotRequest(fp.block_hashes, float(fp.total_bytes), 16.0, 256.0, fp, data)
        for probe in (now, now + 30.0, now + 200.0):
            assert table.crowded(probe) == (table.live_conversations(probe) > slots)
        choice = table.choose(req, CPU, now, useful_tokens=64)
        task = SlotTask(fp.block_hashes, req.prompt_tokens, choice.uncached_tokens, 16.0, now)
        task.query = req.query()
        table.place(task, choice.slot, now, choice.pick, later=True)
        open_tasks.append(task)
        if ends:
            for done in open_tasks:
                table.end(done, now + 0.5, ok=True)
            open_tasks.clear()
            now += 0.5


def test_crowded_counts_prompts_without_a_fingerprint_and_is_asked_once_per_choice() -> None:
    """Prompts placed by hashes alone (no fingerprint: application 0) count as the walk counts
    them; within a choice the answer is computed once for its moment."""
    table = SlotTable(1, 4096)
    now = 0.0
    for conv in range(6):
        now += 1.0
        task, _ = _placed(table, chain(conv + 1, 6), now, later=False)
        table.end(task, now + 0.5, ok=True)
        for probe in (now, now + 59.0, now + 120.0):
            assert table.crowded(probe) == (table.live_conversations(probe) > 1)
    assert table.live_conversations(now) > 0  # (they are counted, under application 0)
    table._choosing = True
    try:
        first = table.crowded(now)
        table.recent.append(state(chain(99, 6), now))  # (the memo holds for the same moment)
        assert table.crowded(now) is first
    finally:
        table._choosing, table._crowd = False, None


def test_no_queue_behind_a_busy_slot_the_server_would_swap_out() -> None:
    """Similarity on: a request pinned to a busy slot makes the server save the running
    sequence and load the best cached prompt for the request into that slot. When the RAM cache
    holds a prompt that beats the running one for this request (its own conversation), the
    request is not queued behind the slot that shares its prefix (docs/llamacpp-cache.md)."""
    table = SlotTable(2, 4096, rules=ServerRules())

    def run_on(slot: int, hashes: tuple[int, ...], now: float) -> SlotTask:
        req = SlotRequest(hashes, len(hashes) * TPB + 10, 16.0, TPB)
        views = table._views(table._busy(now))
        outcome = pick(views, table.ram, req.query(), table.counter, pinned=slot, rules=table.rules)
        task = SlotTask(hashes, req.prompt_tokens, req.prompt_tokens, 16.0, now)
        task.query = req.query()
        table.place(task, slot, now, outcome)
        table.first_token(task, now + 0.01)
        return task

    mine = run_on(0, chain(1, 6, tail=3, tail_blocks=2), 1.0)
    table.end(mine, 1.5, ok=True)
    run_on(1, chain(1, 6, tail=2, tail_blocks=2), 2.0)  # (my conversation saved to RAM)
    run_on(0, chain(5, 8), 2.02)  # every slot busy; slot 1 shares my next turn's first 6 blocks
    assert chain(1, 6, tail=3, tail_blocks=2) in [e.hashes for e in table.ram.entries]
    nxt = SlotRequest(chain(1, 6, tail=3, tail_blocks=3), 9 * TPB + 10, 16.0, TPB)
    choice = table.choose(nxt, CPU, 2.1, useful_tokens=256)
    assert choice.reason != "slot_queue" and choice.slot is None
