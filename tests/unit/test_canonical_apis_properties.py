"""Properties of the canonicalizer on Responses and Messages bodies: total, never mutating,
idempotent, and never touching what a cache_control breakpoint covers."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from proxy.api_validation import validate_api
from proxy.backends.apis import MESSAGES_VISIBLE, RESPONSES_VISIBLE, classify_api_event
from proxy.canonical import CanonicalConfig, Canonicalizer
from proxy.canonical.apis import MESSAGES_KIND, frozen_through
from proxy.errors import BadRequest
from proxy.fingerprint import fingerprint
from proxy.records import Observation
from tests.unit.test_canonical_properties import (
    PROPERTIES,
    any_json,
    arguments,
    config,
    plain_json,
    schema,
    text,
)

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
MARK = st.just({"type": "ephemeral"})

input_part = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": text}),
    plain_json,
)
item = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "developer", "user", "assistant"]),
            "content": st.one_of(text, st.lists(input_part, max_size=3)),
        },
        optional={"type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": st.just("c"),
            "name": st.just("f"),
            "arguments": arguments,
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": st.just("c"), "output": text}
    ),
    plain_json,
)
responses_tool = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("function"), "name": st.sampled_from(["b", "a", "c"])},
        optional={"description": text, "parameters": schema, "strict": st.booleans()},
    ),
    plain_json,
)
responses_body = st.fixed_dictionaries(
    {"model": st.just("m"), "input": st.one_of(text, st.lists(item, max_size=5))},
    optional={"instructions": text, "tools": st.lists(responses_tool, max_size=3)},
)
block = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("text"), "text": text}, optional={"cache_control": MARK}
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.just("t"),
            "name": st.just("f"),
            "input": plain_json,
        },
        optional={"cache_control": MARK},
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": st.just("t"), "content": text},
        optional={"cache_control": MARK},
    ),
    plain_json,
)
anthropic_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": st.one_of(text, st.lists(block, max_size=3)),
    }
)
anthropic_tool = st.one_of(
    st.fixed_dictionaries(
        {"name": st.sampled_from(["b", "a", "c"])},
        optional={"description": text, "input_schema": schema, "cache_control": MARK},
    ),
    plain_json,
)
messages_body = st.fixed_dictionaries(
    {"model": st.just("m"), "messages": st.lists(anthropic_message, max_size=5)},
    optional={
        "system": st.one_of(text, st.lists(block, max_size=2)),
        "tools": st.lists(anthropic_tool, max_size=3),
    },
)
api_body = st.one_of(
    st.tuples(st.just(RESPONSES), responses_body), st.tuples(st.just(MESSAGES), messages_body)
)


@PROPERTIES
@given(
    route=st.sampled_from([RESPONSES, MESSAGES]),
    body=st.dictionaries(st.text(max_size=10), any_json, max_size=6),
)
def test_any_body_never_raises(route: str, body: dict[str, Any]) -> None:
    """Any JSON object on either route: canonicalizing and fingerprinting never raise and
    never mutate; validation raises nothing but a 400."""
    before = copy.deepcopy(body)
    canonicalizer = Canonicalizer()
    canonicalizer.apply(route, body)
    fingerprint(route, body)
    with contextlib.suppress(BadRequest):  # a 400 is a fine answer; nothing else is
        validate_api(route, body)
    assert body == before
    assert sum(canonicalizer.error_counters.values()) == 0


@PROPERTIES
@given(pair=api_body, cfg=config)
def test_idempotent_and_total(pair: tuple[str, dict[str, Any]], cfg: CanonicalConfig) -> None:
    """Canonicalizing a canonical Responses or Messages request changes nothing."""
    route, body = pair
    before = copy.deepcopy(body)
    canonicalizer = Canonicalizer(cfg)
    once = canonicalizer.apply(route, body).body
    again = canonicalizer.apply(route, once)
    assert body == before
    assert orjson.dumps(again.body) == orjson.dumps(once)
    assert again.fired == ()
    assert sum(canonicalizer.error_counters.values()) == 0


@PROPERTIES
@given(body=messages_body, cfg=config)
def test_nothing_before_the_last_breakpoint_changes(
    body: dict[str, Any], cfg: CanonicalConfig
) -> None:
    """With a breakpoint, tools, system and every message up to the marked one are forwarded
    exactly as sent."""
    frozen = frozen_through(MESSAGES_KIND, body)
    out = Canonicalizer(cfg).apply(MESSAGES, body).body
    if frozen is None:
        return
    for key in ("tools", "system"):
        assert orjson.dumps(out.get(key)) == orjson.dumps(body.get(key))
    assert orjson.dumps(out["messages"][: frozen + 1]) == orjson.dumps(
        body["messages"][: frozen + 1]
    )


@PROPERTIES
@given(pair=api_body)
def test_shaped_bodies_fingerprint_and_validate(pair: tuple[str, dict[str, Any]]) -> None:
    """API-shaped bodies with odd values inside (a part whose type is a list…): fingerprinting
    never raises, and validation raises nothing but a 400."""
    route, body = pair
    fingerprint(route, body)
    with contextlib.suppress(BadRequest):
        validate_api(route, body)


event_value = st.one_of(st.sampled_from(sorted(RESPONSES_VISIBLE | MESSAGES_VISIBLE)), any_json)


@PROPERTIES
@given(
    route=st.sampled_from([RESPONSES, MESSAGES]),
    obj=st.dictionaries(
        st.sampled_from(["type", "delta", "usage", "message", "response", "error", "text"]),
        st.one_of(
            event_value,
            st.dictionaries(
                st.sampled_from(["type", "text", "usage", "input_tokens"]), event_value
            ),
        ),
        max_size=4,
    ),
)
def test_stream_events_never_raise(route: str, obj: dict[str, Any]) -> None:
    """Any JSON object as a stream event's data: classified, never an exception."""
    classify_api_event(route, obj, Observation(t_start=0.0))
