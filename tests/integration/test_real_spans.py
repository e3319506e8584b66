"""Against a real llama-server printing tools: a value no detector knows is learned from the
first requests and relocated, so the history is cached from then on; a stable application's
prompt is never touched.

Each forwarded body is rendered by the server's own ``/apply-template`` (with
``deploy/templates/chatml-tools.jinja``): the learning requests reach the model exactly as the
application wrote them; afterwards the value is a placeholder in the system prompt, its newest
definition (in the note after the newest message) is the value the application sent, and the
previous turn's prompt is a prefix of this turn's, which the server reports cached.
"""

from __future__ import annotations

import asyncio
import re
from itertools import pairwise
from typing import Any

import aiohttp
import pytest

from proxy.records import RequestRecord
from tests.integration.tools_template import Proxy, arithmetic_conversation, rendered

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

CHAT = "/v1/chat/completions"
BUILDS = ["7f3a-19", "8c21-04", "91ab-77", "0d0e-11", "aa12-93", "5b5b-20"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "release_notes",
            "description": "The release notes of a build.",
            "parameters": {"type": "object", "properties": {"build": {"type": "string"}}},
        },
    }
]
INSTRUCTIONS = (
    "You are the release desk of Contoso. Answer in one short sentence. Name the build when "
    "you talk about one, and never invent release notes: ask the tool for them."
)
_DEFINITION = re.compile(r"^(\[\[[a-z0-9_]+\]\]) = (.*?)(?:<\|im_end\|>)?$", re.MULTILINE)


def turn_body(n: int, *, volatile: bool = True) -> dict[str, Any]:
    """The application's n-th request: the build in the system prompt (fresh each request,
    in a format no detector knows), the conversation so far, a new question."""
    system = INSTRUCTIONS + (f"\nBuild: {BUILDS[n]}" if volatile else "")
    messages = arithmetic_conversation(system, n)
    return {
        "model": "smollm2",
        "messages": messages,
        "tools": TOOLS,
        "max_tokens": 4,
        "temperature": 0,
    }


async def send(session: aiohttp.ClientSession, proxy: Proxy, body: dict[str, Any]) -> Any:
    """One request through the proxy; its record (written just after the response ends)."""
    count = len(proxy.records)
    async with session.post(proxy.url + CHAT, json=body) as resp:
        assert resp.status == 200, await resp.text()
        reply = await resp.json()
    for _ in range(100):
        if len(proxy.records) > count:
            break
        await asyncio.sleep(0.05)
    return reply, proxy.records[-1]


async def test_a_learned_value_is_relocated_and_the_history_cached(
    tools_llama: str, proxy: Proxy
) -> None:
    """Two requests reach the model as written; from the third, which completes the pattern,
    the build is a placeholder defined by the newest note, and the history is cached."""
    async with aiohttp.ClientSession() as session:
        bare = await rendered(session, tools_llama, {"messages": [{"role": "user", "content": ""}]})
        generation_prompt_len = len(bare) - bare.rindex("<|im_end|>") - len("<|im_end|>")
        previous: str | None = None
        records: list[RequestRecord] = []
        for n in range(6):
            body = turn_body(n)
            _, record = await send(session, proxy, body)
            records.append(record)
            assert isinstance(record.body, dict)
            prompt = await rendered(session, tools_llama, record.body)
            if n < 2:
                assert record.canonical_rules == []
                assert prompt == await rendered(session, tools_llama, body)
                continue
            assert record.canonical_rules == ["volatile_learned"]
            assert record.canonical_learned_spans is not None
            definitions = dict(_DEFINITION.findall(prompt))
            assert definitions == {"[[build_1]]": BUILDS[n]}
            assert "Build: [[build_1]]" in prompt and BUILDS[n] not in prompt.split("<|im_end|>")[0]
            if previous is not None:
                assert prompt.startswith(previous[: len(previous) - generation_prompt_len])
            previous = prompt
    assert [r.canonical_notes_restored or 0 for r in records[2:]] == [0, 1, 2, 3]
    for before, last in pairwise(records[2:]):
        assert last.cached_tokens is not None and before.prompt_tokens is not None
        # Everything the previous request's prompt held, but its generation prompt, is reused.
        assert last.cached_tokens >= before.prompt_tokens - 8


async def test_a_stable_application_reaches_the_model_as_it_wrote_it(
    tools_llama: str, proxy: Proxy
) -> None:
    """The same loop without the build: no rule fires, nothing is learned, and every prompt
    is the one the application's own request renders to."""
    async with aiohttp.ClientSession() as session:
        for n in range(4):
            body = turn_body(n, volatile=False)
            _, record = await send(session, proxy, body)
            assert record.canonical_rules == [] and record.canonical_learned_spans is None
            assert isinstance(record.body, dict)
            want = await rendered(session, tools_llama, body)
            assert await rendered(session, tools_llama, record.body) == want
