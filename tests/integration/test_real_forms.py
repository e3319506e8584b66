"""What the model sees: a real llama-server whose template prints tools and tool calls.

With ``deploy/templates/chatml-tools.jinja`` every tool, every schema key and every past tool
call's arguments reach the prompt verbatim, so any rewrite of them changes what the model reads.
A tool-using application that keeps its tool order must reach the model exactly as it wrote
it (same prompt, same temperature-0 answer as asking the server directly); one that shuffles
its tools must reach it as it first sent them.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
import pytest

from proxy.canonical import Canonicalizer
from tests.integration.tools_template import Proxy, rendered

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


# Keys in no sorted order and tools out of name order: what the fixed rules would rewrite.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"type": "string"}, "city": {"type": "string"}},
                "required": ["city"],
            },
            "description": "Weather for a city.",
        },
    },
    {
        "type": "function",
        "function": {
            "name": "clock",
            "description": "Time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]


def conversation(tools: list[dict[str, Any]], arguments: str) -> dict[str, Any]:
    return {
        "model": "smollm2",
        "temperature": 0,
        "max_tokens": 12,
        "tools": tools,
        "messages": [
            {"role": "system", "content": "You are a weather assistant.  \nBe brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
            {"role": "user", "content": "And should I take a coat?"},
        ],
    }


def shuffled(obj: Any, rng: random.Random) -> Any:
    """``obj`` with every object's keys in a random order."""
    if isinstance(obj, dict):
        items = list(obj.items())
        rng.shuffle(items)
        return {k: shuffled(v, rng) for k, v in items}
    if isinstance(obj, list):
        return [shuffled(v, rng) for v in obj]
    return obj


async def answer(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers.get("X-Prefixgate-Canonical"), await resp.json()


async def forwarded(proxy: Proxy, n: int) -> dict[str, Any]:
    """The body the proxy sent for its ``n``-th request (records are written after the end)."""
    for _ in range(100):
        if len(proxy.records) >= n:
            break
        await asyncio.sleep(0.05)
    sent = proxy.records[n - 1].body
    assert isinstance(sent, dict)
    return sent


async def test_a_stable_tool_app_reaches_the_model_as_it_wrote_it(
    tools_llama: str, proxy: Proxy
) -> None:
    """Tools in their own order, unsorted keys, spaced arguments, blanks before a line end:
    sent twice, no rule fires, the prompt is the application's and the answer the direct one."""
    body = conversation(TOOLS, '{"city": "Paris", "unit": "C"}')
    async with aiohttp.ClientSession() as session:
        direct = await rendered(session, tools_llama, body)
        # The template prints each schema as sent (llama-server orders only name, description
        # and parameters of a function itself): properties in the application's order.
        assert '"properties": {"unit": {"type": "string"}, "city"' in direct
        # The fixed normal form (sorted tools, sorted keys) would change what the model reads.
        fixed = Canonicalizer().apply("/v1/chat/completions", body).body
        assert await rendered(session, tools_llama, fixed) != direct
        _, direct_answer = await answer(session, tools_llama, body)
        for n in (1, 2):
            header, via = await answer(session, proxy.url, body)
            assert header is None
            assert proxy.records[n - 1].canonical_rules == []
            assert await rendered(session, tools_llama, await forwarded(proxy, n)) == direct
            assert via["choices"][0]["message"] == direct_answer["choices"][0]["message"]


async def test_a_shuffling_tool_app_reaches_the_model_as_it_first_wrote_it(
    tools_llama: str, proxy: Proxy
) -> None:
    """The second request shuffles the tools, every key and the arguments' spelling: the
    prompt the model sees is the first request's, and so is the answer."""
    first = conversation(TOOLS, '{"city": "Paris", "unit": "C"}')
    rng = random.Random(7)
    tools = shuffled(TOOLS, rng)[::-1]
    later = conversation(tools, '{"unit":"C","city":"Paris"}')
    async with aiohttp.ClientSession() as session:
        assert await rendered(session, tools_llama, later) != await rendered(
            session, tools_llama, first
        )
        _, first_answer = await answer(session, proxy.url, first)
        header, later_answer = await answer(session, proxy.url, later)
        assert header == "stable_json"
        want = await rendered(session, tools_llama, first)
        assert await rendered(session, tools_llama, await forwarded(proxy, 2)) == want
        assert later_answer["choices"][0]["message"] == first_answer["choices"][0]["message"]
