"""Against a real llama-server: the proxy in front of it changes nothing the server does.

- ``/metrics`` through the proxy is the server's own (its ``llamacpp:*`` page and
  ``Process-Start-Time-Unix`` header; its 501 without ``--metrics``); the proxy's metrics are
  on its admin listener.
- With ``--sleep-idle-seconds`` the server falls asleep behind the proxy and stays asleep (its
  log says when it wakes: only for a client's request).
- ``/cors-proxy`` (``--ui-mcp-proxy``) relaying a 204 answers it with a chunked ``0`` body; the
  client gets the 204 and the server stays in the fleet.
- Started with ``--api-key``, it is still detected as llama.cpp and ready, with or without
  ``--backend-api-key``.
"""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from fakes import MakeProxy
from structlog.testing import LogCapture

from proxy.config import HealthChecks
from proxy.scheduling.config import SchedulingConfig
from proxy.state import STATE
from tests.integration.llama import running_llama_server

pytestmark = pytest.mark.real

KEY = "sk-llama-test"
WAKE_LINE = "server is exiting sleeping state"  # once per wake (handle_sleep)
CHAT = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Say hi."}],
    "max_tokens": 4,
    "temperature": 0,
}


@pytest.fixture(scope="module")
def sleepy_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """llama-server with --metrics, --sleep-idle-seconds 1 and the MCP CORS proxy; its log."""
    log = tmp_path_factory.mktemp("llama") / "server.log"
    extra = ["--sleep-idle-seconds", "1", "--ui-mcp-proxy"]
    with running_llama_server(slots=2, ctx=2048, extra=extra, log_path=log) as url:
        yield url, log


@pytest.fixture(scope="module")
def protected_llama() -> Iterator[str]:
    """llama-server with --api-key and without --metrics."""
    with running_llama_server(slots=2, ctx=2048, metrics=False, extra=["--api-key", KEY]) as url:
        yield url


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """A direct GET to the server (not through the proxy)."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def is_sleeping(url: str) -> bool:
    """What the server's ``/props`` says (``/props`` never wakes it)."""
    return bool(orjson.loads(get(url + "/props")[2]).get("is_sleeping"))


async def wait_asleep(url: str, limit_s: float = 15.0) -> None:
    deadline = time.monotonic() + limit_s
    while not await asyncio.to_thread(is_sleeping, url):
        if time.monotonic() > deadline:
            pytest.fail(f"llama-server did not fall asleep within {limit_s} s")
        await asyncio.sleep(0.2)


def wakes(log: Path) -> int:
    return log.read_text(errors="replace").count(WAKE_LINE)


def metric_names(text: str) -> set[str]:
    return {line.split()[0].split("{")[0] for line in text.splitlines() if line[:1] not in "#"}


async def test_metrics_through_the_proxy_are_the_servers(
    sleepy_llama: tuple[str, Path], make_proxy: MakeProxy
) -> None:
    """GET /metrics on the traffic port is llama-server's page, header included."""
    url, _ = sleepy_llama
    client, _, _ = await make_proxy(url)
    async with client.get("/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
        assert resp.headers["Process-Start-Time-Unix"].isdigit()
    assert "llamacpp:prompt_tokens_total" in text and "prefixgate_" not in text
    direct = (await asyncio.to_thread(get, url + "/metrics"))[2].decode()
    assert metric_names(text) == metric_names(direct)
    async with client.admin.get("/metrics") as resp:
        assert resp.status == 200 and "prefixgate_" in await resp.text()


async def test_metrics_501_passes_through(protected_llama: str, make_proxy: MakeProxy) -> None:
    """Without --metrics the server answers 501, and so does the proxy's traffic port."""
    client, _, _ = await make_proxy(protected_llama, backend_api_key=KEY)
    async with client.get("/metrics") as resp:
        assert resp.status == 501
        body = await resp.json()
    direct = await asyncio.to_thread(get, protected_llama + "/metrics", {"Authorization": KEY})
    assert direct[0] == 501 and body == orjson.loads(direct[2])


async def test_a_sleeping_server_stays_asleep_behind_the_proxy(
    sleepy_llama: tuple[str, Path], make_proxy: MakeProxy
) -> None:
    """Health checks, load reads and slot reads every 0.5 s never wake it; a request does."""
    url, log = sleepy_llama
    client, records, app = await make_proxy(
        url,
        health=HealthChecks(interval_s=0.5),
        scheduling=SchedulingConfig(slots_poll_s=0.5),
    )
    async with client.post("/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200  # woke it if it slept; pinned a slot, so /slots is read
    await records.wait(1)
    await wait_asleep(url)
    before = wakes(log)
    await asyncio.sleep(5.0)  # ten rounds of everything the proxy does in the background
    assert wakes(log) == before, "the proxy woke the sleeping server"
    assert await asyncio.to_thread(is_sleeping, url)
    replica = app[STATE].fleet[url]
    assert replica.asleep and replica.healthy
    async with client.admin.get("/readyz") as resp:
        assert resp.status == 200
    async with client.post("/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["message"]["content"]
    assert wakes(log) == before + 1  # the client's request woke it


async def test_cors_proxy_204_is_relayed(
    sleepy_llama: tuple[str, Path],
    make_proxy: MakeProxy,
    aiohttp_server: Any,
    log_capture: LogCapture,
) -> None:
    """llama-server's chunked 204 reaches the client as a 204; nothing is ejected."""
    url, _ = sleepy_llama

    async def no_content(request: web.Request) -> web.Response:
        return web.Response(status=204)

    target_app = web.Application()
    target_app.router.add_get("/", no_content)
    target = await aiohttp_server(target_app)
    query = f"/cors-proxy?url=http://127.0.0.1:{target.port}/"
    raw = await asyncio.to_thread(raw_get, url, query)
    assert raw.startswith(b"HTTP/1.1 204") and b"chunked" in raw.lower()  # the quirk itself
    client, _, app = await make_proxy(url)
    for _ in range(3):
        async with client.get(query) as resp:
            assert resp.status == 204
            assert await resp.read() == b""
    async with client.get("/props") as resp:
        assert resp.status == 200
    assert not any(e["event"] == "backend_ejected" for e in log_capture.entries)
    assert app[STATE].fleet[url].healthy
    async with client.admin.get("/readyz") as resp:
        assert resp.status == 200


def raw_get(base_url: str, target: str) -> bytes:
    """The server's exact bytes for ``GET target`` (one request, then the connection closes)."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data or (b"chunked" in data.lower() and b"0\r\n\r\n" not in data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


async def test_protected_server_without_its_key(
    protected_llama: str, make_proxy: MakeProxy, log_capture: LogCapture
) -> None:
    """--api-key and no --backend-api-key: llama.cpp, ready, protected; its 401 relayed."""
    client, _, app = await make_proxy(protected_llama)
    replica = app[STATE].fleet[protected_llama]
    assert replica.dialect.name == "llamacpp" and replica.healthy and replica.protected
    async with client.admin.get("/readyz") as resp:
        assert resp.status == 200
        assert (await resp.json())["backends"] == {protected_llama: True}
    async with client.post("/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 401
    assert not any(e["event"] == "backend_ejected" for e in log_capture.entries)


async def test_protected_server_with_its_key(protected_llama: str, make_proxy: MakeProxy) -> None:
    """With --backend-api-key the probes use it: slots and context known, requests served."""
    client, records, app = await make_proxy(protected_llama, backend_api_key=KEY)
    fleet = app[STATE].fleet
    await fleet.check_all()
    replica = fleet[protected_llama]
    assert replica.dialect.name == "llamacpp" and not replica.protected
    assert replica.info is not None and replica.info.slots == 2 and replica.info.ctx_per_slot
    async with client.post("/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    record = await records.wait(1)
    assert record.cached_tokens is not None and record.backend == protected_llama
