"""Time to first *visible* token on a real reasoning stream, and goodput judged on it.

SmolLM2 does not reason by itself. A ChatML template that opens a ``<think>`` block in the
generation prompt (``deploy/templates/chatml-think.jinja``, in the style of Qwen3 and
DeepSeek-R1 templates) makes llama-server parse what the model writes before ``</think>`` as
``reasoning_content``; a grammar makes the model close that block after a few words, so every
answer streams reasoning first, then content, as a reasoning model's does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from fakes import RecordLog

from proxy.app import build_app
from proxy.config import resolve
from proxy.log import get_logger
from proxy.record_writer import RecordWriter
from proxy.records import RequestRecord, Slo
from tests.integration.llama import running_llama_server

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "templates" / "chatml-think.jinja"
# At least 24 characters of thinking, then the end of the block, then the visible answer.
GRAMMAR = 'root ::= [a-z ]{24,40} "</think>" [a-zA-Z ]{4,24}'
BODY: dict[str, Any] = {
    "model": "smollm2",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant. Think before answering."},
        {"role": "user", "content": "Say hello."},
    ],
    "stream": True,
    "max_tokens": 48,
    "temperature": 0,
    "grammar": GRAMMAR,
}


@pytest.fixture(scope="module")
def thinking_server() -> Iterator[str]:
    with running_llama_server(
        slots=1,
        ctx=2048,
        extra=("--jinja", "--chat-template-file", str(TEMPLATE), "--reasoning-format", "deepseek"),
    ) as url:
        yield url


Proxy = tuple[str, list[RequestRecord], RecordWriter]


@pytest.fixture
async def start_proxy(thinking_server: str) -> AsyncIterator[Any]:
    servers: list[TestServer] = []

    async def start(slo: Slo) -> Proxy:
        writer = RecordWriter(logger=get_logger("test.records"))
        records = RecordLog.of(writer)
        settings = dataclasses.replace(resolve({"backend": [thinking_server]}, environ={}), slo=slo)
        server = TestServer(build_app(settings, writer=writer))
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/"), records, writer

    yield start
    for server in servers:
        await server.close()


async def stream(url: str) -> tuple[str, str]:
    """The reasoning and the content of one streamed answer."""
    reasoning, content = [], []
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=BODY) as resp,
    ):
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            for choice in orjson.loads(line[6:]).get("choices", []):
                delta = choice.get("delta") or {}
                reasoning.append(delta.get("reasoning_content") or "")
                content.append(delta.get("content") or "")
    return "".join(reasoning), "".join(content)


async def test_ttfvt_follows_the_reasoning_and_goodput_waits_for_it(
    thinking_server: str, start_proxy: Any
) -> None:
    """The server streams reasoning, then content: TTFT is the first reasoning token, TTFVT the
    first content one, later by the thinking's decode time. An SLO between the two is missed:
    goodput counts what the user waited for, not the hidden thinking."""
    reasoning, content = await stream(thinking_server)  # straight to the server: its behaviour
    assert len(reasoning.strip()) >= 20 and content.strip(), (reasoning, content)

    url, records, writer = await start_proxy(Slo(ttft_ms=60_000))
    for _ in range(2):  # the second one with the prompt cached: its TTFT is decode-bound
        through = await stream(url)
        assert through == (reasoning, content)  # temperature 0, byte-identical prompt
    await writer.drain()
    rec = records[-1]
    assert rec.ttft_ms is not None and rec.ttfvt_ms is not None
    assert rec.ttft_ms < rec.ttfvt_ms, rec
    assert rec.slo_met is True
    gap = rec.ttfvt_ms - rec.ttft_ms

    # An objective half-way between: met by the first token, missed by the first visible one.
    url, records, writer = await start_proxy(Slo(ttft_ms=rec.ttft_ms + gap / 2))
    await stream(url)
    await writer.drain()
    judged = records[-1]
    assert judged.ttft_ms is not None and judged.ttfvt_ms is not None
    assert judged.ttft_ms < rec.ttft_ms + gap / 2 < judged.ttfvt_ms, (judged, rec)
    assert judged.slo_met is False
