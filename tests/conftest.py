"""Shared fixtures: fake backends, a proxy in front of them, and isolated logging.

``make_proxy(backend_url, **overrides)`` builds ``Settings`` for one backend (fields of
``Settings`` can be overridden, e.g. ``timeouts=Timeouts(idle=0.2)``), starts the proxy app
in-process and returns ``(client, records, app)``; ``records`` is a list that receives every
``RequestRecord`` and can ``await records.wait(n)`` for records written after the response ended.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import structlog
from aiohttp import web
from fakes import LlamaFake, MakeProxy, ProxyClient, RecordLog, VllmFake, serve
from hypothesis import settings
from structlog.testing import LogCapture

from proxy.app import build_app
from proxy.config import resolve
from proxy.log import get_logger
from proxy.record_writer import RecordWriter

# Property tests explore new random examples on every local run; in CI they replay a fixed
# sequence, so a run's outcome depends on the commit alone (a counterexample found locally is
# kept in .hypothesis/ and replayed first next time).
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(autouse=True)
def log_capture() -> Iterator[LogCapture]:
    """structlog into memory for the test, reset afterwards so no global state leaks."""
    cap = LogCapture()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            cap,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=False,
    )
    yield cap
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()


@pytest.fixture
async def llama_fake(aiohttp_server: Any) -> LlamaFake:
    """A llama-server fake listening on a free port (its base URL in ``.url``)."""
    return await serve(LlamaFake(), aiohttp_server)


@pytest.fixture
async def vllm_fake(aiohttp_server: Any) -> VllmFake:
    """A vLLM fake listening on a free port (its base URL in ``.url``)."""
    return await serve(VllmFake(), aiohttp_server)


@pytest.fixture
async def make_proxy() -> AsyncIterator[MakeProxy]:
    """Factory: the proxy in front of ``backend_url`` with ``Settings`` overrides.

    The client it returns speaks to the traffic listener; ``client.admin`` to the admin one.
    Every record the proxies write must match the published record schema.
    """
    opened: list[ProxyClient] = []
    logs: list[RecordLog] = []

    async def make(
        backend_url: str, **overrides: Any
    ) -> tuple[ProxyClient, RecordLog, web.Application]:
        settings = resolve({"backend": [backend_url]}, environ={})
        settings = dataclasses.replace(settings, **overrides)
        records = RecordLog()
        logs.append(records)
        writer = RecordWriter(logger=get_logger("prefixgate.records"))
        writer.add_sink(records.append)
        records.writer = writer
        app = build_app(settings, writer=writer)
        client = ProxyClient(app)
        opened.append(client)
        await client.start_server()
        return client, records, app

    yield make
    for client in reversed(opened):
        await client.close()
    problems = [p for records in logs for p in records.schema_problems]
    assert not problems, "records outside docs/schemas/record-v1.schema.json:\n" + "\n".join(
        problems[:20]
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI a skipped test is a failure: the real-backend and Redis tests must run there."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if os.environ.get("CI") and skipped:
        print(f"\nCI: {len(skipped)} test(s) were skipped; failing the run")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
