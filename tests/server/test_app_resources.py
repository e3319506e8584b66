"""The app's resources (the upstream session, the store, the fleet's monitor) are closed even
when a start step after their opening fails, and the failure reaches the caller."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import proxy.app
from proxy.app import build_app
from proxy.config import resolve
from proxy.fleet import Fleet
from proxy.scheduling.scheduler import Scheduler
from proxy.store import EmbeddedStore
from tests.ports import free_port


class StartFailed(RuntimeError):
    """The start step a test makes fail."""


def fail(*args: Any, **kwargs: Any) -> None:
    raise StartFailed


async def fail_async(*args: Any, **kwargs: Any) -> None:
    raise StartFailed


def monitors() -> list[asyncio.Task[Any]]:
    """The fleet's health-monitor tasks still alive."""
    return [t for t in asyncio.all_tasks() if "_run_monitor" in repr(t.get_coro())]


@pytest.mark.parametrize(
    ("owner", "step", "failing"),
    [
        (Fleet, "from_settings", fail),  # a constructor, right after the store is opened
        (Fleet, "start", fail_async),  # backend detection
        (Scheduler, "start", fail),  # the last step, with the fleet's monitor running
    ],
)
async def test_a_failed_start_step_closes_what_was_opened(
    monkeypatch: pytest.MonkeyPatch, owner: type, step: str, failing: Any
) -> None:
    """Whichever start step fails, the session, the store and the monitor are closed."""
    sessions: list[aiohttp.ClientSession] = []
    stores: list[EmbeddedStore] = []
    closed: list[EmbeddedStore] = []
    open_session = aiohttp.ClientSession.__init__
    open_store = proxy.app.open_store
    close_store = EmbeddedStore.aclose

    def session_spy(self: aiohttp.ClientSession, *args: Any, **kwargs: Any) -> None:
        open_session(self, *args, **kwargs)
        sessions.append(self)

    def store_spy(**kwargs: Any) -> Any:
        store = open_store(**kwargs)
        stores.append(store)
        return store

    async def aclose_spy(self: EmbeddedStore) -> None:
        closed.append(self)
        await close_store(self)

    monkeypatch.setattr(aiohttp.ClientSession, "__init__", session_spy)
    monkeypatch.setattr(proxy.app, "open_store", store_spy)
    monkeypatch.setattr(EmbeddedStore, "aclose", aclose_spy)
    if step == "from_settings":
        monkeypatch.setattr(owner, step, staticmethod(failing))
    else:
        monkeypatch.setattr(owner, step, failing)
    app = build_app(resolve({"backend": [f"http://127.0.0.1:{free_port()}"]}, environ={}))
    runner = web.AppRunner(app)
    with pytest.raises(StartFailed):
        await runner.setup()
    assert len(sessions) == 1 and sessions[0].closed
    assert len(stores) == 1 and closed == stores
    assert monitors() == []
