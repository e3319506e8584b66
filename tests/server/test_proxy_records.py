"""The per-request record: token counts, cache source, latencies and the SLO verdict."""

from __future__ import annotations

from typing import Any

import pytest
from fakes import FakeBackend, LlamaFake, MakeProxy, VllmFake, serve

from proxy.records import Slo

# A shared system prompt of 40 words: with "system" and "user", 42 tokens before the question.
SYSTEM = " ".join(f"rule{i}" for i in range(40))


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        **extra,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }


async def test_llama_counts_and_cache_hit(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """llama.cpp: prompt, cached and completion tokens come from usage; the hit is reported."""
    client, records, _ = await make_proxy(llama_fake.url)
    for q in ("what is one plus one", "what is two plus two"):
        async with client.post("/v1/chat/completions", json=chat(q)) as resp:
            assert resp.status == 200
            body = await resp.json()
    first, second = await records.wait(1), await records.wait(2)
    assert (first.prompt_tokens, first.cached_tokens, first.completion_tokens) == (47, 0, 5)
    assert (second.prompt_tokens, second.cached_tokens) == (
        47,
        44,
    )  # "system rule0 … rule39 user what is"
    assert second.cached_tokens_source == "reported"
    assert second.backend_prefill_ms == body["timings"]["prompt_ms"]
    assert second.dialect == "llamacpp"
    assert second.timing_source == "backend"
    assert second.ttft_ms is not None and second.ttft_ms <= second.e2e_ms


async def test_llama_stream_record(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """A streamed llama.cpp answer's record reads usage and timings the client never saw."""
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json=chat("hi", stream=True)) as resp:
        await resp.read()
    rec = await records.wait()
    assert rec.stream is True
    assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (43, 0, 5)
    assert rec.backend_prefill_ms == pytest.approx(43 * llama_fake.knobs.prefill_ms_per_token)
    assert rec.timing_source == "observed"
    assert rec.error is None and rec.status == 200


async def test_vllm_without_details_is_unknown(vllm_fake: VllmFake, make_proxy: MakeProxy) -> None:
    """vLLM without prompt_tokens_details: cached tokens are unknown (null), never 0."""
    client, records, _ = await make_proxy(vllm_fake.url)
    async with client.post("/v1/chat/completions", json=chat("hi", stream=True)) as resp:
        await resp.read()
    async with client.post("/v1/chat/completions", json=chat("hi")) as resp:
        await resp.read()
    for rec in (await records.wait(1), await records.wait(2)):
        assert rec.cached_tokens is None
        assert rec.cached_tokens_source == "unknown"
        assert rec.prompt_tokens == 43
        assert rec.as_dict()["cached_tokens"] is None


async def test_vllm_with_details_is_reported(vllm_fake: VllmFake, make_proxy: MakeProxy) -> None:
    """vLLM with prompt_tokens_details: the cached count is recorded as reported."""
    vllm_fake.prompt_tokens_details = True
    client, records, _ = await make_proxy(vllm_fake.url)
    for q in ("one", "two"):
        async with client.post("/v1/chat/completions", json=chat(q, stream=True)) as resp:
            await resp.read()
    first, second = await records.wait(1), await records.wait(2)
    assert (first.cached_tokens, first.cached_tokens_source) == (0, "reported")
    assert (second.cached_tokens, second.cached_tokens_source) == (32, "reported")
    assert second.dialect == "vllm"


@pytest.mark.parametrize("kind", [LlamaFake, VllmFake])
async def test_reasoning_first_stream_latencies(
    kind: type[FakeBackend], aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """Reasoning tokens count for TTFT, not for the first visible token; TPOT ≈ token spacing."""
    fake = await serve(kind(), aiohttp_server)
    fake.knobs.reasoning = ["Thinking", " hard"]
    fake.knobs.tokens = ["A", "B", "C"]
    fake.knobs.token_delay_s = 0.04
    client, records, _ = await make_proxy(fake.url)
    async with client.post("/v1/chat/completions", json=chat("q", stream=True)) as resp:
        await resp.read()
    rec = await records.wait()
    assert rec.ttft_ms is not None and rec.ttfvt_ms is not None and rec.tpot_ms is not None
    assert rec.ttft_ms <= rec.ttfvt_ms
    assert rec.ttfvt_ms - rec.ttft_ms == pytest.approx(80, abs=35)  # two reasoning gaps
    assert rec.tpot_ms == pytest.approx(40, abs=15)
    assert rec.completion_tokens == 5
    assert rec.e2e_ms >= rec.ttfvt_ms


async def test_native_completion_stream_record(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Native /completion: counts from the stop:true event, cache hits from its timings."""
    client, records, _ = await make_proxy(llama_fake.url)
    body = {"prompt": "a b c d e f g h", "stream": True}
    for _ in range(2):
        async with client.post("/completion", json=body) as resp:
            raw = await resp.read()
    assert b"[DONE]" not in raw
    assert llama_fake.last_body is not None and "stream_options" not in llama_fake.last_body
    rec = await records.wait(2)
    assert (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens) == (8, 7, 5)
    assert rec.route == "/completion"
    assert rec.ttft_ms is not None


@pytest.mark.parametrize(
    "slo,met", [(Slo(ttft_ms=5000, tpot_ms=5000), True), (Slo(ttft_ms=0.001), False), (Slo(), None)]
)
async def test_slo_verdict(
    llama_fake: LlamaFake, make_proxy: MakeProxy, slo: Slo, met: bool | None
) -> None:
    """slo_met is true within the objectives, false beyond them, null with none configured."""
    client, records, _ = await make_proxy(llama_fake.url, slo=slo)
    async with client.post("/v1/chat/completions", json=chat("q", stream=True)) as resp:
        await resp.read()
    assert (await records.wait()).slo_met is met


async def test_failed_request_misses_slo(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """An upstream error is recorded with its status and never meets the SLO."""
    llama_fake.knobs.reject_status = 400
    client, records, _ = await make_proxy(llama_fake.url, slo=Slo(ttft_ms=5000))
    async with client.post("/v1/chat/completions", json=chat("q")) as resp:
        assert resp.status == 400
    rec = await records.wait()
    assert (rec.status, rec.error, rec.slo_met) == (400, "upstream_error", False)
