"""Fixtures for the reliability suite: the proxy and its backends as real processes.

``stack`` is one ``prefixgate serve`` process in front of one fake backend process, shared by
the whole session (bad-input tests, fuzzing and single-request faults steered by ``X-Fault``).
Its timeouts are short so faults resolve quickly: connect 0.5 s, idle 1 s, client body 1 s; its
body limit is 1 MiB. Tests that kill a process start their own through ``procs``, which stops
whatever is left at the end of the test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.reliability.processes import ChildProcess, FakeBackendProcess, ProxyProcess

BODY_LIMIT = 1024 * 1024
IDLE_S = 1.0
CONNECT_S = 0.5
CLIENT_S = 1.0


@dataclass
class Stack:
    """A proxy process in front of a fake backend process."""

    backend: FakeBackendProcess
    proxy: ProxyProcess

    def assert_alive(self) -> None:
        assert self.proxy.alive, f"the proxy died:\n{self.proxy.output_tail()}"


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """One proxy + fake backend for the session, with short timeouts and a 1 MiB body limit."""
    backend = FakeBackendProcess().start()
    proxy = ProxyProcess(
        [backend.url],
        connect_timeout=CONNECT_S,
        idle_timeout=IDLE_S,
        client_timeout=CLIENT_S,
        max_body_bytes=BODY_LIMIT,
    )
    try:
        proxy.start()
        yield Stack(backend, proxy)
    finally:
        for proc in (proxy, backend):
            proc.stop()
            proc.remove_files()


class Procs:
    """Processes a test starts for itself; all stopped when the test ends."""

    def __init__(self) -> None:
        self._started: list[ChildProcess] = []

    def backend(self, *, port: int | None = None, start: bool = True) -> FakeBackendProcess:
        proc = FakeBackendProcess(port=port)
        self._started.append(proc)
        return proc.start() if start else proc

    def proxy(self, backends: list[str], **options: Any) -> ProxyProcess:
        proc = ProxyProcess(backends, **options)
        self._started.append(proc)
        return proc.start()

    def stop_all(self) -> None:
        for proc in reversed(self._started):
            proc.stop()
            proc.remove_files()


@pytest.fixture
def procs() -> Iterator[Procs]:
    """Start processes for this test only."""
    started = Procs()
    try:
        yield started
    finally:
        started.stop_all()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session with no connection limit (faults are tested under concurrency)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session
