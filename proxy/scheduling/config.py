"""The scheduling switches, one frozen value built once from the settings.

``slot_scheduling`` (llama.cpp): ``auto`` pins requests to slots on every llama.cpp replica with
two or more slots and steps back (lets llama.cpp choose) while ``/slots`` shows traffic that did
not come through this proxy, since the proxy's picture of the slots is then unreliable; ``on``
keeps pinning regardless; ``off`` never sets ``id_slot``.

``coalesce`` (servers with one prefix cache for all requests: vLLM and other OpenAI-compatible
servers): a request whose prefix an in-flight request is prefilling right now waits, at most
``coalesce_max_wait_ms``, for that request's first token, then hits the cache.

``fanout`` (llama.cpp started with ``--slot-save-path``): a hot prefix held by a busy slot is copied
into an idle slot (``POST /slots/{id}?action=save`` then ``?action=restore``) so the requests that
share it decode in parallel.

``slot_copy`` (the same server flag, on by default): the slot a request takes is first seeded
with a copy of an idle slot holding more of its prefix (a new conversation's shared system
prompt), so neither that slot's history is overwritten nor the prefix recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.options import option, to_bool

SLOT_MODES = ("auto", "on", "off")
KV_UNIFIED_MODES = ("auto", "on", "off")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulingConfig:
    """How requests are placed on a replica once routing has chosen it."""

    slot_scheduling: str = option(
        "auto",
        "llama.cpp: pin requests sharing a prefix to the slot that holds it (id_slot): "
        "auto (on, but off on a replica while other traffic reaches it), on, off",
        metavar="MODE",
        choices=SLOT_MODES,
    )
    coalesce: bool = option(
        True,
        "vLLM and other shared-cache servers: hold a request until an in-flight request "
        "prefilling its prefix has its first token",
        cast=to_bool,
        metavar="on|off",
    )
    coalesce_max_wait_ms: float = option(
        2000.0, "longest a request is held for another one's prefill", cast=float, metavar="MS"
    )
    fanout: bool = option(
        False,
        "llama.cpp with --slot-save-path: copy a busy slot's prefix into an idle slot so "
        "requests sharing it decode in parallel",
        cast=to_bool,
        metavar="on|off",
    )
    slot_copy: bool = option(
        True,
        "llama.cpp with --slot-save-path: when the slot a request takes would recompute a "
        "prefix another idle slot holds, copy that slot into it first (when the copy costs "
        "under half the prefill it saves); a server without a save path turns it off",
        cast=to_bool,
        metavar="on|off",
    )
    min_prefix_tokens: int = 256
    """A shared prefix shorter than this is not worth a wait (coalescing) or a copy (fan-out,
    seeding)."""
    slots_poll_s: float = 2.0
    """How often ``GET /slots`` is read on a llama.cpp replica the proxy pins (0: never)."""
    foreign_backoff_s: float = 60.0
    """``auto``: how long pinning stays off after traffic from elsewhere was seen on a replica."""
    server_slot_similarity: float = option(
        0.1,
        "llama.cpp: the --slot-prompt-similarity the replicas run with (their default 0.10; 0 "
        "makes them restore conversations from their RAM cache): the cache model follows it",
        cast=float,
        metavar="F",
    )
    """llama.cpp: the replicas' ``--slot-prompt-similarity`` (the cache model follows it)."""
    server_kv_unified: str = option(
        "auto",
        "llama.cpp: whether the replicas run with a unified KV cache (their default without -np): "
        "auto (learned from /slots), on, off",
        metavar="MODE",
        choices=KV_UNIFIED_MODES,
    )
    """llama.cpp: unified KV on the replicas: ``auto`` (learned from ``/slots``), on, off."""

    def __post_init__(self) -> None:
        if self.slot_scheduling not in SLOT_MODES:
            raise ValueError(f"slot scheduling must be one of {', '.join(SLOT_MODES)}")
        if self.coalesce_max_wait_ms < 0:
            raise ValueError("the coalescing wait must not be negative")
        if not 0.0 <= self.server_slot_similarity <= 1.0:
            raise ValueError("the server's slot similarity must be between 0 and 1")
        if self.server_kv_unified not in KV_UNIFIED_MODES:
            raise ValueError(f"server KV unified must be one of {', '.join(KV_UNIFIED_MODES)}")
        if self.min_prefix_tokens < 1:
            raise ValueError("the minimum prefix must be at least one token")
