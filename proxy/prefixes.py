"""Prefix tracking: what each replica has cached, what a request should hit, what it did hit.

On the request path: fingerprint the body (chained block hashes) and ask the store, in one round
trip, how many leading blocks each replica holds, how many requests each has in flight (from
every proxy) and how much of the prompt recent traffic shares (``PrefixView``: what the router
needs). The chosen replica's match, converted to tokens with the model's measured
tokens-per-byte, is the *predicted* cached tokens. Right after routing, ``claim`` records the
request's blocks for the chosen replica, so related requests arriving before it finishes follow
it; ``in_flight`` keeps the shared load count. After the response: record the blocks again (the
backend now holds them), learn the tokens-per-byte ratio from the backend's ``prompt_tokens``,
count the request in the traffic window and fold the finished record into the statistics — all
in the background.

When the store does not answer the lookup, the view falls back to this proxy's own numbers: no
matches, its local in-flight counts, a shared depth of 0.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.fingerprint import Fingerprint, fingerprint, hex64
from proxy.records import RequestRecord
from proxy.routing import TRAFFIC_MAX_BLOCKS, RoutingConfig, TrafficDepth, route_key
from proxy.store import DEFAULT_NAMESPACE, PrefixStore, StatsSample

DEFAULT_TOKENS_PER_BYTE = 0.25  # English prose and code average ~4 bytes per token
MAX_SEGMENTS_LOGGED = 512


@dataclass(frozen=True, slots=True)
class PrefixView:
    """What the store says about one request: everything the router needs."""

    fp: Fingerprint
    namespace: str
    matched_blocks: Mapping[str, int]
    """Leading blocks of the request each replica's index holds (``{}`` when unavailable)."""
    loads: Mapping[str, float] = field(default_factory=dict)
    """Requests in flight per replica from every proxy, never below this proxy's own count."""
    shared_blocks: int = 0
    """Leading blocks carried by most recent traffic (``TrafficDepth``)."""
    available: bool = True
    """False when the store did not answer and the numbers are this proxy's own."""

    def matched_for(self, replica: str) -> int:
        return self.matched_blocks.get(replica, 0)

    def load_for(self, replica: str) -> float:
        return self.loads.get(replica, 0.0)

    @property
    def key(self) -> int:
        """The key the router breaks ties by (``route_key``: the first block hash past the
        traffic-shared depth, 0 without blocks)."""
        return route_key(self.fp.block_hashes, self.shared_blocks)


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
        self,
        store: PrefixStore,
        *,
        block_bytes: int,
        log_prompt_labels: bool = False,
        routing: RoutingConfig | None = None,
    ) -> None:
        self.store = store
        self.block_bytes = block_bytes
        self.tokens_per_byte = TokensPerByte()
        self.depth = TrafficDepth.from_config(routing or RoutingConfig())
        self._labels = log_prompt_labels
        self._local_in_flight: dict[str, int] = {}

    async def lookup(
        self,
        route: str,
        body: Mapping[str, Any],
        replicas: Sequence[str],
        *,
        namespace: str = DEFAULT_NAMESPACE,
        salt: str = "",
    ) -> PrefixView:
        """Fingerprint ``body``; read matches, loads and the shared depth (one round trip)."""
        fp = fingerprint(route, body, block_bytes=self.block_bytes, salt=salt)
        found = await self.store.lookup(namespace, replicas, fp.block_hashes)
        local = self._local_in_flight
        loads = {r: max(found.loads.get(r, 0.0), float(local.get(r, 0))) for r in replicas}
        return PrefixView(
            fp=fp,
            namespace=namespace,
            matched_blocks=found.matched,
            loads=loads,
            shared_blocks=self.depth.shared_blocks(found.window_requests, found.hash_counts),
            available=found.available,
        )

    def local_in_flight(self, replica: str) -> int:
        """Requests this proxy has in flight to ``replica``."""
        return self._local_in_flight.get(replica, 0)

    def in_flight(
        self, view: PrefixView | None, replica: str, delta: int
    ) -> Coroutine[Any, Any, None]:
        """Count ``delta`` requests in flight to ``replica`` (+1 before sending, -1 at the end).

        This proxy's own count changes now; the shared count in the store is the returned
        coroutine, to run in the background (``RecordWriter.spawn``).
        """
        count = self._local_in_flight.get(replica, 0) + delta
        if count > 0:
            self._local_in_flight[replica] = count
        else:
            self._local_in_flight.pop(replica, None)
        namespace = view.namespace if view is not None else DEFAULT_NAMESPACE
        return self.store.add_in_flight(namespace, replica, delta)

    def capacity_blocks(self, capacity_tokens: int, model: str | None) -> int:
        """A replica's cache size in blocks, at the model's token density."""
        ratio = self.tokens_per_byte.get(model)
        return max(int(capacity_tokens / ratio / self.block_bytes), 1)

    async def claim(
        self, view: PrefixView, replica: str, capacity_tokens: int, model: str | None = None
    ) -> None:
        """Record the request's blocks for the replica it was just routed to (run it in the
        background right after choosing), so related requests arriving meanwhile follow it, and
        count the request in the traffic window at arrival (as the fleet simulator does), so a
        burst sharing a system prompt is seen as shared traffic while it is still arriving."""
        if view.fp.block_hashes:
            await self.store.observe_traffic(
                view.namespace, view.fp.block_hashes[:TRAFFIC_MAX_BLOCKS]
            )
            await self.store.record_prefix(
                view.namespace,
                replica,
                view.fp.block_hashes,
                self.capacity_blocks(capacity_tokens, model),
            )

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
                await self.store.record_prefix(
                    view.namespace,
                    replica,
                    view.fp.block_hashes,
                    self.capacity_blocks(capacity_tokens, record.model),
                )
        namespace = view.namespace if view is not None else DEFAULT_NAMESPACE
        sample = StatsSample.from_record(
            record,
            namespace=namespace,
            ts=time.time(),
            prefix_label=label if self._labels else None,
        )
        await self.store.add_stats(sample)
