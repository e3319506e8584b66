"""Backend dialects: every server-specific fact lives in this package and nowhere else.

A ``Dialect`` reads and prepares bodies for its server and carries its ``Capabilities`` (health
path, sleep state, load sources, slots and their ``SlotApi``, a shared prefix cache); the rest of
the proxy asks those and never names a server. ``DIALECT_NAMES`` are what ``--dialect`` takes.
"""

from __future__ import annotations

from collections.abc import Mapping

import aiohttp

from proxy.backends.apis import API_ROUTES, MESSAGES, RESPONSES
from proxy.backends.base import (
    CHAT,
    COMPLETIONS,
    INFERENCE_ROUTES,
    NATIVE_COMPLETION,
    BackendInfo,
    Capabilities,
    Dialect,
    EventKind,
)
from proxy.backends.llamacpp import (
    LlamaCppDialect,
    fetch_json,
    is_sleeping,
    probe_json,
    refused_by_llamacpp,
)
from proxy.backends.load import BackendLoad, LoadSource
from proxy.backends.slot_api import SlotApi, SlotEndpoint
from proxy.backends.vllm import VllmDialect

DIALECTS: Mapping[str, type[Dialect]] = {
    "llamacpp": LlamaCppDialect,
    "vllm": VllmDialect,
    "openai": Dialect,
}

DIALECT_NAMES = tuple(DIALECTS)
"""The dialects a server can be forced to (``--dialect``); ``auto`` detects one instead."""

STRICT_DIALECTS = tuple(name for name, d in DIALECTS.items() if not d.ignores_unknown_fields)
"""Dialects that may reject fields they do not know: they lose hosted-only fields by default."""


def dialect_named(name: str) -> Dialect:
    return DIALECTS[name]()


async def detect_dialect(
    session: aiohttp.ClientSession,
    base_url: str,
    *,
    headers: Mapping[str, str] | None = None,
) -> Dialect | None:
    """Ask the server who it is: llama.cpp answers ``/props``, vLLM answers ``/version``.

    ``headers`` carry the proxy's key for the backend, if it has one. A llama-server started
    with ``--api-key`` refuses ``/props`` without it, in its own error shape, while its
    ``/health`` stays public: that pair is llama.cpp too (up, protected). Returns None when the
    backend cannot be reached (the caller retries later); a reachable server that answers
    neither is treated as a generic OpenAI-compatible one.
    """
    status, props = await probe_json(session, base_url + "/props", headers=headers)
    if (
        status == 200
        and isinstance(props, Mapping)
        and ("default_generation_settings" in props or "total_slots" in props)
    ):
        return LlamaCppDialect()
    if refused_by_llamacpp(status, props):
        _, health = await probe_json(session, base_url + "/health", headers=headers)
        if isinstance(health, Mapping) and health.get("status") == "ok":
            return LlamaCppDialect()
    version = await fetch_json(session, base_url + "/version", headers=headers)
    if isinstance(version, Mapping) and "version" in version:
        return VllmDialect()
    status, _ = await probe_json(session, base_url + "/v1/models", headers=headers)
    if status is None or status >= 500:  # e.g. llama-server answers 503 while loading its model
        return None
    return Dialect()


__all__ = [
    "API_ROUTES",
    "CHAT",
    "COMPLETIONS",
    "DIALECTS",
    "DIALECT_NAMES",
    "INFERENCE_ROUTES",
    "MESSAGES",
    "NATIVE_COMPLETION",
    "RESPONSES",
    "STRICT_DIALECTS",
    "BackendInfo",
    "BackendLoad",
    "Capabilities",
    "Dialect",
    "EventKind",
    "LlamaCppDialect",
    "LoadSource",
    "SlotApi",
    "SlotEndpoint",
    "VllmDialect",
    "detect_dialect",
    "dialect_named",
    "is_sleeping",
    "probe_json",
]
