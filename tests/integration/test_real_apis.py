"""The Responses API (official ``openai`` SDK) and the Anthropic Messages API (official
``anthropic`` SDK) through prefixgate, in front of a real llama-server (SmolLM2)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest
from openai import AsyncOpenAI

from tests.integration.conftest import RunningProxy

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

# About 250 tokens: long enough that a second turn's reuse is a clear share, short enough for
# SmolLM2's ~150 tokens/s prefill on this machine.
SYSTEM = "You are the support assistant of Northwind Outfitters, a shop for hiking gear. " + (
    " ".join(
        f"Policy {i}: items in category {i} may be returned within {10 + i} days with a receipt."
        for i in range(1, 13)
    )
)


@pytest.fixture
async def oai(real_proxy: RunningProxy) -> AsyncIterator[AsyncOpenAI]:
    """The official OpenAI SDK pointed at the proxy."""
    async with AsyncOpenAI(
        base_url=real_proxy.url + "v1", api_key="unused", max_retries=0
    ) as client:
        yield client


@pytest.fixture
async def claude(real_proxy: RunningProxy) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """The official Anthropic SDK pointed at the proxy."""
    async with anthropic.AsyncAnthropic(
        base_url=real_proxy.url.rstrip("/"), api_key="unused", max_retries=0
    ) as client:
        yield client


async def last_record(proxy: RunningProxy, route: str) -> Any:
    await proxy.writer.drain()
    rec = proxy.records[-1]
    assert rec.route == route
    return rec


async def test_responses_sdk_non_streaming(real_proxy: RunningProxy, oai: AsyncOpenAI) -> None:
    """``responses.create``: the answer arrives and the record carries the API's usage."""
    resp = await oai.responses.create(
        model="smollm2", instructions="Be brief.", input="Say hello.", max_output_tokens=8
    )
    assert resp.output_text
    assert resp.usage is not None
    rec = await last_record(real_proxy, "/v1/responses")
    assert rec.status == 200 and rec.error is None and not rec.stream
    assert rec.prompt_tokens == resp.usage.input_tokens
    assert rec.cached_tokens == resp.usage.input_tokens_details.cached_tokens
    assert rec.cached_tokens_source == "reported"
    assert rec.completion_tokens == resp.usage.output_tokens


async def test_responses_sdk_streaming(real_proxy: RunningProxy, oai: AsyncOpenAI) -> None:
    """``responses.create(stream=True)``: text deltas and ``response.completed`` reach the SDK;
    the record has TTFT, time to first visible token, TPOT and usage."""
    stream = await oai.responses.create(
        model="smollm2", input="Count to five.", max_output_tokens=12, stream=True
    )
    events = [e async for e in stream]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    completed = [e for e in events if e.type == "response.completed"]
    assert text and len(completed) == 1
    usage = completed[0].response.usage
    assert usage is not None
    rec = await last_record(real_proxy, "/v1/responses")
    assert rec.stream and rec.status == 200 and rec.error is None
    assert (rec.prompt_tokens, rec.completion_tokens) == (usage.input_tokens, usage.output_tokens)
    assert rec.cached_tokens == usage.input_tokens_details.cached_tokens
    assert rec.ttft_ms is not None and rec.ttfvt_ms is not None and rec.tpot_ms is not None
    assert rec.timing_source == "observed" and rec.backend_prefill_ms is not None


async def test_responses_second_turn_reuses_the_first(
    real_proxy: RunningProxy, oai: AsyncOpenAI
) -> None:
    """A conversation's second turn (first turn's input and output, then a new question) is
    served mostly from cache, and the index predicted it."""
    first_input: list[Any] = [{"role": "user", "content": "Can I return boots?"}]
    instructions = "Channel: web chat. " + SYSTEM  # a prefix no other test has sent
    first = await oai.responses.create(
        model="smollm2", instructions=instructions, input=first_input, max_output_tokens=8
    )
    cold = await last_record(real_proxy, "/v1/responses")
    turn2 = [
        *first_input,
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"role": "user", "content": "And exchanges?"},
    ]
    await oai.responses.create(
        model="smollm2", instructions=instructions, input=turn2, max_output_tokens=4
    )
    warm = await last_record(real_proxy, "/v1/responses")
    print(
        f"\nresponses cold: prompt={cold.prompt_tokens} cached={cold.cached_tokens}"
        f"\nresponses warm: prompt={warm.prompt_tokens} cached={warm.cached_tokens}"
        f" predicted={warm.predicted_cached_tokens}"
    )
    assert cold.prompt_tokens is not None and cold.prompt_tokens > 200
    assert cold.cached_tokens is not None and cold.cached_tokens < 0.2 * cold.prompt_tokens
    assert warm.cached_tokens is not None and warm.cached_tokens > 0.8 * cold.prompt_tokens
    assert warm.predicted_cached_tokens is not None and warm.predicted_cached_tokens > 0


async def test_messages_sdk_non_streaming(
    real_proxy: RunningProxy, claude: anthropic.AsyncAnthropic
) -> None:
    """``messages.create``: the record's prompt is the whole prompt (input + cache read)."""
    msg = await claude.messages.create(
        model="smollm2",
        max_tokens=8,
        system="Be brief.",
        messages=[{"role": "user", "content": "Say hello."}],
    )
    assert msg.content and msg.content[0].type == "text"
    rec = await last_record(real_proxy, "/v1/messages")
    assert rec.status == 200 and rec.error is None
    read = msg.usage.cache_read_input_tokens
    assert read is not None
    assert rec.prompt_tokens == msg.usage.input_tokens + read
    assert rec.cached_tokens == read and rec.cached_tokens_source == "reported"
    assert rec.completion_tokens == msg.usage.output_tokens


async def test_messages_sdk_stream_second_turn_hits_cache(
    real_proxy: RunningProxy, claude: anthropic.AsyncAnthropic
) -> None:
    """``messages.stream`` over two turns: the second reads the first turn's prefix from cache,
    and its record has the stream's timings and the backend's cached tokens."""
    system_text = "Channel: phone support. " + SYSTEM  # a prefix no other test has sent
    system: list[Any] = [
        {"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}}
    ]
    messages: list[Any] = [{"role": "user", "content": "Can I return boots?"}]
    async with claude.messages.stream(
        model="smollm2", max_tokens=8, system=system, messages=messages
    ) as stream:
        first = await stream.get_final_message()
    cold = await last_record(real_proxy, "/v1/messages")
    reply = "".join(b.text for b in first.content if b.type == "text")
    messages += [
        {"role": "assistant", "content": reply or "Yes."},
        {"role": "user", "content": "And exchanges?"},
    ]
    async with claude.messages.stream(
        model="smollm2", max_tokens=4, system=system, messages=messages
    ) as stream:
        text = await stream.get_final_text()
        final = await stream.get_final_message()
    assert isinstance(text, str)
    warm = await last_record(real_proxy, "/v1/messages")
    print(
        f"\nmessages cold: prompt={cold.prompt_tokens} cached={cold.cached_tokens}"
        f"\nmessages warm: prompt={warm.prompt_tokens} cached={warm.cached_tokens}"
        f" predicted={warm.predicted_cached_tokens}"
        f"\nmessages ttft cold={cold.ttft_ms} ms warm={warm.ttft_ms} ms"
    )
    assert warm.stream and warm.error is None
    assert warm.cached_tokens == final.usage.cache_read_input_tokens
    assert cold.prompt_tokens is not None and cold.prompt_tokens > 200
    assert cold.cached_tokens is not None and cold.cached_tokens < 0.2 * cold.prompt_tokens
    assert warm.cached_tokens is not None and warm.cached_tokens > 0.8 * cold.prompt_tokens
    assert warm.predicted_cached_tokens is not None and warm.predicted_cached_tokens > 0
    assert warm.ttft_ms is not None and warm.tpot_ms is not None


async def test_messages_sdk_sees_anthropic_errors(
    real_proxy: RunningProxy, claude: anthropic.AsyncAnthropic
) -> None:
    """A body the proxy cannot read: the SDK raises its own BadRequestError, Anthropic-shaped."""
    with pytest.raises(anthropic.BadRequestError) as info:
        await claude.messages.create(
            model="smollm2",
            max_tokens=4,
            messages=[{"role": "user", "content": 42}],  # type: ignore[typeddict-item]
        )
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content" in body["error"]["message"]
