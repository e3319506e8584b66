"""Learned volatile spans shared through the store: a proxy relocates what another learned."""

from __future__ import annotations

from typing import Any

from redis_process import StoreFactory

from proxy.canonical import Canonicalizer
from proxy.canonical.span_memory import STORE_KEY, STORE_KIND
from proxy.store import EmbeddedStore

CHAT = "/v1/chat/completions"
BASE = "You are the release assistant of Contoso. Answer briefly and precisely, please.\n"
BUILDS = ["7f3a-19", "8c21-04", "91ab-77", "0d0e-11", "aa12-93"]


def body(n: int) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": f"Build: {BUILDS[n]}\n" + BASE},
            {"role": "user", "content": f"Question {n}?"},
        ],
    }


async def test_a_proxy_relocates_a_span_another_proxy_learned(make_store: StoreFactory) -> None:
    """Proxy A learns the pattern from three requests; proxy B (its own store client) relocates
    the value from its first request of that tenant; another tenant learns on its own."""
    first_store = await make_store()
    second_store = first_store if isinstance(first_store, EmbeddedStore) else await make_store()
    a, b = Canonicalizer(), Canonicalizer()
    assert a.spans is not None and b.spans is not None
    a.spans.bind(first_store)
    b.spans.bind(second_store)
    for n in range(3):
        await a.canonicalize(CHAT, body(n), namespace="t")
    await a.spans.drain()
    (stored,) = await second_store.recall("t", STORE_KIND, [STORE_KEY])
    assert stored is not None and b"Build: " in stored
    result = await b.canonicalize(CHAT, body(3), namespace="t")
    assert result.fired == ("volatile_learned",)
    assert result.body["messages"][0]["content"] == "Build: [[build_1]]\n" + BASE
    assert result.learned_spans == tuple(p.id for p in a.spans.patterns("t"))
    other = await b.canonicalize(CHAT, body(3), namespace="u")
    assert other.fired == ()
    await b.spans.drain()
