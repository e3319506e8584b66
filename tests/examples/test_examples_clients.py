"""examples/: each script runs against a live proxy (in front of a fake llama-server) and shows
what its docstring promises.

The fake models a prompt cache (cached tokens = the longest prefix, in words, shared with an
earlier prompt), so the cache figures the examples print are real figures the proxy relayed. For
the agent loop it can also call a tool once per user turn (``Knobs.tool_calls``), so the example's
tool round runs too.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
from typing import Any

import pytest
from example_runner import EXAMPLES, LiveProxy, StartProxy, run_python_example, run_subprocess
from fakes import Knobs, ToolCall
from openai import OpenAI

USAGE = re.compile(r"\[prompt_tokens=(\d+) cached_tokens=(\d+|None)\]")
REPLY = "Hello there, friend!"  # the fake's answer
EVENTS_ARGS = {"person": "Ines", "date": "2025-06-02"}


def calls_a_tool() -> Knobs:
    """A model that looks up a calendar once per user turn, then answers."""
    return Knobs(tool_calls=[ToolCall("list_events", json.dumps(EVENTS_ARGS))])


async def test_sdk_streams_and_second_request_hits_cache(
    live_proxy: LiveProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """openai_sdk.py (base URL from OPENAI_BASE_URL) streams two answers; the second request's
    shared system prompt comes from cache."""
    monkeypatch.setenv("OPENAI_BASE_URL", live_proxy.base_url)
    run = await run_python_example("openai_sdk.py")
    assert run.code == 0, run.out
    assert run.out.count(REPLY) == 2
    (_, c1), (p2, c2) = [(int(p), int(c)) for p, c in USAGE.findall(run.out)]
    assert c1 == 0
    assert c2 >= 0.8 * p2, run.out


async def test_async_sdk_runs_requests_concurrently(live_proxy: LiveProxy) -> None:
    """openai_sdk_async.py warms the cache, then streams several requests at once, all hits."""
    run = await run_python_example(
        "openai_sdk_async.py", "--base-url", live_proxy.base_url, "--concurrency", "3"
    )
    assert run.code == 0, run.out
    warm = [line for line in run.out.splitlines() if line.startswith("warm-up:")]
    parallel = [line for line in run.out.splitlines() if line.startswith("parallel:")]
    assert len(warm) == 1 and len(parallel) == 3
    for line in parallel:
        m = re.search(r"ttft +[\d.]+ ms +prompt_tokens=(\d+) cached_tokens=(\d+)", line)
        assert m, line
        assert int(m.group(2)) >= 0.8 * int(m.group(1)), line
    assert len(live_proxy.fake.requests) == 4
    assert all(r["stream"] is True for r in live_proxy.fake.requests)


async def agent_calls(proxy: LiveProxy, turns: int) -> list[dict[str, object]]:
    run = await run_python_example(
        "agent_loop.py", "--base-url", proxy.base_url, "--turns", str(turns), "--json"
    )
    assert run.code == 0, run.out
    return [json.loads(line) for line in run.out.splitlines()]


def hit_rate_after_first(calls: list[dict[str, object]]) -> float:
    later = calls[1:]
    prompt = sum(int(str(c["prompt_tokens"])) for c in later)
    cached = sum(int(str(c["cached_tokens"])) for c in later)
    return cached / prompt


async def test_agent_loop_shows_the_canonicalizer_effect(start_proxy: StartProxy) -> None:
    """agent_loop.py with a model that calls a tool each turn: the example runs the call and
    sends its result back, then gets the answer. With the canonicalizer the timestamped system
    prompt is byte-identical and served from cache call after call, and every call reports the
    rule that moved the timestamp; with --no-canonicalize almost nothing is cached, no rule fires.
    """
    on_proxy = await start_proxy(calls_a_tool())
    off_proxy = await start_proxy(calls_a_tool(), canonicalize=False)
    on = await agent_calls(on_proxy, turns=3)
    off = await agent_calls(off_proxy, turns=3)
    for calls, proxy in ((on, on_proxy), (off, off_proxy)):
        # Each user turn: a call answered with a tool call, then one answered with text.
        assert [c["turn"] for c in calls] == [1, 1, 2, 2, 3, 3]
        assert [c["tool_calls"] for c in calls] == [1, 0] * 3
        sent = proxy.fake.requests
        assert len(sent) == 6
        ids = []
        for answered in sent[1::2]:
            call, result = answered["messages"][-2:]
            assert (call["role"], result["role"]) == ("assistant", "tool")
            (made,) = call["tool_calls"]
            assert made["function"]["name"] == "list_events"
            assert json.loads(made["function"]["arguments"]) == EVENTS_ARGS
            assert result["tool_call_id"] == made["id"]
            # The example's list_events, with the canonicalizer's note after it (last_suffix).
            assert json.loads(result["content"].split("\n\n[[")[0])["events"], result
            ids.append(made["id"])
        assert len(set(ids)) == 3
    on_system = {r["messages"][0]["content"] for r in on_proxy.fake.requests}
    off_system = {r["messages"][0]["content"] for r in off_proxy.fake.requests}
    assert len(on_system) == 1 and "[[datetime_1]]" in on_system.pop()
    assert len(off_system) == 6
    assert all("volatile_timestamps" in str(c["canonical_rules"]).split(",") for c in on), on
    assert all(c["canonical_rules"] == "" for c in off), off
    assert hit_rate_after_first(on) > 0.6
    assert hit_rate_after_first(off) < 0.1


def stream_tool_calls(base_url: str) -> tuple[list[dict[str, Any]], list[str]]:
    """One streamed chat request offering a tool: the tool calls joined from the deltas (by
    index, as a client does) and the finish reasons seen."""
    tools: Any = [
        {"type": "function", "function": {"name": "list_events", "parameters": {"type": "object"}}}
    ]
    joined: dict[int, dict[str, Any]] = {}
    finishes: list[str] = []
    with OpenAI(base_url=base_url, api_key="unused") as client:
        stream = client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "What is on Ines's calendar?"}],
            tools=tools,
            stream=True,
        )
        for chunk in stream:
            for choice in chunk.choices:
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
                for d in choice.delta.tool_calls or []:
                    call = joined.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = d.id or call["id"]
                    if d.function:
                        call["name"] += d.function.name or ""
                        call["arguments"] += d.function.arguments or ""
    return [joined[i] for i in sorted(joined)], finishes


async def test_streamed_tool_calls_reach_the_client(start_proxy: StartProxy) -> None:
    """The fake streams tool calls as llama-server does (id, type and name first, then the
    arguments in pieces, finish_reason "tool_calls"); through the proxy the SDK joins them into
    the call the model made."""
    proxy = await start_proxy(calls_a_tool())
    calls, finishes = await asyncio.to_thread(stream_tool_calls, proxy.base_url)
    assert finishes == ["tool_calls"]
    (call,) = calls
    assert call["name"] == "list_events" and call["id"]
    assert json.loads(call["arguments"]) == EVENTS_ARGS
    assert proxy.fake.requests[0]["stream"] is True


async def test_agent_loop_prints_a_table(live_proxy: LiveProxy) -> None:
    """Without --json the agent loop prints one row per call and the overall hit rate."""
    run = await run_python_example(
        "agent_loop.py", "--base-url", live_proxy.base_url, "--turns", "2"
    )
    assert run.code == 0, run.out
    lines = run.out.splitlines()
    assert lines[0].split()[:4] == ["turn", "prompt", "cached", "hit"]
    assert re.match(r"\s+1\s+\d+\s+0\s+0\.0%", lines[1]), lines[1]
    assert re.match(r"\s+2\s+\d+\s+\d+\s+\d+\.\d%", lines[2]), lines[2]
    assert lines[-1].startswith("after the first call:")
    # The last column: the canonicalizer rules that fired (X-Prefixgate-Canonical).
    assert all("volatile_timestamps" in line.split()[-1].split(",") for line in lines[1:3]), lines
    # The model saw every value: the relocated timestamp is in the newest user message.
    sent = live_proxy.fake.requests[-1]["messages"]
    assert "[[datetime_1]]" in sent[0]["content"]
    assert re.search(r"\[\[datetime_1\]\] = \d{4}-\d\d-\d\dT", sent[-1]["content"])


async def test_curl_script(live_proxy: LiveProxy) -> None:
    """curl.sh: health, readiness, models, a chat completion with the proxy's headers, a stream."""
    curl = shutil.which("curl")
    assert curl, "curl is required (.ci/run installs it)"
    env = {
        "PATH": os.environ["PATH"],
        "OPENAI_BASE_URL": live_proxy.base_url,
        "PREFIXGATE_ADMIN_URL": live_proxy.admin_url,
    }
    run = await run_subprocess("bash", str(EXAMPLES / "curl.sh"), env=env)
    assert run.code == 0, run.out
    out = run.out.lower()
    assert '{"status": "ok"}' in out and '"status": "ready"' in out
    assert '"object": "list"' in out
    assert "x-request-id: curl-example-1" in out
    assert '"choices"' in out and "hello there, friend!" in out
    assert "data: [done]" in out and '"usage"' in out
