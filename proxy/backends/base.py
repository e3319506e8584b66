"""The interface every backend dialect implements, and the OpenAI-compatible default.

A dialect knows four things about its server: how to prepare a request body before it goes
upstream (ask for usage on streams), how to read token counts, cache hits and timings out of a
response or a stream event, what the server says about itself at start-up (slots, context), and
its ``Capabilities``: where its health is checked, whether and where it says it sleeps, where its
load comes from, whether it has slots (and their API), whether its prefix cache is shared by every
request. Everything outside ``proxy/backends/`` asks a ``Dialect`` and never names a server.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from proxy.backends.apis import (
    API_ROUTES,
    MESSAGES,
    RESPONSES,
    classify_api_event,
    read_api_response,
)
from proxy.backends.events import EventKind as EventKind  # re-exported: its old home
from proxy.backends.load import LoadSource
from proxy.backends.slot_api import SlotApi
from proxy.backends.template_clock import TemplateClock
from proxy.backends.wire import as_count, nonempty
from proxy.records import Observation

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
NATIVE_COMPLETION = "/completion"
INFERENCE_ROUTES = (CHAT, COMPLETIONS, NATIVE_COMPLETION, RESPONSES, MESSAGES)
# Routes whose streams always end with usage: the proxy never adds ``stream_options`` to them.
USAGE_ALWAYS = frozenset({NATIVE_COMPLETION, RESPONSES, MESSAGES})


@dataclass(frozen=True, slots=True)
class BackendInfo:
    """What a backend says about itself at start-up."""

    dialect: str
    model: str | None = None
    slots: int | None = None
    ctx_per_slot: int | None = None
    protected: bool = False
    """It refused the proxy's start-up probes for want of an API key (``--backend-api-key``)."""
    template_clock: TemplateClock | None = None
    """Its chat template prints the date or time into every prompt (``template_clock``)."""

    @property
    def capacity_tokens(self) -> int | None:
        """Tokens of KV cache the backend can hold across its slots, when it says."""
        if self.slots and self.ctx_per_slot:
            return self.slots * self.ctx_per_slot
        return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What a kind of server offers the proxy besides inference; the generic server's defaults."""

    health_path: str = "/v1/models"
    """What a health check asks (a 200 passes)."""
    sleep_state_path: str | None = None
    """Where the server says whether it sleeps, without waking it (``Dialect.is_sleeping`` reads
    the answer); None: it never sleeps, or does not say. A server that says so is left alone
    while asleep, and its load is not read again while it is quiet."""
    load_sources: tuple[LoadSource, ...] = ()
    """Where it reports its own running and queued requests, in the order they are tried."""
    slots: SlotApi | None = None
    """Its slots, when requests can be pinned to one (each slot keeps its own prefix cache)."""
    shared_prefix_cache: bool = True
    """One prefix cache serves every request, so a request may wait for another's prefill."""


class Dialect:
    """An OpenAI-compatible server: usage in ``usage``, cached tokens when it reports them."""

    name = "openai"
    provider_name = "openai"
    """The server's name in OpenTelemetry's GenAI conventions (``gen_ai.provider.name``)."""
    capabilities = Capabilities()
    ignores_unknown_fields = False
    """Whether the server ignores body fields it does not know. A generic OpenAI-compatible
    server may be strict and answer 400 to hosted-only fields (``proxy.hosted``), so by default
    its requests lose them."""

    def prepare(self, route: str, body: MutableMapping[str, Any], *, stream: bool) -> bool:
        """Adjust ``body`` in place before it goes upstream.

        Returns True when the proxy asked for a usage event the client did not ask for, so the
        relay must strip it on the way back.
        """
        if not stream or route in USAGE_ALWAYS:
            return False
        opts = body.get("stream_options")
        if isinstance(opts, Mapping) and opts.get("include_usage") is True:
            return False
        new_opts = dict(opts) if isinstance(opts, Mapping) else {}
        new_opts["include_usage"] = True
        body["stream_options"] = new_opts
        return True

    def partition_cache(
        self, body: MutableMapping[str, Any], tenant: str, route: str = CHAT
    ) -> bool:
        """Put this request in ``tenant``'s partition of the backend's prefix cache.

        Returns True when the body was changed. A backend with no way to partition its cache
        per request (llama.cpp; vLLM on ``route`` MESSAGES) leaves the body alone: its isolation
        is by replica only.
        """
        return False

    # -- reading responses -------------------------------------------------------------------

    def read_response(self, route: str, obj: Mapping[str, Any], obs: Observation) -> None:
        """Read usage and timings from a complete (non-streamed) response body."""
        if route in API_ROUTES:
            read_api_response(route, obj, obs)
            return
        self.read_usage(obj, obs)

    def read_usage(self, obj: Mapping[str, Any], obs: Observation) -> None:
        """The OpenAI usage object of a parsed answer or event (JSON: its objects are dicts,
        tested as such, not as ``Mapping``: a tenth of the cost, on every event parsed)."""
        usage = obj.get("usage")
        if not isinstance(usage, dict):
            return
        obs.prompt_tokens = as_count(usage.get("prompt_tokens"))
        obs.completion_tokens = as_count(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            obs.cached_tokens = as_count(details.get("cached_tokens"))
        cdetails = usage.get("completion_tokens_details")
        if isinstance(cdetails, dict):
            obs.reasoning_tokens = as_count(cdetails.get("reasoning_tokens"))

    def classify_event(self, route: str, obj: Mapping[str, Any], obs: Observation) -> EventKind:
        """Classify one stream event and read any usage it carries."""
        if route in API_ROUTES:
            return classify_api_event(route, obj, obs)
        if "error" in obj and "choices" not in obj:
            return EventKind.ERROR
        if "usage" in obj and isinstance(obj.get("usage"), dict):
            self.read_usage(obj, obs)
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return EventKind.OTHER
        if not choices:
            return EventKind.USAGE_ONLY if "usage" in obj else EventKind.OTHER
        kind = EventKind.OTHER
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if route == COMPLETIONS:
                if nonempty(choice.get("text")):
                    return EventKind.VISIBLE
                continue
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            if nonempty(delta.get("content")) or delta.get("tool_calls"):
                return EventKind.VISIBLE
            if nonempty(delta.get("reasoning_content")) or nonempty(delta.get("reasoning")):
                kind = EventKind.TOKEN
        return kind

    def is_sleeping(self, state: Any) -> bool:
        """Whether an answer from ``Capabilities.sleep_state_path`` says the server is asleep."""
        return False

    def carries_slot(self, route: str) -> bool:
        """Whether the server honours a slot id (``id_slot``) in a request on ``route``."""
        return True

    def carried_on_strip(self, usage_event: Mapping[str, Any]) -> dict[str, Any]:
        """Fields of a stripped usage event the client would have seen on the finishing event."""
        return {}

    # -- start-up ----------------------------------------------------------------------------

    async def describe(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> BackendInfo:
        """What the backend says about itself (``headers``: the proxy's key for it, if any); the
        generic server says nothing."""
        return BackendInfo(dialect=self.name)
