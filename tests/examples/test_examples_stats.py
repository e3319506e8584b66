"""examples/stats.py reads GET /stats (schema prefixgate.stats/v1) and prints the fleet's figures.

Statistics are recorded after each response ends, so the test first waits, within a bound, until
/stats counts the requests it sent; then it runs the script as a user would (a subprocess).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import aiohttp
from example_runner import EXAMPLES, LiveProxy, run_subprocess

CHAT: dict[str, Any] = {
    "model": "smollm2",
    "messages": [
        {"role": "system", "content": "You answer questions about trains. " * 20},
        {"role": "user", "content": "When does the last train leave?"},
    ],
}


async def wait_for_stats(admin_url: str, requests: int, limit_s: float = 5.0) -> dict[str, Any]:
    """GET /stats until it counts ``requests`` requests (statistics land after the response)."""
    last = "no answer"
    async with aiohttp.ClientSession() as session:
        try:
            async with asyncio.timeout(limit_s):
                while True:
                    async with session.get(f"{admin_url}/stats?window=1h") as resp:
                        last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                        if resp.status == 200:
                            stats: dict[str, Any] = await resp.json()
                            if stats.get("totals", {}).get("requests", 0) >= requests:
                                return stats
                    await asyncio.sleep(0.05)
        except TimeoutError:
            raise AssertionError(
                f"GET /stats never counted {requests} requests; last {last}"
            ) from None


async def test_stats_script_reports_the_requests(live_proxy: LiveProxy) -> None:
    """stats.py prints requests, hit rates, goodput, backends and store; --json is the raw body."""
    async with aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.post(f"{live_proxy.base_url}/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
    stats = await wait_for_stats(live_proxy.admin_url, 3)
    assert stats["schema"] == "prefixgate.stats/v1"

    env = {
        "PATH": os.environ["PATH"],
        "OPENAI_BASE_URL": live_proxy.base_url,
        "PREFIXGATE_ADMIN_URL": live_proxy.admin_url,
    }
    script = str(EXAMPLES / "stats.py")
    run = await run_subprocess(sys.executable, script, "--window", "1h", env=env)
    assert run.code == 0, run.out
    lines = run.out.splitlines()
    assert lines[0].startswith("prefixgate stats, window 1h") and "store: embedded" in lines[0]
    assert lines[1].split()[:2] == ["requests", "3"]
    assert any(line.startswith("hit rate") and "measured" in line for line in lines)
    assert any(line.startswith("goodput") for line in lines)
    assert any(live_proxy.fake.url in line and "healthy" in line for line in lines)

    raw = await run_subprocess(sys.executable, script, "--json", env=env)
    assert raw.code == 0, raw.out
    body = json.loads(raw.out)
    assert body["schema"] == "prefixgate.stats/v1" and body["totals"]["requests"] == 3


async def test_stats_script_fails_cleanly_on_a_bad_window(live_proxy: LiveProxy) -> None:
    """A window /stats rejects (400) makes the script exit 1 with the error, not a traceback."""
    env = {
        "PATH": os.environ["PATH"],
        "OPENAI_BASE_URL": live_proxy.base_url,
        "PREFIXGATE_ADMIN_URL": live_proxy.admin_url,
    }
    run = await run_subprocess(
        sys.executable, str(EXAMPLES / "stats.py"), "--window", "3 days", env=env
    )
    assert run.code == 1
    assert "HTTP 400" in run.out and "Traceback" not in run.out
