"""The Responses and Anthropic Messages APIs through the proxy: records, streams, errors, rules."""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest
from fakes import Knobs, LlamaFake, MakeProxy, SlotLlamaFake, VllmFake, serve
from prometheus_client import generate_latest

from proxy.admin import METRICS
from proxy.admin.stats import build_stats, parse_query
from proxy.state import STATE

# A shared instruction of 40 words: the cache holds it from the second request on.
SYSTEM = " ".join(f"rule{i}" for i in range(40))


def responses_body(question: str, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "instructions": SYSTEM, "input": question, **extra}


def messages_body(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "max_tokens": 16,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": question}],
        **extra,
    }


async def test_responses_record_reads_the_apis_usage(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Responses: prompt, cached and completion tokens from input/output_tokens, and a hit."""
    client, records, _ = await make_proxy(llama_fake.url)
    for q in ("what is one plus one", "what is two plus two"):
        async with client.post("/v1/responses", json=responses_body(q)) as resp:
            assert resp.status == 200
            answer = await resp.json()
    assert answer["object"] == "response" and answer["usage"]["input_tokens"] == 47
    first, second = await records.wait(1), await records.wait(2)
    assert first.route == "/v1/responses" and first.dialect == "llamacpp"
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (47, 0, 5)
    assert (second.prompt_tokens, second.cached_tokens) == (47, 44)
    assert second.cached_tokens_source == "reported"
    assert first.prefix_blocks > 0 and first.prefix_anchor is not None
    assert second.prefix_anchor == first.prefix_anchor


async def test_responses_stream_times_tokens_and_reads_completed(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """A Responses stream: reasoning deltas are tokens, text deltas visible, usage and timings
    from ``response.completed``; the client gets the backend's bytes unchanged."""
    knobs = Knobs(reasoning=["hm", " so"], token_delay_s=0.02)
    fake = await serve(LlamaFake(knobs), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)
    async with client.post("/v1/responses", json=responses_body("hi", stream=True)) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        data = await resp.read()
    assert b"event: response.output_text.delta\n" in data
    assert b"[DONE]" not in data and b'"timings"' in data
    assert fake.last_body is not None and "stream_options" not in fake.last_body
    rec = await records.wait()
    assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (43, 0, 7)
    assert rec.ttft_ms is not None and rec.ttfvt_ms is not None and rec.tpot_ms is not None
    assert rec.ttfvt_ms >= rec.ttft_ms + 30  # two reasoning tokens before the first visible one
    assert rec.backend_prefill_ms == pytest.approx(43 * knobs.prefill_ms_per_token)
    assert rec.error is None and rec.stream is True


async def test_messages_prompt_is_uncached_plus_cache_read(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Messages: ``prompt_tokens`` = input_tokens + cache_read_input_tokens; cached = the read."""
    client, records, _ = await make_proxy(llama_fake.url)
    for q in ("what is one plus one", "what is two plus two"):
        async with client.post("/v1/messages", json=messages_body(q)) as resp:
            assert resp.status == 200
            answer = await resp.json()
    assert answer["usage"] == {"cache_read_input_tokens": 44, "input_tokens": 3, "output_tokens": 5}
    first, second = await records.wait(1), await records.wait(2)
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (47, 0, 5)
    assert (second.prompt_tokens, second.cached_tokens, second.completion_tokens) == (47, 44, 5)
    assert second.hit_rate == pytest.approx(44 / 47)


async def test_messages_stream_usage_from_start_and_delta(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """An Anthropic stream: usage from ``message_start``, output from ``message_delta``,
    thinking deltas are not visible."""
    knobs = Knobs(reasoning=["hm"], token_delay_s=0.02)
    fake = await serve(LlamaFake(knobs), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)
    for q in ("one", "two"):
        async with client.post("/v1/messages", json=messages_body(q, stream=True)) as resp:
            assert resp.status == 200
            data = await resp.read()
    assert data.startswith(b"event: message_start\n") and data.endswith(
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    first, second = await records.wait(1), await records.wait(2)
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (43, 0, 6)
    assert (second.prompt_tokens, second.cached_tokens) == (43, 42)
    assert second.ttfvt_ms is not None and second.ttft_ms is not None
    assert second.ttfvt_ms >= second.ttft_ms + 15
    assert second.tpot_ms is not None


async def test_vllm_messages_without_cache_fields_are_unknown(
    vllm_fake: VllmFake, make_proxy: MakeProxy
) -> None:
    """A server that sends no cache_read_input_tokens: the whole prompt, cached unknown."""
    client, records, _ = await make_proxy(vllm_fake.url)
    async with client.post("/v1/messages", json=messages_body("hi", stream=True)) as resp:
        await resp.read()
    async with client.post("/v1/messages", json=messages_body("hi")) as resp:
        await resp.read()
    for rec in (await records.wait(1), await records.wait(2)):
        assert rec.dialect == "vllm"
        assert rec.prompt_tokens == 43 and rec.completion_tokens == 5
        assert rec.cached_tokens is None and rec.cached_tokens_source == "unknown"


async def test_vllm_responses_cached_tokens_when_reported(
    vllm_fake: VllmFake, make_proxy: MakeProxy
) -> None:
    """vLLM with prompt details: Responses' input_tokens_details.cached_tokens is recorded."""
    vllm_fake.prompt_tokens_details = True
    client, records, _ = await make_proxy(vllm_fake.url)
    for q in ("one", "two"):
        async with client.post("/v1/responses", json=responses_body(q, stream=True)) as resp:
            await resp.read()
    first, second = await records.wait(1), await records.wait(2)
    assert (first.cached_tokens, second.cached_tokens) == (0, 32)
    assert second.cached_tokens_source == "reported" and second.prompt_tokens == 43


async def test_second_turn_reuse_is_predicted_by_the_index(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """The second turn of a conversation: the index predicts the first turn's prefix, and the
    backend reports it cached (both APIs)."""
    client, records, _ = await make_proxy(llama_fake.url)
    long = " ".join(f"word{i}" for i in range(300))
    turn1 = [{"role": "user", "content": long}]
    answer = {"role": "assistant", "content": [{"type": "text", "text": "Hello there"}]}
    turn2 = [*turn1, answer, {"role": "user", "content": "and then?"}]
    for messages in (turn1, turn2):
        body = {"model": "fake-model", "max_tokens": 8, "messages": messages}
        async with client.post("/v1/messages", json=body) as resp:
            assert resp.status == 200
    items1: list[dict[str, Any]] = [{"role": "user", "content": long + " again"}]
    output = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Hello there"}],
    }
    items2 = [*items1, output, {"role": "user", "content": "and then?"}]
    for items in (items1, items2):
        async with client.post("/v1/responses", json={"model": "fake-model", "input": items}) as r:
            assert r.status == 200
    m2, r2 = await records.wait(2), await records.wait(4)
    for rec in (m2, r2):
        assert rec.predicted_cached_tokens and rec.predicted_cached_tokens > 0
        assert rec.cached_tokens and rec.cached_tokens >= 300
        assert rec.predicted_hit_rate is not None and rec.predicted_hit_rate > 0.5


async def test_responses_validation_error_is_openai_shaped(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """A Responses body the proxy cannot read: 400, OpenAI's shape with ``param``."""
    client, records, _ = await make_proxy(llama_fake.url)
    body = {"model": "m", "input": [{"role": "user", "content": 7}]}
    async with client.post("/v1/responses", json=body) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "input[0].content"
    assert llama_fake.requests == []
    rec = await records.wait()
    assert rec.status == 400 and rec.route == "/v1/responses"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": "m", "max_tokens": 4}, "messages: Field required"),
        ({"model": "m", "messages": [{"content": "hi"}]}, "messages.0.role: Field required"),
        ({"model": "m", "system": 3, "messages": []}, "system: Input should be"),
    ],
)
async def test_messages_validation_error_is_anthropic_shaped(
    llama_fake: LlamaFake, make_proxy: MakeProxy, body: dict[str, Any], message: str
) -> None:
    """A Messages body the proxy cannot read: 400 in Anthropic's error shape."""
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/messages", json=body) as resp:
        assert resp.status == 400
        got = await resp.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert got["error"]["message"].startswith(message)
    assert llama_fake.requests == []


async def test_messages_malformed_json_is_anthropic_shaped(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Even a body that is not JSON gets Anthropic's error shape on the Messages route."""
    client, _, _ = await make_proxy(llama_fake.url)
    headers = {"Content-Type": "application/json"}
    async with client.post("/v1/messages", data=b"{nope", headers=headers) as resp:
        assert resp.status == 400
        got = await resp.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"


async def test_backend_stream_error_is_recorded(aiohttp_server: Any, make_proxy: MakeProxy) -> None:
    """llama-server's mid-stream error on either API marks the record."""
    fake = await serve(LlamaFake(Knobs(fail_after=2)), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)
    async with client.post("/v1/messages", json=messages_body("hi", stream=True)) as resp:
        data = await resp.read()
    assert b"event: error\n" in data
    async with client.post("/v1/responses", json=responses_body("hi", stream=True)) as resp:
        await resp.read()
    for rec in (await records.wait(1), await records.wait(2)):
        assert rec.error == "upstream_stream_error"


async def test_proxy_stream_error_is_anthropic_shaped(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """A backend lost mid-stream: the proxy's closing error event speaks Anthropic's format."""
    fake = await serve(LlamaFake(Knobs(drop_after=2)), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)
    async with client.post("/v1/messages", json=messages_body("hi", stream=True)) as resp:
        data = await resp.read()
    tail = data.rsplit(b"\n\n", 2)[-2]
    assert tail.startswith(b"event: error\ndata: ")
    error = orjson.loads(tail.split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    rec = await records.wait()
    assert rec.error == "backend_disconnected"


TOOL_B = {
    "type": "function",
    "name": "b_tool",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    "description": "Second.",
}
TOOL_A = {"name": "a_tool", "type": "function", "description": "First.", "parameters": {}}


async def test_responses_tools_are_canonical(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """Responses tools sent shuffled after their sorted form was seen: rewritten to it (keys
    sorted, ordered by name), the rules named in the header."""
    client, records, _ = await make_proxy(llama_fake.url)
    first = responses_body("hi", tools=[TOOL_A, {k: TOOL_B[k] for k in sorted(TOOL_B)}])
    async with client.post("/v1/responses", json=first) as resp:
        assert resp.status == 200 and "X-Prefixgate-Canonical" not in resp.headers
    assert (await records.wait()).canonical_rules == []
    body = responses_body("hi", tools=[TOOL_B, TOOL_A])
    async with client.post("/v1/responses", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["X-Prefixgate-Canonical"] == "stable_json"
    sent = llama_fake.last_body
    assert sent is not None
    assert [t["name"] for t in sent["tools"]] == ["a_tool", "b_tool"]
    assert list(sent["tools"][1]) == sorted(TOOL_B)
    assert (await records.wait(2)).canonical_rules == ["stable_json"]


async def test_responses_volatile_instruction_moves_to_a_note(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """A date in the instructions becomes a placeholder; its value goes to the user's input
    (after its text: the default placement)."""
    client, records, _ = await make_proxy(llama_fake.url)
    body = {
        "model": "fake-model",
        "instructions": "You help. Current date: 2026-11-30T10:00:00Z.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
    }
    async with client.post("/v1/responses", json=body) as resp:
        assert resp.status == 200
    sent = llama_fake.last_body
    assert sent is not None
    assert "2026" not in sent["instructions"] and "[[datetime_1]]" in sent["instructions"]
    parts = sent["input"][0]["content"]
    assert parts[0] == {"type": "input_text", "text": "hi"}
    assert parts[1]["type"] == "input_text" and "2026-11-30T10:00:00Z" in parts[1]["text"]
    assert "volatile_timestamps" in (await records.wait()).canonical_rules


async def test_messages_with_breakpoint_reach_the_backend_untouched(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """A ``cache_control`` breakpoint: tools and system (before it) are sent byte for byte."""
    client, records, _ = await make_proxy(llama_fake.url)
    tools = [
        {"name": "b", "input_schema": {"type": "object", "b": 1, "a": 2}},
        {"name": "a", "input_schema": {}},
    ]
    system = [
        {
            "type": "text",
            "text": "Date: 2026-11-30T10:00:00Z.  \r\n",
            "cache_control": {"type": "ephemeral"},
        }
    ]
    body = messages_body("hi", tools=tools, system=system)
    raw = orjson.dumps(body)
    async with client.post(
        "/v1/messages", data=raw, headers={"Content-Type": "application/json"}
    ) as resp:
        assert resp.status == 200
        assert "X-Prefixgate-Canonical" not in resp.headers
    assert llama_fake.last_body == body
    assert (await records.wait()).canonical_rules == []


async def test_messages_without_breakpoint_get_the_rules(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """No breakpoint: Anthropic tools and the system text sent in another form after their
    normal form was seen are rewritten to it (sorted, line ends normalised)."""
    client, records, _ = await make_proxy(llama_fake.url)
    normal = [
        {"description": "A.\nSecond line.", "input_schema": {}, "name": "a"},
        {"input_schema": {"a": 2, "b": 1, "type": "object"}, "name": "b"},
    ]
    first = messages_body("hi", tools=normal, system="Be brief.\nReally.")
    async with client.post("/v1/messages", json=first) as resp:
        assert resp.status == 200
    assert (await records.wait()).canonical_rules == []
    tools = [
        {"name": "b", "input_schema": {"type": "object", "b": 1, "a": 2}},
        {"name": "a", "description": "A.  \r\nSecond line.", "input_schema": {}},
    ]
    body = messages_body("hi", tools=tools, system="Be brief.  \r\nReally.")
    async with client.post("/v1/messages", json=body) as resp:
        assert resp.status == 200
    sent = llama_fake.last_body
    assert sent is not None
    assert [t["name"] for t in sent["tools"]] == ["a", "b"]
    assert list(sent["tools"][1]["input_schema"]) == ["a", "b", "type"]
    assert sent["tools"][0]["description"] == "A.\nSecond line."
    assert sent["system"] == "Be brief.\nReally."
    assert (await records.wait(2)).canonical_rules == ["stable_json", "whitespace"]


async def test_responses_are_placed_on_a_slot_and_messages_are_not(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """llama.cpp slot scheduling: a Responses request is pinned (``id_slot``); a Messages one
    is not, since llama-server's Messages route drops the field."""
    fake = await serve(SlotLlamaFake(Knobs(prefill_ms_per_token=0.2), slots=2), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)
    async with client.post("/v1/responses", json=responses_body("hi")) as resp:
        assert resp.status == 200
    assert fake.last_body is not None and isinstance(fake.last_body.get("id_slot"), int)
    rec = await records.wait(1)
    assert rec.schedule_reason.startswith("slot_")
    async with client.post("/v1/messages", json=messages_body("hi")) as resp:
        assert resp.status == 200
    assert fake.last_body is not None and "id_slot" not in fake.last_body
    rec = await records.wait(2)
    assert rec.cached_tokens is not None


async def test_vllm_messages_stream_keeps_its_done(
    vllm_fake: VllmFake, make_proxy: MakeProxy
) -> None:
    """vLLM ends its Messages stream with ``[DONE]`` after ``message_stop``: relayed as sent."""
    client, records, _ = await make_proxy(vllm_fake.url)
    async with client.post("/v1/messages", json=messages_body("hi", stream=True)) as resp:
        data = await resp.read()
    assert data.startswith(b"event: message_start\n")
    assert data.endswith(b'data: {"type":"message_stop"}\n\ndata: [DONE]\n\n')
    rec = await records.wait()
    assert rec.error is None and rec.completion_tokens == 5 and rec.ttfvt_ms is not None


async def test_vllm_tenant_salt_only_where_the_route_takes_it(
    vllm_fake: VllmFake, make_proxy: MakeProxy
) -> None:
    """A tenant's vLLM Responses request is salted; its Messages request (no such field on
    vLLM's Messages route) is not."""
    client, _, _ = await make_proxy(vllm_fake.url, api_keys=("key-a",))
    headers = {"Authorization": "Bearer key-a"}
    async with client.post("/v1/responses", json=responses_body("hi"), headers=headers) as r:
        assert r.status == 200
    assert vllm_fake.last_body is not None and len(vllm_fake.last_body["cache_salt"]) == 64
    async with client.post("/v1/messages", json=messages_body("hi"), headers=headers) as r:
        assert r.status == 200
    assert vllm_fake.last_body is not None and "cache_salt" not in vllm_fake.last_body


async def test_anthropic_key_header_authenticates_and_is_not_forwarded(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """With client keys, ``x-api-key`` (the Anthropic SDK's header) is accepted and removed;
    a wrong one is a 401 in Anthropic's shape."""
    client, _, _ = await make_proxy(llama_fake.url, api_keys=("key-a",))
    async with client.post(
        "/v1/messages", json=messages_body("hi"), headers={"x-api-key": "key-a"}
    ) as resp:
        assert resp.status == 200
    assert "x-api-key" not in llama_fake.last_headers
    async with client.post(
        "/v1/messages", json=messages_body("hi"), headers={"x-api-key": "wrong"}
    ) as resp:
        assert resp.status == 401
        got = await resp.json()
    assert got["type"] == "error" and got["error"]["type"] == "authentication_error"


async def test_stats_and_metrics_count_both_apis(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """/stats and the Prometheus counters read these routes' records as they read chat's."""
    client, records, app = await make_proxy(llama_fake.url)
    for q in ("one", "two"):
        async with client.post("/v1/responses", json=responses_body(q, stream=True)) as resp:
            await resp.read()
        async with client.post("/v1/messages", json=messages_body(q)) as resp:
            await resp.read()
    recs = [await records.wait(i) for i in range(1, 5)]
    await app[STATE].writer.drain()
    totals = (await build_stats(app[STATE], parse_query({}), now=time.time()))["totals"]
    assert totals["requests"] == 4
    assert totals["prompt_tokens"] == sum(r.prompt_tokens or 0 for r in recs)
    assert totals["cached_tokens"] == sum(r.cached_tokens or 0 for r in recs) > 0
    assert totals["cached_reported_requests"] == 4
    text = generate_latest(app[METRICS].registry).decode()
    counted = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prefixgate_cached_tokens_total{")
    ]
    assert sum(counted) == sum(r.cached_tokens or 0 for r in recs)


async def test_responses_alias_is_observed_too(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """``/responses`` (llama-server's alias) is the same inference route, forwarded as sent."""
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/responses", json=responses_body("hi", stream=True)) as resp:
        assert resp.status == 200
        await resp.read()
    rec = await records.wait()
    assert rec.route == "/responses" and rec.prompt_tokens == 43 and rec.ttfvt_ms is not None
