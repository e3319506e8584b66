"""Everything around inference: pass-through paths, request ids, health, dialect detection."""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import pytest
from fakes import LlamaFake, MakeProxy, VllmFake

from proxy.state import STATE
from tests.ports import free_port

CHAT: dict[str, Any] = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


async def direct_get(url: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize(
    "path",
    [
        "/v1/models",
        "/props",
        "/health",
        "/health?verbose=1",
        "/props?fields=total_slots&x=%20y",
        "/nowhere",
    ],
)
async def test_get_passthrough(llama_fake: LlamaFake, make_proxy: MakeProxy, path: str) -> None:
    """Other GET paths are forwarded with their query string; status and body come back as is."""
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.get(path) as resp:
        got = (resp.status, await resp.read())
        assert resp.headers["X-Request-Id"]
    assert got == await direct_get(llama_fake.url + path)
    if "?" in path and path.startswith("/props"):
        assert llama_fake.last_query == {"fields": "total_slots", "x": " y"}
    assert records == []  # pass-through writes no request record


async def test_tokenize_passthrough(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """POST /tokenize is forwarded with its body; the backend's 400 is relayed unchanged."""
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.post("/tokenize", json={"content": "a bb ccc"}) as resp:
        assert resp.status == 200
        assert await resp.json() == {"tokens": [1, 2, 3]}
    assert llama_fake.last_body == {"content": "a bb ccc"}
    async with client.post("/tokenize", json={"nothing": 1}) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["error"] == {
        "code": 400,
        "message": '"content" must be provided',
        "type": "invalid_request_error",
    }


@pytest.mark.parametrize(
    "mode,get_status,post_status", [("all", 200, 200), ("read-only", 200, 404), ("off", 404, 404)]
)
async def test_passthrough_modes(
    llama_fake: LlamaFake, make_proxy: MakeProxy, mode: str, get_status: int, post_status: int
) -> None:
    """``--passthrough read-only`` forwards GET only, ``off`` nothing; refusals are 404 in the
    OpenAI shape and never reach the backend; inference and the proxy's own routes still work."""
    client, _, _ = await make_proxy(llama_fake.url, passthrough=mode)
    async with client.get("/v1/models") as resp:
        assert resp.status == get_status
    llama_fake.received.clear()
    async with client.post("/tokenize", json={"content": "a bb"}) as resp:
        assert resp.status == post_status
        if post_status == 404:
            body = await resp.json()
            assert body["error"]["code"] == "unknown_route"
            assert f"--passthrough {mode}" in body["error"]["message"]
    assert llama_fake.received.is_set() == (mode == "all")  # the POST reached the backend
    async with client.post("/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    async with client.admin.get("/healthz") as resp:
        assert resp.status == 200


async def test_request_id_taken_from_client(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """A well-formed X-Request-Id is kept: returned, sent upstream and recorded."""
    client, records, _ = await make_proxy(llama_fake.url)
    headers = {"X-Request-Id": "trace-42.a:b"}
    async with client.post("/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.headers["X-Request-Id"] == "trace-42.a:b"
    assert llama_fake.last_headers["X-Request-Id"] == "trace-42.a:b"
    assert (await records.wait()).request_id == "trace-42.a:b"


@pytest.mark.parametrize("given", [None, "bad id with spaces", "x" * 200])
async def test_request_id_generated(
    llama_fake: LlamaFake, make_proxy: MakeProxy, given: str | None
) -> None:
    """Without a usable X-Request-Id the proxy makes one, returns it and sends it upstream."""
    client, records, _ = await make_proxy(llama_fake.url)
    headers = {"X-Request-Id": given} if given else {}
    async with client.post(
        "/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers
    ) as resp:
        await resp.read()
        rid = resp.headers["X-Request-Id"]
    assert re.fullmatch(r"[0-9a-f]{32}", rid)
    assert llama_fake.last_headers["X-Request-Id"] == rid
    assert (await records.wait()).request_id == rid


async def test_healthz_and_readyz(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """/healthz is 200; /readyz is 200 when the backend answers its health check."""
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.admin.get("/healthz") as resp:
        assert (resp.status, await resp.json()) == (200, {"status": "ok"})
    async with client.admin.get("/readyz") as resp:
        assert resp.status == 200
        assert await resp.json() == {"status": "ready", "backends": {llama_fake.url: True}}


async def test_readyz_503_with_dead_backend(make_proxy: MakeProxy) -> None:
    """/readyz is 503 while no backend answers; /healthz stays 200."""
    dead = f"http://127.0.0.1:{free_port()}"
    client, _, _ = await make_proxy(dead)
    async with client.admin.get("/readyz") as resp:
        assert resp.status == 503
        assert (await resp.json())["backends"] == {dead: False}
    async with client.admin.get("/healthz") as resp:
        assert resp.status == 200


async def test_detects_llamacpp(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """A server answering /props is llama.cpp; its slots and per-slot context are read."""
    _, _, app = await make_proxy(llama_fake.url)
    replica = app[STATE].fleet.replicas[0]
    assert replica.detected and replica.dialect.name == "llamacpp"
    assert replica.info is not None
    assert (replica.info.slots, replica.info.ctx_per_slot) == (4, 4096)
    assert replica.capacity_tokens(None) == 4 * 4096


async def test_detects_vllm(vllm_fake: VllmFake, make_proxy: MakeProxy) -> None:
    """A server answering /version (and not /props) is vLLM; max_model_len is read."""
    _, _, app = await make_proxy(vllm_fake.url)
    replica = app[STATE].fleet.replicas[0]
    assert replica.detected and replica.dialect.name == "vllm"
    assert replica.info is not None
    assert (replica.info.model, replica.info.ctx_per_slot) == ("fake-model", 8192)


async def test_forced_dialect_skips_detection(vllm_fake: VllmFake, make_proxy: MakeProxy) -> None:
    """--dialect forces the dialect regardless of what the server answers."""
    _, _, app = await make_proxy(vllm_fake.url, dialect="llamacpp")
    assert app[STATE].fleet.replicas[0].dialect.name == "llamacpp"
