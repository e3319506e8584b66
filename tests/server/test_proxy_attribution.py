"""Through the proxy: a clock in the system prompt is a breaker while the canonicalizer only
watches (dry-run), and with it on what is left uncached is new."""

from __future__ import annotations

from typing import Any

from fakes import LlamaFake, MakeProxy

from proxy.records import RequestRecord

INSTRUCTIONS = " ".join(f"Rule {i}: answer the customer politely and briefly." for i in range(40))
QUESTIONS = ("Where is my parcel?", "Can I change my address?", "Why was I charged twice?")


def body(turn: int) -> dict[str, Any]:
    clock = f"2026-12-02T01:0{turn}:1{turn}Z"
    return {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": f"Current time: {clock}. {INSTRUCTIONS}"},
            {"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)] + f" (ticket {turn})"},
        ],
    }


def parts(record: RequestRecord) -> dict[str, int | None]:
    return {
        "new": record.miss_new_tokens,
        "breaker": record.miss_breaker_tokens,
        "routing": record.miss_routing_tokens,
        "evicted": record.miss_evicted_tokens,
        "unexplained": record.miss_unexplained_tokens,
    }


async def send_three(llama_fake: LlamaFake, make_proxy: MakeProxy, **settings: Any) -> list[Any]:
    client, records, _ = await make_proxy(llama_fake.url, **settings)
    for turn in range(3):
        async with client.post("/v1/chat/completions", json=body(turn)) as resp:
            assert resp.status == 200
            await resp.read()
    return [await records.wait(n) for n in (1, 2, 3)]


async def test_a_clock_is_a_breaker_with_the_canonicalizer_in_dry_run(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """The clock breaks the prefix at its first words: after the first request, most of the
    uncached tokens are the breaker, named ``volatile_timestamps``; the parts add up."""
    recs = await send_three(llama_fake, make_proxy, canonical_dry_run=True)
    for rec in recs:
        p = parts(rec)
        assert rec.prompt_tokens is not None and rec.cached_tokens is not None
        assert sum(v or 0 for v in p.values()) == rec.prompt_tokens - rec.cached_tokens
    assert recs[0].miss_breaker_tokens == 0  # nothing earlier to share anything with
    for rec in recs[1:]:
        assert rec.miss_breaker_rules == ["volatile_timestamps"]
        uncached = rec.prompt_tokens - rec.cached_tokens  # type: ignore[operator]
        assert rec.miss_breaker_tokens is not None and rec.miss_breaker_tokens > uncached / 2
        assert rec.miss_unexplained_tokens == 0


async def test_with_the_canonicalizer_on_what_is_left_is_new(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """The clock moves into the note: the system prompt is served from cache, and the uncached
    rest (the question and the note) is new; no breaker."""
    recs = await send_three(llama_fake, make_proxy)
    for rec in recs[1:]:
        assert rec.canonical_rules == ["volatile_timestamps"]
        p = parts(rec)
        assert rec.prompt_tokens is not None and rec.cached_tokens is not None
        assert sum(v or 0 for v in p.values()) == rec.prompt_tokens - rec.cached_tokens
        assert p["breaker"] == 0 and p["new"] == max(p.values())
        assert rec.miss_unexplained_tokens == 0
