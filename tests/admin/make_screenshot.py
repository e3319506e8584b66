"""Regenerate docs/dashboard.png: the dashboard of a proxy in front of two backends, with traffic.

    .venv/bin/python tests/admin/make_screenshot.py [--out docs/dashboard.png] [--window 1h]

What it does, all on this machine:

1. starts two fake llama.cpp servers (``tests/fakes.py``) that take time the way a real one does:
   prefill proportional to the prompt tokens not in their cache, then a steady time per output
   token (one backend decodes faster than the other);
2. starts prefixgate in front of both (prefix-affinity routing, an SLO, prices) on a free port;
3. sends live traffic through it: four applications (system prompts of different sizes, one of
   them carrying a timestamp the canonicalizer relocates), several conversations each;
4. because one live run lasts seconds and the charts show an hour, it backfills the previous
   59 minutes with statistics samples derived from the live records (same prompts, sizes,
   backends, anchors, rules and route reasons), with the hit rate and latencies varied minute by
   minute, including a stretch where a prompt change broke the cache, so the history has a shape;
5. opens ``/dashboard`` in headless Chromium (Playwright, ``/usr/bin/chromium``) and saves a
   full-page screenshot.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiohttp import ClientSession, web

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from chromium import CHROMIUM, CHROMIUM_ARGS  # noqa: E402
from fakes import LlamaFake, RecordLog  # noqa: E402

from proxy.app import admin_app, build_app  # noqa: E402
from proxy.config import Settings, resolve  # noqa: E402
from proxy.log import configure_logging, get_logger  # noqa: E402
from proxy.record_writer import RecordWriter  # noqa: E402
from proxy.records import Pricing, RequestRecord, Slo  # noqa: E402
from proxy.state import STATE  # noqa: E402
from proxy.store import StatsSample  # noqa: E402
from tests.ports import free_port  # noqa: E402

SLO = Slo(ttft_ms=400.0, tpot_ms=40.0)
PRICING = Pricing(input_per_mtok=3.0, cached_input_per_mtok=0.3)

APPS: Mapping[str, str] = {
    "support": "You are the help desk of Acme Cloud. Be brief, cite the docs, never guess. " * 30,
    "coder": "You review pull requests for a Python service: correctness, tests, naming. " * 45,
    "planner": "You schedule meetings for a team across time zones. "
    + "Current time: Monday, November 30, 2026 09:41 UTC. " * 2
    + "Prefer mornings. " * 40,
    "sql": "Translate questions into PostgreSQL for the orders schema described below. " * 18,
}


class TimedFake(LlamaFake):
    """A llama.cpp fake whose prefill time follows the uncached prompt tokens."""

    def __init__(self, *, prefill_ms_per_token: float, tpot_s: float) -> None:
        super().__init__()
        self.knobs.prefill_ms_per_token = prefill_ms_per_token
        self.knobs.decode_ms_per_token = tpot_s * 1000
        self.knobs.token_delay_s = tpot_s
        self.knobs.tokens = [f" w{i}" for i in range(12)]

    def cache_lookup(self, body: Mapping[str, Any]) -> tuple[int, int]:
        prompt, cached = super().cache_lookup(body)
        # Read synchronously by the fake right after this call, before its first await.
        self.knobs.header_delay_s = 0.01 + (prompt - cached) * self.knobs.prefill_ms_per_token / 1e3
        return prompt, cached


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def live_traffic(base: str, rng: random.Random) -> None:
    """Conversations of each application, a few at a time, streamed and not."""
    sem = asyncio.Semaphore(4)

    async def conversation(session: ClientSession, app: str, n: int) -> None:
        messages: list[dict[str, str]] = [{"role": "system", "content": APPS[app]}]
        for turn in range(rng.randint(2, 5)):
            messages.append({"role": "user", "content": f"{app} user {n} asks question {turn}"})
            body = {"model": "smollm2", "messages": messages, "stream": rng.random() < 0.7}
            async with sem, session.post(base + "/v1/chat/completions", json=body) as resp:
                await resp.read()
            messages.append({"role": "assistant", "content": "answer " * 12})

    async with ClientSession() as session:
        jobs = [conversation(session, app, n) for app in APPS for n in range(4)]
        rng.shuffle(jobs)
        await asyncio.gather(*jobs)


def hit_factor(minutes_ago: int) -> float:
    """How warm the cache was: mostly warm, a slow wave, and a broken stretch 30-38 min ago."""
    base = 0.86 + 0.06 * math.sin(minutes_ago / 6.0)
    if 30 <= minutes_ago <= 38:
        base -= 0.55 * (1 - abs(minutes_ago - 34) / 6)
    return min(max(base, 0.05), 0.98)


def backfill(
    records: list[RequestRecord], rng: random.Random, now: float, *, slow_backend: str
) -> list[StatsSample]:
    """Samples for the hour before the live run, derived from the live records."""
    good = [r for r in records if r.status == 200 and r.prompt_tokens and r.backend]
    # Applications cache differently: a stable prompt keeps its hits, a chatty one loses some.
    anchors = sorted({r.prefix_anchor or "" for r in good})
    app_factor = dict(zip(anchors, (1.06, 0.93, 0.64, 0.99), strict=False))
    out: list[StatsSample] = []
    for minutes_ago in range(1, 60):
        n = int(26 + 10 * math.sin(minutes_ago / 9.0) + rng.randint(-4, 4))
        h = hit_factor(minutes_ago)
        for _ in range(n):
            r = rng.choice(good)
            prompt = r.prompt_tokens or 0
            app_h = h * app_factor.get(r.prefix_anchor or "", 1.0)
            cached = int(prompt * min(app_h * rng.uniform(0.9, 1.08), 0.99))
            slow = 1.5 if r.backend == slow_backend else 1.0
            ttft = (25 + (prompt - cached) * 1.6) * rng.uniform(0.8, 1.35)
            tpot = 22 * slow * rng.uniform(0.85, 1.3)
            completion = r.completion_tokens or 12
            error = rng.random() < 0.01
            met = not error and ttft <= (SLO.ttft_ms or 0) and tpot <= (SLO.tpot_ms or 0)
            out.append(
                StatsSample(
                    ts=now - minutes_ago * 60 + rng.uniform(-29, 29),
                    namespace="default",
                    model=r.model or "smollm2",
                    backend=r.backend or "unknown",
                    status=502 if error else 200,
                    error=error,
                    prompt_tokens=prompt,
                    cached_tokens=cached,
                    predicted_cached_tokens=int(cached * rng.uniform(0.82, 1.02)),
                    completion_tokens=completion,
                    ttft_ms=ttft,
                    ttfvt_ms=ttft,
                    tpot_ms=tpot,
                    e2e_ms=ttft + tpot * (completion - 1),
                    slo_met=met,
                    saved_prefill_ms=cached * 1.6,
                    saved_usd=PRICING.saved_usd(cached),
                    prefix_anchor=r.prefix_anchor,
                    canonical_rules=list(r.canonical_rules),
                    route_reason=r.route_reason,
                )
            )
    return out


async def main(out: Path, window: str, width: int) -> None:
    from playwright.async_api import async_playwright

    configure_logging(level="warning")
    rng = random.Random(7)
    fast = TimedFake(prefill_ms_per_token=1.6, tpot_s=0.022)
    slow = TimedFake(prefill_ms_per_token=1.6, tpot_s=0.034)
    runners = []
    urls = []
    for fake in (fast, slow):
        runner, url = await start(fake.app())
        fake.url = url
        runners.append(runner)
        urls.append(url)
    settings: Settings = resolve({"backend": urls}, environ={})
    settings = dataclasses.replace(settings, slo=SLO, pricing=PRICING)
    writer = RecordWriter(logger=get_logger("prefixgate.records"))
    records = RecordLog.of(writer)
    app = build_app(settings, writer=writer)
    proxy_runner, base = await start(app)
    runners.append(proxy_runner)
    admin_runner, admin_base = await start(admin_app(app))
    runners.append(admin_runner)
    try:
        await live_traffic(base, rng)
        await writer.drain()
        store = app[STATE].store
        for sample in backfill(records, rng, time.time(), slow_backend=slow.url):
            await store.add_stats(sample)
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = await browser.new_page(
                viewport={"width": width, "height": 900}, color_scheme="light"
            )
            await page.goto(f"{admin_base}/dashboard?window={window}")
            await page.wait_for_selector("body[data-state=data]")
            out.parent.mkdir(parents=True, exist_ok=True)
            await page.screenshot(path=str(out), full_page=True)
            await browser.close()
        print(f"{len(records)} live requests; wrote {out}")
    finally:
        for runner in reversed(runners):
            await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--window", default="1h", choices=["5m", "1h", "24h", "7d"])
    parser.add_argument("--width", type=int, default=1440)
    args = parser.parse_args()
    asyncio.run(main(args.out, args.window, args.width))
