"""A chat template that prints the clock into every prompt is found at start-up and reported."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from fakes import LlamaFake, MakeProxy, serve

from analyzers.analysis import analyze
from proxy.backends.template_clock import calls_clock, first_difference, probe_template_clock
from tests.admin.stats_schema import assert_valid

CLOCK_TEMPLATE = "{{ strftime_now('%H:%M:%S') }}{% for m in messages %}{{ m.content }}{% endfor %}"


class ClockLlamaFake(LlamaFake):
    """llama-server whose template prints the time of day (``/apply-template`` renders it)."""

    def __init__(self, template: str, *, ticking: bool = True) -> None:
        super().__init__()
        self.template = template
        self.ticking = ticking

    def _own_routes(self, router: web.UrlDispatcher) -> None:
        super()._own_routes(router)
        router.add_post("/apply-template", self.apply_template)

    async def props(self, request: web.Request) -> web.Response:
        base = orjson.loads((await super().props(request)).body)  # type: ignore[union-attr]  # a json_response body is bytes
        return web.json_response({**base, "chat_template": self.template})

    async def apply_template(self, request: web.Request) -> web.Response:
        body: Any = await request.json()
        clock = time.strftime("%H:%M:%S") if self.ticking else "01 Dec 2026"
        text = "".join(m["content"] for m in body["messages"])
        return web.json_response({"prompt": f"Now: {clock}\n{text}"})


def test_clock_calls_are_found_in_the_source() -> None:
    """``strftime_now(`` and ``now(`` are clock calls; a template without them is not."""
    assert calls_clock("{{ strftime_now('%d %b %Y') }}")
    assert calls_clock("{% set t = now() %}")
    assert not calls_clock("{{ messages[0].content }}") and not calls_clock(None)
    assert first_difference("abc", "abd") == 2 and first_difference("ab", "ab") is None


async def test_a_ticking_template_is_a_time(aiohttp_server: Any) -> None:
    """Two renders a second apart differ: the template prints a time, and where it starts."""
    fake = await serve(ClockLlamaFake(CLOCK_TEMPLATE), aiohttp_server)
    async with aiohttp.ClientSession() as session:
        clock = await probe_template_clock(session, fake.url, CLOCK_TEMPLATE)
    assert clock is not None and clock.kind == "time" and clock.renders_differ
    assert clock.first_difference is not None and clock.first_difference >= len("Now: ")


async def test_a_date_template_is_a_date(aiohttp_server: Any) -> None:
    """Renders that agree: the template prints a date (it breaks the cache once a day)."""
    fake = await serve(ClockLlamaFake(CLOCK_TEMPLATE, ticking=False), aiohttp_server)
    async with aiohttp.ClientSession() as session:
        clock = await probe_template_clock(session, fake.url, CLOCK_TEMPLATE, gap_s=0.0)
    assert clock is not None and clock.kind == "date" and clock.renders_differ is False


async def test_stats_records_and_the_analyzer_say_so(
    aiohttp_server: Any, make_proxy: MakeProxy, tmp_path: Path
) -> None:
    """/stats shows the backend's template clock, each record carries it, and the analyzer
    over those records says no rewrite can help."""
    fake = await serve(ClockLlamaFake(CLOCK_TEMPLATE), aiohttp_server)
    client, records, _ = await make_proxy(fake.url)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    async with client.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    async with client.admin.get("/stats") as resp:
        stats = await resp.json()
    assert stats["backends"][fake.url]["template_clock"]["kind"] == "time"
    assert_valid(stats)
    record = await records.wait()
    assert record.template_clock == "time"
    log = tmp_path / "records.jsonl"
    log.write_bytes(orjson.dumps({"event": "request", **record.as_dict()}) + b"\n")
    report = analyze([log]).to_json()
    assert report["template_clocks"] == {fake.url: "time"}
    assert any("no rewrite of the request can help" in n for n in report["notes"])


async def test_a_plain_template_reports_no_clock(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """A template without a clock call: nothing rendered, nothing reported."""
    client, records, _ = await make_proxy(llama_fake.url)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    async with client.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    async with client.admin.get("/stats") as resp:
        assert (await resp.json())["backends"][llama_fake.url]["template_clock"] is None
    assert (await records.wait()).template_clock is None
