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


def test_a_chain_recorded_again_leaves_what_touching_every_block_leaves() -> None:
    """A request's blocks are recorded when it is claimed and again when it has ended, often
    all of them already there: that case takes a shortcut, with the same result (repeated
    hashes in a chain included)."""
    rng = random.Random(11)

    async def run() -> None:
        store = EmbeddedStore()
        expected: OrderedDict[int, None] = OrderedDict()
        chains: list[list[int]] = []
        for _ in range(400):
            if chains and rng.random() < 0.6:
                hashes = rng.choice(chains)  # recorded again
            else:
                hashes = [rng.randrange(80) for _ in range(rng.randint(1, 30))]
                chains.append(hashes)
            capacity = rng.randint(40, 90)  # above a chain's length: none is cut short
            await store.record_prefix("default", "r", hashes, capacity)
            expected = _reference(expected, hashes, capacity)
            index = store._indexes[("default", "r")]
            assert list(index.blocks) == list(expected)

    asyncio.run(run())


def test_a_known_prefix_then_new_blocks_leaves_what_touching_every_block_leaves() -> None:
    """The common shape: a shared system prompt, then a request's own blocks, recorded when it
    is claimed and again at its end; new blocks repeated, and a capacity that cuts chains
    short."""
    rng = random.Random(13)

    async def run() -> None:
        store = EmbeddedStore()
        expected: OrderedDict[int, None] = OrderedDict()
        prefixes = [[1000 * p + i for i in range(rng.randint(1, 12))] for p in range(4)]
        fresh = 10_000
        for _ in range(400):
            tail = []
            for _ in range(rng.randint(0, 10)):
                fresh += 1
                tail.append(rng.choice(tail) if tail and rng.random() < 0.1 else fresh)
            hashes = rng.choice(prefixes) + tail
            capacity = rng.randint(8, 120)
            for _ in range(rng.randint(1, 2)):  # claimed, then recorded again at its end
                await store.record_prefix("default", "r", hashes, capacity)
                expected = _reference(expected, hashes[:capacity], capacity)
                index = store._indexes[("default", "r")]
                assert list(index.blocks) == list(expected)

    asyncio.run(run())
