"""examples/: each script runs against a live proxy (in front of a fake llama-server) and shows
what its docstring promises.

The fake models a prompt cache (cached tokens = the longest prefix, in words, shared with an
earlier prompt), so the cache figures the examples print are real figures the proxy relayed.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from example_runner import EXAMPLES, LiveProxy, StartProxy, run_python_example, run_subprocess

USAGE = re.compile(r"\[prompt_tokens=(\d+) cached_tokens=(\d+|None)\]")
REPLY = "Hello there, friend!"  # the fake's answer


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
    """agent_loop.py: with the canonicalizer the timestamped system prompt is served from cache
    turn after turn; with --no-canonicalize almost nothing is."""
    on = await agent_calls(await start_proxy(), turns=3)
    off = await agent_calls(await start_proxy(canonicalize=False), turns=3)
    assert len(on) == len(off) == 3
    assert hit_rate_after_first(on) > 0.6
    assert hit_rate_after_first(off) < 0.1


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
    # The model saw every value: the relocated timestamp is in the newest user message.
    sent = live_proxy.fake.requests[-1]["messages"]
    assert "[[datetime_1]]" in sent[0]["content"]
    assert re.search(r"\[\[datetime_1\]\] = \d{4}-\d\d-\d\dT", sent[-1]["content"])


async def test_curl_script(live_proxy: LiveProxy) -> None:
    """curl.sh: health, readiness, models, a chat completion with the proxy's headers, a stream."""
    curl = shutil.which("curl")
    assert curl, "curl is required (.ci/run installs it)"
    env = {"PATH": os.environ["PATH"], "OPENAI_BASE_URL": live_proxy.base_url}
    run = await run_subprocess("bash", str(EXAMPLES / "curl.sh"), env=env)
    assert run.code == 0, run.out
    out = run.out.lower()
    assert '{"status": "ok"}' in out and '"status": "ready"' in out
    assert '"object": "list"' in out
    assert "x-request-id: curl-example-1" in out
    assert '"choices"' in out and "hello there, friend!" in out
    assert "data: [done]" in out and '"usage"' in out
