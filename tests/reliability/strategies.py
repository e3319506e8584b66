"""Hypothesis strategies for hostile requests: JSON of every kind, request shapes with wrong types.

``any_json`` is whatever orjson parses (no lone surrogates, integers within 64 bits, finite
floats); ``wild_json`` adds what Python's json module also produces (lone surrogates, integers
of any size). ``request_body`` is an OpenAI chat/completions body in which every field is
usually of the right type and sometimes any JSON at all (tools, tool calls, content parts,
``tool_choice`` and ``response_format`` included, member by member), with text that trips the
canonicalizer's detectors.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

# Text that trips the canonicalizer's detectors, mixed with arbitrary text.
VOLATILE = [
    "2026-11-30T22:41:07Z",
    "Monday, November 30, 2026",
    "Mon, 30 Nov 2026 22:41:00 +0000",
    "2026-11-30 22:41",
    "550e8400-e29b-41d4-a716-446655440000",
    "4bf92f3577b34da6a3ce929d0e0e4736",
    "TICKET-4711",
    "[[date_1]]",
    "\r\n  \t",
]
text = st.lists(st.sampled_from(VOLATILE) | st.text(max_size=15), max_size=4).map("".join)
# Any JSON orjson parses: no lone surrogates, integers within 64 bits, finite floats.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | text
)
any_json = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=16,
)
# Any JSON Python's json module produces: lone surrogates and integers of any size too.
wild_scalars = scalars | st.integers() | st.text(st.characters(codec=None), max_size=10)
wild_json = st.recursive(
    wild_scalars,
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=16,
)


def either(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: usually a valid one, sometimes any JSON at all."""
    return st.one_of(valid, valid, any_json)


def shaped(kind: str, member: str, value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """An object of one ``type`` whose member is usually right: ``{"type": kind, member: …}``."""
    return st.fixed_dictionaries({"type": st.just(kind)}, optional={member: either(value)})


part = either(
    shaped("text", "text", text)
    | shaped("refusal", "refusal", text)
    | shaped("image_url", "image_url", st.fixed_dictionaries({"url": either(text)}) | text)
    | shaped("input_audio", "input_audio", st.fixed_dictionaries({"data": text}))
    | shaped("input_video", "input_video", any_json)  # a server's extension: not checked
)
tool_call = st.fixed_dictionaries(
    {},
    optional={
        "id": either(text),
        "type": either(st.sampled_from(["function", "custom"])),
        "function": either(
            st.fixed_dictionaries({"name": either(st.text(max_size=8)), "arguments": either(text)})
        ),
        "custom": either(st.fixed_dictionaries({"name": text, "input": either(text)})),
    },
)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": either(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
        "content": either(text | st.none() | st.lists(part, max_size=3)),
        "tool_calls": either(st.lists(either(tool_call), max_size=2)),
        "tool_call_id": either(text),
        "name": either(text),
    },
)
tool = st.fixed_dictionaries(
    {
        "type": either(st.just("function")),
        "function": either(
            st.fixed_dictionaries(
                {"name": either(st.text(max_size=8)), "description": either(text)},
                optional={
                    "parameters": either(st.just({"type": "object"})),
                    "strict": either(st.booleans()),
                },
            )
        ),
    }
)
tool_choice = either(
    st.sampled_from(["auto", "none", "required"])
    | st.fixed_dictionaries(
        {"type": either(st.just("function"))},
        optional={"function": either(st.fixed_dictionaries({"name": either(text)}))},
    )
)
response_format = either(
    st.fixed_dictionaries({"type": either(st.sampled_from(["text", "json_object"]))})
    | st.fixed_dictionaries(
        {"type": st.just("json_schema")},
        optional={
            "json_schema": either(
                st.fixed_dictionaries(
                    {"name": either(text)}, optional={"schema": either(st.just({}))}
                )
            )
        },
    )
)
request_body = st.fixed_dictionaries(
    {},
    optional={
        "model": either(st.text(max_size=10)),
        "messages": either(st.lists(either(message), max_size=5)),
        "prompt": either(text | st.lists(st.integers(0, 50_000), max_size=5)),
        "stream": either(st.booleans()),
        "stream_options": either(st.fixed_dictionaries({"include_usage": either(st.booleans())})),
        "tools": either(st.lists(either(tool), max_size=3)),
        "tool_choice": tool_choice,
        "prompt_cache_key": either(text),
        "max_tokens": any_json,
        "temperature": any_json,
        "stop": any_json,
        "response_format": response_format,
        "cache_prompt": any_json,
    },
)
