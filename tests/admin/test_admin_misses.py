"""The dashboard's miss attribution view in a real headless Chromium: one stacked bar of cached
tokens and each cause, for all traffic and per replica, matching ``/stats``.

The test also writes the view's screenshot: to the test's temporary directory, and to
``docs/miss-attribution.png`` (the README's picture) when ``PREFIXGATE_SCREENSHOTS=1``::

    PREFIXGATE_SCREENSHOTS=1 .venv/bin/python -m pytest tests/admin/test_admin_misses.py
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from fakes import LlamaFake, MakeProxy, fleet_proxy, serve
from test_admin_dashboard import browser, open_page  # noqa: F401  # the browser fixture

pytestmark = pytest.mark.browser

DOCS = Path(__file__).resolve().parents[2] / "docs"
INSTRUCTIONS = " ".join(f"Step {i}: check the order, then answer in one line." for i in range(30))
POLICY = " ".join(f"Clause {i}: refunds within thirty days of delivery." for i in range(40))


def clocked(n: int) -> dict[str, Any]:
    """A support bot whose system prompt starts with the time (a breaker while in dry-run)."""
    system = f"Current time: 2026-12-02T09:{n:02d}:{(7 * n) % 60:02d}Z. {INSTRUCTIONS}"
    return {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Where is order {1000 + n}?"},
        ],
    }


def conversation(c: int, turns: int) -> dict[str, Any]:
    """Conversation ``c`` after ``turns`` turns (round-robin moves it between replicas)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"Shop {c}. {POLICY}"}]
    for t in range(turns):
        messages.append(
            {"role": "user", "content": f"Question {t} of customer {c}: can I return it?"}
        )
        messages.append({"role": "assistant", "content": f"Answer {t}: yes, within thirty days."})
    messages.append({"role": "user", "content": f"Question {turns}: and the shipping cost?"})
    return {"model": "fake-model", "messages": messages}


async def test_miss_attribution_view_matches_stats(
    browser: Any,  # noqa: F811  # the fixture imported above
    aiohttp_server: Any,
    make_proxy: MakeProxy,
    tmp_path: Path,
) -> None:
    """Breakers (canonicalizer in dry-run), routing (round-robin over two replicas), evictions
    (a replica that lost its cache) and new tokens: the bars and the legend show /stats'
    figures, one bar for all traffic and one per replica, and the fixes name the rule."""
    fakes = [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]
    client, records, _ = await fleet_proxy(
        make_proxy, *fakes, policy="round-robin", canonical_dry_run=True
    )
    n = 0
    for turn in range(4):
        if turn == 3:
            fakes[0].forget()  # as a restarted server: the index still says it holds them
        # Seven requests a turn: round-robin puts each conversation on the other replica.
        bodies = [conversation(c, turn) for c in range(3)]
        bodies += [clocked(4 * turn + k) for k in range(4)]
        for body in bodies:
            async with client.post("/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
            n += 1
    await records.wait(n)
    async with client.admin.get("/stats") as resp:
        stats = await resp.json()
    misses = stats["totals"]["misses"]
    tokens = misses["tokens"]
    assert misses["requests"] == n
    assert sum(tokens.values()) == misses["uncached_tokens"] > 0
    assert all(tokens[c] > 0 for c in ("new", "breaker", "routing", "evicted")), tokens
    assert misses["breaker_rules"] == {"volatile_timestamps": tokens["breaker"]}
    assert "round_robin" in misses["routing_why"]

    page, console = await open_page(browser, str(client.admin.make_url("/dashboard")))
    await page.wait_for_selector("body[data-state=data]")
    card = page.locator("#card-misses")
    await card.scroll_into_view_if_needed()
    assert await card.locator(".miss-row").count() == 3  # all traffic, two replicas
    bar = card.locator('.miss-row[data-row="all"] .stack > span')
    causes = [await bar.nth(i).get_attribute("data-cause") for i in range(await bar.count())]
    assert causes[0] == "cached" and {"new", "breaker", "routing", "evicted"} <= set(causes)
    legend = await card.locator(".misses-legend").inner_text()
    assert "breaker" in legend and "routing" in legend and "evicted" in legend
    fixes = await card.locator(".miss-fixes").inner_text()
    assert "turn on volatile_timestamps" in fixes and "round robin" in fixes

    await bar.nth(causes.index("breaker")).hover()
    await page.wait_for_selector("#tooltip:not(.hidden)")
    assert "breaker" in await page.inner_text("#tooltip")
    await page.mouse.move(0, 0)

    shot = tmp_path / "miss-attribution.png"
    await card.screenshot(path=str(shot))
    assert shot.stat().st_size > 5_000
    if os.environ.get("PREFIXGATE_SCREENSHOTS") == "1":
        shutil.copyfile(shot, DOCS / "miss-attribution.png")
    assert console.errors == []
