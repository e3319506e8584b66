"""The control group: a stable share of conversations the proxy leaves alone, to measure its gain.

With ``--control-share S`` (0 to 1; off by default), a share ``S`` of *conversations* is put in
the control group by a stable hash of the conversation's key: each of its requests is forwarded
without canonicalization (the client's bytes, as with ``--no-canonicalize``), routed as a plain
balancer would (round-robin over the healthy replicas, nothing of the prefix index), and left to
the server to place (no slot pinning, no coalescing). It is recorded, counted and indexed like
every other request (``control_group: true`` in its record), so the two groups' cached share,
TTFT and goodput can be compared on the same traffic at the same time (``proxy.lift``): what
prefixgate measurably adds, beside the estimate of what the cache saved.

The conversation key (``conversation_key``) is the one the router already honours when the
client sends one (``prompt_cache_key`` or a session header: ``proxy.hosted.AffinityKey``);
otherwise a hash of the request's first stable part: its system prompt with every run of digits
and hex digits masked (clocks, dates, ids: what changes from turn to turn of one conversation)
and its first user message, as the client wrote them. The tools are left out (clients reorder
them), the rest of the history too (it grows). Every turn of one conversation therefore lands
in the same group, on every proxy replica and across restarts; two conversations that open
alike (same instructions, same first message) share a key, and so a group, which keeps the
comparison honest (they are one cluster in the intervals).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.backends import CHAT, COMPLETIONS, MESSAGES, NATIVE_COMPLETION, RESPONSES
from proxy.hosted import AffinityKey
from proxy.options import option

CONTROL = "control"
TREATED = "treated"
GROUPS = (TREATED, CONTROL)

_PERSON = b"prefixgate-ctl"  # blake2b personalization: independent of the routing hashes
_SCALE = float(1 << 64)
_VOLATILE = re.compile(rb"[0-9A-Fa-f-]*[0-9][0-9A-Fa-f-]*")
_FIRST_PROMPT_BYTES = 1024  # of a bare completion prompt: its opening, history comes later


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlGroup:
    """Which conversations the proxy leaves alone (from ``Settings``)."""

    share: float = option(
        0.0,
        "share of conversations (0 to 1, by a stable hash) forwarded without canonicalization "
        "and routed as a plain balancer would, to measure what the proxy adds (0: off)",
        cast=float,
        metavar="SHARE",
    )
    """Share of conversations in the control group; 0 turns the control group off."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.share) and 0.0 <= self.share <= 1.0):
            raise ValueError("control_share must be a number from 0 to 1")

    @property
    def enabled(self) -> bool:
        return self.share > 0.0

    def is_control(self, key: int) -> bool:
        """Whether the conversation of ``key`` (``conversation_key``) is in the control group."""
        return self.share > 0.0 and key < self.share * _SCALE


def conversation_key(
    route: str,
    body: Mapping[str, Any],
    affinity: AffinityKey | None = None,
    tenant: str | None = None,
) -> int:
    """The 64-bit key of the request's conversation, uniform over its range.

    The client's own key when it sent one, else the request's first stable part (see the
    module's docstring). The same conversation of two tenants keys apart.
    """
    h = hashlib.blake2b(digest_size=8, person=_PERSON)
    h.update((tenant or "").encode("utf-8", "surrogatepass") + b"\0")
    if affinity is not None:
        h.update(b"k\0" + affinity.value.to_bytes(8, "big"))
    else:
        system, first = _opening(route, body)
        h.update(b"o\0" + _masked(system) + b"\0" + _dumps(first))
    return int.from_bytes(h.digest(), "big")


def _dumps(value: Any) -> bytes:
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # validated JSON always serializes; a safe fallback all the same
        return repr(value).encode()


def _masked(value: Any) -> bytes:
    return _VOLATILE.sub(b"#", _dumps(value))


def _opening(route: str, body: Mapping[str, Any]) -> tuple[Any, Any]:
    """``(system part, first user part)`` of a request, as the client wrote them."""
    if route in (COMPLETIONS, NATIVE_COMPLETION):
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return prompt[:_FIRST_PROMPT_BYTES], None
        return prompt, None
    if route == RESPONSES:
        items = body.get("input")
        first = items if isinstance(items, str) else _first_user(items)
        return body.get("instructions"), first
    if route == MESSAGES:
        return body.get("system"), _first_user(body.get("messages"))
    assert route == CHAT, route
    messages = body.get("messages")
    system = []
    if isinstance(messages, list):
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
                break
            system.append(message.get("content"))
    return system, _first_user(messages)


def _first_user(items: Any) -> Any:
    if not isinstance(items, list):
        return None
    for item in items:
        if isinstance(item, dict) and item.get("role") == "user":
            return item.get("content")
    return None
