"""The control group on a real llama-server (SmolLM2, two slots): control conversations are left
to the server's slot choice and still known to the slot picture; treated ones keep their pins."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from fakes import RecordLog

from proxy.app import build_app
from proxy.backends import CHAT
from proxy.config import resolve
from proxy.control import ControlGroup, conversation_key
from proxy.log import get_logger
from proxy.record_writer import RecordWriter
from proxy.records import RequestRecord
from proxy.scheduling.config import SchedulingConfig

pytestmark = [pytest.mark.real, pytest.mark.timeout(600)]

INSTRUCTIONS = " ".join(
    f"Rule {i}: answer questions about module {i} with one short sentence." for i in range(40)
)


def turn(conversation: int, n: int) -> dict[str, Any]:
    """Turn ``n`` of a conversation whose system prompt opens with a clock."""
    history: list[dict[str, str]] = []
    for i in range(n):
        history += [
            {"role": "assistant", "content": f"Module {conversation} step {i} is done."},
            {"role": "user", "content": f"Now step {i + 1}."},
        ]
    return {
        "model": "smollm2",
        "messages": [
            # A clock to the second, different on every request of every conversation.
            {"role": "system", "content": f"Time: 01:{n:02d}:{conversation:02d}. {INSTRUCTIONS}"},
            {"role": "user", "content": f"Conversation {conversation}: fix module {conversation}."},
            *history,
        ],
        "max_tokens": 4,
        "temperature": 0,
    }


def pick(share: float) -> tuple[list[int], list[int]]:
    """Two conversations in the control group and two outside it."""
    group = ControlGroup(share=share)
    control: list[int] = []
    treated: list[int] = []
    for c in range(200):
        side = control if group.is_control(conversation_key(CHAT, turn(c, 0))) else treated
        if len(side) < 2:
            side.append(c)
    return control, treated


async def test_control_requests_are_unpinned_and_never_seen_as_foreign(llama_url: str) -> None:
    """Share 0.5, two control and two treated conversations interleaved over three turns, the
    proxy reading ``/slots`` often: control requests are ``slot_unpinned`` with the slot the
    server chose learned from its answer; no treated request is ever refused a pin as
    ``slot_foreign``; the treated turns are served from cache far more than the control ones."""
    control, treated = pick(0.5)
    writer = RecordWriter(logger=get_logger("test.records"))
    records = RecordLog.of(writer)
    settings = dataclasses.replace(
        resolve({"backend": [llama_url]}, environ={}),
        control=ControlGroup(share=0.5),
        scheduling=SchedulingConfig(slots_poll_s=0.2),
    )
    server = TestServer(build_app(settings, writer=writer))
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            for n in range(3):
                for c in (control[0], treated[0], control[1], treated[1]):
                    url = str(server.make_url("/v1/chat/completions"))
                    async with session.post(url, json=turn(c, n)) as resp:
                        assert resp.status == 200, await resp.text()
                        await resp.read()
                    await asyncio.sleep(0.3)  # a /slots read between requests
    finally:
        await server.close()
    assert len(records) == 12
    ctrl = [r for r in records if r.control_group]
    rest = [r for r in records if r.control_group is False]
    assert len(ctrl) == len(rest) == 6
    assert {r.schedule_reason for r in ctrl} == {"slot_unpinned"}
    assert all(r.slot is not None for r in ctrl)  # learned from the server's answer
    assert "slot_foreign" not in {r.schedule_reason for r in rest}
    later = records[4:]  # the second and third turns

    def share(rs: list[RequestRecord]) -> float:
        return sum(r.cached_tokens or 0 for r in rs) / sum(r.prompt_tokens or 0 for r in rs)

    assert share([r for r in later if r.control_group is False]) > 0.5
    assert share([r for r in later if r.control_group]) < 0.2
