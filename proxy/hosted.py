"""Hosted-cache fields: the client's own conversation key, and fields a backend would reject.

Clients written for hosted APIs say which conversation a request belongs to: OpenAI's
``prompt_cache_key`` body field (editors and agents send one per thread on every request), or
a session header that routers and gateways key on (OpenCode sends ``x-session-affinity`` and
``x-session-id``; Caddy's ``lb_policy header`` and AWS AgentCore's session stickiness are set
up on ``x-session-id``; vLLM's production-stack router takes a configurable session header).
``AffinityKey`` is that key, hashed with the tenant: the router sends every request carrying it
to one replica (``proxy.routing``'s ``key_affinity``), and records and ``/stats`` carry the
hash and where it came from, never the value. The key seeds nothing else: not the
fingerprint, not a cache salt.

The same clients send fields only a hosted API understands (``prompt_cache_key``,
``prompt_cache_retention``, ``safety_identifier``...). llama.cpp and vLLM ignore unknown fields
(vLLM's request models allow extra fields and only log them); a strict OpenAI-compatible server
answers 400. ``HostedFields.strip`` removes them for the dialects configured to need it
(``--strip-hosted-fields``: by default the dialects that may reject unknown fields, i.e. the
generic OpenAI-compatible one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.backends import DIALECT_NAMES, STRICT_DIALECTS
from proxy.options import option, split_items
from proxy.values import value

PROMPT_CACHE_KEY = "prompt_cache_key"

DEFAULT_SESSION_HEADERS = ("x-session-affinity", "x-session-id")
"""Request headers read as the conversation key when the body has no ``prompt_cache_key``,
in this order."""

HOSTED_FIELDS = (
    PROMPT_CACHE_KEY,
    "prompt_cache_retention",
    "safety_identifier",
    "service_tier",
    "store",
    "metadata",
)
"""Body fields only a hosted API acts on: removed for the dialects that reject them."""

DEFAULT_STRIP_DIALECTS = STRICT_DIALECTS
"""Dialects whose requests lose ``HOSTED_FIELDS`` by default: those that may reject unknown
fields (``Dialect.ignores_unknown_fields``)."""

_PERSON = b"prefixgate-key"  # blake2b personalization: these hashes are the proxy's own


@value
class AffinityKey:
    """A conversation key the client sent, hashed."""

    value: int
    """64-bit keyed hash of the tenant and the key (blake2b): what the router hashes."""
    source: str
    """Where it came from: ``prompt_cache_key`` or the header's name, in lower case."""

    @property
    def hashed(self) -> str:
        """The hash as 16 hex digits, as records and logs carry it."""
        return f"{self.value:016x}"


def hash_key(raw: str, tenant: str | None = None) -> int:
    """The 64-bit hash of a conversation key within ``tenant`` (the same key of two tenants
    hashes apart). Records carry only this; a key that is itself guessable (a counter, a user
    name) could still be confirmed by hashing guesses, so clients should send random ids, as
    they do (thread UUIDs)."""
    material = f"{tenant or ''}\0{raw}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(material, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "big")


def _names(raw: Any) -> tuple[str, ...]:
    """A repeated list of names, in lower case; ``none`` alone for no name at all."""
    names = tuple(str(v).strip().lower() for v in split_items(raw, ","))
    return () if names == ("none",) else names


@dataclass(frozen=True, slots=True, kw_only=True)
class HostedFields:
    """What the proxy does with hosted-cache fields (from ``Settings``)."""

    session_headers: Sequence[str] = option(
        DEFAULT_SESSION_HEADERS,
        "request header read as the conversation's routing key when the body has no "
        "prompt_cache_key (repeat; 'none' for no header)",
        name="session_header",
        repeat=True,
        metavar="NAME",
        parse=_names,
    )
    """Headers read as the conversation key, in order, after the body's ``prompt_cache_key``."""
    strip_dialects: Sequence[str] = option(
        DEFAULT_STRIP_DIALECTS,
        "dialects whose requests lose hosted-only fields (prompt_cache_key, "
        "prompt_cache_retention, safety_identifier, service_tier, store, metadata) "
        "before they go upstream (repeat; 'none' for no dialect)",
        name="strip_hosted_fields",
        repeat=True,
        metavar="DIALECT",
        parse=_names,
        choices=DIALECT_NAMES,
    )
    """Dialects whose requests lose ``fields``."""
    fields: Sequence[str] = HOSTED_FIELDS

    def affinity_key(
        self, body: Mapping[str, Any], headers: Mapping[str, str], tenant: str | None = None
    ) -> AffinityKey | None:
        """The request's conversation key, or None (an empty value counts as none)."""
        raw = body.get(PROMPT_CACHE_KEY)
        if isinstance(raw, str) and raw:
            return AffinityKey(hash_key(raw, tenant), PROMPT_CACHE_KEY)
        for name in self.session_headers:
            value = headers.get(name)
            if value and value.strip():
                return AffinityKey(hash_key(value.strip(), tenant), name.lower())
        return None

    def strip(self, dialect: str, body: MutableMapping[str, Any]) -> tuple[str, ...]:
        """Remove the hosted fields from ``body`` when ``dialect`` is configured to need it;
        the names removed, in ``fields`` order."""
        if dialect not in self.strip_dialects:
            return ()
        removed = tuple(name for name in self.fields if name in body)
        for name in removed:
            del body[name]
        return removed
