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


CAPABILITIES_INTRO = """# Backend capabilities

<!-- Generated from the dialects (proxy/backends/): do not edit by hand; run
     `make options-doc`. -->

Every server-specific fact lives in `proxy/backends/`. Besides reading and preparing bodies,
each dialect states its `Capabilities`, and the rest of the proxy asks those instead of naming
a server: the fleet checks health at the *health check* path and, where the server says whether
it sleeps without waking (*sleep state*), leaves a sleeping or quiet replica alone; the load
reader tries the *own load* sources in order; the scheduler pins requests to slots only on a
server with *slots* (through their API: the body field and the slot endpoints,
`proxy/backends/slot_api.py`), and holds a request for another one's prefill only on a server
whose *prefix cache is shared* by every request.

"""


def capabilities_markdown() -> str:
    """The dialects' capabilities as Markdown (``docs/backends.md``)."""

    def code(text: str | None) -> str:
        return f"`{text}`" if text else "—"

    lines = [
        CAPABILITIES_INTRO.rstrip("\n"),
        "",
        "| Dialect | Health check | Sleep state | Own load (in order) | Slots "
        "| Shared prefix cache |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, dialect in DIALECTS.items():
        caps = dialect.capabilities
        loads = ", ".join(
            f"`{src.path}`" + (f" (`{src.running}` + `{src.waiting}`)" if src.running else "")
            for src in caps.load_sources
        )
        slots = f"pinned with `{caps.slots.field}`" if caps.slots is not None else "—"
        lines.append(
            f"| `{name}` | {code(caps.health_path)} | {code(caps.sleep_state_path)} | "
            f"{loads or '—'} | {slots} | {'yes' if caps.shared_prefix_cache else 'no'} |"
        )
    return "\n".join(lines) + "\n"


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
    "capabilities_markdown",
    "detect_dialect",
    "dialect_named",
    "is_sleeping",
    "probe_json",
]
