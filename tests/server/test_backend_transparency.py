"""Background work leaves a backend as it is; a backend behind an API key is still understood.

The fakes here are llama-server fakes with what the real server does (``tests/integration``
checks it on the real one): ``/props`` says ``is_sleeping`` and never wakes it, ``/slots``
wakes it; with an API key every route but ``/health`` answers 401 in llama.cpp's error shape.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from fakes import Knobs, LlamaFake, MakeProxy, SlotLlamaFake, VllmFake, fleet_proxy, serve
from structlog.testing import LogCapture

from proxy.config import HealthChecks
from proxy.control import ControlGroup
from proxy.scheduling.config import SchedulingConfig
from proxy.state import STATE

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


class SleepyLlama(LlamaFake):
    """A llama-server fake with ``--sleep-idle-seconds``: asleep until a request wakes it.

    ``/slots`` wakes it, as the real server does; ``/props`` and ``/health`` do not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.sleeping = True
        self.wakes = 0
        self.slots_reads = 0
        self.serve_slots = True

    def _wake(self) -> None:
        if self.sleeping:
            self.sleeping = False
            self.wakes += 1

    async def props(self, request: web.Request) -> web.Response:
        resp = await super().props(request)
        assert resp.text is not None
        props = json.loads(resp.text)
        props["is_sleeping"] = self.sleeping
        return web.json_response(props)

    async def slots(self, request: web.Request) -> web.Response:
        self.slots_reads += 1
        self._wake()
        return await super().slots(request)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self._wake()
        return await super().chat(request)


class ProtectedLlama(LlamaFake):
    """A llama-server fake started with ``--api-key``: only ``/health`` is public."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.refused: list[str] = []

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def api_key(request: web.Request, handler: Any) -> web.StreamResponse:
            given = request.headers.get("Authorization", "").removeprefix("Bearer ")
            if request.path in ("/health", "/v1/health") or given == self.key:
                return await handler(request)
            self.refused.append(request.path)
            body = {"error": {"message": "Invalid API Key", "type": "authentication_error"}}
            body["error"]["code"] = 401  # type: ignore[index]
            return web.json_response(body, status=401)

        app.middlewares.append(api_key)
        return app


async def test_a_sleeping_backend_stays_asleep(
    aiohttp_server: Any, make_proxy: MakeProxy, log_capture: LogCapture
) -> None:
    """While /props says it sleeps: no /slots, load zero, ready; a request still wakes it."""
    fake = await serve(SleepyLlama(), aiohttp_server)
    client, _, app = await fleet_proxy(
        make_proxy, fake, scheduling=SchedulingConfig(slots_poll_s=0.05)
    )
    fleet = app[STATE].fleet
    for _ in range(3):
        await fleet.check_all()
    await asyncio.sleep(0.3)  # the scheduler's /slots reader had several turns
    replica = fleet[fake.url]
    assert fake.wakes == 0 and fake.slots_reads == 0
    assert replica.asleep and replica.healthy
    assert replica.backend_load is not None and replica.backend_load.total == 0
    assert any(e["event"] == "backend_sleeping" for e in log_capture.entries)
    async with client.admin.get("/readyz") as resp:
        assert resp.status == 200
    async with client.post("/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    assert fake.wakes == 1  # the client's request woke it, nothing else
    await fleet.check_all()
    assert not replica.asleep


async def test_a_quiet_backend_is_not_polled(aiohttp_server: Any, make_proxy: MakeProxy) -> None:
    """Load is read while there is some to see; once idle with nothing in flight, no more."""
    fake = await serve(SleepyLlama(), aiohttp_server)
    fake.sleeping = False
    # (the scheduler's own reader parked: only the rounds read, so the counts below are exact)
    _, _, app = await fleet_proxy(make_proxy, fake, scheduling=SchedulingConfig(slots_poll_s=3600))
    fleet = app[STATE].fleet
    replica = fleet[fake.url]
    reads = fake.slots_reads  # the start-up round's
    for _ in range(3):
        await fleet.check_all()
    assert fake.slots_reads <= max(reads, 1)
    assert replica.load_paused and not replica.may_poll_slots
    replica.in_flight = 1  # a request of this proxy's is running there: read again
    assert replica.may_poll_slots  # at once, not at the next round
    await fleet.check_all()
    assert fake.slots_reads == max(reads, 1) + 1 and not replica.load_paused
    replica.in_flight = 0


async def test_a_quiet_backend_is_read_for_the_slot_of_a_request_it_places(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """A control-group request on a quiet llama-server: the server picks its slot and its chat
    answer does not say which, so the proxy reads ``/slots`` while the request runs there;
    quiet since the last round does not stop that read, and the record has the slot."""
    fake = await serve(SlotLlamaFake(Knobs(token_delay_s=0.1), slots=2), aiohttp_server)
    client, records, app = await fleet_proxy(
        make_proxy,
        fake,
        scheduling=SchedulingConfig(slots_poll_s=0.05),
        control=ControlGroup(share=1.0),
    )
    fleet = app[STATE].fleet
    replica = fleet[fake.url]
    await fleet.check_all()
    assert replica.load_paused  # quiet: the next round is an hour away
    async with client.post("/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
        await resp.read()
    record = await records.wait(1)
    assert record.control_group and record.schedule_reason == "slot_unpinned"
    assert record.slot in (0, 1)
    assert not replica.may_poll_slots  # quiet again once nothing of ours runs there


async def test_busy_backend_is_polled_every_round(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """A backend reporting work of its own keeps being read (traffic from elsewhere)."""
    fake = await serve(SleepyLlama(), aiohttp_server)
    fake.sleeping, fake.load_running = False, 2
    _, _, app = await fleet_proxy(make_proxy, fake)
    fleet = app[STATE].fleet
    before = fake.slots_reads
    for _ in range(3):
        await fleet.check_all()
    assert fake.slots_reads == before + 3
    load = fleet[fake.url].backend_load
    assert load is not None and load.total == 2


async def test_protected_backend_without_its_key(
    aiohttp_server: Any, make_proxy: MakeProxy, log_capture: LogCapture
) -> None:
    """401 on /props with a public /health: llama.cpp, up and ready, protected, not ejected."""
    fake = await serve(ProtectedLlama("sk-backend"), aiohttp_server)
    client, _, app = await fleet_proxy(make_proxy, fake)
    replica = app[STATE].fleet[fake.url]
    assert replica.dialect.name == "llamacpp" and replica.detected
    assert replica.healthy and replica.protected
    assert replica.info is not None and replica.info.protected and replica.info.slots is None
    assert not any(e["event"] == "backend_ejected" for e in log_capture.entries)
    assert any(e["event"] == "backend_protected" for e in log_capture.entries)
    async with client.admin.get("/readyz") as resp:
        assert resp.status == 200
    async with client.post("/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 401  # the backend's own refusal, relayed
    refused = len(fake.refused)
    for _ in range(3):
        await app[STATE].fleet.check_all()
    assert fake.refused[refused:] == []  # nothing in the background it would refuse


async def test_protected_backend_with_its_key(aiohttp_server: Any, make_proxy: MakeProxy) -> None:
    """With --backend-api-key every probe and load read carries it: slots and context known."""
    fake = await serve(ProtectedLlama("sk-backend"), aiohttp_server)
    fake.serve_slots = True
    client, _, app = await fleet_proxy(
        make_proxy, fake, backend_api_key="sk-backend", health=HealthChecks(interval_s=3600)
    )
    fleet = app[STATE].fleet
    await fleet.check_all()
    replica = fleet[fake.url]
    assert replica.dialect.name == "llamacpp" and not replica.protected
    assert replica.info is not None and replica.info.slots == fake.total_slots
    assert replica.backend_load is not None and replica.backend_load.source == "/slots"
    assert fake.refused == []
    async with client.post("/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200


async def test_vllm_load_is_read_every_round(aiohttp_server: Any, make_proxy: MakeProxy) -> None:
    """vLLM's /metrics has no side effect: read every round, idle or not."""
    fake = await serve(VllmFake(), aiohttp_server)
    fake.serve_metrics = True
    _, _, app = await fleet_proxy(make_proxy, fake)
    fleet = app[STATE].fleet
    for _ in range(2):
        await fleet.check_all()
    fake.load_running = 2
    await fleet.check_all()
    load = fleet[fake.url].backend_load
    assert load is not None and load.total == 2 and not fleet[fake.url].load_paused
