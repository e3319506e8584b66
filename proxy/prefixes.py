"""Prefix tracking: what each replica has cached, what a request should hit, what it did hit.

On the request path: fingerprint the body (chained block hashes) and ask the store, in one round
trip, how many leading blocks each replica holds; the longest match, converted to tokens with the
model's measured tokens-per-byte, is the *predicted* cached tokens. After the response: record the
chosen replica's blocks in its index, learn the tokens-per-byte ratio from the backend's
``prompt_tokens``, and fold the finished record into the statistics — all in the background.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.fingerprint import Fingerprint, fingerprint, hex64
from proxy.records import RequestRecord
from proxy.store import DEFAULT_NAMESPACE, PrefixStore, StatsSample

DEFAULT_TOKENS_PER_BYTE = 0.25  # English prose and code average ~4 bytes per token
MAX_SEGMENTS_LOGGED = 512


@dataclass(frozen=True, slots=True)
class PrefixView:
    """What the index says about one request."""

    fp: Fingerprint
    namespace: str
    matched_blocks: Mapping[str, int]

    def matched_for(self, replica: str) -> int:
        return self.matched_blocks.get(replica, 0)


class TokensPerByte:
    """Running tokens-per-byte ratio per model, learned from the backend's prompt_tokens."""

    def __init__(self, *, alpha: float = 0.1) -> None:
        self._alpha = alpha
        self._ratio: dict[str, float] = {}

    def get(self, model: str | None) -> float:
        return self._ratio.get(model or "", DEFAULT_TOKENS_PER_BYTE)

    def observe(self, model: str | None, prompt_tokens: int | None, prompt_bytes: int) -> None:
        if not prompt_tokens or prompt_bytes < 64:
            return
        key = model or ""
        ratio = prompt_tokens / prompt_bytes
        old = self._ratio.get(key)
        self._ratio[key] = ratio if old is None else old + self._alpha * (ratio - old)


class PrefixTracker:
    """Fingerprints requests, predicts their cache hits and keeps the index and statistics."""

    def __init__(
        self, store: PrefixStore, *, block_bytes: int, log_prompt_labels: bool = False
    ) -> None:
        self.store = store
        self.block_bytes = block_bytes
        self.tokens_per_byte = TokensPerByte()
        self._labels = log_prompt_labels

    async def lookup(
        self,
        route: str,
        body: Mapping[str, Any],
        replicas: Sequence[str],
        *,
        namespace: str = DEFAULT_NAMESPACE,
        salt: str = "",
    ) -> PrefixView:
        """Fingerprint ``body`` and find how much of it each replica holds (one round trip)."""
        fp = fingerprint(route, body, block_bytes=self.block_bytes, salt=salt)
        matched: Mapping[str, int] = {}
        if fp.block_hashes:
            matched = await self.store.longest_match(namespace, replicas, fp.block_hashes)
        return PrefixView(fp=fp, namespace=namespace, matched_blocks=matched)

    def predicted_tokens(self, view: PrefixView, replica: str, model: str | None) -> int:
        """Predicted cached tokens on ``replica``: matched bytes at the model's token density."""
        matched_bytes = view.matched_for(replica) * self.block_bytes
        return int(matched_bytes * self.tokens_per_byte.get(model))

    def annotate(self, record: RequestRecord, view: PrefixView, replica: str) -> None:
        """Add the prefix fields to a record (prediction made before the response)."""
        fp = view.fp
        record.predicted_cached_tokens = self.predicted_tokens(view, replica, record.model)
        record.prefix_anchor = hex64(fp.anchor)
        record.prefix_blocks = len(fp.block_hashes)
        record.prompt_bytes = fp.total_bytes
        record.extra["prefix_block_bytes"] = fp.block_bytes
        record.extra["prefix_matched_blocks"] = view.matched_for(replica)
        table = fp.segment_table()
        if len(table) > MAX_SEGMENTS_LOGGED:  # keep the head: that is where prefixes are shared
            table = table[:MAX_SEGMENTS_LOGGED]
        record.extra["prefix_segments"] = table

    async def learn(
        self,
        record: RequestRecord,
        view: PrefixView | None,
        *,
        replica: str,
        capacity_tokens: int,
        label: str | None = None,
    ) -> None:
        """After the response: update the index, the token ratio and the statistics."""
        if view is not None and record.status < 400 and record.error is None:
            self.tokens_per_byte.observe(record.model, record.prompt_tokens, view.fp.total_bytes)
            if view.fp.block_hashes:
                ratio = self.tokens_per_byte.get(record.model)
                capacity_blocks = max(int(capacity_tokens / ratio / self.block_bytes), 1)
                await self.store.record_prefix(
                    view.namespace, replica, view.fp.block_hashes, capacity_blocks
                )
        namespace = view.namespace if view is not None else DEFAULT_NAMESPACE
        sample = StatsSample.from_record(
            record,
            namespace=namespace,
            ts=time.time(),
            prefix_label=label if self._labels else None,
        )
        await self.store.add_stats(sample)
