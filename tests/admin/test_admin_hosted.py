"""GET /stats for hosted-cache fields: conversation keys by source, stripped fields by name,
key_affinity among the routes; every document validated against the published schema."""

from __future__ import annotations

from typing import Any

from admin_traffic import chat, send_all
from fakes import LlamaFake, MakeProxy, fleet_proxy, serve
from stats_schema import assert_valid


async def test_stats_report_keys_and_stripped_fields(
    aiohttp_server: Any, make_proxy: MakeProxy
) -> None:
    """Keyed requests count under hosted.keys by source and route as key_affinity; a generic
    server's stripped fields count under hosted.stripped; unkeyed requests count in neither."""
    fakes = [await serve(LlamaFake(), aiohttp_server) for _ in range(2)]
    client, records, app = await fleet_proxy(make_proxy, *fakes, dialect="openai")
    bodies = [
        chat("coder", "q1") | {"prompt_cache_key": "t1", "prompt_cache_retention": "24h"},
        chat("coder", "q2") | {"prompt_cache_key": "t1"},
        chat("coder", "q3"),
    ]
    await send_all(client, records, app, bodies)
    async with client.admin.get("/stats") as resp:
        assert resp.status == 200
        body = await resp.json()
    assert_valid(body)
    totals = body["totals"]
    assert totals["hosted"] == {
        "keys": {"prompt_cache_key": 2},
        "stripped": {"prompt_cache_key": 2, "prompt_cache_retention": 1},
    }
    assert totals["routes"]["key_affinity"] == 2
    backend = next(iter(body["by_backend"].values()))
    assert set(backend["hosted"]) == {"keys", "stripped"}
