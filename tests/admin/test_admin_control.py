"""``/stats`` with a control group: the ``control_group`` block matches the published schema and
the records it was computed from."""

from __future__ import annotations

from admin_traffic import mixed_requests, send_all
from fakes import LlamaFake, MakeProxy
from stats_schema import assert_valid

from proxy.control import ControlGroup


async def test_control_group_block_is_valid_and_adds_up(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Every question is its own conversation (its own first message): the groups' requests add
    up to the traffic, each figure has a value and an interval, and the document validates."""
    client, records, app = await make_proxy(llama_fake.url, control=ControlGroup(share=0.5))
    bodies = mixed_requests(per_app=6)
    await send_all(client, records, app, bodies)
    async with client.admin.get("/stats") as resp:
        stats = await resp.json()
    assert_valid(stats)
    block = stats["control_group"]
    groups = block["groups"]
    assert groups["treated"]["requests"] + groups["control"]["requests"] == len(bodies)
    assert groups["control"]["requests"] == sum(1 for r in records if r.control_group)
    assert groups["treated"]["conversations"] >= 2 and groups["control"]["conversations"] >= 2
    for name in ("cached_share", "ttft_p50_ms", "goodput_share"):
        est = block["lift"][name]
        low, high = est["ci"]
        assert est["value"] is not None and low is not None and high is not None, name
        assert low <= est["value"] <= high, name
    control_cached = sum(r.cached_tokens or 0 for r in records if r.control_group)
    assert groups["control"]["cached_tokens"] == control_cached
