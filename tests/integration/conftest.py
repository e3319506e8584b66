"""Fixtures for tests against a real llama-server (marker ``real``)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from fakes import RecordLog

from proxy.app import build_app
from proxy.config import resolve
from proxy.log import get_logger
from proxy.record_writer import RecordWriter
from proxy.records import RequestRecord
from tests.integration.llama import running_llama_server
from tests.integration.tools_template import FLAGS, Proxy, proxied


@pytest.fixture(scope="session")
def llama_url() -> Iterator[str]:
    """One real llama-server (SmolLM2, 2 slots) for the whole session."""
    with running_llama_server(slots=2, ctx=8192) as url:
        yield url


@pytest.fixture(scope="module")
def tools_llama() -> Iterator[str]:
    """One llama-server printing tools and tool calls (one slot: answers comparable)."""
    with running_llama_server(slots=1, ctx=4096, extra=FLAGS) as url:
        yield url


@pytest.fixture
async def proxy(tools_llama: str) -> AsyncIterator[Proxy]:
    """prefixgate with its defaults in front of ``tools_llama``, logging the bodies it forwards."""
    async with proxied(tools_llama) as running:
        yield running


@dataclasses.dataclass
class RunningProxy:
    url: str
    records: list[RequestRecord]
    writer: RecordWriter


@pytest.fixture
async def real_proxy(llama_url: str) -> AsyncIterator[RunningProxy]:
    """prefixgate in process, in front of the real llama-server."""
    writer = RecordWriter(logger=get_logger("test.records"))
    records = RecordLog.of(writer)
    settings = resolve({"backend": [llama_url]}, environ={})
    app = build_app(dataclasses.replace(settings, canonicalize=True), writer=writer)
    server = TestServer(app)
    await server.start_server()
    try:
        yield RunningProxy(url=str(server.make_url("/")), records=records, writer=writer)
    finally:
        await server.close()


def find(records: list[RequestRecord], **match: Any) -> list[RequestRecord]:
    return [r for r in records if all(getattr(r, k) == v for k, v in match.items())]
