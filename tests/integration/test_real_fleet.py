"""More conversations than slots on a real llama-server: prefixgate never caches less than direct.

Three agent conversations interleaved over two slots (the fleet workload of
``bench/bench_cache.py`` at a size CI affords): one system prompt shared by all of them with a
per-conversation date and session id, tools reordered on every request, every request after a
conversation's first ending with a tool result. The same requests go to two fresh llama-servers
(a ChatML template that prints tools), one directly and one through prefixgate with its
defaults; the backend's own ``cached_tokens`` decide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from fakes import RecordLog

from bench import workloads
from proxy.app import build_app
from proxy.config import resolve
from proxy.log import get_logger
from proxy.record_writer import RecordWriter
from proxy.records import RequestRecord
from tests.integration.llama import running_llama_server

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "templates" / "chatml-tools.jinja"
SCALE = dataclasses.replace(
    workloads.Scale(), fleet_conversations=3, fleet_turns=3, fleet_system_words=160, max_tokens=4
)
FLAGS = ("--jinja", "--chat-template-file", str(TEMPLATE), "--poll", "0")


@pytest.fixture(scope="module")
def two_servers() -> Iterator[tuple[str, str]]:
    """Two fresh llama-servers with two slots each: one direct, one behind the proxy."""
    with (
        running_llama_server(slots=2, ctx=8192, threads=1, extra=FLAGS) as direct,
        running_llama_server(slots=2, ctx=8192, threads=1, extra=FLAGS) as behind,
    ):
        yield direct, behind


@pytest.fixture
async def proxied(two_servers: tuple[str, str]) -> AsyncIterator[tuple[str, list[RequestRecord]]]:
    writer = RecordWriter(logger=get_logger("test.records"))
    records = RecordLog.of(writer)
    settings = resolve({"backend": [two_servers[1]]}, environ={})
    server = TestServer(build_app(settings, writer=writer))
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), records
    finally:
        await server.close()


async def send_all(
    session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]]
) -> list[tuple[int, int]]:
    """Each body, one after another, not streamed: (prompt tokens, cached tokens)."""
    out = []
    for body in bodies:
        plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        async with session.post(url + "/v1/chat/completions", json=plain) as resp:
            assert resp.status == 200, await resp.text()
            usage = (await resp.json())["usage"]
        out.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    return out


def share(usage: list[tuple[int, int]]) -> float:
    rest = usage[1:]
    return sum(c for _, c in rest) / sum(p for p, _ in rest)


async def test_fleet_through_prefixgate_caches_at_least_as_much_as_direct(
    two_servers: tuple[str, str], proxied: tuple[str, list[RequestRecord]]
) -> None:
    """Interleaved conversations outnumbering the slots: prefixgate's cached share is never
    below direct's, and its predictions stay close to what the backend reports."""
    bodies = workloads.fleet_bodies(SCALE, "fixed")
    url, records = proxied
    async with aiohttp.ClientSession() as session:
        direct = await send_all(session, two_servers[0], bodies)
        through = await send_all(session, url, bodies)
    direct_share, proxy_share = share(direct), share(through)
    print(f"fleet: direct {direct_share:.3f}, prefixgate {proxy_share:.3f}")
    assert proxy_share >= direct_share, (direct, through)
    errors = [
        abs(r.predicted_cached_tokens - r.cached_tokens) / r.prompt_tokens
        for r in records
        if r.prompt_tokens and r.cached_tokens is not None and r.predicted_cached_tokens is not None
    ]
    assert len(errors) == len(bodies)
    assert sum(errors) / len(errors) <= 0.06, errors
    assert {r.cache_source for r in records} <= {"slot", "ram", "none"}


@pytest.fixture(scope="module")
def two_servers_as_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """Two fresh llama-servers started as ``make run`` starts one: similarity 0, a save path."""
    saves = tmp_path_factory.mktemp("slots")
    flags = (*FLAGS, "--slot-prompt-similarity", "0", "--slot-save-path", str(saves))
    with (
        running_llama_server(slots=2, ctx=8192, threads=1, extra=flags) as direct,
        running_llama_server(slots=2, ctx=8192, threads=1, extra=flags) as behind,
    ):
        yield direct, behind


async def test_fleet_as_make_run_starts_the_server_never_recomputes_the_shared_prompt(
    two_servers_as_run: tuple[str, str],
) -> None:
    """With the flags ``make run`` gives llama-server, the second conversation's first request
    takes a copy of the slot holding the shared system prompt (``slot_copy``), the first
    conversation keeps its slot, and every request after the first reuses a cached prefix."""
    writer = RecordWriter(logger=get_logger("test.records"))
    records = RecordLog.of(writer)
    settings = resolve(
        {"backend": [two_servers_as_run[1]], "server_slot_similarity": 0.0}, environ={}
    )
    server = TestServer(build_app(settings, writer=writer))
    await server.start_server()
    bodies = workloads.fleet_bodies(SCALE, "fixed")
    try:
        url = str(server.make_url("")).rstrip("/")
        async with aiohttp.ClientSession() as session:
            direct = await send_all(session, two_servers_as_run[0], bodies)
            through = await send_all(session, url, bodies)
    finally:
        await server.close()
    direct_share, proxy_share = share(direct), share(through)
    print(f"fleet (make run flags): direct {direct_share:.3f}, prefixgate {proxy_share:.3f}")
    assert proxy_share >= direct_share, (direct, through)
    assert records[1].schedule_reason == "slot_copy", [r.schedule_reason for r in records]
    assert all(cached > 0 for _, cached in through[1:]), through
    assert through[1][1] >= 0.6 * through[1][0]  # the shared prompt and tools, not a few tokens
    errors = [
        abs(r.predicted_cached_tokens - r.cached_tokens) / r.prompt_tokens
        for r in records
        if r.prompt_tokens and r.cached_tokens is not None and r.predicted_cached_tokens is not None
    ]
    assert sum(errors) / len(errors) <= 0.05, errors
