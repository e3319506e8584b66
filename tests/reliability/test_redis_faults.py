"""Redis faults under a proxy process: killed and restarted, blackholed, paused.

Redis only serves the prefix index and statistics, so its failure must degrade predictions,
never traffic: every request completes, none waits on Redis longer than the store timeout plus
scheduling noise, ``store_degraded`` is logged once per incident and ``store_recovered`` when
Redis answers again, after which predictions are right again (no reply of the old connection is
mistaken for a new one).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import redis

from tests.reliability.conftest import Procs
from tests.reliability.outcome import COMPLETE, Outcome, call
from tests.reliability.processes import ProxyProcess, TcpGate, eventually
from tests.store.redis_process import RedisServer

# The proxy, the backend and Redis run as processes of their own, so an unclosed socket this
# process reports when it collects garbage is the harness's (the TCP gate, the HTTP client), never
# the proxy's; now and then one turns up a test later and must not fail an unrelated test. The
# proxy's own leaks are what the soak test's RSS check and the fault tests' assertions catch.
pytestmark = [
    pytest.mark.redis,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

CHAT = "/v1/chat/completions"
SYSTEM = "You are the help desk assistant of Acme Corp. Answer briefly and politely. " * 12
STORE_TIMEOUT_S = 0.05  # the default 5 ms is tight for a loaded 2-core test machine
SLOW_S = 1.0  # no request may take this long while Redis is away


def chat(question: str, *, stream: bool = False, system: str = SYSTEM) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "fake-model", "messages": messages, "stream": stream}


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A redis-server of this test's own, free to be killed."""
    server = RedisServer()
    server.start()
    yield server
    server.kill()


async def burst(
    http: aiohttp.ClientSession, proxy: ProxyProcess, n: int, tag: str
) -> list[Outcome]:
    """``n`` requests at once, half streamed, all sharing the system prompt."""
    return await asyncio.gather(
        *(
            call(http, proxy.url + CHAT, chat(f"{tag} {i}?", stream=i % 2 == 0), timeout_s=10)
            for i in range(n)
        )
    )


def assert_all_fast(outcomes: list[Outcome], proxy: ProxyProcess) -> None:
    bad = [o.label for o in outcomes if o.kind != COMPLETE]
    assert not bad, bad
    slowest = max(o.elapsed_s for o in outcomes)
    assert slowest < SLOW_S, f"a request took {slowest:.2f} s\n{log_tail(proxy, 60)}"


_probes = itertools.count()


async def predicts(proxy: ProxyProcess, http: aiohttp.ClientSession, question: str) -> bool:
    """A request sharing the system prompt is predicted to hit (the index answers again)."""
    rid = f"probe-{next(_probes)}"
    got = await call(http, proxy.url + CHAT, chat(question), headers={"X-Request-Id": rid})
    assert got.kind == COMPLETE

    async def recorded() -> bool:
        return any(r["request_id"] == rid for r in proxy.records())

    assert await eventually(recorded, within_s=2)
    record = next(r for r in proxy.records() if r["request_id"] == rid)
    return bool(record.get("prefix_matched_blocks"))


async def recovers(proxy: ProxyProcess, http: aiohttp.ClientSession) -> None:
    """``store_recovered`` is logged and predictions come back."""
    n = 0

    async def check() -> bool:
        nonlocal n
        n += 1
        hit = await predicts(proxy, http, f"r{n}")  # the traffic that lets the store probe Redis
        return hit and bool(proxy.events("store_recovered"))

    assert await eventually(check, within_s=10, every_s=0.3), log_tail(proxy)


def log_tail(proxy: ProxyProcess, n: int = 30) -> str:
    """The proxy's last log lines, records shortened to what matters here (for failures)."""
    keep = ("event", "request_id", "status", "error", "e2e_ms", "proxy_overhead_ms", "op", "detail")
    lines = [{k: e[k] for k in keep if k in e} for e in proxy.log_lines()[-n:]]
    return "\n".join(map(str, lines))


async def noticed(proxy: ProxyProcess) -> bool:
    """The proxy logged that the store stopped answering. With one replica a lookup is not
    waited for (nothing routes by it): it times out in the background, so the requests that
    sent it may all have ended first."""

    async def degraded() -> bool:
        return bool(proxy.events("store_degraded"))

    return await eventually(degraded, within_s=2)


async def warm_up(proxy: ProxyProcess, http: aiohttp.ClientSession) -> None:
    assert_all_fast(await burst(http, proxy, 4, "warm"), proxy)
    assert await eventually(lambda: predicts(proxy, http, "warm"), within_s=5)


async def test_redis_killed_and_restarted(
    procs: Procs, http: aiohttp.ClientSession, redis_server: RedisServer
) -> None:
    """Redis SIGKILLed: traffic is served at full speed; restarted on its port, the proxy
    reconnects by itself and predicts again."""
    backend = procs.backend()
    proxy = procs.proxy([backend.url], redis_url=redis_server.url, store_timeout=STORE_TIMEOUT_S)
    await warm_up(proxy, http)
    redis_server.kill()
    for round_ in range(3):
        assert_all_fast(await burst(http, proxy, 10, f"down{round_}"), proxy)
    assert await noticed(proxy)
    redis_server.start()
    await recovers(proxy, http)
    assert proxy.alive


async def test_redis_blackholed(
    procs: Procs, http: aiohttp.ClientSession, redis_server: RedisServer
) -> None:
    """Redis behind a gate that stops forwarding (connections open, no replies): requests
    do not wait on it; when the gate opens, stale replies are not taken for new ones."""
    gate = await TcpGate(redis_server.port).start()
    try:
        backend = procs.backend()
        url = f"redis://127.0.0.1:{gate.port}/0"
        proxy = procs.proxy([backend.url], redis_url=url, store_timeout=STORE_TIMEOUT_S)
        await warm_up(proxy, http)
        gate.block()
        for round_ in range(3):
            assert_all_fast(await burst(http, proxy, 10, f"hole{round_}"), proxy)
        assert await noticed(proxy)
        gate.unblock()
        await recovers(proxy, http)
        other = chat("unrelated", system="A different application prompt entirely. " * 12)
        rid = "after-blackhole-unrelated"
        got = await call(http, proxy.url + CHAT, other, headers={"X-Request-Id": rid})
        assert got.kind == COMPLETE

        async def recorded() -> bool:
            return any(r["request_id"] == rid for r in proxy.records())

        assert await eventually(recorded, within_s=2)
        record = next(r for r in proxy.records() if r["request_id"] == rid)
        # A prompt never seen predicts nothing (what the record and the log said, if it did).
        said = {k: v for k, v in record.items() if k.startswith(("prefix_", "route", "sched"))}
        assert not record.get("prefix_matched_blocks"), f"{said}\n{log_tail(proxy, 60)}"
    finally:
        await gate.close()


async def test_redis_paused(
    procs: Procs, http: aiohttp.ClientSession, redis_server: RedisServer
) -> None:
    """``CLIENT PAUSE 3000 ALL`` freezes every Redis client for 3 s (the server holds their
    commands unanswered): requests meanwhile are not slowed; afterwards the index answers."""
    backend = procs.backend()
    proxy = procs.proxy([backend.url], redis_url=redis_server.url, store_timeout=STORE_TIMEOUT_S)
    await warm_up(proxy, http)
    client = redis.Redis(port=redis_server.port)
    try:
        client.client_pause(3000, all=True)
    finally:
        client.close()
    for round_ in range(3):
        assert_all_fast(await burst(http, proxy, 10, f"paused{round_}"), proxy)
    assert await noticed(proxy)
    await recovers(proxy, http)
