"""Miss attribution: every uncached token gets exactly one cause, and each cause where it should."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from proxy.attribution import (
    CAUSES,
    WHY_HEALTH,
    WHY_LOAD_GATE,
    WHY_MIN_AFFINITY,
    WHY_SLOT,
    WHY_STALE,
    DryRunIndex,
    MissFacts,
    split,
    why_passed_over,
)

positions = st.one_of(
    st.floats(min_value=-1e6, max_value=1e6),
    st.sampled_from([math.inf, -math.inf, math.nan, 0.0]),
)


@given(
    prompt=st.integers(min_value=-5, max_value=100_000),
    cached=st.integers(min_value=-5, max_value=100_000),
    known=st.booleans(),
    held=positions,
    index=positions,
    slot=st.booleans(),
    other=positions,
    shared=positions,
    precision=st.floats(min_value=0.0, max_value=1e4),
    why=st.sampled_from([None, WHY_LOAD_GATE, WHY_HEALTH]),
    rules=st.lists(st.sampled_from(["volatile_timestamps", "stable_json"]), max_size=2),
)
def test_parts_are_non_negative_integers_summing_to_the_uncached_tokens(
    prompt: int,
    cached: int,
    known: bool,
    held: float,
    index: float,
    slot: bool,
    other: float,
    shared: float,
    precision: float,
    why: str | None,
    rules: list[str],
) -> None:
    """Whatever the stages said (any numbers, not finite, past the prompt), the five parts are
    non-negative integers adding up to ``prompt - cached`` (clamped to the prompt)."""
    facts = MissFacts(
        prompt_tokens=prompt,
        cached_tokens=cached,
        known=known,
        chosen_held=held,
        chosen_index=index,
        slot_passed_over=slot,
        best_other=other,
        other_why=why,
        shared_with_rules=shared,
        rules=tuple(rules),
        precision=precision,
    )
    parts = split(facts).tokens()
    assert list(parts) == list(CAUSES)
    assert all(type(v) is int and v >= 0 for v in parts.values())
    p = max(prompt, 0)
    assert sum(parts.values()) == p - min(max(cached, 0), p)
    result = split(facts)
    assert (result.routing_why is not None) == (result.routing > 0)
    assert not result.breaker_rules or result.breaker > 0


def test_nothing_shared_is_new() -> None:
    """No replica, cache model or would-be prompt holds any of it: all new."""
    r = split(MissFacts(prompt_tokens=1000, cached_tokens=10))
    assert r.tokens() == {"new": 990, "breaker": 0, "routing": 0, "evicted": 0, "unexplained": 0}


def test_fully_cached_has_no_parts() -> None:
    """Nothing uncached, nothing to attribute."""
    assert split(MissFacts(prompt_tokens=500, cached_tokens=500)).total == 0


def test_a_dry_run_rule_names_the_breaker_span() -> None:
    """An earlier request shares the prompt up to token 800 once the clock is relocated: the
    span past the index's match is the breaker, named by its rule; the rest is new."""
    r = split(
        MissFacts(
            prompt_tokens=1000,
            cached_tokens=5,
            chosen_index=0,
            shared_with_rules=800.7,
            rules=("volatile_timestamps",),
            precision=64,
        )
    )
    assert (r.breaker, r.new, r.breaker_rules) == (795, 200, ("volatile_timestamps",))


def test_another_replica_holding_more_is_routing_with_its_why() -> None:
    """The chosen replica holds 200, another 700: 500 tokens are routing, why the load gate."""
    r = split(
        MissFacts(
            prompt_tokens=1000,
            cached_tokens=200,
            chosen_held=200,
            chosen_index=200,
            best_other=700,
            other_why=WHY_LOAD_GATE,
            precision=64,
        )
    )
    assert (r.routing, r.routing_why, r.new, r.evicted) == (500, WHY_LOAD_GATE, 300, 0)


def test_the_cache_model_held_more_than_served_is_evicted() -> None:
    """The slot held 900 tokens by the cache model, the backend served 100: 800 evicted."""
    r = split(MissFacts(prompt_tokens=1000, cached_tokens=100, chosen_held=900, chosen_index=900))
    assert (r.evicted, r.new, r.unexplained) == (800, 100, 0)


def test_a_shortfall_within_one_block_is_unexplained() -> None:
    """Predicted 130, served 100, one block is 64 tokens: the 30 are the index's precision."""
    r = split(
        MissFacts(
            prompt_tokens=1000, cached_tokens=100, chosen_held=130, chosen_index=128, precision=64
        )
    )
    assert (r.unexplained, r.evicted, r.new) == (30, 0, 870)


def test_a_request_on_another_slot_than_the_holder_is_slot_routing() -> None:
    """The index says the replica holds 600, the request went to a busy-slot's neighbour."""
    r = split(
        MissFacts(
            prompt_tokens=1000,
            cached_tokens=0,
            chosen_held=0,
            chosen_index=600,
            slot_passed_over=True,
            precision=64,
        )
    )
    assert (r.routing, r.routing_why, r.new) == (600, WHY_SLOT, 400)


def test_an_index_that_did_not_answer_leaves_everything_unexplained() -> None:
    """The store did not answer: nothing can be placed."""
    r = split(MissFacts(prompt_tokens=300, cached_tokens=100, known=False, best_other=300))
    assert r.tokens()["unexplained"] == 200 and r.total == 200


def test_why_passed_over_names_health_first() -> None:
    """An unhealthy holder was passed over for its health, whatever the route reason."""
    assert why_passed_over("affinity", healthy=False) == WHY_HEALTH
    assert why_passed_over("load_gate", healthy=True) == WHY_LOAD_GATE
    assert why_passed_over("miss", healthy=True) == WHY_MIN_AFFINITY
    assert why_passed_over("affinity", healthy=True) == WHY_STALE


def test_dry_run_index_matches_the_leading_run_of_an_earlier_chain() -> None:
    """A chain shares its leading hashes with an earlier one; other namespaces share none."""
    index = DryRunIndex(max_blocks=8)
    index.add("t", [1, 2, 3, 4])
    assert index.matched("t", [1, 2, 3, 9, 10]) == 3
    assert index.matched("t", [7, 2]) == 0
    assert index.matched("u", [1, 2]) == 0
    index.add("t", [5, 6, 7, 8, 9])  # over the bound: the oldest go first
    assert len(index) == 8
    assert index.matched("t", [1, 2]) == 0


def test_stats_add_up_the_causes_of_attributed_requests() -> None:
    """Two attributed records and one without: ``misses`` sums the two, by cause, rule and
    reason, and its causes are the attribution's."""
    from proxy.records import RequestRecord
    from proxy.store.stats import MISS_CAUSES, StatsSample, Tally, sample_increments

    assert MISS_CAUSES == CAUSES

    def record(**fields: object) -> RequestRecord:
        return RequestRecord(
            ts="t", request_id="r", route="/v1/chat/completions", model="m", backend="b",
            stream=False, status=200, **fields,  # type: ignore[arg-type]  # test records
        )  # fmt: skip

    tally = Tally()
    for rec in (
        record(prompt_tokens=100, cached_tokens=40, miss_new_tokens=10, miss_breaker_tokens=50,
               miss_breaker_rules=["volatile_timestamps"], miss_routing_tokens=0,
               miss_evicted_tokens=0, miss_unexplained_tokens=0),
        record(prompt_tokens=80, cached_tokens=0, miss_new_tokens=20, miss_breaker_tokens=0,
               miss_routing_tokens=60, miss_routing_why="round_robin", miss_evicted_tokens=0,
               miss_unexplained_tokens=0),
        record(prompt_tokens=50),
    ):  # fmt: skip
        sample = StatsSample.from_record(rec, namespace="default", ts=0.0)
        for name, value in sample_increments(sample).items():
            tally.add(name, value)
    misses = tally.summary()["misses"]
    assert misses["requests"] == 2 and misses["uncached_tokens"] == 140
    assert (misses["prompt_tokens"], misses["cached_tokens"]) == (180, 40)
    assert misses["tokens"] == {"new": 30, "breaker": 50, "routing": 60, "evicted": 0,
                                "unexplained": 0}  # fmt: skip
    assert misses["breaker_rules"] == {"volatile_timestamps": 50}
    assert misses["routing_why"] == {"round_robin": 60}
    assert misses["shares"]["routing"] == round(60 / 140, 4)


def test_a_match_short_of_the_system_prompt_counts_in_the_templates_order() -> None:
    """The index hashes tools before the system prompt, templates print the system prompt
    first: a match inside the system prompt reuses only its system part, one inside the tools
    nothing known; one into the messages, or without tools, all of it."""
    from proxy.attribution import template_order_bytes
    from proxy.fingerprint import fingerprint

    tools = [{"type": "function", "function": {"name": "f", "description": "x" * 600}}]
    body = {
        "model": "m",
        "tools": tools,
        "messages": [
            {"role": "system", "content": "s" * 1200},
            {"role": "user", "content": "u" * 600},
        ],
    }
    fp = fingerprint("/v1/chat/completions", body, block_bytes=256)
    kinds = [s.kind for s in fp.segments]
    tools_len = fp.segment_ends()[kinds.index("tools")] - fp.segments[kinds.index("tools")].start
    system = fp.segments[kinds.index("system")]
    inside = system.start // 256 + 2
    assert template_order_bytes(fp, inside) == inside * 256 - tools_len
    assert template_order_bytes(fp, 1) == fp.segments[kinds.index("tools")].start
    n = len(fp.block_hashes)
    assert template_order_bytes(fp, n) == n * 256  # into the messages
    without = fingerprint("/v1/chat/completions", {**body, "tools": None}, block_bytes=256)
    assert template_order_bytes(without, 2) == 512


def test_what_the_cache_model_lost_and_another_replica_holds_is_routing() -> None:
    """The index says the chosen replica processed 800 tokens earlier, its cache model says it
    keeps 300 (the shared head), another replica holds 700: 400 routing, the last 100 the
    chosen replica lost with nobody else holding them: evicted."""
    r = split(
        MissFacts(
            prompt_tokens=1000,
            cached_tokens=300,
            chosen_held=300,
            chosen_index=800,
            best_other=700,
            other_why="round_robin",
            precision=64,
        )
    )
    assert (r.routing, r.routing_why, r.evicted, r.new) == (400, "round_robin", 100, 200)
