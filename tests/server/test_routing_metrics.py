"""Backends' own load: llama.cpp /slots or /metrics, vLLM /metrics; folded into routing."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from fakes import LlamaFake, MakeProxy, VllmFake, fleet_proxy, serve

from proxy.backend_metrics import BackendLoad, LoadReader, prometheus_samples
from proxy.config import HealthChecks
from proxy.state import STATE

LLAMA_PAGE = """\
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
"""

VLLM_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0 1700000000000
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0
vllm:num_requests_running_total{model_name="m"} 99.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} NaN
"""


def test_prometheus_samples_llamacpp() -> None:
    """Unlabelled gauges, HELP/TYPE lines skipped."""
    names = ("llamacpp:requests_processing", "llamacpp:requests_deferred")
    assert prometheus_samples(LLAMA_PAGE, names) == dict(zip(names, (2.0, 3.0), strict=True))


def test_prometheus_samples_vllm_sums_label_sets() -> None:
    """Label sets (engines) are summed; timestamps, longer names and NaN are ignored."""
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    assert prometheus_samples(VLLM_PAGE, names) == {
        "vllm:num_requests_running": 3.0,
        "vllm:num_requests_waiting": 4.0,
    }
    assert prometheus_samples("garbage\nvllm:num_requests_running{x} notanumber\n", names) == {}


async def read(fake: LlamaFake | VllmFake, dialect: str, reader: LoadReader) -> BackendLoad | None:
    async with aiohttp.ClientSession() as session:
        return await reader.read(session, fake.url, dialect, timeout_s=2.0)


async def test_llamacpp_slots_first_then_metrics(llama_fake: LlamaFake) -> None:
    """llama.cpp: /slots (busy slots) when served, else /metrics (processing + deferred); the
    source that answered is asked first next time."""
    reader = LoadReader()
    assert await read(llama_fake, "llamacpp", reader) is None  # --no-slots, no --metrics
    llama_fake.load_running, llama_fake.load_waiting = 3, 5
    llama_fake.serve_metrics = True
    assert await read(llama_fake, "llamacpp", reader) == BackendLoad(3.0, 5.0, "/metrics")
    llama_fake.serve_slots = True
    assert await read(llama_fake, "llamacpp", reader) == BackendLoad(3.0, 5.0, "/metrics")
    assert await read(llama_fake, "llamacpp", LoadReader()) == BackendLoad(3.0, 0.0, "/slots")


async def test_vllm_metrics(vllm_fake: VllmFake) -> None:
    """vLLM: running + waiting from /metrics; a generic server reports nothing."""
    vllm_fake.serve_metrics = True
    vllm_fake.load_running, vllm_fake.load_waiting = 2, 7
    load = await read(vllm_fake, "vllm", LoadReader())
    assert load is not None and load.total == 9.0
    assert await read(vllm_fake, "openai", LoadReader()) is None


@pytest.mark.parametrize("kind", ["llamacpp-slots", "llamacpp-metrics", "vllm"])
async def test_backend_load_steers_least_loaded(
    aiohttp_server: Any, make_proxy: MakeProxy, kind: str
) -> None:
    """A replica whose server reports requests of its own is avoided; its load is on its record."""
    fakes: list[LlamaFake | VllmFake]
    if kind == "vllm":
        fakes = [await serve(VllmFake(), aiohttp_server) for _ in range(2)]
    else:
        fakes = [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]
    busy, idle = fakes
    for f in fakes:
        f.serve_metrics = kind != "llamacpp-slots"
        f.serve_slots = isinstance(f, LlamaFake) and kind == "llamacpp-slots"
    busy.load_running = 3
    client, records, app = await fleet_proxy(make_proxy, busy, idle, policy="least-loaded")
    fleet = app[STATE].fleet
    await fleet.check_all()
    reported = fleet[busy.url].backend_load
    assert reported is not None and reported.total == 3.0
    for _ in range(3):
        async with client.post(
            "/v1/chat/completions",
            json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
        ) as resp:
            assert resp.status == 200
    await records.wait(3)
    assert not busy.requests and len(idle.requests) == 3
    busy.load_running = 0
    await fleet.check_all()
    assert fleet[busy.url].load() == 0.0


async def test_load_not_read_when_disabled(aiohttp_server: Any, make_proxy: MakeProxy) -> None:
    """--no-backend-load: the fleet never asks the backends for their load."""
    fake = await serve(LlamaFake(), aiohttp_server)
    fake.serve_slots, fake.load_running = True, 2
    _, _, app = await fleet_proxy(
        make_proxy, fake, health=HealthChecks(interval_s=3600, backend_load=False)
    )
    await app[STATE].fleet.check_all()
    assert app[STATE].fleet[fake.url].backend_load is None
