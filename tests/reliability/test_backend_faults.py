"""Backend faults: killed mid-answer, down at start-up, slow, dribbling, stalling, resetting.

The proxy runs as its own process in front of fake backend processes. Every request must end
in a complete answer or a well-formed error (an OpenAI-shaped body, or an SSE error event once
the stream has started), within its timeout, and the proxy must serve normally afterwards.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from tests.reliability.conftest import CONNECT_S, IDLE_S, Procs, Stack
from tests.reliability.fake_backend import synthetic_stream
from tests.reliability.outcome import (
    COMPLETE,
    ERROR,
    Outcome,
    call,
    classify,
    is_proxy_error_body,
    sse_payloads,
)
from tests.reliability.processes import eventually, http_get

CHAT = "/v1/chat/completions"


def chat(text: str = "tell me a story", *, stream: bool = False) -> dict[str, Any]:
    messages = [{"role": "user", "content": text}]
    return {"model": "fake-model", "messages": messages, "stream": stream}


async def serves(http: aiohttp.ClientSession, proxy_url: str, *, stream: bool = False) -> bool:
    """One ordinary request through the proxy completes."""
    outcome = await call(http, proxy_url + CHAT, chat("still there?", stream=stream), timeout_s=5)
    return outcome.kind == COMPLETE


async def test_backend_killed_mid_answer_then_restarted(
    procs: Procs, http: aiohttp.ClientSession
) -> None:
    """SIGKILL mid-stream ends the stream with an SSE error event and a held non-streamed
    request with 502; once the backend is back on its port, the proxy serves again."""
    backend = procs.backend()
    proxy = procs.proxy([backend.url], idle_timeout=5.0, connect_timeout=0.5)
    held = asyncio.ensure_future(
        call(http, proxy.url + CHAT, chat(), headers={"X-Fault": "hold=10"}, timeout_s=8)
    )
    slow = {"X-Fault": "tokens=200,token-delay=0.05"}
    async with http.post(proxy.url + CHAT, json=chat(stream=True), headers=slow) as resp:
        assert resp.status == 200
        got = b""
        while b'"content":" t1"' not in got:
            got += await asyncio.wait_for(resp.content.readany(), 5)
        backend.kill()
        got += await asyncio.wait_for(resp.content.read(), 5)
        streamed = classify(resp.status, resp.content_type, got)
    assert streamed.kind == ERROR and streamed.error == "backend_unavailable", streamed
    assert is_proxy_error_body(orjson.loads(sse_payloads(got)[-1]))
    answered = await held
    assert (answered.kind, answered.status, answered.error) == (ERROR, 502, "backend_unavailable")
    assert answered.elapsed_s < 5

    backend.start()
    assert await eventually(lambda: serves(http, proxy.url, stream=True), within_s=15)
    assert proxy.alive


async def test_backend_down_at_startup_then_comes_back(
    procs: Procs, http: aiohttp.ClientSession
) -> None:
    """With its only backend down the proxy starts, answers 502 fast and /readyz 503; when the
    backend comes up, readiness and traffic follow without a restart."""
    backend = procs.backend(start=False)
    proxy = procs.proxy([backend.url], connect_timeout=0.5, extra=["--health-interval-s", "0.5"])
    first = await call(http, proxy.url + CHAT, chat(), timeout_s=5)
    assert (first.kind, first.status, first.error) == (ERROR, 502, "backend_unavailable")
    assert first.elapsed_s < 2
    assert http_get(proxy.admin_url + "/readyz")[0] == 503

    backend.start()

    async def ready() -> bool:
        return http_get(proxy.admin_url + "/readyz")[0] == 200

    assert await eventually(ready, within_s=10)
    assert await eventually(lambda: serves(http, proxy.url), within_s=5)
    assert await serves(http, proxy.url, stream=True)


# X-Fault, stream, expected (kind, status, error type), bounds on the time it may take. The
# stack's timeouts: connect 0.5 s, idle 1 s, so a response head is due within 1.5 s.
HEAD_DEADLINE = CONNECT_S + IDLE_S
SLOW_CASES: list[tuple[str, bool, tuple[str, int, str | None], tuple[float, float]]] = [
    ("hold=5", False, (ERROR, 504, "backend_timeout"), (IDLE_S, HEAD_DEADLINE + 1)),
    ("hold=5", True, (ERROR, 504, "backend_timeout"), (IDLE_S, HEAD_DEADLINE + 1)),
    ("dribble-head=0.05", False, (ERROR, 504, "backend_timeout"), (HEAD_DEADLINE, 4)),
    ("dribble-head=0.05", True, (ERROR, 504, "backend_timeout"), (HEAD_DEADLINE, 4)),
    ("stall-after=2", True, (ERROR, 200, "backend_timeout"), (IDLE_S, IDLE_S + 1.5)),
    ("tokens=6,token-delay=0.3", True, (COMPLETE, 200, None), (1.5, 4)),
    ("dribble-body=0.002,tokens=3", True, (COMPLETE, 200, None), (0.5, 4)),
    ("fail-after=2", True, (ERROR, 200, "server_error"), (0, 1.5)),
    ("reset-after=2", True, (ERROR, 200, "backend_unavailable"), (0, 1.5)),
    ("reset-after=2", False, (ERROR, 502, "backend_unavailable"), (0, 1.5)),
    ("status=503", False, (ERROR, 503, "server_error"), (0, 1.5)),
    ("status=400", True, (ERROR, 400, "invalid_request_error"), (0, 1.5)),
]


async def test_slow_and_stalling_backends(stack: Stack, http: aiohttp.ClientSession) -> None:
    """Each slow or broken answer ends as it should within its bound, all at once, and the
    upstream connections the proxy gave up on are closed (the backend holds none)."""

    async def one(fault: str, stream: bool) -> Outcome:
        headers = {"X-Fault": fault}
        return await call(http, stack.proxy.url + CHAT, chat(stream=stream), headers=headers)

    outcomes = await asyncio.gather(*(one(fault, stream) for fault, stream, _, _ in SLOW_CASES))
    for (fault, stream, want, (low, high)), got in zip(SLOW_CASES, outcomes, strict=True):
        where = f"{fault} stream={stream}: {got.label} in {got.elapsed_s:.2f} s ({got.detail})"
        assert (got.kind, got.status, got.error) == want, where
        assert low <= got.elapsed_s <= high, where
        if got.kind == ERROR and (got.status >= 500 or got.status == 200):
            last = sse_payloads(got.body)[-1] if got.status == 200 else got.body
            shape_ok = is_proxy_error_body(orjson.loads(last))
            assert shape_ok or want[2] in ("server_error",), where
    stalled = outcomes[4]
    assert stalled.body.count(b'"delta":{"content"') == 2  # the tokens before the stall got through
    dribbled = outcomes[6]
    assert dribbled.body == b"".join(synthetic_stream("chat", 3))  # byte for byte

    async def released() -> bool:
        return bool(stack.backend.stats()["active"] == 0)

    assert await eventually(released, within_s=3)
    assert await serves(http, stack.proxy.url, stream=True)
    stack.assert_alive()


@pytest.mark.parametrize("route", ["/v1/completions", "/completion"])
async def test_completion_routes_survive_a_reset(
    stack: Stack, http: aiohttp.ClientSession, route: str
) -> None:
    """A connection reset mid-stream on the completion routes ends in an SSE error event too."""
    body = {"prompt": "once upon a time", "stream": True}
    got = await call(http, stack.proxy.url + route, body, headers={"X-Fault": "reset-after=1"})
    assert (got.kind, got.status, got.error) == (ERROR, 200, "backend_unavailable"), got
    assert await serves(http, stack.proxy.url)
