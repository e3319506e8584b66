"""prefixgate in front of a real llama-server (SmolLM2), driven by the official OpenAI SDK."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from openai import AsyncOpenAI

from tests.integration.conftest import RunningProxy

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]

SYSTEM = (
    "You are the support assistant of Northwind Outfitters, a shop for hiking gear. "
    + " ".join(
        f"Policy {i}: items in category {i} may be returned within {10 + i} days with a "
        f"receipt, and exchanges for category {i} are free of charge at every store."
        for i in range(1, 25)
    )
)


@pytest.fixture
async def oai(real_proxy: RunningProxy) -> AsyncIterator[AsyncOpenAI]:
    """The official OpenAI SDK pointed at the proxy."""
    async with AsyncOpenAI(
        base_url=real_proxy.url + "v1", api_key="unused", max_retries=0
    ) as client:
        yield client


async def test_sdk_non_streaming_through_proxy(real_proxy: RunningProxy, oai: AsyncOpenAI) -> None:
    """A plain SDK chat call works through the proxy and is recorded with reported cache use."""
    resp = await oai.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert resp.choices[0].message.content
    assert resp.usage is not None and resp.usage.prompt_tokens > 0
    await real_proxy.writer.drain()
    rec = real_proxy.records[-1]
    assert rec.status == 200 and rec.error is None and not rec.stream
    assert rec.prompt_tokens == resp.usage.prompt_tokens
    assert rec.cached_tokens_source == "reported" and rec.cached_tokens is not None
    assert rec.completion_tokens == resp.usage.completion_tokens
    assert rec.backend_prefill_ms is not None and rec.ttft_ms is not None


async def test_sdk_streaming_without_usage_sees_no_usage_chunk(
    real_proxy: RunningProxy, oai: AsyncOpenAI
) -> None:
    """A streaming SDK client that did not ask for usage gets none, yet the record has it."""
    stream = await oai.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    chunks = [c async for c in stream]
    assert chunks and all(c.choices for c in chunks)
    assert all(getattr(c, "usage", None) is None for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text
    await real_proxy.writer.drain()
    rec = real_proxy.records[-1]
    assert rec.stream and rec.status == 200
    assert rec.prompt_tokens and rec.completion_tokens
    assert rec.ttft_ms is not None and rec.ttfvt_ms is not None and rec.e2e_ms >= rec.ttft_ms
    assert rec.timing_source == "observed"


async def test_sdk_streaming_with_usage_gets_cached_tokens(
    real_proxy: RunningProxy, oai: AsyncOpenAI
) -> None:
    """A client that asks for usage receives the usage chunk with cached token details."""
    stream = await oai.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    assert usage[0].prompt_tokens_details is not None
    assert usage[0].prompt_tokens_details.cached_tokens is not None


async def test_shared_system_prompt_second_request_hits_cache(
    real_proxy: RunningProxy, oai: AsyncOpenAI
) -> None:
    """The second of two requests sharing a long system prompt is served mostly from cache."""
    for question in ("Can I return boots?", "Are exchanges free?"):
        stream = await oai.chat.completions.create(
            model="smollm2",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        async for _ in stream:
            pass
    await real_proxy.writer.drain()
    cold, warm = real_proxy.records[-2], real_proxy.records[-1]
    print(
        f"\ncold: prompt={cold.prompt_tokens} cached={cold.cached_tokens} ttft={cold.ttft_ms} ms"
        f"\nwarm: prompt={warm.prompt_tokens} cached={warm.cached_tokens} ttft={warm.ttft_ms} ms"
        f" predicted={warm.predicted_cached_tokens} saved={warm.saved_prefill_ms} ms"
    )
    assert cold.prompt_tokens is not None and cold.prompt_tokens > 400
    assert warm.cached_tokens is not None and warm.cached_tokens > 0.8 * cold.prompt_tokens
    assert cold.ttft_ms is not None and warm.ttft_ms is not None
    assert warm.ttft_ms < 0.5 * cold.ttft_ms
    assert warm.predicted_cached_tokens is not None and warm.predicted_cached_tokens > 0
    assert warm.saved_prefill_ms is not None and warm.saved_prefill_ms > 0


async def test_passthrough_reaches_real_backend(real_proxy: RunningProxy) -> None:
    """Non-inference paths (/health, /props, /v1/models) pass through to llama-server."""
    import aiohttp

    async with aiohttp.ClientSession() as s:
        for path in ("health", "props", "v1/models"):
            async with s.get(real_proxy.url + path) as resp:
                assert resp.status == 200, path
                assert isinstance(await resp.json(), dict)


async def test_multi_turn_predicted_and_measured_hit_rates_agree(
    real_proxy: RunningProxy, oai: AsyncOpenAI
) -> None:
    """Over a multi-turn conversation the index's predicted hit rate tracks the measured one."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM[:1500]}]
    questions = [
        "Hi there.",
        "What is policy 3?",
        "And policy 4?",
        "Thanks. Policy 7?",
        "What about receipts?",
        "Bye.",
    ]
    first = len(real_proxy.records)
    for q in questions:
        messages.append({"role": "user", "content": q})
        resp = await oai.chat.completions.create(
            model="smollm2",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=12,
            temperature=0,
        )
        messages.append({"role": "assistant", "content": resp.choices[0].message.content or ""})
    await real_proxy.writer.drain()
    turns = real_proxy.records[first:]
    assert len(turns) == len(questions)
    diffs = []
    for rec in turns[1:]:  # the first turn is cold for both
        assert rec.prompt_tokens and rec.cached_tokens is not None
        assert rec.predicted_cached_tokens is not None
        measured = rec.cached_tokens / rec.prompt_tokens
        predicted = rec.predicted_cached_tokens / rec.prompt_tokens
        diffs.append(abs(measured - predicted))
        print(
            f"\nturn prompt={rec.prompt_tokens} measured={measured:.3f} predicted={predicted:.3f}"
        )
    mae = sum(diffs) / len(diffs)
    print(f"\nmean absolute difference predicted vs measured hit rate: {mae:.3f}")
    assert mae < 0.15
