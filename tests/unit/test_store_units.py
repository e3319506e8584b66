"""Pure parts of the store: leading-run search, bucket plans, histograms, samples, breaker, keys."""

from __future__ import annotations

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from proxy.records import RequestRecord
from proxy.store import LATENCY_BOUNDS_MS, StatsSample, Tally, leading_run
from proxy.store.base import StoreTimeouts
from proxy.store.health import StoreHealth
from proxy.store.redis_layout import namespace_key, replica_id
from proxy.store.redis_scripts import ALL_SCRIPTS, pack_chain
from proxy.store.stats import add_increments, latency_bucket, sample_increments
from proxy.store.window import add_counters, bucket_field, plan_buckets, split_bucket_field

BASE = 1_700_002_800  # an hour boundary


def chain(n: int, tag: str) -> list[int]:
    out, h = [], 0
    for i in range(n):
        h = xxhash.xxh3_64_intdigest(f"{tag}{i}".encode(), seed=h)
        out.append(h)
    return out


@given(st.integers(0, 300), st.integers(0, 300))
def test_leading_run_finds_where_a_chain_leaves_a_prefix_closed_index(
    held: int, shared: int
) -> None:
    """Binary search returns exactly the shared prefix length of chained hashes."""
    index = set(chain(held, "a"))
    lookup = chain(shared, "a") + chain(50, "b" * (shared + 1))
    assert leading_run(lookup, index) == min(held, shared)


def test_leading_run_probes_logarithmically() -> None:
    """A 2,048-block lookup costs a dozen probes, not 2,048."""
    hashes = chain(2048, "x")
    index = set(hashes[:1000])
    probes: list[object] = []

    class Present:
        def __contains__(self, h: object) -> bool:
            probes.append(h)
            return h in index

    assert leading_run(hashes, Present()) == 1000
    assert len(probes) <= 12


def test_short_window_is_read_minute_by_minute() -> None:
    """Up to six hours: one bucket and one series point per minute, edges widened."""
    plan = plan_buckets(BASE + 30, BASE + 6 * 3600)
    assert (plan.since_s, plan.until_s, plan.resolution_s) == (BASE, BASE + 6 * 3600, 60)
    assert len(plan.buckets) == 360 == len(plan.points)
    assert {b.resolution_s for b in plan.buckets} == {60}


def test_week_window_reads_hours_and_ragged_minutes() -> None:
    """A 7-day window reads whole hours plus the minutes at either ragged end."""
    since = BASE + 17 * 60
    until = since + 7 * 86400
    plan = plan_buckets(since, until)
    assert plan.resolution_s == 3600
    minutes = [b for b in plan.buckets if b.resolution_s == 60]
    hours = [b for b in plan.buckets if b.resolution_s == 3600]
    assert len(minutes) == (60 - 17) + 17
    assert len(hours) == 7 * 24 - 1
    covered = sum(b.resolution_s for b in plan.buckets)
    assert covered == until - since
    assert len(plan.points) == 7 * 24 + 1
    assert all(b.point_ts in plan.points for b in plan.buckets)


def test_empty_window() -> None:
    """A window that ends before it starts reads nothing."""
    plan = plan_buckets(BASE + 600, BASE)
    assert plan.buckets == () and plan.points == ()


def test_latency_buckets_are_log_spaced_with_inclusive_upper_bounds() -> None:
    """Ten buckets a decade from 1 ms to 125 s, then an overflow bucket."""
    assert LATENCY_BOUNDS_MS[0] == 1.0 and LATENCY_BOUNDS_MS[-1] == 125_000.0
    assert list(LATENCY_BOUNDS_MS) == sorted(set(LATENCY_BOUNDS_MS))
    assert latency_bucket(0.2) == 0 and latency_bucket(1.0) == 0
    assert latency_bucket(1.01) == 1
    assert latency_bucket(125_000.0) == len(LATENCY_BOUNDS_MS) - 1
    assert latency_bucket(1e9) == len(LATENCY_BOUNDS_MS)


def test_percentile_interpolates_inside_the_bucket() -> None:
    """Quantiles are linear inside the bucket; the overflow bucket reports its lower edge."""
    t = Tally()
    i = latency_bucket(45.0)  # (40, 50]
    t.add(f"ttft:h{i}", 4)
    assert LATENCY_BOUNDS_MS[i - 1 : i + 1] == (40.0, 50.0)
    assert t.percentile("ttft", 0.5) == pytest.approx(45.0)
    assert t.percentile("ttft", 1.0) == pytest.approx(50.0)
    assert t.percentile("tpot", 0.5) is None
    t.add(f"e2e:h{len(LATENCY_BOUNDS_MS)}", 1)
    assert t.percentile("e2e", 0.99) == 125_000.0


def test_unknown_cached_tokens_differ_from_zero() -> None:
    """A backend that did not report adds nothing to the measured rate; a zero is a miss."""

    def make(cached: int | None) -> StatsSample:
        return StatsSample(
            ts=0.0,
            namespace="d",
            model="m",
            backend="b",
            status=200,
            error=False,
            prompt_tokens=100,
            cached_tokens=cached,
        )

    unknown, zero = sample_increments(make(None)), sample_increments(make(0))
    assert "cached_known" not in unknown and "hit_rate_n" not in unknown
    assert zero["cached_known"] == 1 and zero["cached_prompt_tokens"] == 100
    assert zero["hit_rate_n"] == 1


def test_nonfinite_and_negative_values_are_ignored() -> None:
    """NaN and negative latencies never reach a histogram."""
    s = StatsSample(
        ts=0.0,
        namespace="d",
        model="m",
        backend="b",
        status=200,
        error=False,
        ttft_ms=float("nan"),
        tpot_ms=-1.0,
        saved_usd=float("inf"),
    )
    inc = sample_increments(s)
    assert not any(k.startswith(("ttft", "tpot")) for k in inc)
    assert "saved_usd" not in inc


def test_a_bucket_adds_samples_as_their_increments_summed() -> None:
    """``add_increments`` (what both stores sum a batch's samples of one bucket with) adds
    exactly the counters ``sample_increments`` gives: zeros, NaN and negative values, repeated
    names and misses included."""
    nan = float("nan")
    samples = [
        StatsSample(
            ts=0.0,
            namespace="d",
            model="m",
            backend="b",
            status=200 if i % 3 else 503,
            error=not i % 3,
            prompt_tokens=[100, 0, None][i % 3],
            cached_tokens=[40, 0, 7][i % 3],
            predicted_cached_tokens=[50, None, 0][i % 3],
            completion_tokens=i % 2,
            ttft_ms=[5.0, nan, -1.0, 0.0][i % 4],
            tpot_ms=2.5,
            e2e_ms=[40.0, float("inf")][i % 2],
            slo_met=[True, False, None][i % 3],
            saved_prefill_ms=[nan, 3.0, -2.0][i % 3],
            saved_usd=[None, 0.5][i % 2],
            canonical_rules=["json_keys", "json_keys", "volatile"][: i % 4],
            route_reason="affinity" if i % 2 else None,
            schedule_reason="slot_hit",
            cache_source="slot" if i % 2 else None,
            affinity_source="prompt_cache_key" if i % 3 else None,
            hosted_stripped=["store", "store"] if i % 2 else [],
            misses={"new": 10, "breaker": i, "routing": 0, "evicted": 3, "unexplained": 0}
            if i % 2
            else None,
            miss_breaker_rules=["volatile", "volatile"] if i % 2 else [],
            miss_routing_why="load" if i % 2 else None,
        )
        for i in range(12)
    ]
    summed: dict[str, float] = {}
    added: dict[str, float] = {}
    for sample in samples:
        add_counters(summed, sample_increments(sample))
        add_increments(added, sample)
    assert list(added) == list(summed)
    for name, value in summed.items():
        assert added[name] == pytest.approx(value, nan_ok=True), name


def test_sample_from_record() -> None:
    """A record maps onto a sample; a missing model or backend reads 'unknown'."""
    rec = RequestRecord(
        ts="2025-01-01T00:00:00.000Z",
        request_id="r1",
        route="/v1/chat/completions",
        model=None,
        backend="http://b:1",
        stream=True,
        status=200,
        error="upstream_reset",
        prompt_tokens=100,
        cached_tokens=64,
        ttft_ms=12.5,
        e2e_ms=40.0,
        predicted_cached_tokens=60,
        prefix_anchor="00ff",
        canonical_rules=["tool_order"],
    )
    s = StatsSample.from_record(rec, namespace="t1", ts=1.5, prefix_label="bot")
    assert (s.ts, s.namespace, s.model, s.backend) == (1.5, "t1", "unknown", "http://b:1")
    assert s.error is True
    assert (s.prompt_tokens, s.cached_tokens, s.predicted_cached_tokens) == (100, 64, 60)
    assert (s.ttft_ms, s.e2e_ms, s.prefix_anchor, s.prefix_label) == (12.5, 40.0, "00ff", "bot")
    assert s.canonical_rules == ["tool_order"] and s.canonical_rules is not rec.canonical_rules


@given(st.text(), st.text(), st.text(min_size=1))
def test_bucket_fields_round_trip(model: str, backend: str, name: str) -> None:
    """Any model and backend name survives the ``model|backend|field`` encoding."""
    assert split_bucket_field(bucket_field(model, backend, name)) == (model, backend, name)


def test_key_parts() -> None:
    """Plain namespaces stay readable; others are hashed; replica ids are short and stable."""
    assert namespace_key("tenant-1.prod") == "tenant-1.prod"
    odd = namespace_key("a{b}:c")
    assert odd.startswith("~") and "{" not in odd and odd == namespace_key("a{b}:c")
    assert namespace_key("~x") != "~x"
    rid = replica_id("http://10.0.0.1:8080")
    assert len(rid) == 12 and rid == replica_id("http://10.0.0.1:8080")
    assert rid != replica_id("http://10.0.0.2:8080")


def test_pack_chain_is_big_endian_8_bytes_a_hash() -> None:
    """Members are the hashes as 8-byte big-endian strings."""
    packed = pack_chain([1, 2**64 - 1])
    assert packed == struct.pack(">QQ", 1, 2**64 - 1)
    assert packed[:8] == (1).to_bytes(8, "big")
    assert len({s.sha for s in ALL_SCRIPTS}) == len(ALL_SCRIPTS)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_skips_then_lets_one_probe_through() -> None:
    """After a failure calls are skipped for ``breaker_s``; then exactly one probe goes."""
    clock = FakeClock()
    health = StoreHealth(store="redis", breaker_s=1.0, clock=clock)
    with capture_logs() as logs:
        assert health.allow()
        health.failed("lookup", ConnectionError("refused"))
        assert health.degraded and not health.allow()
        clock.now += 1.0
        assert health.allow()  # the probe
        assert not health.allow()  # everyone else waits for it
        health.failed("lookup", ConnectionError("refused"))
        assert not health.allow()
        clock.now += 1.0
        assert health.allow()
        health.succeeded()
        assert not health.degraded and health.allow()
    assert [e["event"] for e in logs] == ["store_degraded", "store_recovered"]
    assert logs[1]["failures"] == 2 and logs[1]["down_s"] == pytest.approx(2.0)
    assert health.failures == 2 and health.skipped == 3


def test_a_cancelled_probe_lets_the_next_call_probe() -> None:
    """A probe that never reports back (cancelled) does not keep the breaker shut forever."""
    clock = FakeClock()
    health = StoreHealth(store="redis", breaker_s=1.0, clock=clock)
    with capture_logs():
        health.failed("lookup", TimeoutError())
    clock.now += 1.0
    assert health.allow()
    assert not health.allow()
    health.abandoned()
    assert health.allow()


def test_a_chosen_lookup_deadline_scales_the_write_deadline_never_below_its_default() -> None:
    """A write timing out opens the breaker for the lookups too: writes get ten times the
    lookup's deadline (the defaults' ratio), and never less than their default."""
    default = StoreTimeouts()
    assert StoreTimeouts.for_lookup(default.lookup_s) == default
    assert StoreTimeouts.for_lookup(0.5).write_s == pytest.approx(5.0)
    assert StoreTimeouts.for_lookup(0.0005).write_s == default.write_s
    assert StoreTimeouts.for_lookup(0.5).breaker_s == default.breaker_s
