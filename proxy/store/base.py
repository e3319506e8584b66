"""The store's contract: one interface, an embedded and a Redis implementation.

A store does two jobs for the proxy:

* **Prefix index.** Per (namespace, backend replica), which prompt blocks that replica recently
  processed: a capacity-bounded LRU of chained block hashes with an idle TTL. ``longest_match``
  sits on the request's critical path (zero round trips embedded, one pipelined round trip to
  Redis, bounded by ``StoreTimeouts.lookup_s``); ``record_prefix`` runs in the background after
  routing.
* **Routing inputs.** What the router needs besides the index, kept here so that every proxy
  sharing one Redis sees the same numbers: per namespace, rolling-window counts of the leading
  blocks recent requests carried (``observe_traffic`` / ``traffic_counts``, for the traffic-shared
  depth), and per replica the requests in flight from every proxy (``add_in_flight``). ``lookup``
  reads the index, the counts and the loads in the same single round trip.
* **Statistics.** Every finished request folded into per-minute buckets (hit rates, predicted vs
  measured, latency histograms, savings) and a per-namespace ranking of application prefixes,
  read back by ``query_stats`` and ``top_prefixes`` for ``/stats`` and the dashboard.

The index only ever receives chained hashes (``h_k`` determines ``h_1 .. h_k``) and is kept
*prefix-closed*: recording a prompt touches its whole chain with the leading blocks most
recent, so eviction takes a prompt's tail before its head and a block is never evicted before
the blocks that lead to it. That is why ``longest_match`` may find the leading run by binary
search (``proxy.fingerprint.leading_run``) in both implementations.

Failure model (Redis). A store call never raises and never waits longer than its timeout: on
an error it returns the neutral result (``{}``, an empty window, ``[]``), sets ``degraded`` and
counts a failure; writes made while Redis is unreachable are lost. The embedded store is never
degraded. A failed ``lookup`` answers ``LookupResult.unavailable()``: the caller falls back to
its own numbers (its local in-flight counts, a shared depth of 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from proxy.routing import TRAFFIC_MAX_HASHES
from proxy.values import value

if TYPE_CHECKING:
    from proxy.store.ranking import PrefixStat
    from proxy.store.stats import StatsSample
    from proxy.store.window import StatsWindow

DEFAULT_NAMESPACE = "default"


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreTimeouts:
    """How long the store may wait on Redis, per kind of call, in seconds.

    ``lookup_s`` bounds the critical-path lookup; ``write_s`` the background index and stats
    writes; ``read_s`` the ``/stats`` queries (a 7-day window reads a few hundred hashes);
    ``connect_s`` a TCP connect, as a backstop under the per-call bounds. After a failure the
    store skips Redis for ``breaker_s`` and then lets one call probe it again.
    """

    lookup_s: float = 0.005
    write_s: float = 0.05
    read_s: float = 2.0
    connect_s: float = 0.25
    breaker_s: float = 1.0

    @classmethod
    def for_lookup(cls, lookup_s: float) -> StoreTimeouts:
        """The defaults around a chosen lookup deadline: the background writes get ten times as
        long (as by default), never less than their default.

        A write batch does more than a lookup, and a write that times out opens the breaker for
        the lookups too: a deadline chosen for a busy machine must not be undone by writes held
        to the default one.
        """
        default = cls()
        return cls(lookup_s=lookup_s, write_s=max(default.write_s, 10.0 * lookup_s))


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreOptions:
    """Sizing and retention shared by both implementations."""

    index_ttl_s: float = 3600.0
    """A replica's index is dropped after this long without a ``record_prefix``."""
    stats_retention_s: float = 7 * 86400.0
    """Statistics buckets are kept this long after their minute (or hour) ends."""
    top_prefixes_cap: int = 1000
    """Application prefixes ranked per namespace and hour; the least used beyond are dropped."""
    memory_entries: int = 100_000
    """Entries the embedded store keeps for ``remember`` / ``recall`` (least recent out)."""
    memory_value_bytes: int = 65_536
    """Largest value ``remember`` keeps; a larger one is not stored."""
    memory_bytes: int = 64 * 1024 * 1024
    """Bytes of values the embedded store keeps for ``remember`` (least recent out): values
    learned per request (a form of a text seen once) cannot fill memory up to the entry bound."""
    key_prefix: str = "pg"
    """First component of every Redis key."""
    traffic_window_s: float = 120.0
    """Bucket length of the traffic counts; a read sums the current and the previous bucket,
    so the window covers between one and two bucket lengths."""
    traffic_max_hashes: int = TRAFFIC_MAX_HASHES
    """Distinct block hashes one traffic bucket counts per namespace; past it, only the hashes
    it holds (``proxy.routing.TRAFFIC_MAX_HASHES``)."""
    in_flight_ttl_s: float = 300.0
    """A proxy's in-flight counts stop counting this long after its last write (a crashed proxy's
    load decays instead of sticking)."""
    timeouts: StoreTimeouts = field(default_factory=StoreTimeouts)


@value
class LookupResult:
    """What the critical-path lookup reads in one round trip."""

    matched: dict[str, int]
    """Leading blocks matched per replica (``longest_match``); ``{}`` when unavailable."""
    loads: dict[str, float]
    """Requests in flight per replica, from every proxy sharing the store."""
    window_requests: int
    """Requests in the traffic window of the namespace."""
    hash_counts: list[int]
    """For each of the request's leading hashes (up to ``TRAFFIC_MAX_BLOCKS``), how many of
    those requests carried it."""
    available: bool = True
    """False when the store could not answer (the other fields are then empty)."""

    @classmethod
    def unavailable(cls) -> LookupResult:
        """The neutral answer of a failed lookup."""
        return cls({}, {}, 0, [], available=False)


@runtime_checkable
class PrefixStore(Protocol):
    """The prefix index and statistics store the proxy talks to."""

    @property
    def degraded(self) -> bool:
        """True while the backing service is failing and calls return neutral results."""
        ...

    @property
    def failures(self) -> int:
        """Calls that failed against the backing service since start-up (for metrics)."""
        ...

    async def longest_match(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> dict[str, int]:
        """Blocks matched per replica: how many leading ``hashes`` its index holds.

        Every replica gets an entry (0 when nothing matches); ``{}`` when the store is degraded.
        """
        ...

    async def record_prefix(
        self, namespace: str, replica: str, hashes: Sequence[int], capacity_blocks: int
    ) -> None:
        """Mark the whole chain ``hashes`` as just used by ``replica`` and trim to capacity."""
        ...

    async def lookup(
        self, namespace: str, replicas: Sequence[str], hashes: Sequence[int]
    ) -> LookupResult:
        """The index match, the replicas' loads and the traffic counts of ``hashes`` at once.

        ``matched`` is what ``longest_match`` answers; ``hash_counts`` covers the leading
        ``TRAFFIC_MAX_BLOCKS`` hashes. One pipelined round trip to Redis, bounded by
        ``StoreTimeouts.lookup_s``; ``LookupResult.unavailable()`` when degraded.
        """
        ...

    async def traffic_counts(self, namespace: str, hashes: Sequence[int]) -> tuple[int, list[int]]:
        """``(window_requests, count per hash)`` for the leading ``hashes`` (a block chain: past
        a hash no request carried, every count is zero, and a store may stop reading there);
        ``(0, [])`` when degraded."""
        ...

    async def observe_traffic(self, namespace: str, hashes: Sequence[int]) -> None:
        """Count one request carrying the leading ``hashes`` in the rolling traffic window."""
        ...

    async def add_in_flight(self, namespace: str, replica: str, delta: int) -> None:
        """Change this proxy's count of requests in flight to ``replica`` by ``delta``.

        Loads belong to replicas, not tenants: ``lookup`` answers each replica's load summed over
        every namespace and every proxy (a proxy silent for ``in_flight_ttl_s`` stops counting).
        """
        ...

    async def add_stats(self, sample: StatsSample) -> None:
        """Fold one finished request into its minute and hour buckets."""
        ...

    async def query_stats(
        self,
        *,
        since_s: float,
        until_s: float | None = None,
        model: str | None = None,
        backend: str | None = None,
        namespace: str | None = None,
    ) -> StatsWindow:
        """Aggregate the buckets of ``[since_s, until_s)`` (epoch seconds, whole minutes)."""
        ...

    async def top_prefixes(
        self, *, since_s: float, limit: int = 10, namespace: str | None = None
    ) -> list[PrefixStat]:
        """The application prefixes that served the most prompt tokens since ``since_s``."""
        ...

    async def recall(self, namespace: str, kind: str, keys: Sequence[str]) -> list[bytes | None]:
        """The values last remembered under ``keys`` of ``kind`` (``None`` where none, expired,
        or when degraded).

        A small shared memory for what the proxy learns about requests (the first form of a
        tool list, the note it put in a message) so that every proxy replica agrees. On the
        request path: bounded by ``StoreTimeouts.lookup_s``, one round trip to one Redis node.
        """
        ...

    async def remember(
        self, namespace: str, kind: str, items: Mapping[str, bytes], ttl_s: float
    ) -> None:
        """Keep each value under its key of ``kind`` for ``ttl_s`` seconds (renewed by a
        later ``remember``); values over ``StoreOptions.memory_value_bytes`` are not kept."""
        ...

    async def warm(self) -> bool:
        """Do, off any request's deadline, what a first call would otherwise do under it.

        For Redis: connect to every node, learn a cluster's layout and load the scripts, so
        that the first lookups and writes after start-up fit their few-millisecond bounds.
        Bounded by ``StoreTimeouts.read_s``; a failure counts as any failed call (the store is
        degraded and recovers by itself). ``True`` when the store is ready.
        """
        ...

    async def aclose(self) -> None:
        """Release connections; safe to call more than once."""
        ...
