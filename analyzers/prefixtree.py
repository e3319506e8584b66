"""The prefix tree of a trace: which groups of requests share which prefixes.

Keys stand for whole prefixes, so the tree needs no explicit nodes: a key's parent is the key
before it in any chain, and its weight is how many requests contain it. A *group* is a maximal
run of keys that the same requests pass through (a compressed edge of the radix tree): its
requests share everything up to the run's last key, and the run itself is what they share
beyond the enclosing group. Sharing the run saves ``(requests - 1) * run tokens`` of prefill
in an unbounded cache, so the groups' savings add up to the ideal cached tokens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

from analyzers.ideal import IdealReplay
from analyzers.trace import PrefixKey, TraceRequest
from proxy.fingerprint import hex64


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """One group of requests sharing a prefix."""

    requests: int
    prefix_tokens: int  # shared from the start of the prompt
    shared_tokens: int  # shared beyond the enclosing (larger) group
    tokens_saved: int
    first_seen: float
    source: str
    app: str | None
    kinds: str | None  # segment kinds the run covers, where the input has segments


@dataclass(frozen=True, slots=True)
class PrefixTree:
    """The largest groups by tokens saved, and totals over all groups."""

    groups: list[SharedPrefix]
    total_groups: int
    total_saved_tokens: int


def shared_prefixes(
    requests: Sequence[TraceRequest], ideal: IdealReplay, *, top: int = 10
) -> PrefixTree:
    """Compress the prefix tree and rank its groups by tokens saved."""
    counts: Counter[PrefixKey] = Counter()
    parent: dict[PrefixKey, PrefixKey] = {}
    first: dict[PrefixKey, int] = {}
    for idx, (r, k) in enumerate(zip(requests, ideal.hit_keys, strict=True)):
        keys = r.keys
        counts.update(keys)
        if k < len(keys):  # keys from k on are new: note their parent and first request once
            first.update(zip(keys[k:], repeat(idx)))
            if k:
                parent.update(zip(keys[k:], keys[k - 1 :], strict=False))
            else:
                parent.update(zip(keys[1:], keys, strict=False))
    not_bottom = set()
    for key, c in counts.items():
        if c >= 2:
            p = parent.get(key)
            if p is not None and counts[p] == c:
                not_bottom.add(p)
    groups: list[SharedPrefix] = []
    total_saved = 0.0
    for key, c in counts.items():
        if c < 2 or key in not_bottom:
            continue
        top_key, steps = key, 0
        while (p := parent.get(top_key)) is not None and counts[p] == c:
            top_key = p
            steps += 1
        r = requests[first[key]]
        end = r.keys.index(key) + 1
        start = end - 1 - steps
        prefix = r.tokens_upto(end)
        shared = prefix - r.tokens_upto(start)
        saved = (c - 1) * shared
        total_saved += saved
        kinds = None
        if r.kinds is not None:
            kinds = "+".join(dict.fromkeys(r.kinds[start:end]))
        groups.append(
            SharedPrefix(
                requests=c,
                prefix_tokens=round(prefix),
                shared_tokens=round(shared),
                tokens_saved=round(saved),
                first_seen=r.ts,
                source=r.source,
                app=hex64(r.anchor) if r.anchor is not None else None,
                kinds=kinds,
            )
        )
    groups.sort(key=lambda g: (-g.tokens_saved, -g.requests))
    return PrefixTree(groups[:top], len(groups), round(total_saved))
