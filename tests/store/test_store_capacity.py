"""The embedded index past capacity: touching only a chain's leading blocks is exact."""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict

from proxy.store.embedded import EmbeddedStore


def _reference(
    blocks: OrderedDict[int, None], hashes: list[int], capacity: int
) -> OrderedDict[int, None]:
    """Every block touched, tail first, then the least recent out past capacity."""
    out = OrderedDict(blocks)
    for h in reversed(hashes):
        if h in out:
            out.move_to_end(h)
        else:
            out[h] = None
    while len(out) > capacity:
        out.popitem(last=False)
    return out


def test_a_chain_longer_than_capacity_leaves_what_touching_every_block_leaves() -> None:
    rng = random.Random(7)

    async def run() -> None:
        store = EmbeddedStore()
        expected: OrderedDict[int, None] = OrderedDict()
        for _ in range(300):
            capacity = rng.randint(1, 40)
            hashes = rng.sample(range(120), rng.randint(1, 60))
            await store.record_prefix("default", "r", hashes, capacity)
            expected = _reference(expected, hashes, capacity)
            index = store._indexes[("default", "r")]
            assert list(index.blocks) == list(expected)

    asyncio.run(run())
