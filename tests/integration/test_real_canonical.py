"""The canonicalizer against a real llama-server: an agent loop whose prompt changes every turn."""

from __future__ import annotations

import dataclasses
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from fakes import RecordLog

from proxy.app import build_app
from proxy.config import resolve
from proxy.log import get_logger
from proxy.record_writer import RecordWriter
from proxy.records import RequestRecord

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

TURNS = 20
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ').capitalize()} in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": "file path"},
                    "limit": {"type": "integer", "description": "max results"},
                },
                "required": ["path"],
            },
        },
    }
    for name in ("read_file", "write_file", "list_dir", "search_code", "run_tests")
]
BASE_SYSTEM = (
    "You are a coding agent working in a Python repository. Think step by step, call tools "
    "when you need information, and keep answers short. " * 40
)


def _shuffled(obj: Any, rng: random.Random) -> Any:
    """The same JSON value with every object's keys in a random order."""
    if isinstance(obj, dict):
        items = list(obj.items())
        rng.shuffle(items)
        return {k: _shuffled(v, rng) for k, v in items}
    if isinstance(obj, list):
        return [_shuffled(v, rng) for v in obj]
    return obj


async def _agent_loop(llama_url: str, *, canonicalize: bool, seed: int) -> list[RequestRecord]:
    writer = RecordWriter(logger=get_logger("test.records"))
    records = RecordLog.of(writer)
    settings = dataclasses.replace(
        resolve({"backend": [llama_url]}, environ={}), canonicalize=canonicalize
    )
    server = TestServer(build_app(settings, writer=writer))
    await server.start_server()
    rng = random.Random(seed)
    start = datetime(2026, 11, 30, 22, 41, 7, tzinfo=UTC) + timedelta(days=seed)
    messages: list[dict[str, Any]] = []
    try:
        async with aiohttp.ClientSession() as s:
            for turn in range(TURNS):
                now = start + timedelta(seconds=17 * turn)
                system = f"Current time: {now.isoformat().replace('+00:00', 'Z')}\n" + BASE_SYSTEM
                tools = _shuffled(TOOLS, rng)
                rng.shuffle(tools)
                messages.append({"role": "user", "content": f"Step {turn}: what next?"})
                body = {
                    "model": "smollm2",
                    "temperature": 0,
                    "max_tokens": 6,
                    "stream": True,
                    "tools": tools,
                    "messages": [{"role": "system", "content": system}, *messages],
                }
                async with s.post(server.make_url("/v1/chat/completions"), json=body) as r:
                    assert r.status == 200, await r.text()
                    text = []
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            import orjson

                            ev = orjson.loads(line[6:])
                            for c in ev.get("choices", []):
                                text.append(c.get("delta", {}).get("content") or "")
                messages.append({"role": "assistant", "content": "".join(text) or "ok"})
        await writer.drain()
    finally:
        await server.close()
    return records


def _summary(records: list[RequestRecord]) -> tuple[float, float]:
    prompt = sum(r.prompt_tokens or 0 for r in records)
    cached = sum(r.cached_tokens or 0 for r in records)
    ttft = [r.ttft_ms for r in records if r.ttft_ms is not None]
    return cached / prompt, sum(ttft) / len(ttft)


async def test_agent_loop_cache_share_with_and_without_canonicalizer(llama_url: str) -> None:
    """With the canonicalizer on, ≥ 90 % of prompt tokens come from cache; off, almost none."""
    off = await _agent_loop(llama_url, canonicalize=False, seed=1)
    on = await _agent_loop(llama_url, canonicalize=True, seed=2)
    share_off, ttft_off = _summary(off)
    share_on, ttft_on = _summary(on)
    print(
        f"\ncanonicalizer off: cached share {share_off:.1%}, mean TTFT {ttft_off:.0f} ms"
        f"\ncanonicalizer on:  cached share {share_on:.1%}, mean TTFT {ttft_on:.0f} ms"
        f"\nrules fired: {sorted({n for r in on for n in r.canonical_rules})}"
    )
    assert all(r.status == 200 for r in off + on)
    assert share_on >= 0.90
    assert share_off < 0.30
    assert ttft_on < ttft_off
    assert any("volatile_timestamps" in r.canonical_rules for r in on)
