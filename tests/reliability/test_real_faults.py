"""Faults with the real llama-server (SmolLM2) behind a proxy process: few and short.

The fakes speak llama.cpp's wire format; these check the two things only the real server can:
that a llama-server killed mid-generation ends the client's stream with an error event and the
proxy serves again once it is back, and that fields the proxy forwards without judging them are
answered by llama-server exactly as if the client had called it directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.integration.llama import llama_server_binary, smollm2_model
from tests.ports import free_port
from tests.reliability.conftest import Procs
from tests.reliability.outcome import (
    COMPLETE,
    ERROR,
    call,
    classify,
    is_proxy_error_body,
    sse_payloads,
)
from tests.reliability.processes import ChildProcess, eventually

pytestmark = pytest.mark.real

CHAT = "/v1/chat/completions"


class LlamaServer(ChildProcess):
    """llama-server with SmolLM2 on a fixed port, so it can be killed and come back there."""

    def __init__(self) -> None:
        self.port = free_port()
        argv = [llama_server_binary(), "-m", smollm2_model(), "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "-c", "2048", "-np", "1", "-t", "2"]
        super().__init__(argv, name=f"llama-{self.port}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LlamaServer:
        self.spawn()
        self.wait_http(self.url + "/health", timeout_s=120)
        return self


@pytest.fixture(scope="module")
def llama() -> Iterator[LlamaServer]:
    server = LlamaServer().start()
    try:
        yield server
    finally:
        server.stop()
        server.remove_files()


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "temperature": 0, **extra}


# Fields only llama-server reads, with wrong types: it judges them, the proxy relays its answer.
FORWARDED: list[dict[str, Any]] = [
    {"max_tokens": "ten"},
    {"temperature": "hot"},
    {"stop": {"a": 1}},
    {"n_probs": [1]},
]


async def test_llama_judges_fields_the_proxy_forwards(llama: LlamaServer, procs: Procs) -> None:
    """For fields the proxy does not read, the client gets llama-server's own status and
    body, exactly as it would calling llama-server directly."""
    proxy = procs.proxy([llama.url], idle_timeout=60.0, connect_timeout=2.0)
    async with aiohttp.ClientSession() as http:
        for extra in FORWARDED:
            body = orjson.dumps({**chat("Say yes.", max_tokens=2), **extra})
            headers = {"Content-Type": "application/json"}
            async with http.post(llama.url + CHAT, data=body, headers=headers) as direct:
                want = (direct.status, await direct.read())
            async with http.post(proxy.url + CHAT, data=body, headers=headers) as proxied:
                got = (proxied.status, await proxied.read())
            assert got[0] == want[0], (extra, got, want)
            if want[0] >= 400:
                assert got[1] == want[1], (extra, got, want)
            else:
                assert classify(got[0], "application/json", got[1]).kind == COMPLETE


async def test_llama_killed_mid_stream_then_restarted(llama: LlamaServer, procs: Procs) -> None:
    """SIGKILL while llama-server streams: the client's stream ends with the proxy's error
    event; once llama-server is back on its port the proxy serves again, unrestarted."""
    proxy = procs.proxy([llama.url], idle_timeout=60.0, connect_timeout=2.0)
    async with aiohttp.ClientSession() as http:
        body = chat("Write a long story about a dragon and a lighthouse.", max_tokens=400)
        async with http.post(proxy.url + CHAT, json={**body, "stream": True}) as resp:
            assert resp.status == 200
            got = b""
            while got.count(b'"content":"') < 3:
                got += await asyncio.wait_for(resp.content.readany(), 60)
            llama.kill()
            got += await asyncio.wait_for(resp.content.read(), 10)
        outcome = classify(resp.status, resp.content_type, got)
        assert (outcome.kind, outcome.error) == (ERROR, "backend_unavailable"), got[-400:]
        assert is_proxy_error_body(orjson.loads(sse_payloads(got)[-1]))

        await asyncio.to_thread(llama.start)

        async def served() -> bool:
            short = chat("Say hi.", max_tokens=4)
            return (await call(http, proxy.url + CHAT, short, timeout_s=60)).kind == COMPLETE

        assert await eventually(served, within_s=60, every_s=0.5)
    assert proxy.alive
