"""The store writes of finished and forwarded requests, batched and sent a moment later.

Every request writes to the store three or four times: the claim of its blocks and its arrival
in the traffic window when it is forwarded, the replica's in-flight count at the start and at the
end, its blocks again and its statistics once it has ended. Made one by one, each is a Python
call walking a chain (and, with Redis, a script run and a round trip), and they land where they
hurt: the claim between forwarding and the backend's first byte, the end-of-request writes right
when the client sends its next turn, whose lookup then queues behind them in Redis.

``WriteBehind`` queues them and applies them together ``delay_s`` later (5 ms by default,
``--store-write-delay-ms``), off those moments, or at once when ``max_pending`` are queued:

* the same chain recorded twice for one replica (the claim, then the request's end) is written
  once, as the later write;
* in-flight changes are summed per replica (each replica's count is written once a batch);
* everything else is applied in arrival order;
* with Redis, a batch is one pipelined round trip (``RedisStore.apply_writes``), and requests
  that fall in the same statistics bucket are added as one.

What this proxy reads itself is unaffected: its lookups see its own claims at once
(``PrefixTracker.recent``) and its own in-flight counts (``local_in_flight``). Other proxies
sharing the store, and this store's own answers, see a write up to ``delay_s`` later.

A lookup nothing waits for (one replica: ``PrefixTracker``) rides in the batch too, ahead of its
writes (``lookup``), so it never reads its own request's claim (queued after it; it does read
what other requests wrote meanwhile). The batch goes at its timer, or at once when a request
that ended needs the answer for its record (``hurry``). The lookup's round trip and Redis's work
on it then fall after the first token of a request whose first token comes within ``delay_s``,
not between forwarding and it, where a request's time to first token is made. A failed batch
answers its lookups as a failed store does; they share the writes' deadline, not the request
path's (nothing on the request path waits for them).
``flush()`` applies everything queued (``RecordWriter.drain`` calls it, at shutdown and in
tests); a failing store loses a batch as it would lose the single writes (never raised).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proxy.log import get_logger
from proxy.store.base import LookupResult

if TYPE_CHECKING:
    from proxy.store.base import PrefixStore
    from proxy.store.stats import StatsSample

log = get_logger()

DEFAULT_DELAY_S = 0.005
DEFAULT_MAX_PENDING = 256
QUEUE_LIMIT = 16
"""Writes queued while a batch is under way, in ``max_pending`` s: past it (a store slower
than the traffic) new writes are dropped and counted, as a failed write is lost."""


@dataclass(slots=True)
class WriteBatch:
    """Writes queued for one trip to the store."""

    records: dict[tuple[str, str, int, int], tuple[Sequence[int], int]] = field(
        default_factory=dict
    )
    """(namespace, replica, last hash, length) -> (chain, capacity in blocks), oldest first."""
    observes: list[tuple[str, Sequence[int]]] = field(default_factory=list)
    """(namespace, leading hashes) of each request counted in the traffic window."""
    in_flight: dict[str, tuple[str, int]] = field(default_factory=dict)
    """replica -> (namespace of its first change, summed change)."""
    stats: list[StatsSample] = field(default_factory=list)
    lookups: list[Lookup] = field(default_factory=list)
    """Lookups to answer before the writes are applied (a batch's reads come first)."""
    queued: int = 0
    """``len(self)``, kept by the ``add_*`` methods as each write comes (``WriteBehind`` asks
    it at every write)."""

    def add_record(
        self, namespace: str, replica: str, hashes: Sequence[int], capacity: int
    ) -> None:
        key = (namespace, replica, hashes[-1], len(hashes))
        if self.records.pop(key, None) is None:  # written once, as the latest (its LRU place)
            self.queued += 1
        self.records[key] = (hashes, capacity)

    def add_observe(self, namespace: str, hashes: Sequence[int]) -> None:
        self.observes.append((namespace, hashes))
        self.queued += 1

    def add_in_flight(self, namespace: str, replica: str, delta: int) -> None:
        known = self.in_flight.get(replica)
        if known is None:
            self.in_flight[replica] = (namespace, delta)
            self.queued += 1
        else:  # (summed: the namespace of its first change)
            self.in_flight[replica] = (known[0], known[1] + delta)

    def add_stat(self, sample: StatsSample) -> None:
        self.stats.append(sample)
        self.queued += 1

    def add_lookup(self, lookup: Lookup) -> None:
        self.lookups.append(lookup)
        self.queued += 1

    def __len__(self) -> int:
        return (
            len(self.records)
            + len(self.observes)
            + len(self.in_flight)
            + len(self.stats)
            + len(self.lookups)
        )

    def unanswered(self) -> None:
        """Answer every lookup not answered yet as a store that failed would."""
        for lookup in self.lookups:
            lookup.answer(LookupResult.unavailable())


@dataclass(slots=True)
class Lookup:
    """One queued ``PrefixStore.lookup``, and where its answer goes."""

    namespace: str
    replicas: Sequence[str]
    hashes: Sequence[int]
    future: asyncio.Future[LookupResult]

    def answer(self, result: LookupResult) -> None:
        if not self.future.done():
            self.future.set_result(result)


async def apply_batch(store: PrefixStore, batch: WriteBatch) -> None:
    """Apply ``batch`` to ``store``: in one call where the store takes batches, else call by
    call (the lookups first, then the in-flight counts, the traffic, the chains and the
    statistics). Every lookup is answered, by a store that failed too."""
    batched = getattr(store, "apply_writes", None)
    if batched is not None:
        await batched(batch)
        return
    for lookup in batch.lookups:
        lookup.answer(await store.lookup(lookup.namespace, lookup.replicas, lookup.hashes))
    for replica, (namespace, delta) in batch.in_flight.items():
        if delta:
            await store.add_in_flight(namespace, replica, delta)
    for namespace, hashes in batch.observes:
        await store.observe_traffic(namespace, hashes)
    for (namespace, replica, _, _), (hashes, capacity) in batch.records.items():
        await store.record_prefix(namespace, replica, hashes, capacity)
    for sample in batch.stats:
        await store.add_stats(sample)


class WriteBehind:
    """Store writes queued, and applied together ``delay_s`` later (module docstring)."""

    def __init__(
        self,
        store: PrefixStore,
        *,
        delay_s: float = DEFAULT_DELAY_S,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self.store = store
        self.delay_s = max(delay_s, 0.0)
        self.max_pending = max(max_pending, 1)
        self._batch = WriteBatch()
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._hurried = False
        """The queued batch goes as soon as the one under way is done (``hurry``)."""
        self.batches = 0
        """Batches applied since start-up (for tests and metrics)."""
        self.dropped = 0
        """Writes dropped because the queue was full (the store falls behind the traffic)."""
        self.before_apply: Callable[[], None] | None = None
        """Called as each batch is taken, before it is applied (``PrefixTracker``: the lookups
        it answers itself are answered from the store as it was before these writes)."""

    @property
    def pending(self) -> int:
        """Writes queued and not yet under way."""
        return self._batch.queued

    # -- what is queued -------------------------------------------------------------------------

    def record_prefix(
        self, namespace: str, replica: str, hashes: Sequence[int], capacity_blocks: int
    ) -> None:
        if not hashes or self._full():
            return
        self._batch.add_record(namespace, replica, hashes, capacity_blocks)
        self._queued()

    def observe_traffic(self, namespace: str, hashes: Sequence[int]) -> None:
        if self._full():
            return
        self._batch.add_observe(namespace, hashes)
        self._queued()

    def add_in_flight(self, namespace: str, replica: str, delta: int) -> None:
        self._batch.add_in_flight(namespace, replica, delta)
        self._queued()

    def add_stats(self, sample: StatsSample) -> None:
        if self._full():
            return
        self._batch.add_stat(sample)
        self._queued()

    def lookup(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> asyncio.Future[LookupResult]:
        """``PrefixStore.lookup``, sent with the next batch, before its writes (the request's own
        claim and count among them): its answer, when it comes (a failing store's, too)."""
        future: asyncio.Future[LookupResult] = asyncio.get_running_loop().create_future()
        self._batch.add_lookup(Lookup(namespace, replicas, hashes, future))
        self._queued()
        return future

    def hurry(self) -> None:
        """Send what is queued now (after the batch under way, if one is): an answer is
        awaited, or the moment that mattered has passed."""
        if not self._batch.queued:
            return  # (a lookup in the batch under way is answered with it)
        if self._task is not None:
            self._hurried = True
        else:
            self._start()

    def _full(self) -> bool:
        """Whether the queue is at its limit (in-flight counts are never dropped: they are
        summed into one entry per replica, and a lost one would skew the shared loads)."""
        if self._batch.queued < QUEUE_LIMIT * self.max_pending:
            return False
        if not self.dropped:
            log.warning("store_writes_dropped", queued=self._batch.queued)
        self.dropped += 1
        return True

    # -- when it is written ---------------------------------------------------------------------

    def _queued(self) -> None:
        if self._task is not None:
            return  # the batch under way arms the next one when it is done
        if self._batch.queued >= self.max_pending or self._hurried:
            self._start()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.delay_s, self._start)

    def _start(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is None and self._batch.queued:
            self._hurried = False
            self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        batch, self._batch = self._batch, WriteBatch()
        if self.before_apply is not None:
            self.before_apply()  # (never raises)
        try:
            await apply_batch(self.store, batch)
            self.batches += 1
        except Exception as exc:  # a store never raises; a bug here must not stop the writes
            log.error("store_writes_failed", error=type(exc).__name__, writes=len(batch))
        finally:
            batch.unanswered()  # (cancelled at shutdown too: nobody waits for ever)
            self._task = None
            if self._batch.queued:
                self._queued()
            else:
                self._hurried = False

    async def flush(self) -> None:
        """Apply everything queued now (and wait for a batch already under way)."""
        while True:
            task = self._task
            if task is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)
                continue
            if not self._batch.queued:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                return
            self._start()
