"""Learned canonical forms shared through the store: every proxy rewrites to the first form."""

from __future__ import annotations

from typing import Any

from redis_process import StoreFactory

from proxy.canonical import Canonicalizer
from proxy.canonical.forms import FormMemory
from proxy.store import EmbeddedStore

CHAT = "/v1/chat/completions"


def body(names: list[str]) -> dict[str, Any]:
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in names
    ]
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": tools}


async def test_a_proxy_adopts_the_form_another_proxy_learned(make_store: StoreFactory) -> None:
    """Proxy A sees the set first; proxy B (its own store client) sees it shuffled and sends
    A's order; a third set B sees first is A's to adopt in turn."""
    first_store = await make_store()
    second_store = first_store if isinstance(first_store, EmbeddedStore) else await make_store()
    one, two = FormMemory(), FormMemory()
    one.bind(first_store)
    two.bind(second_store)
    a, b = Canonicalizer(forms=one), Canonicalizer(forms=two)
    first = body(["weather", "clock"])
    assert (await a.canonicalize(CHAT, first, namespace="t")).body is first
    await one.drain()
    result = await b.canonicalize(CHAT, body(["clock", "weather"]), namespace="t")
    assert result.body["tools"] == first["tools"] and result.fired == ("stable_json",)
    other = body(["x", "y"])
    assert (await b.canonicalize(CHAT, other, namespace="t")).body is other
    await two.drain()
    adopted = await a.canonicalize(CHAT, body(["y", "x"]), namespace="t")
    assert adopted.body["tools"] == other["tools"]
    # Another tenant has its own forms.
    elsewhere = body(["clock", "weather"])
    assert (await b.canonicalize(CHAT, elsewhere, namespace="u")).body is elsewhere
