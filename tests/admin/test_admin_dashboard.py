"""GET /dashboard in a real headless Chromium (Playwright) against a real proxy with traffic."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from admin_traffic import mixed_requests, send_all
from chromium import CHROMIUM, CHROMIUM_ARGS
from fakes import LlamaFake, MakeProxy

from proxy.config import Timeouts
from proxy.records import Pricing, Slo
from tests.ports import free_port

pytestmark = pytest.mark.browser

TOKEN = "dash-board-token"
T = TypeVar("T")


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    """Headless Chromium from the system package (never a downloaded browser build)."""
    from playwright.async_api import async_playwright

    if not os.path.exists(CHROMIUM):  # noqa: ASYNC240 - one stat before any await
        pytest.fail(f"{CHROMIUM} not found: apt-get install -y chromium (browser tests never skip)")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        await b.close()


class Console:
    """Errors the page logged or threw."""

    def __init__(self, page: Any) -> None:
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))


async def until(
    read: Callable[[], Awaitable[T]], ok: Callable[[T], bool], timeout_s: float = 10.0
) -> T:
    """Poll ``read`` from the test until ``ok``; no script evaluated in the page, whose CSP
    (``script-src 'self'``) forbids the string evaluation ``wait_for_function`` relies on."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = await read()
        if ok(value):
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"still {value!r} after {timeout_s} s")
        await asyncio.sleep(0.05)


async def _renders(page: Any) -> int:
    return int(await page.get_attribute("body", "data-renders") or 0)


async def _url(page: Any) -> str:
    return str(page.url)


async def open_page(browser: Any, url: str, **context: Any) -> tuple[Any, Console]:
    ctx = await browser.new_context(viewport={"width": 1400, "height": 1000}, **context)
    page = await ctx.new_page()
    console = Console(page)
    await page.goto(url)
    return page, console


async def test_empty_state_behind_the_admin_token(
    browser: Any, llama_fake: LlamaFake, make_proxy: MakeProxy, tmp_path: Path
) -> None:
    """A fresh proxy: the page needs the admin token, then says there is no traffic yet."""
    from playwright.async_api import Error as PlaywrightError

    client, _, _ = await make_proxy(llama_fake.url, admin_token=TOKEN)
    url = str(client.admin.make_url("/dashboard"))
    anonymous = await (await browser.new_context()).new_page()
    with pytest.raises(PlaywrightError, match="ERR_INVALID_AUTH_CREDENTIALS"):
        await anonymous.goto(url)  # 401, and no credentials to offer: headless cannot prompt

    page, console = await open_page(
        browser, url, http_credentials={"username": "admin", "password": TOKEN}
    )
    await page.wait_for_selector("body[data-state=empty]")
    assert await page.is_visible("#empty-state")
    assert await page.is_hidden("#charts")
    assert await page.is_hidden("#error-banner")  # /stats answered with the same credentials
    assert "No traffic yet" in await page.inner_text("#empty-title")
    assert "/v1" in await page.inner_text("#empty-snippet")
    assert await page.locator(".kpi").count() == 6
    assert "—" in await page.inner_text("#kpis")
    await page.screenshot(path=str(tmp_path / "dashboard-empty.png"), full_page=True)
    assert console.errors == []


async def test_charts_draw_the_traffic(
    browser: Any, llama_fake: LlamaFake, make_proxy: MakeProxy, tmp_path: Path
) -> None:
    """With traffic: every chart has data, the figures match /stats, the controls work."""
    # Every answer's headers wait 50 ms, so TTFT is never below the SLO's reach on the chart (an
    # SLO line is drawn when it is within 2.5x the highest point).
    llama_fake.knobs.header_delay_s = 0.05
    client, records, app = await make_proxy(
        llama_fake.url,
        slo=Slo(ttft_ms=100, tpot_ms=1000),
        pricing=Pricing(input_per_mtok=3.0, cached_input_per_mtok=0.3),
    )
    await send_all(client, records, app, mixed_requests())
    async with client.admin.get("/stats") as resp:
        stats = await resp.json()

    page, console = await open_page(browser, str(client.admin.make_url("/dashboard")))
    await page.wait_for_selector("body[data-state=data]")
    for chart in ("hitrate", "tokens", "ttft", "tpot", "goodput"):
        points = await page.get_attribute(f"#chart-{chart} svg", "data-points")
        assert points is not None and int(points) > 0, chart
        marks = page.locator(f"#chart-{chart} svg .plot > *")
        assert await marks.count() > 0, chart
    assert await page.locator("#chart-hitrate svg text").count() > 5  # labelled axes
    assert "measured" in await page.inner_text("#chart-hitrate .legend")
    assert await page.locator("#chart-ttft svg line.slo").count() == 1  # the dashed SLO line
    assert "SLO 100" in (await page.text_content("#chart-ttft svg .slo-label") or "")

    hit = stats["totals"]["hit_rate_token_weighted"]
    kpis = await page.inner_text("#kpis")
    assert f"{hit * 100:.1f}" in kpis
    assert str(stats["totals"]["requests"]) in kpis
    saved = page.locator(".kpi", has_text="Saved by the cache")
    assert stats["savings"]["cached_tokens"] > 0 and stats["savings"]["prefill_s"] > 0
    assert (await saved.locator(".value").inner_text()).strip() not in ("", "—", "0")
    saved_text = await saved.inner_text()
    assert re.search(r"prefill\s+\d", saved_text), saved_text  # a duration, not "—"
    assert "$" in saved_text and "at your prices" in saved_text
    assert await page.is_hidden("#store-banner")
    rows = page.locator("#table-backends tbody tr")
    assert await rows.count() == 1
    assert llama_fake.url in await rows.first.inner_text()
    assert await page.locator("#table-prefixes tbody tr").count() == 3
    assert await page.locator('#list-rules [data-rule="volatile_timestamps"]').count() == 1

    # Hovering a chart shows the tooltip for that interval.
    box = await page.locator("#chart-ttft svg .hit").bounding_box()
    assert box is not None
    await page.mouse.move(box["x"] + box["width"] - 3, box["y"] + box["height"] / 2)
    await page.wait_for_selector("#tooltip:not(.hidden)")
    assert "p50" in await page.inner_text("#tooltip")

    # The window selector refetches and re-renders; the choice is kept in the URL.
    renders = int(await page.get_attribute("body", "data-renders") or 0)
    await page.click('#window-select button[data-window="5m"]')
    await until(lambda: _renders(page), lambda n: n > renders)
    assert re.search(r"window=5m", page.url)
    assert "last 5 minutes" in await page.inner_text("#foot-window")
    assert await page.get_attribute('[data-window="5m"]', "aria-checked") == "true"
    await page.select_option("#model-select", "fake-model")
    await until(lambda: _url(page), lambda url: "model=fake-model" in url)

    await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    assert console.errors == []


async def test_degraded_store_is_shown(
    browser: Any, llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Redis unreachable: traffic still flows, and the page says the store is degraded instead
    of claiming there was no traffic."""
    client, records, app = await make_proxy(
        llama_fake.url,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        timeouts=Timeouts(connect=2, idle=5, store=0.05),
    )
    recs = await send_all(client, records, app, mixed_requests(per_app=1))
    assert all(r.status == 200 for r in recs)

    page, console = await open_page(browser, str(client.admin.make_url("/dashboard")))
    await page.wait_for_selector("body[data-store=degraded]")
    assert await page.is_visible("#store-banner")
    assert "degraded" in await page.inner_text("#store-banner")
    assert "warn" in (await page.get_attribute("#status-dot", "class") or "")
    assert "store degraded" in await page.inner_text("#status-text")
    assert await page.get_attribute("body", "data-state") == "empty"
    assert "unavailable" in await page.inner_text("#empty-title")
    assert await page.is_hidden("#error-banner")  # /stats answered 200, not an error
    assert console.errors == []


async def test_control_group_card_shows_both_groups_and_the_lift(
    browser: Any, llama_fake: LlamaFake, make_proxy: MakeProxy, tmp_path: Path
) -> None:
    """With --control-share: the card lists treated, control and the lift as /stats has them;
    without one the card stays hidden (the other tests' pages)."""
    from proxy.control import ControlGroup

    client, records, app = await make_proxy(llama_fake.url, control=ControlGroup(share=0.5))
    await send_all(client, records, app, mixed_requests())
    async with client.admin.get("/stats") as resp:
        block = (await resp.json())["control_group"]
    page, console = await open_page(browser, str(client.admin.make_url("/dashboard")))
    await page.wait_for_selector("body[data-state=data]")
    assert await page.is_visible("#card-control")
    rows = page.locator("#table-control tbody tr")
    assert await rows.count() == 3
    treated = await page.inner_text('#table-control tr[data-group="treated"]')
    assert str(block["groups"]["treated"]["requests"]) in treated
    assert "50.0" in treated  # its share of conversations
    assert "pt" in await page.inner_text('#table-control tr[data-group="lift"]') or (
        block["lift"]["cached_share"]["value"] is None
    )
    await page.screenshot(path=str(tmp_path / "dashboard-control.png"), full_page=True)
    assert console.errors == []
