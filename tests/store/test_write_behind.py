"""Write behind: queued store writes, applied together, leave a store as single writes do.

Every test of the equivalence runs on the embedded store, one Redis and a Redis Cluster
(``make_store``): one store is written write by write, the other through ``WriteBehind``, and
everything the proxy reads back (matches, loads, traffic counts, statistics, top prefixes)
must be the same.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
from redis_process import RELAXED, RedisServer, StoreFactory
from test_store_stats import sample

from proxy.store import EmbeddedStore, LookupResult, PrefixStore, RedisStore, StoreOptions
from proxy.store.write_behind import QUEUE_LIMIT, WriteBatch, WriteBehind, apply_batch

NOW = time.time()
BASE = (int(NOW) // 3600 - 2) * 3600  # an hour boundary one to two hours ago
R1, R2 = "http://r1:8080", "http://r2:8080"
RULES = ["json_keys", "volatile"]


async def batches_applied(behind: WriteBehind, n: int, timeout_s: float = 5.0) -> None:
    """Wait (polling) until ``behind`` has applied ``n`` batches, or ``timeout_s`` has passed;
    the caller asserts what it expects."""
    for _ in range(round(timeout_s / 0.01)):
        if behind.batches >= n:
            return
        await asyncio.sleep(0.01)


def workload(seed: int) -> list[tuple[str, tuple[Any, ...]]]:
    """Writes as a proxy makes them: claims, in-flight counts, ends, statistics."""
    rng = random.Random(seed)
    system = [rng.getrandbits(63) for _ in range(6)]
    ops: list[tuple[str, tuple[Any, ...]]] = []
    for n in range(40):
        replica = rng.choice((R1, R2))
        ns = rng.choice(("default", "default", "t1"))
        own = [rng.getrandbits(63) for _ in range(rng.randint(0, 4))]
        chain = system[: rng.randint(1, 6)] + own
        ops.append(("add_in_flight", (ns, replica, +1)))
        ops.append(("observe_traffic", (ns, chain[:4])))
        ops.append(("record_prefix", (ns, replica, chain, 12)))
        if rng.random() < 0.9:
            ops.append(("add_in_flight", (ns, replica, -1)))
            ops.append(("record_prefix", (ns, replica, chain, 12)))
            ops.append(
                (
                    "add_stats",
                    (
                        sample(
                            BASE + 60 * rng.randint(0, 90) + rng.random(),
                            namespace=ns,
                            model=rng.choice(("m1", "m2")),
                            backend=replica,
                            prompt_tokens=rng.randint(10, 5000),
                            cached_tokens=rng.choice((None, 0, rng.randint(1, 10))),
                            predicted_cached_tokens=rng.randint(0, 10),
                            completion_tokens=rng.randint(0, 50),
                            ttft_ms=rng.random() * 500,
                            slo_met=rng.random() < 0.5,
                            prefix_anchor=rng.choice((None, "aa", "bb", "cc")),
                            prefix_label=rng.choice((None, "support bot")),
                            canonical_rules=rng.sample(RULES, rng.randint(0, 2)),
                        ),
                    ),
                )
            )
        if n % 7 == 6:
            ops.append(("flush", ()))
    return ops


async def read_back(store: PrefixStore, chains: list[list[int]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for ns in ("default", "t1"):
        for chain in chains:
            found = await store.lookup(ns, [R1, R2], chain)
            out[f"{ns}:{chain[0]}:{len(chain)}"] = (
                found.matched,
                found.window_requests,
                found.hash_counts,
            )
        window = await store.query_stats(since_s=BASE, until_s=BASE + 3 * 3600, namespace=ns)
        out[f"{ns}:stats"] = window.to_json()
        out[f"{ns}:top"] = [
            (p.anchor, p.requests, p.prompt_tokens, p.cached_tokens, p.label)
            for p in await store.top_prefixes(since_s=BASE, limit=10, namespace=ns)
        ]
    out["loads"] = (await store.lookup("default", [R1, R2], [])).loads
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_batched_writes_leave_the_store_as_single_writes_do(
    make_store: StoreFactory, seed: int
) -> None:
    one_by_one = await make_store(key_prefix=f"single{seed}")
    batched = await make_store(key_prefix=f"batched{seed}")
    behind = WriteBehind(batched, delay_s=60.0)  # applied only by the flushes
    chains: list[list[int]] = []
    for op, args in workload(seed):
        if op == "flush":
            await behind.flush()
            continue
        if op == "record_prefix":
            chains.append(args[2])
        await getattr(one_by_one, op)(*args)
        getattr(behind, op)(*args)
    await behind.flush()
    assert behind.pending == 0 and behind.batches >= 6
    single, together = await read_back(one_by_one, chains), await read_back(batched, chains)
    assert together == single


async def test_a_batch_of_statistics_across_retention_reads_back_as_single_writes(
    make_store: StoreFactory,
) -> None:
    """One batch mixing samples past retention (their hour expired), samples whose minute has
    expired but not their hour, and fresh ones, several of each in one minute, model and
    backend (summed before they are added): the statistics and the top prefixes read back as
    the same samples written one by one."""
    now = time.time()
    hour = int(now) // 3600 * 3600
    stamps = [hour - 3600 - 30.0, hour - 3600 + 5.0, hour + 1.0, now - 90.0, now - 1.0]
    samples = [
        sample(
            ts + k,
            model=model,
            backend=R1,
            prompt_tokens=100 * (k + 1),
            cached_tokens=37 * k,
            predicted_cached_tokens=11 * k,
            ttft_ms=3.1 * (k + 1),
            saved_prefill_ms=0.7 * k,
            slo_met=k % 2 == 0,
            prefix_anchor="aa" if k % 2 else None,
            canonical_rules=RULES[: k % 3],
        )
        for ts in stamps
        for model in ("m1", "m2")
        for k in range(3)
    ]
    options = {"stats_retention_s": 3600.0}
    one_by_one = await make_store(key_prefix="single-retention", **options)
    batched = await make_store(key_prefix="batched-retention", **options)
    behind = WriteBehind(batched, delay_s=60.0)
    for each in samples:
        await one_by_one.add_stats(each)
        behind.add_stats(each)
    await behind.flush()
    assert behind.batches == 1

    async def read(store: PrefixStore) -> tuple[Any, ...]:
        since, until = hour - 3 * 3600, now + 60
        windows = [
            (await store.query_stats(since_s=since, until_s=until, model=model)).to_json()
            for model in (None, "m1", "m2")
        ]
        top = await store.top_prefixes(since_s=since, limit=10)
        return windows, [(p.anchor, p.requests, p.prompt_tokens) for p in top]

    single, together = await read(one_by_one), await read(batched)
    assert together == single
    assert single[0] != (await read(await make_store(key_prefix="empty-retention")))[0]


async def test_a_batch_is_applied_once_the_delay_has_passed(store: PrefixStore) -> None:
    # The delay leaves room for the "not yet" read on a loaded machine (a Redis cluster's
    # round trip can take tens of ms there); the batch is then waited for, not slept on.
    behind = WriteBehind(store, delay_s=0.3)
    behind.record_prefix("default", R1, [1, 2, 3], 100)
    behind.add_in_flight("default", R1, +1)
    assert behind.pending == 2
    assert (await store.longest_match("default", [R1], [1, 2, 3]))[R1] == 0  # not yet
    assert behind.batches == 0
    await batches_applied(behind, 1)
    assert behind.pending == 0 and behind.batches == 1
    assert (await store.longest_match("default", [R1], [1, 2, 3]))[R1] == 3
    assert (await store.lookup("default", [R1], [1])).loads[R1] == 1.0


async def test_a_full_queue_is_sent_without_waiting(store: PrefixStore) -> None:
    behind = WriteBehind(store, delay_s=60.0, max_pending=4)
    for i in range(4):
        behind.record_prefix("default", R1, [10 + i], 100)
    await batches_applied(behind, 1)
    assert behind.batches == 1 and behind.pending == 0


class Counting:
    """A store double that counts the writes it is given (and may fail them)."""

    def __init__(self, *, fail: bool = False) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.fail = fail

    async def record_prefix(self, *args: Any) -> None:
        self._call("record_prefix", args)

    async def observe_traffic(self, *args: Any) -> None:
        self._call("observe_traffic", args)

    async def add_in_flight(self, *args: Any) -> None:
        self._call("add_in_flight", args)

    async def add_stats(self, *args: Any) -> None:
        self._call("add_stats", args)

    def _call(self, name: str, args: tuple[Any, ...]) -> None:
        if self.fail:
            raise RuntimeError("boom")
        self.calls.append((name, args))


class Gated(Counting):
    """A store double whose statistics writes wait for ``gate`` (a store slow to answer)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def add_stats(self, *args: Any) -> None:
        await self.gate.wait()
        self._call("add_stats", args)


async def test_a_chain_written_twice_is_written_once_and_counts_are_summed() -> None:
    double = Counting()
    behind = WriteBehind(double, delay_s=60.0)  # type: ignore[arg-type]
    chain = [1, 2, 3]
    behind.add_in_flight("default", R1, +1)
    behind.record_prefix("default", R1, chain, 100)  # the claim
    behind.record_prefix("default", R1, [7, 8], 100)
    behind.add_in_flight("default", R1, -1)
    behind.add_in_flight("default", R2, +1)
    behind.record_prefix("default", R1, chain, 100)  # the end: the latest write
    await behind.flush()
    assert double.calls == [
        ("add_in_flight", ("default", R2, 1)),  # R1's +1 and -1 cancel
        ("record_prefix", ("default", R1, [7, 8], 100)),
        ("record_prefix", ("default", R1, chain, 100)),
    ]


async def test_the_queue_counts_what_its_batch_holds() -> None:
    """``pending`` (counted as writes come, not summed at each) is the batch's length: a chain
    written again and a replica's in-flight changes summed count once, a lookup counts."""
    behind = WriteBehind(EmbeddedStore(), delay_s=60.0)
    behind.add_in_flight("default", R1, +1)
    behind.record_prefix("default", R1, [1, 2, 3], 100)
    behind.record_prefix("default", R1, [1, 2, 3], 100)
    behind.record_prefix("default", R1, [], 100)  # nothing to write
    behind.add_in_flight("default", R1, -1)
    behind.add_in_flight("default", R2, +1)
    behind.observe_traffic("default", [1, 2])
    behind.add_stats(sample(NOW))
    lookup = behind.lookup("default", [R1], [1, 2, 3])
    assert behind.pending == len(behind._batch) == 6
    await behind.flush()
    assert lookup.done() and lookup.result().available
    assert behind.pending == len(behind._batch) == 0
    behind.add_in_flight("default", R1, +1)
    assert behind.pending == len(behind._batch) == 1
    await behind.flush()


async def test_a_failing_store_loses_the_batch_and_the_writes_go_on() -> None:
    double = Counting(fail=True)
    behind = WriteBehind(double, delay_s=0.001)  # type: ignore[arg-type]
    behind.add_stats(sample(BASE))
    await behind.flush()  # never raises
    assert behind.pending == 0
    double.fail = False
    behind.add_stats(sample(BASE + 1))
    await asyncio.sleep(0.05)
    assert [name for name, _ in double.calls] == ["add_stats"]


async def test_an_empty_batch_writes_nothing(store: PrefixStore) -> None:
    await apply_batch(store, WriteBatch())
    assert (await store.lookup("default", [R1], [1])).loads == {R1: 0.0}


async def test_a_store_slower_than_the_traffic_drops_writes_past_the_limit() -> None:
    """While a batch is under way the queue grows; past its limit new writes are dropped and
    counted (in-flight counts never are), as writes to a store that is down are lost."""
    double = Gated()
    gate = double.gate
    behind = WriteBehind(double, delay_s=0.0, max_pending=2)  # type: ignore[arg-type]
    behind.add_stats(sample(BASE))
    await asyncio.sleep(0.01)  # the first batch is under way, stuck on the gate
    for i in range(QUEUE_LIMIT * 2 + 10):
        behind.add_stats(sample(BASE + i))
    behind.add_in_flight("default", R1, +1)  # never dropped
    assert behind.pending == QUEUE_LIMIT * 2 + 1 and behind.dropped == 10
    gate.set()
    await behind.flush()
    assert len(double.calls) == 1 + QUEUE_LIMIT * 2 + 1


# -- a lookup nothing waits for, queued with the writes ------------------------------------------


async def test_a_queued_lookup_reads_the_store_before_the_writes_queued_after_it(
    store: PrefixStore,
) -> None:
    """The lookup goes with the batch, ahead of it: it sees an earlier request's claim, never
    the request's own claim, count and traffic queued after it."""
    await store.record_prefix("default", R1, [1, 2], 100)  # an earlier request's
    behind = WriteBehind(store, delay_s=60.0)  # sent only when hurried
    found = behind.lookup("default", [R1], [1, 2, 3])
    behind.add_in_flight("default", R1, +1)
    behind.observe_traffic("default", [1, 2, 3])
    behind.record_prefix("default", R1, [1, 2, 3], 100)  # its own claim
    await asyncio.sleep(0.01)
    assert not found.done() and behind.pending == 4
    behind.hurry()
    got = await asyncio.wait_for(found, 5.0)
    assert got.available and got.matched == {R1: 2} and got.loads == {R1: 0.0}
    assert got.window_requests == 0 and got.hash_counts == [0, 0, 0]
    await behind.flush()
    assert (await store.lookup("default", [R1], [1, 2, 3])).matched == {R1: 3}  # written after


async def batch_under_way() -> tuple[Gated, WriteBehind]:
    """A write-behind with a long delay whose first batch, hurried, is stuck in the store."""
    double = Gated()
    behind = WriteBehind(double, delay_s=60.0)  # type: ignore[arg-type]
    behind.add_stats(sample(BASE))
    behind.hurry()
    await asyncio.sleep(0.01)  # under way, stuck on the gate
    return double, behind


async def test_hurry_sends_the_queue_after_the_batch_under_way() -> None:
    double, behind = await batch_under_way()
    gate = double.gate
    behind.add_in_flight("default", R1, +1)
    behind.hurry()  # noted: it goes when the one under way is done, not 60 s later
    gate.set()
    await batches_applied(behind, 2)
    assert behind.batches == 2 and behind.pending == 0
    assert [name for name, _ in double.calls] == ["add_stats", "add_in_flight"]


async def test_every_queued_lookup_is_answered_whatever_becomes_of_its_batch() -> None:
    """A batch that fails (a bug: stores never raise), or that is cancelled at shutdown,
    answers its lookups as a failed store would: nobody waits for ever."""

    class Broken(Counting):
        async def lookup(self, *args: Any) -> LookupResult:
            raise RuntimeError("boom")

    behind = WriteBehind(Broken(), delay_s=60.0)  # type: ignore[arg-type]
    found = behind.lookup("default", [R1], [1])
    await behind.flush()
    assert (await found) == LookupResult.unavailable()

    gate = asyncio.Event()

    class Stuck(Counting):
        async def lookup(self, *args: Any) -> LookupResult:
            await gate.wait()
            raise AssertionError("never reached")

    behind = WriteBehind(Stuck(), delay_s=0.0)  # type: ignore[arg-type]
    found = behind.lookup("default", [R1], [1])
    await asyncio.sleep(0.01)
    assert behind._task is not None
    behind._task.cancel()
    assert (await asyncio.wait_for(found, 1.0)) == LookupResult.unavailable()


@pytest.mark.redis
async def test_a_queued_lookup_to_a_redis_that_is_down_answers_unavailable(
    own_redis_server: RedisServer,
) -> None:
    # Generous deadlines (the first batch connects and loads the scripts on a busy machine):
    # a Redis that is down refuses at once.
    store = RedisStore.from_url(own_redis_server.url, StoreOptions(timeouts=RELAXED))
    try:
        behind = WriteBehind(store, delay_s=60.0)
        found = behind.lookup("default", [R1], [1, 2])
        behind.hurry()
        assert (await asyncio.wait_for(found, 5.0)).available
        own_redis_server.kill()
        found = behind.lookup("default", [R1], [1, 2])
        behind.record_prefix("default", R1, [1, 2], 100)
        behind.hurry()
        assert (await asyncio.wait_for(found, 5.0)) == LookupResult.unavailable()
        assert store.degraded
    finally:
        await store.aclose()


async def test_a_hurry_with_nothing_queued_leaves_the_next_writes_to_their_timer() -> None:
    double, behind = await batch_under_way()
    behind.hurry()  # nothing queued: nothing to hurry
    double.gate.set()
    await asyncio.sleep(0.01)
    behind.add_in_flight("default", R1, +1)
    await asyncio.sleep(0.02)
    assert behind.batches == 1 and behind.pending == 1  # waits for its timer, batched
