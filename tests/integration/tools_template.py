"""What the tests of what the model sees share: the tools template, prefixgate in front of a
server that prints tools and tool calls, and the server's own rendering of a request."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from fakes import RecordLog

from proxy.app import build_app
from proxy.config import resolve
from proxy.log import get_logger
from proxy.record_writer import RecordWriter
from proxy.records import RequestRecord

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "templates" / "chatml-tools.jinja"
FLAGS = ("--jinja", "--chat-template-file", str(TEMPLATE))


@dataclasses.dataclass
class Proxy:
    url: str
    records: list[RequestRecord]


@asynccontextmanager
async def proxied(backend: str) -> AsyncIterator[Proxy]:
    """prefixgate with its defaults in front of ``backend``, logging the bodies it forwards."""
    writer = RecordWriter(logger=get_logger("test.records"))
    records = RecordLog.of(writer)
    settings = resolve({"backend": [backend]}, environ={})
    app = build_app(dataclasses.replace(settings, log_prompts=True), writer=writer)
    server = TestServer(app)
    await server.start_server()
    try:
        yield Proxy(url=str(server.make_url("")).rstrip("/"), records=records)
    finally:
        await server.close()


async def rendered(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> str:
    """The prompt the server's template makes of ``body``."""
    async with session.post(url + "/apply-template", json=body) as resp:
        assert resp.status == 200, await resp.text()
        prompt = (await resp.json())["prompt"]
    assert isinstance(prompt, str)
    return prompt


def arithmetic_conversation(system: str, n: int) -> list[dict[str, Any]]:
    """The messages of a scripted conversation's n-th request: ``system``, then n questions and
    their answers, then the n-th question (the real-backend tests of what reaches the prompt)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for i in range(n):
        messages += [
            {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."},
        ]
    messages.append({"role": "user", "content": f"Question {n}: what is {n} plus {n}?"})
    return messages
