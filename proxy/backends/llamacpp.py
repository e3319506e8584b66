"""llama.cpp ``llama-server``: ``timings`` on responses, native ``/completion``, ``/props``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from proxy.backends.apis import MESSAGES
from proxy.backends.base import (
    NATIVE_COMPLETION,
    BackendInfo,
    Capabilities,
    Dialect,
    EventKind,
)
from proxy.backends.load import LoadSource
from proxy.backends.slot_api import SlotApi
from proxy.backends.template_clock import probe_template_clock
from proxy.backends.wire import as_count, as_number, nonempty
from proxy.records import Observation

CAPABILITIES = Capabilities(
    health_path="/health",
    # /health, /props and (answered from a cache while asleep) /metrics leave a server started
    # with --sleep-idle-seconds asleep; /slots wakes it and restarts its idle timer.
    sleep_state_path="/props",
    load_sources=(
        # /slots first (on by default): a /metrics scrape (needs --metrics) resets the windowed
        # throughput gauges (llamacpp:prompt_tokens_seconds...) an operator's own scrape reads.
        LoadSource("/slots"),
        LoadSource("/metrics", "llamacpp:requests_processing", "llamacpp:requests_deferred"),
    ),
    slots=SlotApi(field="id_slot"),
    shared_prefix_cache=False,  # one prompt cache per slot, plus the RAM prompt cache
)


class LlamaCppDialect(Dialect):
    """llama-server. Cached tokens are always reported (``timings.cache_n``, also in usage)."""

    name = "llamacpp"
    provider_name = "llama.cpp"
    capabilities = CAPABILITIES
    ignores_unknown_fields = True  # it reads the fields it knows from the JSON and no others

    def read_timings(self, obj: Mapping[str, Any], obs: Observation) -> None:
        timings = obj.get("timings")
        if not isinstance(timings, dict):
            return
        cache_n = as_count(timings.get("cache_n"))
        prompt_n = as_count(timings.get("prompt_n"))
        if cache_n is not None:
            obs.cached_tokens = cache_n
        if prompt_n is not None:
            obs.backend_prompt_processed = prompt_n
            if obs.prompt_tokens is None and cache_n is not None:
                obs.prompt_tokens = prompt_n + cache_n
        obs.backend_prefill_ms = as_number(timings.get("prompt_ms"))
        obs.backend_decode_ms = as_number(timings.get("predicted_ms"))
        predicted_n = as_count(timings.get("predicted_n"))
        if predicted_n is not None and predicted_n >= 2:
            obs.backend_tpot_ms = as_number(timings.get("predicted_per_token_ms"))

    def read_native(self, obj: Mapping[str, Any], obs: Observation) -> None:
        evaluated = as_count(obj.get("tokens_evaluated"))
        predicted = as_count(obj.get("tokens_predicted"))
        if evaluated is not None:
            obs.prompt_tokens = evaluated
        if predicted is not None:
            obs.completion_tokens = predicted

    def read_response(self, route: str, obj: Mapping[str, Any], obs: Observation) -> None:
        if route == NATIVE_COMPLETION:
            self.read_native(obj, obs)
        else:
            super().read_response(route, obj, obs)  # OpenAI usage, or the API's own
        self.read_timings(obj, obs)

    def classify_event(self, route: str, obj: Mapping[str, Any], obs: Observation) -> EventKind:
        if route == NATIVE_COMPLETION:
            if "error" in obj and "content" not in obj:
                return EventKind.ERROR
            if obj.get("stop") is True:
                self.read_native(obj, obs)
                self.read_timings(obj, obs)
            return EventKind.VISIBLE if nonempty(obj.get("content")) else EventKind.OTHER
        kind = super().classify_event(route, obj, obs)
        self.read_timings(obj, obs)
        return kind

    def is_sleeping(self, state: Any) -> bool:
        return is_sleeping(state)

    def carries_slot(self, route: str) -> bool:
        # The Messages route rebuilds the request from a fixed list of fields: no ``id_slot``.
        return route != MESSAGES

    def carried_on_strip(self, usage_event: Mapping[str, Any]) -> dict[str, Any]:
        # Without include_usage llama-server attaches `timings` to the finish_reason chunk.
        timings = usage_event.get("timings")
        return {"timings": timings} if timings is not None else {}

    async def describe(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> BackendInfo:
        status, props = await probe_json(session, base_url + "/props", headers=headers)
        if status in AUTH_REFUSED:  # started with --api-key, and the proxy has not got it
            return BackendInfo(dialect=self.name, protected=True)
        if status != 200 or not isinstance(props, Mapping):
            return BackendInfo(dialect=self.name)
        settings = props.get("default_generation_settings")
        n_ctx = as_count(settings.get("n_ctx")) if isinstance(settings, Mapping) else None
        alias = props.get("model_alias")
        clock = await probe_template_clock(
            session, base_url, props.get("chat_template"), headers=headers
        )
        return BackendInfo(
            dialect=self.name,
            model=alias if isinstance(alias, str) else None,
            slots=as_count(props.get("total_slots")),
            ctx_per_slot=n_ctx,
            template_clock=clock,
        )


AUTH_REFUSED = frozenset({401, 403})


def is_sleeping(props: Any) -> bool:
    """Whether a ``/props`` answer says the server is asleep (``--sleep-idle-seconds``)."""
    return isinstance(props, Mapping) and props.get("is_sleeping") is True


def refused_by_llamacpp(status: int | None, body: Any) -> bool:
    """Whether an answer is llama-server's own API-key refusal (its error shape, integer code).

    ``{"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}}``
    """
    if status not in AUTH_REFUSED or not isinstance(body, Mapping):
        return False
    error = body.get("error")
    return (
        isinstance(error, Mapping)
        and error.get("code") == status
        and error.get("type") == "authentication_error"
    )


async def probe_json(
    session: aiohttp.ClientSession,
    url: str,
    limit_s: float = 3.0,
    *,
    headers: Mapping[str, str] | None = None,
) -> tuple[int | None, Any]:
    """GET ``url``: its status and its body as JSON (None when it is not JSON); a status of None
    when it could not be reached. Never raises (start-up probing must not)."""
    try:
        async with session.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=limit_s)
        ) as resp:
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, None
    except (aiohttp.ClientError, TimeoutError):
        return None, None


async def fetch_json(
    session: aiohttp.ClientSession,
    url: str,
    limit_s: float = 3.0,
    *,
    headers: Mapping[str, str] | None = None,
) -> Any:
    """GET ``url`` and decode JSON; None on any failure (start-up probing must not raise)."""
    status, body = await probe_json(session, url, limit_s, headers=headers)
    return body if status == 200 else None
