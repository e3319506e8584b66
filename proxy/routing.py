"""Choosing a backend replica: prefix affinity that cannot pile the fleet onto one replica.

Sending a request to the replica that already holds the longest part of its prompt saves that
prefill, but naive prefix routing fails in two known ways: a system prompt shared by all traffic
makes *every* request "match" the same replica, and a replica that holds popular prefixes keeps
attracting traffic while it is already the busiest. The ``prefix-affinity`` policy guards
against both:

* **Traffic-shared depth.** ``TrafficDepth`` counts, over a rolling window, how many recent
  requests carry each leading block; the leading blocks carried by at least ``shared_share`` of
  them are the traffic-shared depth of a request (typically its system prompt). Every replica
  soon holds those, so a match only counts as affinity when it is at least
  ``min_affinity_blocks`` longer than that depth.
* **Load gate.** A replica whose requests in flight exceed ``load_gate_ratio`` times the
  fleet's mean plus ``load_gate_slack`` is not chosen for affinity; the request goes to the
  least loaded other replica instead (``"load_gate"``). The slack keeps a nearly idle fleet
  from gating on one or two requests.
* **A client's own affinity key** (``prompt_cache_key``, or a session header; see
  ``proxy.hosted``) names the conversation outright: its requests go to the key's home replica,
  the highest weighted rendezvous score of the key over the healthy replicas
  (``"key_affinity"``), whatever the index says, under the same load gate. Every proxy computes
  the same home without sharing any state, a replica that fails moves only its own keys, and
  the key only chooses the replica: it never enters the fingerprint or a cache salt, so
  conversations with different keys still share a common prefix's cache.
* **Misses go to the least loaded replica**, and the proxy records the chosen replica's blocks
  in the index right away (``PrefixTracker.claim``), so the next request of the same
  conversation or burst finds them there even before this one has finished.

Determinism: ``Router.choose`` is pure. Ties are broken by rendezvous hashing of the request's
key (``route_key``) and the replica URL, never by randomness or dict order, so every proxy
replica sharing one Redis (same index, same traffic counts, same loads) makes the same decision
for the same request. The one exception is ``round-robin``: its counter is each router's own.

The fleet simulator (``prefixgate simulate``) runs this same code against simulated replicas.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from proxy.options import option
from proxy.values import value

ROUND_ROBIN = "round-robin"
LEAST_LOADED = "least-loaded"
PREFIX_AFFINITY = "prefix-affinity"
POLICIES = (ROUND_ROBIN, LEAST_LOADED, PREFIX_AFFINITY)

# Decision reasons.
SINGLE = "single"
AFFINITY = "affinity"
KEY_AFFINITY = "key_affinity"
MISS = "miss"
RETRY_REASON = "retry"  # route reason of a request served by a second replica
LOAD_GATE = "load_gate"
ROUND_ROBIN_REASON = "round_robin"
LEAST_LOADED_REASON = "least_loaded"
REASONS = (SINGLE, AFFINITY, KEY_AFFINITY, MISS, LOAD_GATE, ROUND_ROBIN_REASON, LEAST_LOADED_REASON)

TRAFFIC_MAX_BLOCKS = 64
"""Leading blocks of a request counted for the traffic-shared depth (``K``)."""
TRAFFIC_MAX_HASHES = 262_144
"""Distinct block hashes one traffic bucket counts (per namespace, in either store). Traffic of
distinct prompts adds a hash per block: at 1,000 requests/s of 8 KB prompts about 32,000 a
second, which over a 120 s bucket would be millions. Once a bucket holds this many, a request
still counts in it, and so do the hashes of it the bucket holds already (the shared prefixes,
counted exactly as before); hashes new to the bucket are not added until the next one. A shared
prefix that first appears in a full bucket is seen from the next bucket on."""

_SEED_MASK = (1 << 64) - 1
_HASH_SPAN2 = 1 << 65  # twice the hash range: 1 - u = (2**64 - h - 1/2) / 2**64, in integers
_BELOW_ONE = 1.0 - 2.0**-53


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingConfig:
    """How to choose among several replicas (``ValueError`` on an impossible value)."""

    policy: str = option(
        PREFIX_AFFINITY, "how requests are spread over several backends", choices=POLICIES
    )
    """One of ``POLICIES``; with a single replica every policy answers ``"single"``."""
    min_affinity_blocks: int = option(
        2,
        "prefix-affinity: blocks a replica must hold beyond the prefix most traffic shares "
        "before the request follows it",
        cast=int,
        metavar="N",
    )
    """A match counts as affinity when it exceeds the traffic-shared depth by this many blocks."""
    load_gate_ratio: float = option(
        1.5,
        "prefix-affinity: a replica loaded above RATIO x the fleet mean (plus 2 requests) "
        "loses its affinity traffic to the least loaded replica",
        cast=float,
        metavar="RATIO",
    )
    """A replica with load above ``ratio * mean + slack`` is not chosen for affinity."""
    load_gate_slack: float = option(
        2.0,
        "prefix-affinity: requests added to the load gate's limit, so a nearly idle fleet "
        "never gates",
        cast=float,
        metavar="N",
    )
    """Absolute slack, in requests, so that an idle or lightly used fleet never gates."""
    shared_share: float = option(
        0.5,
        "prefix-affinity: a leading block carried by at least this share of recent requests is "
        "shared by most traffic and never counts as affinity",
        cast=float,
        metavar="SHARE",
    )
    """A block is shared by most traffic when at least this share of recent requests carry it."""
    min_window_requests: int = option(
        16,
        "prefix-affinity: below this many requests in the traffic window no block counts as shared",
        cast=int,
        metavar="N",
    )
    """Below this many requests in the traffic window no block counts as shared (a single
    conversation is not "most traffic")."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; one of {POLICIES}")
        if self.min_affinity_blocks < 1:
            raise ValueError("min_affinity_blocks must be at least 1")
        if not (math.isfinite(self.load_gate_ratio) and self.load_gate_ratio >= 1.0):
            raise ValueError("load_gate_ratio must be a finite number >= 1")
        if not (math.isfinite(self.load_gate_slack) and self.load_gate_slack >= 0.0):
            raise ValueError("load_gate_slack must be a finite number >= 0")
        if not 0.0 < self.shared_share <= 1.0:
            raise ValueError("shared_share must be in (0, 1]")
        if self.min_window_requests < 1:
            raise ValueError("min_window_requests must be at least 1")


@value
class Candidate:
    """A replica the request may go to, and what the router knows of it."""

    replica: str
    """The replica's URL."""
    matched_blocks: int
    """Leading blocks of this request that its index holds."""
    load: float
    """Requests in flight to it (from every proxy), not counting this one."""
    weight: float = 1.0
    """Relative capacity: load is compared as ``load / weight``."""
    healthy: bool = True
    """Unhealthy candidates are chosen only when no healthy one exists."""

    @property
    def relative_load(self) -> float:
        return self.load / self.weight if self.weight > 0 else math.inf


@value
class Decision:
    """The chosen replica and why."""

    replica: str
    reason: str
    """One of ``REASONS``."""
    matched_blocks: int
    """Blocks the chosen replica holds."""
    shared_blocks: int
    """The traffic-shared depth used for the affinity test."""


def rendezvous(key: int, replica: str) -> int:
    """Stable score of ``replica`` for ``key``: the highest score wins a tie (HRW hashing)."""
    return xxhash.xxh3_64_intdigest(replica.encode(), seed=key & _SEED_MASK)


def weighted_rendezvous(key: int, candidate: Candidate) -> float:
    """Weighted HRW score of ``candidate`` for ``key``: keys spread in proportion to weight.

    The score ``-weight / ln(u)``, with ``u`` the rendezvous hash mapped into (0, 1), is the
    logarithmic method of weighted rendezvous hashing: a replica of twice the weight is the
    home of twice the keys, and adding or removing a replica moves only the keys it wins or
    held. A replica of weight 0 is never a home while another exists.
    """
    if candidate.weight <= 0:
        return -math.inf
    # ln(u) as log1p(-(1 - u)): u close to 1 keeps its precision there, and never reaches 0.
    rest = min((_HASH_SPAN2 - 2 * rendezvous(key, candidate.replica) - 1) / _HASH_SPAN2, _BELOW_ONE)
    return -candidate.weight / math.log1p(-rest)


def route_key(hashes: Sequence[int], shared_blocks: int = 0) -> int:
    """The key a request's ties are broken by: its first block past the traffic-shared depth.

    Keying by the very first block would break every tie the same way when all traffic starts
    with one system prompt, and one replica would win them all; the first block that is not
    shared by most traffic is typically the conversation's own, so ties spread evenly over the
    fleet while one conversation's requests still break them the same way. 0 without blocks.
    """
    if not hashes:
        return 0
    return hashes[min(max(shared_blocks, 0), len(hashes) - 1)]


class Router:
    """Chooses a replica per request under one ``RoutingConfig``."""

    def __init__(self, config: RoutingConfig | None = None) -> None:
        self.config = config or RoutingConfig()
        self._turn = itertools.count()

    def choose(
        self,
        candidates: Sequence[Candidate],
        *,
        key: int,
        shared_blocks: int,
        affinity_key: int | None = None,
    ) -> Decision:
        """The replica for one request.

        ``key``: the request's routing key (``route_key``: a block hash, 0 if none), for
        deterministic tie-breaks and nothing else;
        ``shared_blocks``: how many of its leading blocks most recent traffic carries (from
        ``TrafficDepth``);
        ``affinity_key``: the client's own key for the conversation (a 64-bit hash), or None.
        Raises ``ValueError`` when there is no candidate at all.
        """
        if not candidates:
            raise ValueError("no replica to route to")
        if len(candidates) == 1:
            only = candidates[0]
            return Decision(only.replica, SINGLE, only.matched_blocks, shared_blocks)
        pool = [c for c in candidates if c.healthy] or list(candidates)
        policy = self.config.policy
        if policy == ROUND_ROBIN:
            chosen = pool[next(self._turn) % len(pool)]
            return Decision(
                chosen.replica, ROUND_ROBIN_REASON, chosen.matched_blocks, shared_blocks
            )
        if policy == LEAST_LOADED:
            chosen = least_loaded(pool, key)
            return Decision(
                chosen.replica, LEAST_LOADED_REASON, chosen.matched_blocks, shared_blocks
            )
        if affinity_key is not None:
            return self._keyed(pool, affinity_key, shared_blocks)
        return self._affinity(pool, key, shared_blocks)

    def _keyed(self, pool: list[Candidate], affinity_key: int, shared_blocks: int) -> Decision:
        home = max(pool, key=lambda c: weighted_rendezvous(affinity_key, c))
        others = [c for c in pool if c is not home]
        if not others or not self.gated(home, pool):
            return Decision(home.replica, KEY_AFFINITY, home.matched_blocks, shared_blocks)
        chosen = least_loaded(others, affinity_key)
        return Decision(chosen.replica, LOAD_GATE, chosen.matched_blocks, shared_blocks)

    def _affinity(self, pool: list[Candidate], key: int, shared_blocks: int) -> Decision:
        cfg = self.config
        best = max(
            pool, key=lambda c: (c.matched_blocks, -c.relative_load, rendezvous(key, c.replica))
        )
        if best.matched_blocks >= shared_blocks + cfg.min_affinity_blocks:
            others = [c for c in pool if c is not best]
            if not others or not self.gated(best, pool):
                return Decision(best.replica, AFFINITY, best.matched_blocks, shared_blocks)
            chosen = least_loaded(others, key)
            return Decision(chosen.replica, LOAD_GATE, chosen.matched_blocks, shared_blocks)
        chosen = least_loaded(pool, key)
        return Decision(chosen.replica, MISS, chosen.matched_blocks, shared_blocks)

    def gated(self, candidate: Candidate, pool: Sequence[Candidate]) -> bool:
        """Whether ``candidate`` is too far above the fleet's mean load to take affinity.

        Loads are compared per unit of weight; the slack is in requests. A replica of weight 0
        takes no affinity traffic.
        """
        if candidate.weight <= 0:
            return True
        total_weight = sum(c.weight for c in pool if c.weight > 0)
        if total_weight <= 0:
            return False
        mean = sum(c.load for c in pool if c.weight > 0) / total_weight
        cfg = self.config
        limit = cfg.load_gate_ratio * mean + cfg.load_gate_slack / candidate.weight
        return candidate.relative_load > limit


def least_loaded(pool: Sequence[Candidate], key: int) -> Candidate:
    """The candidate with the least load per weight; ties by rendezvous hash of ``key``."""
    return min(pool, key=lambda c: (c.relative_load, -rendezvous(key, c.replica)))


@dataclass(frozen=True, slots=True, kw_only=True)
class TrafficDepth:
    """How many leading blocks of a request most recent traffic shares.

    Computed from counts the store keeps over a rolling window (so every proxy on one Redis
    sees the same numbers): ``window_requests`` requests observed, and for each of the
    request's first ``TRAFFIC_MAX_BLOCKS`` chained hashes how many of them carried it. Counts
    can only fall along a chain (a request carrying block ``k`` carries every block before
    it), so the depth is the leading run of blocks whose count reaches the share.
    """

    share: float = 0.5
    min_window_requests: int = 16

    @classmethod
    def from_config(cls, config: RoutingConfig) -> TrafficDepth:
        return cls(share=config.shared_share, min_window_requests=config.min_window_requests)

    def shared_blocks(self, window_requests: int, hash_counts: Sequence[int]) -> int:
        """The traffic-shared depth: leading blocks carried by ``share`` of the window."""
        if window_requests < self.min_window_requests:
            return 0
        need = self.share * window_requests
        depth = 0
        for count in hash_counts:
            if count < need:
                break
            depth += 1
        return depth


class TrafficWindow:
    """The counts behind ``TrafficDepth`` kept in memory over a rolling window.

    Two buckets of ``bucket_s`` seconds (the current and the previous one), summed on read, so
    the window covers between one and two bucket lengths: what the Redis store keeps in two
    hashes with an expiry. The embedded store and the fleet simulator use this class; the clock
    is the caller's (wall time, or the trace's time).
    """

    __slots__ = ("_bucket_s", "_current", "_index", "_max_hashes", "_previous")

    def __init__(self, *, bucket_s: float = 120.0, max_hashes: int = TRAFFIC_MAX_HASHES) -> None:
        if not bucket_s > 0:
            raise ValueError("bucket_s must be positive")
        self._bucket_s = bucket_s
        self._max_hashes = max_hashes
        self._index: int | None = None
        self._current = _Bucket()
        self._previous = _Bucket()

    def _roll(self, now: float) -> None:
        index = math.floor(now / self._bucket_s)
        last = self._index
        if last is not None and index <= last:
            return  # same bucket, or a clock that stepped back: keep counting in this one
        self._previous = self._current if last is not None and index == last + 1 else _Bucket()
        self._current = _Bucket()
        self._index = index

    def observe(self, hashes: Sequence[int], now: float) -> None:
        """Count one request carrying the leading ``hashes`` (at most ``TRAFFIC_MAX_BLOCKS``).

        A request whose hashes would take the bucket past ``max_hashes`` distinct ones
        (``TRAFFIC_MAX_HASHES``; counting its hashes the bucket holds already, so a bucket is
        full up to one request's length early) counts only those it holds: the leading run of
        the chain it knows (a bucket's hashes are whole leading runs of the chains it counted,
        so past the first it lacks it holds none)."""
        self._roll(now)
        cur = self._current
        cur.requests += 1
        head = hashes[:TRAFFIC_MAX_BLOCKS]
        counts = cur.counts
        if len(counts) + len(head) <= self._max_hashes:
            counts.update(head)  # +1 each (a Counter's loop runs in C)
            return
        for h in head:
            n = counts.get(h)
            if n is None:
                return
            counts[h] = n + 1

    @property
    def held(self) -> int:
        """Distinct hashes the current bucket holds (at most ``max_hashes``)."""
        return len(self._current.counts)

    def holds(self, block_hash: int) -> bool:
        """Whether the current bucket holds ``block_hash``."""
        return block_hash in self._current.counts

    def counts(self, hashes: Sequence[int], now: float) -> tuple[int, list[int]]:
        """``(window_requests, count per hash)`` for the leading ``hashes`` (a block chain).

        Read up to the first hash no request carried: block hashes chain, so a request that
        carries one carries every one before it, and every count after a zero is zero too
        (a request's own unique blocks are most of the table and need no lookup).
        """
        self._roll(now)
        cur, prev = self._current.counts, self._previous.counts
        window = self._current.requests + self._previous.requests
        head = hashes[:TRAFFIC_MAX_BLOCKS]
        out: list[int] = []
        for h in head:
            count = cur.get(h, 0) + prev.get(h, 0)
            if not count:
                break
            out.append(count)
        if len(out) < len(head):
            out.extend(itertools.repeat(0, len(head) - len(out)))
        return window, out


class _Bucket:
    __slots__ = ("counts", "requests")

    def __init__(self) -> None:
        self.requests = 0
        self.counts: Counter[int] = Counter()
