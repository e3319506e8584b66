"""Against a real llama-server: with the note memory, what the model sees is complete and the
history it sees is byte-identical from turn to turn, notes included.

Each turn's forwarded body is rendered by the server's own ``/apply-template``: every value of
the application's request is in the prompt (the newest definition of every placeholder is the
value the application sent this turn), and the previous turn's prompt, up to where the server
would start generating, is a prefix of this turn's. Through the proxy, the server reports the
history cached.
"""

from __future__ import annotations

import re
from typing import Any

import aiohttp
import pytest

from proxy.canonical import Canonicalizer
from tests.integration.conftest import RunningProxy
from tests.integration.tools_template import arithmetic_conversation

pytestmark = pytest.mark.real

CHAT = "/v1/chat/completions"
SESSION = "550e8400-e29b-41d4-a716-446655440000"
# A note line; the template may close the message on the same line.
_DEFINITION = re.compile(r"^(\[\[[a-z0-9_]+\]\]) = (.*?)(?:<\|im_end\|>)?$", re.MULTILINE)


def turn_body(n: int) -> dict[str, Any]:
    """The application's n-th request: a system prompt with an epoch clock and a session id,
    the conversation so far (replies scripted), a new question."""
    system = f"You are a terse assistant.\nClock: {1764542467 + 37 * n}\nSession: {SESSION}"
    messages = arithmetic_conversation(system, n)
    return {"model": "smollm2", "messages": messages, "max_tokens": 4, "temperature": 0}


async def rendered(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    async with session.post(url + "/apply-template", json=body) as resp:
        assert resp.status == 200
        return str((await resp.json())["prompt"])


async def test_model_sees_every_value_and_an_unchanged_history(llama_url: str) -> None:
    canonicalizer = Canonicalizer()
    previous: str | None = None
    async with aiohttp.ClientSession() as session:
        bare = await rendered(session, llama_url, {"messages": [{"role": "user", "content": ""}]})
        generation_prompt_len = len(bare) - bare.rindex("<|im_end|>") - len("<|im_end|>")
        for n in range(4):
            body = turn_body(n)
            result = canonicalizer.apply(CHAT, body)
            assert result.fired == ("volatile_timestamps", "volatile_uuids")
            prompt = await rendered(session, llama_url, result.body)
            # Every placeholder in the prompt is defined, its newest definition is this
            # turn's value, and no value is missing.
            definitions = dict(_DEFINITION.findall(prompt))
            assert definitions["[[epoch_1]]"] == str(1764542467 + 37 * n)
            assert definitions["[[uuid_1]]"] == SESSION
            assert set(re.findall(r"\[\[[a-z0-9_]+\]\]", prompt)) == set(definitions)
            assert str(1764542467 + 37 * n) not in prompt.split("<|im_end|>")[0]
            if previous is not None:
                history = previous[: len(previous) - generation_prompt_len]
                assert prompt.startswith(history)
                # The session id is stated once, in the first turn's note only.
                assert prompt.count(SESSION) == 1
                assert result.note_values_omitted == 1
            previous = prompt


async def test_through_the_proxy_the_history_is_cached(real_proxy: RunningProxy) -> None:
    async with aiohttp.ClientSession() as session:
        for n in range(3):
            async with session.post(real_proxy.url.rstrip("/") + CHAT, json=turn_body(n)) as resp:
                assert resp.status == 200
                await resp.json()
    await real_proxy.writer.drain()
    records = [r for r in real_proxy.records if r.route == CHAT]
    assert [(r.canonical_notes_restored or 0) for r in records] == [0, 1, 2]
    last, before = records[-1], records[-2]
    assert last.cached_tokens is not None and before.prompt_tokens is not None
    # Everything the previous request's prompt held, but its generation prompt, is reused.
    assert last.cached_tokens >= before.prompt_tokens - 8
