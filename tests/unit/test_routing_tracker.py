"""PrefixTracker's routing side: the view the router reads, claims right after routing, the
shared in-flight counts, the traffic window fed by learn(), and the fallback when the store
cannot answer."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from structlog.testing import capture_logs

from proxy.exchange import Exchange, Target, settle_view
from proxy.fingerprint import common_blocks
from proxy.prefixes import PrefixTracker, PrefixView, answered, prefix_label, settled
from proxy.recent_claims import RecentClaims, checkpoints
from proxy.records import Observation, RequestRecord
from proxy.routing import Candidate, Router, RoutingConfig, route_key
from proxy.store import EmbeddedStore, LookupResult

CHAT = "/v1/chat/completions"
R1, R2 = "http://r1:8080", "http://r2:8080"
BLOCK = 64
SYSTEM = "You are a careful assistant. " * 12  # a few blocks every request shares


def body(user: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
    }


def record(**fields: Any) -> RequestRecord:
    values: dict[str, Any] = {
        "ts": "t",
        "request_id": "r",
        "route": CHAT,
        "model": "m",
        "backend": None,
        "stream": False,
        "status": 200,
    }
    values.update(fields)
    return RequestRecord(**values)


def candidates(view: PrefixView, replicas: Sequence[str]) -> list[Candidate]:
    return [Candidate(r, view.matched_for(r), view.load_for(r)) for r in replicas]


class UnavailableStore(EmbeddedStore):
    """An embedded store whose lookups fail, as a Redis store does while Redis is down."""

    async def lookup(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> LookupResult:
        return LookupResult.unavailable()


async def test_lookup_fills_matches_loads_and_shared_depth() -> None:
    """After traffic sharing the system prompt, the view reports it as the shared depth."""
    store = EmbeddedStore()
    tracker = PrefixTracker(store, block_bytes=BLOCK, routing=RoutingConfig(min_window_requests=4))
    views = [await tracker.lookup(CHAT, body(f"question {i} " * 20), [R1, R2]) for i in range(6)]
    for view in views:
        await tracker.claim(view, R1, capacity_tokens=100_000)
    view = await tracker.lookup(CHAT, body("a new question " * 20), [R1, R2])
    assert view.available
    assert view.shared_blocks >= len(SYSTEM) // BLOCK - 1
    assert view.shared_blocks < len(view.fp.block_hashes)
    assert view.matched_for(R1) >= view.shared_blocks
    assert view.matched_for(R2) == 0
    assert view.loads == {R1: 0.0, R2: 0.0}
    # Ties are broken by the first block past the shared prompt, not by the prompt itself.
    assert view.key == route_key(view.fp.block_hashes, view.shared_blocks)
    assert view.key == view.fp.block_hashes[view.shared_blocks]


async def test_claim_records_the_chosen_replica_at_once() -> None:
    """A claim makes the next related request match the replica before the first one ends."""
    tracker = PrefixTracker(EmbeddedStore(), block_bytes=BLOCK)
    first = await tracker.lookup(CHAT, body("long shared document " * 40), [R1, R2])
    await tracker.claim(first, R2, capacity_tokens=100_000)
    again = await tracker.lookup(CHAT, body("long shared document " * 40 + "more"), [R1, R2])
    assert again.matched_for(R2) >= len(first.fp.block_hashes) - 1
    assert again.matched_for(R1) == 0
    # The router now sends it to R2 by affinity.
    decision = Router().choose(candidates(again, [R1, R2]), key=again.key, shared_blocks=0)
    assert (decision.replica, decision.reason) == (R2, "affinity")


async def test_in_flight_counts_locally_at_once_and_in_the_store() -> None:
    """The proxy's own count changes immediately; the store's when the write runs."""
    store = EmbeddedStore()
    tracker = PrefixTracker(store, block_bytes=BLOCK)
    view = await tracker.lookup(CHAT, body("x"), [R1, R2])
    write = tracker.in_flight(view, R1, +1)
    assert tracker.local_in_flight(R1) == 1
    assert (await store.lookup("default", [R1], [])).loads == {R1: 0.0}
    await write
    assert (await store.lookup("default", [R1], [])).loads == {R1: 1.0}
    view = await tracker.lookup(CHAT, body("y"), [R1, R2])
    assert view.load_for(R1) == 1.0
    await tracker.in_flight(view, R1, -1)
    await tracker.in_flight(None, R1, -1)  # an unmatched end never goes negative
    assert tracker.local_in_flight(R1) == 0
    assert (await tracker.lookup(CHAT, body("z"), [R1])).loads == {R1: 0.0}


async def test_loads_never_fall_below_the_local_count() -> None:
    """A shared count lagging behind this proxy's own is raised to it."""
    tracker = PrefixTracker(EmbeddedStore(), block_bytes=BLOCK)
    pending = [tracker.in_flight(None, R2, +1) for _ in range(3)]  # written later
    view = await tracker.lookup(CHAT, body("q"), [R1, R2])
    assert view.loads == {R1: 0.0, R2: 3.0}
    for write in pending:
        await write


async def test_an_unavailable_store_falls_back_to_local_numbers() -> None:
    """No matches, this proxy's in-flight counts and a shared depth of 0."""
    tracker = PrefixTracker(UnavailableStore(), block_bytes=BLOCK)
    await tracker.in_flight(None, R1, +1)
    view = await tracker.lookup(CHAT, body("q " * 200), [R1, R2])
    assert not view.available
    assert view.matched_blocks == {}
    assert view.loads == {R1: 1.0, R2: 0.0}
    assert view.shared_blocks == 0
    decision = Router().choose(candidates(view, [R1, R2]), key=view.key, shared_blocks=0)
    assert (decision.replica, decision.reason) == (R2, "miss")


async def test_traffic_is_counted_at_arrival_and_failures_stay_out_of_the_index() -> None:
    """A request joins the traffic window when it is routed; only a success is learned."""
    store = EmbeddedStore()
    tracker = PrefixTracker(store, block_bytes=BLOCK)
    view = await tracker.lookup(CHAT, body("failing " * 30), [R1])
    await tracker.claim(view, R1, capacity_tokens=100_000)
    assert (await store.traffic_counts("default", view.fp.block_hashes))[0] == 1
    await store.aclose()
    store = EmbeddedStore()
    tracker = PrefixTracker(store, block_bytes=BLOCK)
    view = await tracker.lookup(CHAT, body("failing " * 30), [R1])
    await tracker.learn(record(status=502, error="upstream"), view, replica=R1, capacity_tokens=1)
    assert (await store.traffic_counts("default", view.fp.block_hashes))[0] == 0
    assert await store.longest_match("default", [R1], view.fp.block_hashes) == {R1: 0}


async def test_route_reason_reaches_the_statistics() -> None:
    """The record's route_reason is counted in the statistics' routes."""
    store = EmbeddedStore()
    tracker = PrefixTracker(store, block_bytes=BLOCK)
    rec = record(backend=R1)
    rec.route_reason = "load_gate"
    await tracker.learn(rec, None, replica=R1, capacity_tokens=1)
    window = await store.query_stats(since_s=0)
    assert window.total.routes() == {"load_gate": 1}


async def test_a_claim_is_seen_before_its_store_write_lands() -> None:
    """Requests arriving together look up before any background write: this proxy's own
    recent claims answer them, with the exact match length."""
    tracker = PrefixTracker(EmbeddedStore(), block_bytes=BLOCK)
    doc = "shared new document " * 60
    first = await tracker.lookup(CHAT, body(doc), [R1, R2])
    write = tracker.claim(first, R2, capacity_tokens=100_000)  # not run yet
    again = await tracker.lookup(CHAT, body(doc + " and a follow-up question"), [R1, R2])
    shared = common_blocks(first.fp.block_hashes, again.fp.block_hashes)
    assert shared >= 10
    assert again.matched_for(R2) == shared
    assert again.matched_for(R1) == 0
    await write
    # Forgotten (the replica failed before serving): the store's copy is all that is left.
    tracker.unclaim(first, R2)
    assert len(tracker.recent) == 0
    # Forgetting one claim leaves the entries a later claim took over.
    claims = RecentClaims()
    a, b = (1, 2, 3, 4), (1, 2, 3, 5)
    claims.add("ns", R1, a, now=0.0)
    claims.add("ns", R1, b, now=0.0)
    claims.forget("ns", R1, a)
    assert claims.matched("ns", R1, (1, 2, 3, 6), now=0.0) == 3  # found through b's entries


def test_checkpoints_find_any_shared_prefix_exactly() -> None:
    """Every pair of chains sharing m blocks shares a checkpoint, and the match is exact."""
    for n in range(1, 70):
        points = list(checkpoints(n))
        assert points[0] == n - 1 and len(set(points)) == len(points)
        assert len(points) <= n.bit_length() + 1
    claims = RecentClaims(ttl_s=5.0)
    chain = list(range(1000, 1100))
    claims.add("ns", R1, chain, now=0.0)
    for m in range(1, 101):
        probe = chain[:m] + [-i for i in range(1, 30)]
        assert claims.matched("ns", R1, probe, now=1.0) == m
    assert claims.matched("ns", R2, chain, now=1.0) == 0
    assert claims.matched("other", R1, chain, now=1.0) == 0
    assert claims.matched("ns", R1, chain, now=5.0) == 0  # expired


def test_recent_claims_stay_bounded() -> None:
    """Old claims go first, by age and by the block hashes they hold in all."""
    claims = RecentClaims(ttl_s=5.0, max_blocks=100)
    for i in range(1000):
        claims.add("ns", R1, [i * 10 + k for k in range(8)], now=i * 0.001)
    assert claims.blocks <= 100 and len(claims) <= 12 * 4
    assert claims.matched("ns", R1, [999 * 10 + k for k in range(8)], now=1.0) == 8
    assert claims.matched("ns", R1, [k for k in range(8)], now=1.0) == 0  # pushed out
    claims.add("ns", R1, [1, 2, 3], now=100.0)  # everything else has expired
    assert (claims.blocks, len(claims)) == (3, 3)
    # A newer claim under the same checkpoint keeps its entry when the older one goes.
    claims = RecentClaims(ttl_s=1.0)
    claims.add("ns", R1, [1, 2, 3, 4], now=0.0)
    claims.add("ns", R1, [1, 2, 3, 5], now=0.5)
    claims.add("ns", R2, [9], now=1.2)  # the first claim expires
    assert claims.matched("ns", R1, [1, 2, 3, 5, 6], now=1.2) == 4


def test_prefix_label_never_holds_part_of_a_secret() -> None:
    """The label is cut on whitespace after redaction: a secret is redacted whole or left out."""

    def redact(text: str) -> str:
        return " ".join("[SECRET]" if w.startswith("sk-") else w for w in text.split(" "))

    def label(system: Any) -> str | None:
        return prefix_label({"messages": [{"role": "system", "content": system}]}, redact)

    assert label("Short   system\nprompt") == "Short system prompt"
    long_key = "sk-" + "x" * 500
    assert label("word " * 14 + long_key) == ("word " * 14).strip()  # key crosses the cut
    assert label("a " * 10 + "sk-abc rest") == "a " * 10 + "[SECRET] rest"
    cut = label("token " * 40)
    assert cut is not None and len(cut) <= 80 and cut.endswith("token")
    assert label([{"type": "text", "text": "from parts"}]) == "from parts"
    assert label(None) is None
    assert prefix_label({"prompt": ["first", "second"]}, redact) == "first"


class SlowStore(EmbeddedStore):
    """An embedded store whose lookups answer only once ``release`` is set, as a remote one
    answers a round trip later."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.lookups = 0

    async def lookup(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> LookupResult:
        self.lookups += 1
        await self.release.wait()
        return await super().lookup(namespace, replicas, hashes)


async def test_one_replica_and_a_remote_store_route_without_waiting() -> None:
    """With one replica nothing routes by the store's numbers: the view comes at once with
    this proxy's own, and the store's answer is folded in later, as it was when asked (this
    request's own claim, made meanwhile, is not in it)."""
    store = SlowStore()
    tracker = PrefixTracker(store, block_bytes=BLOCK, remote_store=True)
    doc = "a shared document " * 40
    earlier = [1, 2, 3]
    await EmbeddedStore.record_prefix(store, "default", R1, earlier, 1000)
    first = tracker.lookup(CHAT, body(doc), [R1])
    store.release.set()
    first_view = await answered(await first)
    store.release.clear()
    claimed = tracker.claim(first_view, R1, capacity_tokens=100_000)  # not in the store yet
    await tracker.in_flight(first_view, R1, +1)
    view = await asyncio.wait_for(tracker.lookup(CHAT, body(doc + " more"), [R1]), 1)
    assert view.pending is not None and not view.pending.done()
    shared = common_blocks(first_view.fp.block_hashes, view.fp.block_hashes)
    assert view.matched_for(R1) == shared  # this proxy's recent claim
    assert view.loads == {R1: 1.0}
    assert not settled(view).available  # not yet: what the proxy knew, marked unavailable
    assert not view.pending.done()  # the lookup runs on (to its own deadline)

    again = await tracker.lookup(CHAT, body(doc + " more"), [R1])
    own = tracker.claim(again, R1, capacity_tokens=100_000)  # its own: a full match locally
    store.release.set()
    done = await answered(again)
    assert done.pending is None and done.available
    assert done.matched_for(R1) == shared  # as found, not its own claim
    assert done.loads == {R1: 1.0}
    assert settled(again) == done
    assert (await view.pending).available  # the first one answered too
    for write in (claimed, own):
        assert write is not None
        await write


async def test_several_replicas_or_an_embedded_store_wait_for_the_answer() -> None:
    for replicas, remote in (([R1, R2], True), ([R1], False)):
        store = SlowStore()
        tracker = PrefixTracker(store, block_bytes=BLOCK, remote_store=remote)
        lookup = asyncio.ensure_future(tracker.lookup(CHAT, body("q " * 100), replicas))
        await asyncio.sleep(0.01)
        assert not lookup.done()  # routing needs the store's numbers
        store.release.set()
        view = await lookup
        assert view.pending is None and view.available
        assert await answered(view) is view and settled(view) is view


async def test_the_answer_not_waited_for_is_the_one_an_awaited_lookup_gets() -> None:
    """The store knows more than this proxy (another proxy's claim, load and traffic): the
    view folded in later says what a lookup that waited would have said."""
    store = SlowStore()
    store.release.set()
    routing = RoutingConfig(min_window_requests=4)
    peer = PrefixTracker(store, block_bytes=BLOCK, routing=routing)  # another proxy
    doc = "a document another proxy sent " * 30
    for i in range(6):
        seen = await peer.lookup(CHAT, body(doc + f" question {i}"), [R1])
        claimed = peer.claim(seen, R1, capacity_tokens=100_000)
        assert claimed is not None
        await claimed
    for _ in range(2):
        counted = peer.in_flight(seen, R1, +1)
        assert counted is not None
        await counted
    waited = await PrefixTracker(store, block_bytes=BLOCK, routing=routing).lookup(
        CHAT, body(doc + " a new one"), [R1]
    )
    assert waited.matched_for(R1) > 0 and waited.load_for(R1) == 2.0 and waited.shared_blocks > 0

    store.release.clear()
    tracker = PrefixTracker(store, block_bytes=BLOCK, routing=routing, remote_store=True)
    view = await tracker.lookup(CHAT, body(doc + " a new one"), [R1])
    assert (view.matched_for(R1), view.load_for(R1), view.shared_blocks) == (0, 0.0, 0)
    view = dataclasses.replace(view, affinity_key=7)  # set by the handler meanwhile
    store.release.set()
    done = await answered(view)
    assert done.matched_blocks == waited.matched_blocks
    assert done.loads == waited.loads
    assert done.shared_blocks == waited.shared_blocks
    assert done.available and done.affinity_key == 7 and done.pending is None

    # Before the record: the exchange's view, and the load the router would have seen.
    ex = Exchange(request_id="r", route=CHAT, upstream_path=CHAT, obs=Observation(t_start=0.0))
    ex.view = view
    ex.target = Target(replica=SimpleNamespace(url=R1), reason="single", load=1.0)  # type: ignore[arg-type]
    settle_view(ex)
    assert ex.view == done and ex.target.load == 2.0
    await tracker.flush()  # nothing left running


async def test_a_lookup_that_fails_is_logged_not_lost() -> None:
    class Broken(SlowStore):
        async def lookup(
            self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
        ) -> LookupResult:
            await self.release.wait()
            raise ValueError("a reply the store could not read")

    store = Broken()
    tracker = PrefixTracker(store, block_bytes=BLOCK, remote_store=True)
    with capture_logs() as logs:
        view = await tracker.lookup(CHAT, body("q " * 100), [R1])
        assert view.pending is not None
        store.release.set()
        await tracker.flush()
        await asyncio.sleep(0)
    assert [e["event"] for e in logs] == ["lookup_failed"]
    assert not settled(view).available


async def test_a_deferred_lookup_rides_with_the_writes_and_flush_does_not_wait_their_timer() -> (
    None
):
    """One replica, a remote store, nothing waiting: the lookup is queued with the writes (not
    sent) until they go; flushing sends both at once rather than after the writes' delay."""
    store = EmbeddedStore()
    tracker = PrefixTracker(store, block_bytes=BLOCK, write_delay_s=60.0, remote_store=True)
    assert tracker.writes is not None
    view = await tracker.lookup(CHAT, body("hi"), ["http://r:1"], deferred=True)
    assert view.pending is not None and tracker.writes.pending == 1
    await asyncio.sleep(0.01)
    assert not view.pending.done()  # queued: sent with the writes
    await asyncio.wait_for(tracker.flush(), 1.0)
    assert view.pending.done() and settled(view).available
    waited = await tracker.lookup(CHAT, body("hi"), ["http://r:1"])  # not deferred: sent now
    assert waited.pending is not None and tracker.writes.pending == 0
    assert (await answered(waited)).available


async def test_a_queued_lookup_that_fails_or_is_cancelled_settles_unavailable() -> None:
    """The view of a lookup queued with the writes follows its answer: a failure or a
    cancellation (shutting down) leaves the proxy's own numbers, marked unavailable."""
    store = EmbeddedStore()
    tracker = PrefixTracker(store, block_bytes=BLOCK, write_delay_s=60.0, remote_store=True)
    assert tracker.writes is not None
    views = [await tracker.lookup(CHAT, body(f"q{i}"), [R1], deferred=True) for i in range(2)]
    failing, cancelled = (tracker.writes._batch.lookups[i].future for i in range(2))
    failing.set_exception(ConnectionError("gone"))
    cancelled.cancel()
    with capture_logs() as logs:
        for _ in range(2):  # the answers' callbacks, then the views'
            await asyncio.sleep(0)
    for view in views:
        assert view.pending is not None and view.pending.done()
        assert not settled(view).available
    assert [e["event"] for e in logs] == ["lookup_failed"]
    tracker.writes._batch.lookups.clear()
    tracker.writes._batch.queued = 0  # (what the batch counts of itself)


async def test_a_deferred_lookup_in_this_process_is_read_before_its_claim() -> None:
    """The embedded store, one replica, nothing waiting: the lookup is left for later
    (``answer_local``: at the first token or the end) and read from the store before any batch
    of queued writes, the request's own claim among them, is applied."""
    store = EmbeddedStore()
    tracker = PrefixTracker(store, block_bytes=BLOCK, write_delay_s=60.0)
    assert tracker.writes is not None
    first = await tracker.lookup(CHAT, body("a" * 300), [R1])
    await store.record_prefix("default", R1, first.fp.block_hashes, 1000)
    view = await tracker.lookup(CHAT, body("b" * 300), [R1], deferred=True)
    hashes = view.fp.block_hashes
    before = (await store.lookup("default", [R1], hashes)).matched[R1]
    assert view.pending is not None and not view.pending.done() and before < len(hashes)
    tracker.claim(view, R1, 100_000)  # queued: applied with the batch
    await asyncio.wait_for(tracker.writes.flush(), 1.0)  # the batch answers the lookup first
    assert view.pending.done() and settled(view).available
    assert settled(view).matched_blocks[R1] == before
    assert (await store.lookup("default", [R1], hashes)).matched[R1] == len(hashes)
    later = await tracker.lookup(CHAT, body("c"), [R1], deferred=True)
    tracker.answer_local()  # (a first token): folded in at once, in this step
    assert later.pending is not None and later.pending.done() and settled(later).available


async def test_a_deferred_lookup_in_this_process_that_fails_is_logged_not_lost() -> None:
    """A store in this process whose read fails (a bug): the view settles unavailable, with
    this proxy's own numbers, and the failure is logged once, as a remote lookup's is."""

    class Broken(EmbeddedStore):
        def lookup_now(
            self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
        ) -> LookupResult:
            raise ValueError("an index the store could not read")

    tracker = PrefixTracker(Broken(), block_bytes=BLOCK, write_delay_s=60.0)
    view = await tracker.lookup(CHAT, body("q " * 100), [R1], deferred=True)
    assert view.pending is not None and not view.pending.done()
    with capture_logs() as logs:
        tracker.answer_local()
    assert [e["event"] for e in logs] == ["lookup_failed"]
    assert view.pending.done() and not settled(view).available
    await tracker.flush()
