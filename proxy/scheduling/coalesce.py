"""Coalescing: wait for the request already prefilling your prefix instead of prefilling it too.

vLLM (and other servers with one prefix cache shared by every request) caches a block of the
prompt once it has been computed. Two requests that arrive together with the same new prefix
are scheduled together and both compute every block of it: the cache only helps requests that
arrive after the blocks exist. So when a request arrives whose leading blocks an in-flight request
(the *leader*) is prefilling right now, and the shared part is long enough to matter, the proxy
holds it until the leader's first token (its prefill is done, the blocks are cached), bounded by a
maximum wait, and then sends it: it computes only what it does not share.

``InflightPrefixes`` is one replica's registry: block hash → the leader prefilling it. A request
registers the blocks it will compute (those no earlier leader owns) when it is sent; they leave
the registry at its first token, or when it ends without one.

A leader whose answer is not streamed shows no first token; followers then wait for the end of
its expected prefill (from the measured prefill rate), still within the maximum wait.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from proxy.records import monotonic


@dataclass(slots=True, eq=False)
class Leader:
    """An in-flight request that is computing blocks other requests may want."""

    blocks: tuple[int, ...]
    streamed: bool
    expected_prefill_end: float
    """When its prefill should be done (``monotonic()``), used when no first token is seen."""
    done: asyncio.Event = field(default_factory=asyncio.Event)
    followers: int = 0


class InflightPrefixes:
    """The blocks being prefilled right now on one replica, and by whom."""

    def __init__(self) -> None:
        self._owner: dict[int, Leader] = {}

    def __len__(self) -> int:
        return len(self._owner)

    def cached(self, hashes: tuple[int, ...], matched: int) -> int:
        """How many of the ``matched`` leading blocks the index holds are really cached.

        Routing claims a prompt's blocks in the index as soon as the request is sent, so the
        index also holds blocks that a request is still prefilling: those are not cached until
        its first token, and a follower should wait for them rather than skip them.
        """
        owner = self._owner
        if owner:
            for i in range(min(matched, len(hashes))):
                if hashes[i] in owner:
                    return i
        return matched

    def shared(self, hashes: tuple[int, ...]) -> tuple[Leader | None, int]:
        """The leader to wait for and how many of ``hashes`` in-flight requests are computing.

        That is the run of consecutive blocks, from the first one a leader owns, that leaders
        own; the leader to wait for is the one owning the last block of the run.
        """
        start = next((i for i, h in enumerate(hashes) if h in self._owner), None)
        if start is None:
            return None, 0
        end = start
        while end < len(hashes) and hashes[end] in self._owner:
            end += 1
        return self._owner[hashes[end - 1]], end - start

    def lead(
        self, hashes: tuple[int, ...], *, streamed: bool, expected_prefill_s: float
    ) -> Leader | None:
        """Register a request about to be sent as the leader of the blocks nobody computes yet."""
        mine = tuple(h for h in hashes if h not in self._owner)
        if not mine:
            return None
        leader = Leader(
            blocks=mine, streamed=streamed, expected_prefill_end=monotonic() + expected_prefill_s
        )
        for h in mine:
            self._owner[h] = leader
        return leader

    def release(self, leader: Leader) -> None:
        """``leader`` produced its first token or ended: its blocks are cached, or never will be."""
        for h in leader.blocks:
            if self._owner.get(h) is leader:
                del self._owner[h]
        leader.done.set()


async def wait_for_leader(leader: Leader, max_wait_s: float) -> bool:
    """Wait until ``leader``'s blocks are cached, at most ``max_wait_s``; True if they are.

    For a leader that is not streamed, the end of its expected prefill counts as cached.
    """
    limit = max_wait_s
    if not leader.streamed:
        limit = min(limit, max(leader.expected_prefill_end - monotonic(), 0.0))
    leader.followers += 1
    try:
        async with asyncio.timeout(limit):
            await leader.done.wait()
    except TimeoutError:
        return not leader.streamed and limit < max_wait_s
    return True
