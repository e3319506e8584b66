"""Strict shapes against a real llama-server: the bodies it answers with a 500 ("Failed to
parse tools", "Failed to parse messages") get the proxy's 400 naming the field, and valid tool
requests still pass."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from openai import AsyncOpenAI

from tests.integration.conftest import RunningProxy

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

FUZZ = Path(__file__).parents[1] / "data" / "fuzz"
CASES = tomllib.loads((FUZZ / "bodies.toml").read_text())["case"]
BACKEND_500 = [c for c in CASES if c.get("backend_500")]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def case_id(case: dict[str, Any]) -> str:
    return str(Path(case["file"]).stem)


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + "/v1/chat/completions", json=body) as resp,
    ):
        return resp.status, orjson.loads(await resp.read())


def test_the_corpus_marks_llama_500s() -> None:
    """The corpus names enough llama-server 500s to be worth checking, all of them 400s."""
    assert len(BACKEND_500) >= 15
    assert {c["status"] for c in BACKEND_500} == {400}


@pytest.mark.parametrize("case", BACKEND_500, ids=case_id)
async def test_a_backend_500_becomes_the_proxys_400(
    llama_url: str, real_proxy: RunningProxy, case: dict[str, Any]
) -> None:
    """Straight to llama-server the body is a 500; through the proxy it is a 400 in OpenAI's
    shape naming the field, and never reaches the server."""
    body = orjson.loads((FUZZ / case["file"]).read_bytes()) | {"max_tokens": 2}
    status, answer = await post(llama_url, body)
    assert status == 500, (status, answer)
    status, answer = await post(real_proxy.url.rstrip("/"), body)
    assert status == 400, answer
    assert answer["error"]["param"] == case["param"]
    assert answer["error"]["type"] == "invalid_request_error"
    await real_proxy.writer.drain()
    assert real_proxy.records[-1].status == 400 and real_proxy.records[-1].backend is None


async def test_valid_tool_requests_still_pass(real_proxy: RunningProxy) -> None:
    """Tools, tool_choice, a past tool call with its result, content parts, response_format
    and stream_options in their OpenAI shapes: answered by the server, through the SDK."""
    async with AsyncOpenAI(base_url=real_proxy.url + "v1", api_key="unused", max_retries=0) as oai:
        resp = await oai.chat.completions.create(
            model="smollm2",
            messages=[
                {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "What time is it in Oslo?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
            ],
            tools=[TOOL],  # type: ignore[list-item]  # a plain dict in the SDK's shape
            tool_choice="auto",
            max_tokens=4,
            temperature=0,
        )
        assert resp.choices[0].finish_reason in {"stop", "length", "tool_calls"}
        stream = await oai.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}],
            response_format={"type": "json_object"},
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=4,
            temperature=0,
        )
        chunks = [chunk async for chunk in stream]
        assert chunks and chunks[-1].usage is not None
    await real_proxy.writer.drain()
    assert [r.status for r in real_proxy.records[-2:]] == [200, 200]
