"""The response names the canonicalization rules that rewrote the request, streamed or not."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from aiohttp import web
from fakes import LlamaFake, MakeProxy

from proxy.backends import detect_dialect


def dated_chat(stream: bool) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "stream": stream,
        "messages": [
            {"role": "system", "content": "You are helpful. Now: 2026-11-30T10:15:00Z. Be brief."},
            {"role": "user", "content": "hello"},
        ],
    }


@pytest.mark.parametrize("stream", [False, True])
async def test_canonical_header_reaches_the_client(
    llama_fake: LlamaFake, make_proxy: MakeProxy, stream: bool
) -> None:
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json=dated_chat(stream)) as resp:
        assert resp.status == 200
        await resp.read()
        assert "volatile_timestamps" in resp.headers["X-Prefixgate-Canonical"]


async def test_no_header_when_nothing_changed(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    client, _, _ = await make_proxy(llama_fake.url)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hello"}]}
    async with client.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert "X-Prefixgate-Canonical" not in resp.headers


async def test_a_loading_backend_is_not_detected_as_generic(aiohttp_server: Any) -> None:
    """llama-server answers 503 everywhere while it loads: detect it later, not as 'openai'."""

    async def loading(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
            status=503,
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", loading)
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as session:
        assert await detect_dialect(session, str(server.make_url("")).rstrip("/")) is None
