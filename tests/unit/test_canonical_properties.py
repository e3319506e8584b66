"""Properties of the canonicalizer over generated requests: total, idempotent, deterministic,
never mutating, and touching only the spans its rules claim."""

from __future__ import annotations

import copy
import random
from collections import Counter
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.canonical import CanonicalConfig, Canonicalizer, CustomPattern
from proxy.canonical.config import NOTE_PLACEMENTS

CHAT = "/v1/chat/completions"
ROUTES = ("/v1/chat/completions", "/v1/completions", "/completion", "/v1/embeddings")
PROPERTIES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Arbitrary JSON: integers of any size and every string orjson can parse.
any_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
# JSON that orjson can serialize (so the output can be compared byte for byte).
int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
plain_json = st.recursive(
    st.none()
    | st.booleans()
    | int64
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(st.characters(exclude_categories=["Cs"]), max_size=12),
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(
            st.sampled_from(["a", "b", "type", "z", "description"]), children, max_size=4
        )
    ),
    max_leaves=12,
)
FRAGMENTS = [
    "2026-11-30T22:41:07Z",
    "Monday, November 30, 2026",
    "Mon, 30 Nov 2026 22:41:00 +0000",
    "22:41:07",
    "timestamp: 1764542467",
    "550e8400-e29b-41d4-a716-446655440000",
    "4bf92f3577b34da6a3ce929d0e0e4736",
    "req_42",
    "[[date_1]]",
    "[[uuid_3]] = x",
    "\r\n",
    "\r",
    "  \n",
    "\t",
    " ",
    "\n",
    "Date: ",
    "é",
    "{",
    "}",
    "\\",
    '"',
]
text = st.lists(
    st.sampled_from(FRAGMENTS) | st.text(st.characters(exclude_categories=["Cs"]), max_size=6),
    max_size=8,
).map("".join)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries(
        {"type": st.just("text"), "text": text, "cache_control": st.just({"type": "ephemeral"})}
    ),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": text})}
    ),
    text,
    plain_json,
)
content = st.one_of(text, st.lists(part, max_size=3), st.none(), plain_json)
arguments = st.one_of(
    plain_json.map(lambda v: orjson.dumps(v).decode()),
    st.dictionaries(st.sampled_from(["b", "a", "c"]), plain_json, max_size=3).map(
        lambda d: orjson.dumps(d, option=orjson.OPT_INDENT_2).decode()
    ),
    text,
    plain_json,
)
tool_call = st.fixed_dictionaries(
    {
        "id": st.text(max_size=5),
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["f", "g"]), "arguments": arguments}
        ),
    }
)
message = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
            "content": content,
        },
        optional={"tool_calls": st.lists(tool_call, max_size=2), "name": text},
    ),
    plain_json,
)
schema = st.recursive(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["string", "integer"])},
        optional={"description": text, "enum": st.lists(text, max_size=2)},
    ),
    lambda children: st.fixed_dictionaries(
        {
            "type": st.just("object"),
            "properties": st.dictionaries(
                st.sampled_from(["q", "a", "description", "z"]), children, max_size=3
            ),
        },
        optional={"description": text, "required": st.lists(st.sampled_from(["q", "a"]))},
    ),
    max_leaves=6,
)
tool = st.one_of(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.sampled_from(["search", "read", "write", "search"])},
                optional={"description": text, "parameters": schema, "strict": st.booleans()},
            ),
        },
        optional={"cache_control": st.just({"type": "ephemeral"})},
    ),
    plain_json,
)
chat_body = st.fixed_dictionaries(
    {"model": st.sampled_from(["m", "qwen"]), "messages": st.lists(message, max_size=6)},
    optional={
        "tools": st.lists(tool, max_size=4),
        "functions": st.lists(schema.map(lambda s: {"name": "h", "parameters": s}), max_size=2),
        "response_format": st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries({"name": st.just("r"), "schema": schema}),
            }
        ),
        "tool_choice": plain_json,
        "stream": st.booleans(),
    },
)
config = st.builds(
    CanonicalConfig,
    note_placement=st.sampled_from(NOTE_PLACEMENTS),
    custom_patterns=st.just((CustomPattern("request_id", r"req_(\d+)"),)),
)


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


@PROPERTIES
@given(
    body=st.dictionaries(st.text(max_size=10), any_json, max_size=6) | chat_body,
    route=st.sampled_from(ROUTES),
)
def test_never_raises_and_never_mutates(body: dict[str, Any], route: str) -> None:
    """Any JSON object body, on any route: no exception, no rule error, input untouched."""
    before = copy.deepcopy(body)
    canonicalizer = Canonicalizer()
    result = canonicalizer.apply(route, body)
    assert body == before
    assert sum(canonicalizer.error_counters.values()) == 0
    result.stable_bytes_gained  # measuring never raises either  # noqa: B018


@PROPERTIES
@given(body=chat_body, cfg=config)
def test_idempotent(body: dict[str, Any], cfg: CanonicalConfig) -> None:
    """Canonicalizing a canonical request changes nothing (same bytes, nothing fired)."""
    canonicalizer = Canonicalizer(cfg)
    once = canonicalizer.apply(CHAT, body).body
    again = canonicalizer.apply(CHAT, once)
    assert dumps(again.body) == dumps(once)
    assert again.fired == ()
    assert sum(canonicalizer.error_counters.values()) == 0


@PROPERTIES
@given(body=chat_body, seed=st.integers(0, 2**16))
def test_deterministic_under_reordering(body: dict[str, Any], seed: int) -> None:
    """The same logical request (tools and schema keys reordered) gives the same bytes."""
    shuffled = copy.deepcopy(body)
    rng = random.Random(seed)
    if isinstance(shuffled.get("tools"), list) and not any(
        isinstance(t, dict) and "cache_control" in t for t in shuffled["tools"]
    ):
        rng.shuffle(shuffled["tools"])
        shuffled["tools"] = [  # key order is owned only inside function tools
            _shuffle_keys(t, rng)
            if isinstance(t, dict) and isinstance(t.get("function"), dict)
            else t
            for t in shuffled["tools"]
        ]
    a = Canonicalizer().apply(CHAT, body).body
    b = Canonicalizer().apply(CHAT, shuffled).body
    if _has_duplicate_tools(body):
        return  # same-named tools keep the order they came in
    assert dumps(a.get("tools")) == dumps(b.get("tools"))
    assert dumps(a) == dumps({k: b[k] for k in a})


def _shuffle_keys(value: Any, rng: random.Random) -> Any:
    if isinstance(value, dict):
        keys = list(value)
        rng.shuffle(keys)
        return {k: value[k] if k == "cache_control" else _shuffle_keys(value[k], rng) for k in keys}
    if isinstance(value, list):
        return [_shuffle_keys(v, rng) for v in value]
    return value


def _has_duplicate_tools(body: dict[str, Any]) -> bool:
    """Whether two tools share a name (or lack one): the stable sort keeps their order."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return False
    names = [
        t["function"].get("name")
        if isinstance(t, dict) and isinstance(t.get("function"), dict)
        else None
        for t in tools
    ]
    return len(set(names)) < len(names)


def _without_arguments(call: Any) -> Any:
    """A tool call with its arguments taken out (the one part stable_json may rewrite)."""
    if not (isinstance(call, dict) and isinstance(call.get("function"), dict)):
        return dumps(call)
    function = {k: v for k, v in call["function"].items() if k != "arguments"}
    return dumps({**call, "function": function})


def _key_sets(value: Any, out: Counter[tuple[str, ...]]) -> Counter[tuple[str, ...]]:
    if isinstance(value, dict):
        out[tuple(sorted(value))] += 1
        for v in value.values():
            _key_sets(v, out)
    elif isinstance(value, list):
        for v in value:
            _key_sets(v, out)
    return out


@PROPERTIES
@given(body=chat_body, cfg=config)
def test_only_claimed_spans_change(body: dict[str, Any], cfg: CanonicalConfig) -> None:
    """Conversation turns keep order and bytes (bar the note and tool-call arguments); no
    object gains or loses a key; fields no rule owns are the same objects."""
    out = Canonicalizer(cfg).apply(CHAT, body).body
    messages, new = body["messages"], out["messages"]
    assert len(new) == len(messages)
    users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
    # The message the note may go to: the newest user message, or with last_suffix the newest
    # message when it is a user or tool message.
    noted = users[-1] if users else None
    if cfg.note_placement == "last_suffix":
        last = messages[-1] if messages else None
        noted = (
            len(messages) - 1
            if isinstance(last, dict) and last.get("role") in ("user", "tool")
            else None
        )
    for i, (old, cur) in enumerate(zip(messages, new, strict=True)):
        role = old.get("role") if isinstance(old, dict) else None
        if role in ("system", "developer"):
            continue
        if i == noted:
            assert {k: v for k, v in cur.items() if k != "content"} == {
                k: v for k, v in old.items() if k != "content"
            }
            continue
        if role == "assistant" and "tool_calls" in old:
            strip = {k: v for k, v in old.items() if k != "tool_calls"}
            assert {k: v for k, v in cur.items() if k != "tool_calls"} == strip
            assert len(cur["tool_calls"]) == len(old["tool_calls"])
            for new_call, old_call in zip(cur["tool_calls"], old["tool_calls"], strict=True):
                assert _without_arguments(new_call) == _without_arguments(old_call)
            continue
        assert dumps(cur) == dumps(old)
    for key in set(body) - {"messages", "tools", "functions", "response_format"}:
        assert out[key] is body[key]
    added = _key_sets(out, Counter()) - _key_sets(body, Counter())
    removed = _key_sets(body, Counter()) - _key_sets(out, Counter())
    assert not removed
    assert set(added) <= {("text", "type")}  # only the note's own text part
