"""The control group through the proxy, against the llama.cpp fake: a control conversation's
bytes reach the backend as the client sent them (no rewrite, no slot pin), a treated one's are
canonicalized; both are recorded with their group, counted per group in ``/metrics`` and
compared in ``/stats``."""

from __future__ import annotations

from typing import Any

import orjson
from fakes import LlamaFake, MakeProxy, fleet_proxy, serve

from proxy.backends import CHAT
from proxy.control import ControlGroup, conversation_key


def body(conversation: int, turn: int) -> dict[str, Any]:
    """A turn of a chat whose system prompt carries a clock (the canonicalizer moves it out)."""
    return {
        "model": "smollm2",
        "messages": [
            {
                "role": "system",
                "content": f"Current time: 2026-12-02T01:{turn:02d}:07Z\nYou are a careful agent.",
            },
            {"role": "user", "content": f"Task {conversation}: fix the failing export."},
            *(
                [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "More."}]
                * turn
            ),
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4,
    }


def conversations(share: float) -> tuple[int, int]:
    """One conversation in the control group and one outside it, at ``share``."""
    group = ControlGroup(share=share)
    found: dict[bool, int] = {}
    for c in range(1000):
        found.setdefault(group.is_control(conversation_key(CHAT, body(c, 0), None)), c)
        if len(found) == 2:
            return found[True], found[False]
    raise AssertionError("no conversation in each group")


async def test_control_bytes_reach_the_backend_unchanged_and_treated_ones_are_canonicalized(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Share 0.5: every turn of the control conversation arrives byte for byte as sent (no
    ``id_slot``, no note), every turn of the treated one rewritten; records say which group."""
    control, treated = conversations(0.5)
    client, records, _ = await make_proxy(llama_fake.url, control=ControlGroup(share=0.5))
    for turn in range(3):
        for conv in (control, treated):
            raw = orjson.dumps(body(conv, turn))
            headers = {"Content-Type": "application/json"}
            async with client.post("/v1/chat/completions", data=raw, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()
                canonical = resp.headers.get("X-Prefixgate-Canonical")
            if conv == control:
                assert llama_fake.last_raw == raw
                assert canonical is None
            else:
                assert llama_fake.last_raw != raw
                assert llama_fake.last_body is not None
                system = llama_fake.last_body["messages"][0]["content"]
                assert "2026-12-02" not in system  # the clock moved out of the prefix
                assert canonical is not None
    groups = [r.control_group for r in records]
    assert groups == [True, False] * 3
    assert all(r.schedule_reason in (None, "slot_unpinned") for r in records[::2])
    assert all(r.route_reason == "single" for r in records)

    async with client.admin.get("/stats") as resp:
        stats = await resp.json()
    block = stats["control_group"]
    assert block["share"] == 0.5
    assert block["groups"]["control"]["requests"] == 3
    assert block["groups"]["treated"]["requests"] == 3
    assert block["groups"]["control"]["conversations"] == 1
    assert set(block["lift"]) == {"cached_share", "ttft_p50_ms", "ttft_p90_ms", "goodput_share"}
    async with client.admin.get("/metrics") as resp:
        text = await resp.text()
    assert 'prefixgate_control_group_requests_total{group="control"} 3.0' in text
    assert 'prefixgate_control_group_requests_total{group="treated"} 3.0' in text


async def test_without_a_control_share_nothing_changes(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Off by default: no record carries a group, ``/stats`` says null, every request is
    canonicalized."""
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json=body(1, 0)) as resp:
        assert resp.status == 200
        assert resp.headers.get("X-Prefixgate-Canonical") is not None
    assert records[0].control_group is None
    assert "control_group" not in records[0].as_dict()
    async with client.admin.get("/stats") as resp:
        assert (await resp.json())["control_group"] is None


async def test_control_requests_are_spread_round_robin_over_replicas(
    llama_fake: LlamaFake, make_proxy: MakeProxy, aiohttp_server: Any
) -> None:
    """Share 1 under prefix affinity: one conversation's turns alternate between two replicas,
    as a plain balancer sends them, where affinity would have kept them on one."""
    second = await serve(LlamaFake(), aiohttp_server)
    client, records, _ = await fleet_proxy(
        make_proxy, llama_fake, second, control=ControlGroup(share=1.0)
    )
    for turn in range(4):
        async with client.post("/v1/chat/completions", json=body(3, turn)) as resp:
            assert resp.status == 200
    assert {r.route_reason for r in records} == {"round_robin"}
    assert len({r.backend for r in records}) == 2
    assert all(r.control_group for r in records)
