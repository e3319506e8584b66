"""Fingerprint and canonicalizer on JSON nested far deeper than a request may be (validation
stops at 128 levels): they still never raise, and the deep fallback renders what json would."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.canonical import Canonicalizer
from proxy.deep_json import deep_json
from proxy.fingerprint import _json, fingerprint

CHAT = "/v1/chat/completions"


def nested(depth: int, leaf: Any = "leaf") -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value, "n": i}
    return value


def stdlib(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=repr)


@pytest.mark.parametrize("depth", [300, 1_000, 5_000, 50_000])
def test_fingerprint_never_raises_on_deep_json(depth: int) -> None:
    body = {
        "model": "m",
        "tools": [nested(depth)],
        "messages": [{"role": "user", "content": [nested(depth)], "x": nested(depth)}],
    }
    first = fingerprint(CHAT, body)
    assert fingerprint(CHAT, body) == first  # deterministic
    other = fingerprint(CHAT, {**body, "tools": [nested(depth, "other")]})
    assert other.block_hashes != first.block_hashes


def test_deep_fallback_renders_what_json_renders() -> None:
    value = nested(600)  # past orjson's 255 levels, within json's reach
    assert deep_json(value) == stdlib(value)
    assert _json(value) == stdlib(value).encode()
    odd = {"s": '"\\\n\x01é\ud800', 2: 2, 1.5: 3, True: None, "f": [float("nan"), float("inf")]}
    assert deep_json(odd) == stdlib(odd)
    assert deep_json({"o": object.__new__(object)}).startswith('{"o":"<object object')
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular"):
        deep_json(loop)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_deep_fallback_matches_json_on_any_value(value: Any) -> None:
    assert deep_json(value) == stdlib(value)


# Only 5,000 levels: the canonicalizer's walk over tool schemas copies each node's path, so it is
# quadratic in depth (about 30 s at 100,000 levels; nothing at the 128 that validation allows).
@pytest.mark.parametrize("depth", [1_000, 5_000])
def test_canonicalizer_never_raises_on_deep_json(depth: int) -> None:
    body = {
        "model": "m",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": nested(depth)}}],
        "messages": [
            {"role": "system", "content": "Today is 2024-05-01.", "x": nested(depth)},
            {"role": "user", "content": "hi"},
        ],
        "response_format": nested(depth),
    }
    result = Canonicalizer().apply(CHAT, body)
    fingerprint(CHAT, result.body)
