"""Backend dialects: every server-specific fact lives in this package and nowhere else."""

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
    Dialect,
    EventKind,
)
from proxy.backends.llamacpp import LlamaCppDialect, fetch_json
from proxy.backends.vllm import VllmDialect

DIALECTS: Mapping[str, type[Dialect]] = {
    "llamacpp": LlamaCppDialect,
    "vllm": VllmDialect,
    "openai": Dialect,
}

STRICT_DIALECTS = tuple(name for name, d in DIALECTS.items() if not d.ignores_unknown_fields)
"""Dialects that may reject fields they do not know: they lose hosted-only fields by default."""


def dialect_named(name: str) -> Dialect:
    return DIALECTS[name]()


async def detect_dialect(session: aiohttp.ClientSession, base_url: str) -> Dialect | None:
    """Ask the server who it is: llama.cpp answers ``/props``, vLLM answers ``/version``.

    Returns None when the backend cannot be reached (the caller retries later); a reachable
    server that answers neither is treated as a generic OpenAI-compatible one.
    """
    props = await fetch_json(session, base_url + "/props")
    if isinstance(props, Mapping) and (
        "default_generation_settings" in props or "total_slots" in props
    ):
        return LlamaCppDialect()
    version = await fetch_json(session, base_url + "/version")
    if isinstance(version, Mapping) and "version" in version:
        return VllmDialect()
    try:
        async with session.get(
            base_url + "/v1/models", timeout=aiohttp.ClientTimeout(total=3)
        ) as resp:
            await resp.read()
            if resp.status >= 500:  # e.g. llama-server answers 503 while loading its model
                return None
    except (aiohttp.ClientError, TimeoutError):
        return None
    return Dialect()


__all__ = [
    "API_ROUTES",
    "CHAT",
    "COMPLETIONS",
    "DIALECTS",
    "INFERENCE_ROUTES",
    "MESSAGES",
    "NATIVE_COMPLETION",
    "RESPONSES",
    "STRICT_DIALECTS",
    "BackendInfo",
    "Dialect",
    "EventKind",
    "LlamaCppDialect",
    "VllmDialect",
    "detect_dialect",
    "dialect_named",
]
