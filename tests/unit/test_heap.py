"""The heap trimmer: glibc's free pages given back on a timer, the process's own server only."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import Any

import pytest
from aiohttp import web

from proxy import heap, server
from proxy.heap import HeapTrimmer


async def test_trims_on_its_timer_until_stopped() -> None:
    calls: list[int] = []
    three = asyncio.Event()

    def trim(pad: int) -> None:
        calls.append(pad)
        if len(calls) >= 3:
            three.set()

    trimmer = HeapTrimmer(0.01, trim=trim)
    trimmer.start()
    trimmer.start()  # idempotent: one timer
    await asyncio.wait_for(three.wait(), 5)
    trimmer.stop()
    done = len(calls)
    assert set(calls) == {0}  # malloc_trim(0): every arena, no padding kept
    assert trimmer.trims == done and trimmer.seconds >= 0.0
    await asyncio.sleep(0.03)
    assert len(calls) == done  # stopped


async def test_a_failing_trim_stops_trimming() -> None:
    calls = 0
    tried = asyncio.Event()

    def trim(pad: int) -> int:
        nonlocal calls
        calls += 1
        tried.set()
        raise OSError("no")

    trimmer = HeapTrimmer(0.01, trim=trim)
    trimmer.start()
    await asyncio.wait_for(tried.wait(), 5)
    await asyncio.sleep(0.03)
    assert calls == 1
    assert not trimmer.available
    trimmer.start()  # nothing left to start
    await asyncio.sleep(0.02)
    assert calls == 1


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        HeapTrimmer(0)


async def test_without_malloc_trim_nothing_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    trimmer = HeapTrimmer(0.01)
    assert not trimmer.available
    trimmer.start()
    trimmer.trim()
    await asyncio.sleep(0.02)
    assert trimmer.trims == 0


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_free_heap_pages_go_back_to_the_system() -> None:
    """Buffers freed between live objects keep their pages resident until a trim."""
    trimmer = HeapTrimmer()
    assert trimmer.available
    trimmer.trim()
    size = 96 * 1024  # under glibc's initial mmap threshold: served from the heap
    total = 320 * size  # 30 MiB
    big = [b"\x01" * size for _ in range(320)]  # every page written (not calloc's zero pages)
    pin = b"\x02" * size  # live above them: the heap's top cannot shrink past it
    before = _rss()
    del big
    freed = _rss()
    trimmer.trim()
    after = _rss()
    assert trimmer.trims == 2
    assert before - freed < 0.2 * total  # freed, but still resident
    assert freed - after > 0.6 * total  # given back
    del pin


async def test_the_process_server_starts_and_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    class Recording(HeapTrimmer):
        def start(self) -> None:
            events.append("start")

        def stop(self) -> None:
            events.append("stop")

    monkeypatch.setattr(server, "HeapTrimmer", Recording)
    monkeypatch.setattr(server, "tune_collector", lambda: events.append("gc"))
    app = web.Application()
    task = asyncio.ensure_future(server.serve_app(app, host="127.0.0.1", port=0, tune_process=True))
    for _ in range(200):
        await asyncio.sleep(0.01)
        if "start" in events:
            break
    assert events == ["gc", "start"]
    os.kill(os.getpid(), signal.SIGTERM)  # serve_app's own handler: a graceful stop
    await asyncio.wait_for(task, 10)
    assert events == ["gc", "start", "stop"]


async def test_an_embedded_server_leaves_the_heap_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[Any] = []

    class Recording(HeapTrimmer):
        def start(self) -> None:
            events.append("start")

    monkeypatch.setattr(server, "HeapTrimmer", Recording)
    app = web.Application()
    task = asyncio.ensure_future(server.serve_app(app, host="127.0.0.1", port=0))
    await asyncio.sleep(0.2)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 10)
    assert events == []
