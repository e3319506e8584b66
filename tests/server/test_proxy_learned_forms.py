"""Through the proxy: a stable application reaches the backend byte for byte; a shuffling one
is rewritten to its first form, and only a rewrite is counted."""

from __future__ import annotations

from typing import Any

import orjson
from fakes import LlamaFake, MakeProxy

from proxy.exchange import added_fields

# Keys unsorted, tools out of name order, blanks before line ends: everything the fixed rules
# would rewrite, sent the same way every time.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "parameters": {"type": "object", "properties": {"zip": {}, "city": {}}},
            "name": "weather",
            "description": "Weather.  \r\nBy city.",
        },
    },
    {"type": "function", "function": {"name": "search", "parameters": {}}},
]


def body(tools: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [
            {"role": "system", "content": "You help.  \r\nBe brief."},
            {"role": "user", "content": "hi"},
        ],
        "tools": tools,
    }


async def test_a_stable_application_reaches_the_backend_byte_identical(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """Three identical requests: each forwarded with the client's exact bytes (plus only the
    slot id the proxy adds at the end), no rule fired."""
    client, records, _ = await make_proxy(llama_fake.url)
    raw = b'{"model": "fake-model",  "messages": ' + orjson.dumps(body(TOOLS)["messages"])
    raw += b', "tools": ' + orjson.dumps(TOOLS) + b"}"
    for n in range(1, 4):
        headers = {"Content-Type": "application/json"}
        async with client.post("/v1/chat/completions", data=raw, headers=headers) as resp:
            assert resp.status == 200
            assert "X-Prefixgate-Canonical" not in resp.headers
        sent = llama_fake.last_raw
        assert sent is not None and sent.startswith(raw[:-1] + b",")
        assert {k: v for k, v in orjson.loads(sent).items() if k != "id_slot"} == orjson.loads(raw)
        assert (await records.wait(n)).canonical_rules == []


async def test_a_shuffled_request_is_rewritten_to_the_first_form(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """The tools arrive in the other order on the second request: the backend gets the first
    order, and the record names ``stable_json``."""
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json=body(TOOLS)) as resp:
        assert resp.status == 200
    async with client.post("/v1/chat/completions", json=body(TOOLS[::-1])) as resp:
        assert resp.status == 200
        assert resp.headers["X-Prefixgate-Canonical"] == "stable_json"
    assert llama_fake.last_body is not None and llama_fake.last_body["tools"] == TOOLS
    assert (await records.wait(1)).canonical_rules == []
    assert (await records.wait(2)).canonical_rules == ["stable_json"]


def test_added_fields_are_appended_to_the_client_bytes() -> None:
    """Fields only added: spliced after the client's bytes; a replaced field: None."""
    raw = b'{"a": [1, 2],\n "b": "\\u00e9"}\n'
    original = orjson.loads(raw)
    assert added_fields(raw, original, dict(original)) == raw
    spliced = added_fields(raw, original, {**original, "id_slot": 1})
    assert isinstance(spliced, tuple)  # the client's bytes, not a copy, then the fields
    assert isinstance(spliced[0], memoryview) and spliced[0].obj is raw
    assert b"".join(spliced) == b'{"a": [1, 2],\n "b": "\\u00e9","id_slot":1}'
    padded = raw + b" \r\n" * 100  # trailing space past the short scan: the same splice
    assert b"".join(added_fields(padded, original, {**original, "id_slot": 1}) or ()) == (
        b'{"a": [1, 2],\n "b": "\\u00e9","id_slot":1}'
    )
    assert added_fields(raw, original, {**original, "a": [1]}) is None
    assert added_fields(raw, original, {"a": original["a"]}) is None
