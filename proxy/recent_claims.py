"""This proxy's own recent claims: the prefixes it just routed, before the store has them.

The store learns a claim in the background (``PrefixTracker.claim``); requests arriving
together look up before those writes land, and read these instead (``PrefixTracker.lookup``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from proxy.fingerprint import common_blocks


def checkpoints(n: int) -> Iterator[int]:
    """Indices of a chain of ``n`` blocks that ``RecentClaims`` files a claim under, deepest
    first: the last block, then blocks ``2**k - 1`` (the 1st, 2nd, 4th, 8th...). Two chains
    sharing ``m`` leading blocks share a checkpoint at depth at least ``m / 2``."""
    if n <= 0:
        return
    yield n - 1
    k = 1 << (n - 1).bit_length()
    while k > 1:
        k >>= 1
        if k - 1 < n - 1:
            yield k - 1


@dataclass(slots=True, eq=False)
class _Claim:
    expires: float
    namespace: str
    replica: str
    chain: Sequence[int]


class RecentClaims:
    """Claims this proxy made in the last ``ttl_s`` seconds, read by its next lookups.

    The store learns a claim in the background, and requests that arrive together all look up
    the index before any of those writes lands; without this they would all miss and spread over
    the fleet. A claim is filed under ``(namespace, replica, hash)`` at the checkpoint indices of
    its chain and keeps a reference to the chain, so a lookup finds a claim sharing at least half
    of its match in O(log n) probes and measures the exact match by binary search.

    Bounded by the TTL and by ``max_blocks``, the block hashes the live claims hold in all (a
    128 KB prompt is 512 of them; 2**18 is some 10 MB at most): past it the oldest claims go
    first, whatever their age.
    """

    __slots__ = ("_blocks", "_claims", "_entries", "_max_blocks", "_ttl_s")

    def __init__(self, *, ttl_s: float = 5.0, max_blocks: int = 1 << 18) -> None:
        self._ttl_s = ttl_s
        self._max_blocks = max_blocks
        self._entries: dict[tuple[str, str, int], _Claim] = {}
        self._claims: deque[_Claim] = deque()
        self._blocks = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def blocks(self) -> int:
        """Block hashes the live claims hold."""
        return self._blocks

    def add(self, namespace: str, replica: str, hashes: Sequence[int], now: float) -> None:
        claim = _Claim(now + self._ttl_s, namespace, replica, hashes)
        entries = self._entries
        for i in checkpoints(len(hashes)):
            entries[(namespace, replica, hashes[i])] = claim
        self._claims.append(claim)
        self._blocks += len(hashes)
        claims = self._claims
        while claims and (claims[0].expires <= now or self._blocks > self._max_blocks):
            self._drop(claims.popleft())

    def _drop(self, claim: _Claim) -> None:
        self._blocks -= len(claim.chain)
        entries, chain = self._entries, claim.chain
        for i in checkpoints(len(chain)):
            key = (claim.namespace, claim.replica, chain[i])
            if entries.get(key) is claim:  # not since taken over by a newer claim
                del entries[key]

    def forget(self, namespace: str, replica: str, hashes: Sequence[int]) -> None:
        """Drop the claim of ``hashes`` (its replica failed before serving the request); the
        entries other claims have since taken over stay theirs."""
        entries = self._entries
        for i in checkpoints(len(hashes)):
            key = (namespace, replica, hashes[i])
            claim = entries.get(key)
            if claim is not None and claim.chain is hashes:
                del entries[key]

    def matched(self, namespace: str, replica: str, hashes: Sequence[int], now: float) -> int:
        """Leading blocks of ``hashes`` that a live claim for ``replica`` holds."""
        entries = self._entries
        if not entries:
            return 0
        for i in checkpoints(len(hashes)):
            claim = entries.get((namespace, replica, hashes[i]))
            if claim is not None and claim.expires > now:
                return common_blocks(hashes, claim.chain, i + 1)
        return 0
