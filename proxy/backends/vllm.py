"""vLLM's OpenAI-compatible server.

Cached tokens appear in ``usage.prompt_tokens_details.cached_tokens`` only when the server runs
with ``--enable-prompt-tokens-details``; older servers omit the key when the count is 0. A missing
key is therefore recorded as unknown, never as zero. With ``--enable-per-request-metrics`` the
final usage event carries ``metrics.time_to_first_token_ms``, read as the backend's prefill time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, MutableMapping
from typing import Any

import aiohttp

from proxy.backends.apis import MESSAGES
from proxy.backends.base import CHAT, BackendInfo, Capabilities, Dialect, EventKind
from proxy.backends.llamacpp import fetch_json
from proxy.backends.load import LoadSource
from proxy.backends.wire import as_number
from proxy.records import Observation


def tenant_cache_salt(tenant: str, client_salt: object = None) -> str:
    """vLLM ``cache_salt`` for a tenant: 64 hex digits, within vLLM's validator (≤128, no '/').

    A salt the client sent is folded in, never used as is, so a client can split its own
    tenant's cache further but cannot choose a salt that lands in another tenant's.
    """
    material = tenant if not isinstance(client_salt, str) else f"{tenant}\0{client_salt}"
    data = b"prefixgate-cache-salt\0" + material.encode("utf-8", "replace")
    return hashlib.sha256(data).hexdigest()


CAPABILITIES = Capabilities(
    health_path="/health",
    # Summed over label sets (one per model name / engine); it never sleeps as far as the proxy
    # can tell, so it is always read.
    load_sources=(
        LoadSource("/metrics", "vllm:num_requests_running", "vllm:num_requests_waiting"),
    ),
    shared_prefix_cache=True,  # one block cache for every request
)


class VllmDialect(Dialect):
    """vLLM (V1 engine)."""

    name = "vllm"
    provider_name = "vllm"
    capabilities = CAPABILITIES
    # Its request models allow extra fields ("fields were present in the request but ignored",
    # logged at debug), so hosted-only fields pass harmlessly.
    ignores_unknown_fields = True

    def partition_cache(
        self, body: MutableMapping[str, Any], tenant: str, route: str = CHAT
    ) -> bool:
        """vLLM salts the first block's hash with ``cache_salt``: one salt per tenant.

        Its Anthropic Messages route takes no ``cache_salt`` (the request model drops unknown
        fields and the chat request it builds has none), so there it cannot partition.
        """
        if route == MESSAGES:
            return False
        body["cache_salt"] = tenant_cache_salt(tenant, body.get("cache_salt"))
        return True

    def _read_metrics(self, obj: Mapping[str, Any], obs: Observation) -> None:
        metrics = obj.get("metrics")
        if isinstance(metrics, Mapping):
            ttft = as_number(metrics.get("time_to_first_token_ms"))
            queue = as_number(metrics.get("queue_time_ms")) or 0.0
            if ttft is not None:
                obs.backend_prefill_ms = max(ttft - queue, 0.0)
            itl = as_number(metrics.get("mean_itl_ms"))
            if itl is not None:
                obs.backend_tpot_ms = itl

    def read_response(self, route: str, obj: Mapping[str, Any], obs: Observation) -> None:
        super().read_response(route, obj, obs)
        self._read_metrics(obj, obs)

    def classify_event(self, route: str, obj: Mapping[str, Any], obs: Observation) -> EventKind:
        kind = super().classify_event(route, obj, obs)
        if kind is EventKind.USAGE_ONLY:
            self._read_metrics(obj, obs)
        return kind

    async def describe(
        self,
        session: aiohttp.ClientSession,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> BackendInfo:
        models = await fetch_json(session, base_url + "/v1/models", headers=headers)
        model = None
        ctx = None
        if isinstance(models, Mapping) and isinstance(models.get("data"), list) and models["data"]:
            first = models["data"][0]
            if isinstance(first, Mapping):
                model = first.get("id") if isinstance(first.get("id"), str) else None
                ml = first.get("max_model_len")
                ctx = ml if isinstance(ml, int) else None
        return BackendInfo(dialect=self.name, model=model, ctx_per_slot=ctx)
