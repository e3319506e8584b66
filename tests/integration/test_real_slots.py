"""Slot scheduling against a real llama-server (SmolLM2, four slots): a fan-out burst, timed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from fakes import RecordLog

from proxy.app import build_app
from proxy.config import resolve
from proxy.log import get_logger
from proxy.record_writer import RecordWriter
from tests.integration.llama import running_llama_server

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

QUESTIONS = (
    "What is the return window for category 3?",
    "Are exchanges free for category 7?",
    "How long do I have to return category 12 items?",
    "Do I need a receipt for category 20?",
)


def system_prompt(tag: str) -> str:
    """A new ~1,200-token system prompt (``tag`` makes it new)."""
    policies = " ".join(
        f"Policy {i}: items in category {i} may be returned within {10 + i} days with a "
        f"receipt, and exchanges for category {i} are free of charge at every store."
        for i in range(1, 32)
    )
    return f"[{tag}] You are the support assistant of Northwind Outfitters. {policies}"


@pytest.fixture(scope="module")
def four_slots() -> Iterator[str]:
    """A llama-server with four slots of 2,048 tokens each."""
    with running_llama_server(slots=4, ctx=8192) as url:
        yield url


async def ask(session: aiohttp.ClientSession, url: str, system: str, question: str) -> int:
    """One chat request; returns the prompt tokens the server processed for it."""
    body: dict[str, Any] = {
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    processed: int = answer["timings"]["prompt_n"]
    return processed


async def burst(session: aiohttp.ClientSession, url: str, tag: str) -> tuple[float, list[int]]:
    """Four concurrent requests sharing a new system prompt: wall seconds, tokens processed."""
    system = system_prompt(tag)
    t0 = time.perf_counter()
    processed = await asyncio.gather(*(ask(session, url, system, q) for q in QUESTIONS))
    return time.perf_counter() - t0, list(processed)


async def test_fan_out_burst_is_prefilled_once_and_finishes_sooner(four_slots: str) -> None:
    """Through prefixgate the burst prefills the prompt once and ends sooner than direct."""
    writer = RecordWriter(logger=get_logger("test.records"))
    records = RecordLog.of(writer)
    settings = resolve({"backend": [four_slots]}, environ={})
    server = TestServer(build_app(settings, writer=writer))
    await server.start_server()
    proxy_url = str(server.make_url("")).rstrip("/")
    timeout = aiohttp.ClientTimeout(total=600)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # The proxy measures the server's speeds from a first, unrelated request.
            await ask(session, proxy_url, "You answer briefly. " * 40, "Hello?")
            # Through the proxy first: direct traffic would make it step back (slot_foreign).
            proxied_s, proxied = await burst(session, proxy_url, "through-proxy")
            direct_s, direct = await burst(session, four_slots, "direct")
    finally:
        await server.close()
    await writer.drain()
    reasons = sorted(str(r.schedule_reason) for r in records[-4:])
    assert reasons == ["slot_place", "slot_queue", "slot_queue", "slot_queue"], reasons
    one = max(proxied)  # the request that prefilled the prompt for the others
    assert sum(proxied) <= 1.5 * one, proxied
    # Direct, the server prefills the prompt once per request that reaches it before an
    # earlier one has finished: all four on most machines, fewer when its HTTP threads hand
    # some requests over late. The time saved scales with the prefills the proxy spared it.
    prefills_direct = sum(direct) / one
    expected = 0.6 * min(prefills_direct, len(QUESTIONS))
    assert direct_s / proxied_s >= expected, (direct_s, proxied_s, direct)
