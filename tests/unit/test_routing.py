"""The router: policies, the affinity test against the traffic-shared depth, the load gate,
health, weights, deterministic tie-breaks, and the traffic counts behind the shared depth."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.routing import (
    POLICIES,
    TRAFFIC_MAX_BLOCKS,
    Candidate,
    Decision,
    Router,
    RoutingConfig,
    TrafficDepth,
    TrafficWindow,
    rendezvous,
    route_key,
    weighted_rendezvous,
)

A, B, C, D = (f"http://10.0.0.{i}:8080" for i in range(1, 5))
KEY = 0x1234_5678_9ABC_DEF0


def affinity(**overrides: float | int | str) -> Router:
    return Router(RoutingConfig(**overrides))  # type: ignore[arg-type]  # test-only overrides


def cands(*specs: tuple[str, int, float]) -> list[Candidate]:
    return [Candidate(url, matched, load) for url, matched, load in specs]


def test_contract_names() -> None:
    """The policies, in order, and prefix-affinity as the default."""
    assert POLICIES == ("round-robin", "least-loaded", "prefix-affinity")
    assert RoutingConfig().policy == "prefix-affinity"


@pytest.mark.parametrize(
    "field, value",
    [
        ("policy", "random"),
        ("min_affinity_blocks", 0),
        ("load_gate_ratio", 0.5),
        ("load_gate_ratio", float("nan")),
        ("load_gate_slack", -1.0),
        ("shared_share", 0.0),
        ("shared_share", 1.5),
        ("min_window_requests", 0),
    ],
)
def test_impossible_config_is_refused(field: str, value: object) -> None:
    """An impossible setting fails when the configuration is built, not on a request."""
    with pytest.raises(ValueError, match=field.split("_")[0]):
        RoutingConfig(**{field: value})  # type: ignore[arg-type]  # deliberately wrong values


def test_no_candidate_is_an_error() -> None:
    """There is nothing to choose from an empty fleet."""
    with pytest.raises(ValueError):
        Router().choose([], key=KEY, shared_blocks=0)


@pytest.mark.parametrize("policy", POLICIES)
def test_one_replica_is_single(policy: str) -> None:
    """With one replica every policy answers it, as "single"."""
    d = Router(RoutingConfig(policy=policy)).choose(
        [Candidate(A, 3, 9.0, healthy=False)], key=KEY, shared_blocks=1
    )
    assert d == Decision(A, "single", 3, 1)


def test_affinity_follows_the_longest_match_beyond_the_shared_depth() -> None:
    """A match at least min_affinity_blocks past the shared depth wins, even at a higher load."""
    pool = cands((A, 2, 0.0), (B, 7, 3.0), (C, 4, 1.0))
    d = Router().choose(pool, key=KEY, shared_blocks=2)
    assert d == Decision(B, "affinity", 7, 2)


def test_a_shared_system_prompt_is_not_affinity() -> None:
    """Every replica holding the traffic-shared prompt: a miss, sent to the least loaded."""
    pool = cands((A, 4, 2.0), (B, 4, 1.0), (C, 5, 0.0), (D, 4, 3.0))
    d = Router().choose(pool, key=KEY, shared_blocks=4)
    assert d == Decision(C, "miss", 5, 4)
    # One block more than the shared depth is below min_affinity_blocks=2: still a miss, so the
    # least loaded replica takes it even though another holds more.
    pool = cands((A, 5, 2.0), (B, 4, 0.0))
    assert Router().choose(pool, key=KEY, shared_blocks=4).reason == "miss"
    assert Router().choose(pool, key=KEY, shared_blocks=4).replica == B
    # Exactly shared + min_affinity_blocks qualifies.
    pool = cands((A, 6, 2.0), (B, 4, 0.0))
    assert Router().choose(pool, key=KEY, shared_blocks=4) == Decision(A, "affinity", 6, 4)


def test_min_affinity_blocks_is_configurable() -> None:
    """A larger minimum turns a modest match into a miss."""
    pool = cands((A, 6, 2.0), (B, 0, 0.0))
    assert affinity(min_affinity_blocks=8).choose(pool, key=KEY, shared_blocks=0).replica == B
    assert affinity(min_affinity_blocks=6).choose(pool, key=KEY, shared_blocks=0).replica == A


def test_an_overloaded_match_is_gated_to_the_least_loaded_other() -> None:
    """A replica far above the fleet's mean load loses its affinity to the least loaded other."""
    # mean = (20 + 2 + 1 + 1) / 4 = 6; limit = 1.5 * 6 + 2 = 11 < 20.
    pool = cands((A, 9, 20.0), (B, 3, 2.0), (C, 0, 1.0), (D, 0, 1.0))
    d = Router().choose(pool, key=KEY, shared_blocks=0)
    assert d.reason == "load_gate"
    assert d.replica in (C, D)
    assert d.matched_blocks == 0
    # Others at 1 each: A at 5 is within 1.5 * mean + 2, A at 6 is not.
    pool = cands((A, 9, 5.0), (B, 0, 1.0), (C, 0, 1.0), (D, 0, 1.0))  # mean 2, limit 5
    assert Router().choose(pool, key=KEY, shared_blocks=0).reason == "affinity"
    pool = cands((A, 9, 6.0), (B, 0, 1.0), (C, 0, 1.0), (D, 0, 1.0))  # mean 2.25, limit 5.375
    assert Router().choose(pool, key=KEY, shared_blocks=0).reason == "load_gate"
    assert affinity(load_gate_slack=4.0).choose(pool, key=KEY, shared_blocks=0).reason == (
        "affinity"
    )


def test_an_idle_fleet_never_gates() -> None:
    """The slack keeps one or two requests in flight from counting as overload."""
    pool = cands((A, 9, 2.0), (B, 0, 0.0), (C, 0, 0.0))
    assert Router().choose(pool, key=KEY, shared_blocks=0) == Decision(A, "affinity", 9, 0)


def test_unhealthy_replicas_are_never_chosen_while_one_is_healthy() -> None:
    """Health filters first, whatever the policy; an all-unhealthy fleet still gets a choice."""
    pool = [
        Candidate(A, 9, 0.0, healthy=False),
        Candidate(B, 0, 5.0),
        Candidate(C, 0, 9.0, healthy=False),
    ]
    for policy in POLICIES:
        router = Router(RoutingConfig(policy=policy))
        assert {router.choose(pool, key=k, shared_blocks=0).replica for k in range(20)} == {B}
    down = [Candidate(A, 0, 1.0, healthy=False), Candidate(B, 0, 0.0, healthy=False)]
    assert Router().choose(down, key=KEY, shared_blocks=0).replica == B


def test_least_loaded_compares_load_per_weight() -> None:
    """A replica of twice the weight carries twice the load at the same relative load."""
    router = Router(RoutingConfig(policy="least-loaded"))
    pool = [Candidate(A, 0, 3.0, weight=2.0), Candidate(B, 0, 2.0)]
    assert router.choose(pool, key=KEY, shared_blocks=0) == Decision(A, "least_loaded", 0, 0)
    pool = [Candidate(A, 0, 5.0, weight=2.0), Candidate(B, 0, 2.0)]
    assert router.choose(pool, key=KEY, shared_blocks=0).replica == B


def test_the_gate_scales_with_weight() -> None:
    """A heavier replica is gated later: its load is compared per unit of weight."""
    # Total load 12 over weight 4 -> mean 3 per weight; A (weight 2) limit 1.5*3 + 2/2 = 5.5.
    heavy = [Candidate(A, 9, 10.0, weight=2.0), Candidate(B, 0, 1.0), Candidate(C, 0, 1.0)]
    assert Router().choose(heavy, key=KEY, shared_blocks=0).reason == "affinity"
    light = [Candidate(A, 9, 10.0), Candidate(B, 0, 1.0), Candidate(C, 0, 1.0)]
    assert Router().choose(light, key=KEY, shared_blocks=0).reason == "load_gate"


def test_a_zero_weight_replica_is_a_last_resort() -> None:
    """Weight 0 means no capacity: never the least loaded, never kept for affinity."""
    pool = [Candidate(A, 9, 0.0, weight=0.0), Candidate(B, 0, 5.0), Candidate(C, 0, 7.0)]
    assert Router().choose(pool, key=KEY, shared_blocks=0) == Decision(B, "load_gate", 0, 0)
    router = Router(RoutingConfig(policy="least-loaded"))
    assert router.choose(pool, key=KEY, shared_blocks=0).replica == B


def test_round_robin_cycles_over_healthy_replicas() -> None:
    """Round-robin takes the healthy replicas in turn, whatever they hold."""
    router = Router(RoutingConfig(policy="round-robin"))
    pool = [Candidate(A, 9, 0.0), Candidate(B, 0, 0.0, healthy=False), Candidate(C, 0, 9.0)]
    got = [router.choose(pool, key=KEY, shared_blocks=0) for _ in range(4)]
    assert [d.replica for d in got] == [A, C, A, C]
    assert {d.reason for d in got} == {"round_robin"}


def test_ties_are_broken_by_rendezvous_hash_not_order() -> None:
    """Equal candidates: the answer depends on the key and URLs only, never on list order."""
    pool = cands((A, 0, 1.0), (B, 0, 1.0), (C, 0, 1.0), (D, 0, 1.0))
    for policy in ("least-loaded", "prefix-affinity"):
        for key in (0, 1, KEY, 2**64 - 1):
            answers = {
                Router(RoutingConfig(policy=policy)).choose(list(p), key=key, shared_blocks=0)
                for p in itertools.permutations(pool)
            }
            assert len(answers) == 1
            (answer,) = answers
            assert answer.replica == max((A, B, C, D), key=lambda r: rendezvous(key, r))
    # Different keys spread over the replicas.
    spread = {Router().choose(pool, key=k, shared_blocks=0).replica for k in range(64)}
    assert spread == {A, B, C, D}


def test_equal_matches_prefer_the_less_loaded() -> None:
    """Two replicas holding the same prefix: the less loaded one gets the affinity."""
    pool = cands((A, 6, 3.0), (B, 6, 1.0), (C, 0, 0.0))
    assert Router().choose(pool, key=KEY, shared_blocks=0) == Decision(B, "affinity", 6, 0)


candidate_lists = st.lists(
    st.builds(
        Candidate,
        replica=st.sampled_from([A, B, C, D, "http://e:1", "http://f:1"]),
        matched_blocks=st.integers(0, 12),
        load=st.integers(0, 30).map(float),
        weight=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        healthy=st.booleans(),
    ),
    min_size=2,
    max_size=6,
    unique_by=lambda c: c.replica,
)


@settings(max_examples=200, deadline=None)
@given(
    pool=candidate_lists,
    key=st.integers(0, 2**64 - 1),
    shared=st.integers(0, 10),
    policy=st.sampled_from(["least-loaded", "prefix-affinity"]),
    data=st.data(),
)
def test_decisions_are_deterministic_and_sane(
    pool: list[Candidate], key: int, shared: int, policy: str, data: st.DataObject
) -> None:
    """Any order, any router instance: the same decision, a healthy replica when one exists,
    and affinity only for a match past the shared depth on a replica that is not gated."""
    config = RoutingConfig(policy=policy)
    first = Router(config).choose(pool, key=key, shared_blocks=shared)
    shuffled = data.draw(st.permutations(pool))
    assert Router(config).choose(shuffled, key=key, shared_blocks=shared) == first
    chosen = next(c for c in pool if c.replica == first.replica)
    if any(c.healthy for c in pool):
        assert chosen.healthy
    assert first.matched_blocks == chosen.matched_blocks
    assert first.shared_blocks == shared
    if first.reason == "affinity":
        live = [c for c in pool if c.healthy] or pool
        assert chosen.matched_blocks >= shared + config.min_affinity_blocks
        assert chosen.matched_blocks == max(c.matched_blocks for c in live)
        assert len(live) == 1 or not Router(config).gated(chosen, live)


def test_route_key_is_the_first_block_past_the_shared_depth() -> None:
    """Requests are keyed by their first block not shared by most traffic; 0 without blocks."""
    assert route_key([7, 8, 9]) == 7
    assert route_key([7, 8, 9], 2) == 9
    assert route_key([7, 8, 9], 5) == 9  # all shared: the last block
    assert route_key([], 3) == 0


def test_traffic_depth_is_the_leading_run_over_the_share() -> None:
    """Blocks carried by at least half of the window count as shared, up to the first that
    is not."""
    depth = TrafficDepth()
    assert depth.shared_blocks(100, [100, 90, 50, 49, 80]) == 3
    assert depth.shared_blocks(100, [10, 10]) == 0
    assert depth.shared_blocks(100, []) == 0
    assert TrafficDepth(share=0.9).shared_blocks(100, [100, 90, 50]) == 2
    # A quiet window (one conversation) shares nothing.
    assert depth.shared_blocks(15, [15, 15, 15]) == 0
    config = RoutingConfig(shared_share=0.25, min_window_requests=4)
    assert TrafficDepth.from_config(config).shared_blocks(4, [4, 1, 1]) == 3


def test_traffic_window_rolls_over_two_buckets() -> None:
    """Counts live between one and two bucket lengths, and a step back in time is harmless."""
    window = TrafficWindow(bucket_s=60.0)
    window.observe([1, 2, 3], now=10.0)
    window.observe([1, 2], now=30.0)
    assert window.counts([1, 2, 3, 4], now=59.0) == (2, [2, 2, 1, 0])
    window.observe([1, 5], now=70.0)  # next bucket: the first two are still in the window
    assert window.counts([1, 2, 5], now=100.0) == (3, [3, 2, 1])
    assert window.counts([1, 2, 5], now=50.0) == (3, [3, 2, 1])  # the clock stepped back
    assert window.counts([1, 5], now=130.0) == (1, [1, 1])  # the first bucket is gone
    assert window.counts([1, 2, 3], now=130.0) == (1, [1, 0, 0])
    assert window.counts([1, 2, 5], now=500.0) == (0, [0, 0, 0])  # a long pause clears all


@settings(max_examples=200, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 12), st.integers(0, 5)), max_size=40
    ),
    cap=st.integers(1, 40),
)
def test_a_bounded_traffic_bucket_never_outgrows_its_bound_nor_miscounts(
    requests: list[tuple[int, int, int]], cap: int
) -> None:
    """Whatever the traffic, a bucket holds at most ``max_hashes`` hashes, always whole leading
    runs of the chains it counted (what lets a full bucket stop at the first hash it lacks),
    and each hash it holds is counted exactly from the request that added it on."""
    from collections import Counter

    def chain(f: int, shared: int, n: int) -> list[int]:
        # chained: a hash names its whole prefix (a shared head, then the family's own blocks)
        return [hash((-1, i)) if i < shared else hash((f, shared, i)) for i in range(n)]

    window = TrafficWindow(bucket_s=1e9, max_hashes=cap)
    since: Counter[int] = Counter()  # requests carrying each hash since it was added
    for f, n, shared in requests:
        hashes = chain(f, shared, n)
        window.observe(hashes, now=0.0)
        for h in hashes:
            if window.holds(h):
                since[h] += 1
        assert window.held <= cap
        held = [window.holds(h) for h in hashes]
        assert held == sorted(held, reverse=True)  # a leading run, nothing after a gap
    for f, n, shared in requests:
        hashes = chain(f, shared, n)
        _, counts = window.counts(hashes, now=0.0)
        run = [h for h in hashes if window.holds(h)]
        assert counts[: len(run)] == [since[h] for h in run]
        assert counts == sorted(counts, reverse=True)  # counts only fall along a chain


def test_traffic_window_counts_only_the_leading_blocks() -> None:
    """Only the first TRAFFIC_MAX_BLOCKS hashes of a request are counted."""
    window = TrafficWindow()
    chain = list(range(1, 2 * TRAFFIC_MAX_BLOCKS))
    window.observe(chain, now=0.0)
    _, counts = window.counts(chain, now=0.0)
    assert len(counts) == TRAFFIC_MAX_BLOCKS
    assert counts == [1] * TRAFFIC_MAX_BLOCKS
    assert window.counts(chain[TRAFFIC_MAX_BLOCKS:], now=0.0)[1][0] == 0


# -- the client's conversation key ------------------------------------------------------------


def keyed_home(router: Router, pool: list[Candidate], key: int) -> Decision:
    return router.choose(pool, key=0, shared_blocks=0, affinity_key=key)


def test_a_key_goes_home_whatever_the_index_says() -> None:
    """With a key, the decision is its rendezvous home ("key_affinity"), not the best match."""
    pool = [Candidate(A, 30, 0.0), Candidate(B, 0, 0.0), Candidate(C, 0, 0.0)]
    homes = {keyed_home(affinity(), pool, k).replica for k in range(64)}
    assert homes == {A, B, C}
    d = keyed_home(affinity(), pool, 7)
    assert d.reason == "key_affinity" and d == keyed_home(affinity(), pool, 7)


def test_keys_spread_by_weight_and_move_only_from_a_lost_replica() -> None:
    """Homes follow weights (3:1), and removing one replica moves only the keys it held."""
    pool = [Candidate(A, 0, 0.0, weight=3.0), Candidate(B, 0, 0.0), Candidate(C, 0, 0.0)]
    router = affinity()
    before = {k: keyed_home(router, pool, k).replica for k in range(6000)}
    share = sum(h == A for h in before.values()) / len(before)
    assert 0.56 < share < 0.64  # 3/5
    after = {k: keyed_home(router, pool[:2], k).replica for k in range(6000)}
    assert all(after[k] == before[k] for k in before if before[k] != C)


def test_a_key_respects_health_and_the_load_gate() -> None:
    """An unhealthy home is passed over; a home past the gate sends to the least loaded other."""
    key = next(
        k
        for k in range(100)
        if keyed_home(
            affinity(), [Candidate(A, 0, 0.0), Candidate(B, 0, 0.0), Candidate(C, 0, 0.0)], k
        ).replica
        == A
    )
    sick = [Candidate(A, 0, 0.0, healthy=False), Candidate(B, 0, 0.0), Candidate(C, 0, 0.0)]
    assert keyed_home(affinity(), sick, key).replica != A
    busy = [Candidate(A, 0, 20.0), Candidate(B, 0, 1.0), Candidate(C, 0, 0.0)]
    d = keyed_home(affinity(), busy, key)
    assert (d.replica, d.reason) == (C, "load_gate")
    light = [Candidate(A, 0, 2.0), Candidate(B, 0, 1.0), Candidate(C, 0, 0.0)]
    assert keyed_home(affinity(), light, key).reason == "key_affinity"


@given(st.integers(min_value=0, max_value=(1 << 64) - 1))
def test_weighted_rendezvous_is_finite_for_every_hash(key: int) -> None:
    """Every 64-bit key gives every replica a finite positive score."""
    for replica in (A, B):
        assert 0.0 < weighted_rendezvous(key, Candidate(replica, 0, 0.0)) < float("inf")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 80), st.floats(0.0, 400.0)), max_size=40),
    st.integers(0, 3),
    st.integers(0, 80),
)
def test_traffic_counts_equal_a_count_of_every_hash(
    requests: list[tuple[int, int, float]], family: int, length: int
) -> None:
    """The window reads counts only up to the first zero; every count it gives is the count of
    the requests, in the window's buckets, that carried the hash (chained: a request carrying a
    block carries every one before it)."""
    from collections import Counter

    def chain(f: int, n: int) -> list[int]:
        return [hash((f, i)) & (2**64 - 1) for i in range(n)]

    window = TrafficWindow(bucket_s=120.0)
    seen: list[tuple[float, list[int]]] = []
    now = 0.0
    for f, n, dt in requests:
        now += dt
        window.observe(chain(f, n), now)
        seen.append((now, chain(f, n)[:TRAFFIC_MAX_BLOCKS]))
    index = int(now // 120.0)
    expected: Counter[int] = Counter()
    for t, hashes in seen:
        if int(t // 120.0) in (index, index - 1):
            expected.update(hashes)
    query = chain(family, length)
    _, counts = window.counts(query, now)
    assert counts == [expected[h] for h in query[:TRAFFIC_MAX_BLOCKS]]
