"""The canonical rules on Responses and Anthropic Messages bodies, and cache_control breakpoints."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxy.canonical import CanonicalConfig, Canonicalizer
from proxy.canonical.apis import MESSAGES_KIND, frozen_through
from proxy.canonical.config import NotePlacement

RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
DATE = "2026-11-30T10:00:00Z"


def canon(route: str, body: dict[str, Any], placement: NotePlacement = "user_prefix") -> Any:
    return Canonicalizer(CanonicalConfig(note_placement=placement)).apply(route, body)


def responses_agent() -> dict[str, Any]:
    return {
        "model": "m",
        "instructions": f"Now: {DATE}.",
        "tools": [
            {"type": "function", "name": "z", "parameters": {"type": "object", "b": 1, "a": 2}},
            {"type": "function", "name": "a", "description": "Look up.  \r\nFast."},
        ],
        "input": [
            {"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "c", "name": "z", "arguments": '{"y": 1, "x": 2}'},
            {"type": "function_call_output", "call_id": "c", "output": "done"},
        ],
    }


def test_responses_agent_request() -> None:
    """Responses: tools sorted, call arguments canonical, descriptions normalised, the date
    relocated to the newest user item; the input is never mutated."""
    body = responses_agent()
    before = copy.deepcopy(body)
    result = canon(RESPONSES, body)
    assert body == before
    out = result.body
    assert [t["name"] for t in out["tools"]] == ["a", "z"]
    assert list(out["tools"][1]["parameters"]) == ["a", "b", "type"]
    assert out["tools"][0]["description"] == "Look up.\nFast."
    assert out["input"][1]["arguments"] == '{"x":2,"y":1}'
    assert out["instructions"] == "Now: [[datetime_1]]."
    assert out["input"][0]["content"] == f"[[datetime_1]] = {DATE}\n\ngo"
    assert result.fired == ("stable_json", "whitespace", "volatile_timestamps")


def test_responses_rules_are_idempotent() -> None:
    """Canonicalizing a canonical Responses request changes nothing."""
    once = canon(RESPONSES, responses_agent()).body
    again = canon(RESPONSES, once)
    assert again.body is once and again.fired == ()


def test_responses_last_suffix_goes_to_the_call_output() -> None:
    """``last_suffix``: the note ends the newest function_call_output."""
    out = canon(RESPONSES, responses_agent(), "last_suffix").body
    assert out["input"][2]["output"] == f"done\n\n[[datetime_1]] = {DATE}"
    assert out["input"][0]["content"] == "go"


def test_responses_string_input_holds_the_note() -> None:
    """A string ``input`` is the user's turn: the note goes in front of it."""
    body = {"model": "m", "instructions": f"Now: {DATE}.", "input": "hi"}
    out = canon(RESPONSES, body).body
    assert out["input"] == f"[[datetime_1]] = {DATE}\n\nhi"


def messages_body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 8,
        "system": [{"type": "text", "text": f"Now: {DATE}."}],
        "tools": [{"name": "z", "input_schema": {"b": 1, "a": 2}}, {"name": "a"}],
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "t", "name": "z", "input": {"y": 1, "x": 2}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
            },
            {"role": "assistant", "content": "fine"},
            {"role": "user", "content": "and now?"},
        ],
        **extra,
    }


def test_messages_request_without_breakpoint() -> None:
    """Messages: tools and tool-use inputs sorted, the date relocated to the newest user turn."""
    result = canon(MESSAGES, messages_body())
    out = result.body
    assert [t["name"] for t in out["tools"]] == ["a", "z"]
    assert list(out["tools"][1]["input_schema"]) == ["a", "b"]
    assert list(out["messages"][1]["content"][0]["input"]) == ["x", "y"]
    assert out["system"][0]["text"] == "Now: [[datetime_1]]."
    assert out["messages"][4]["content"] == f"[[datetime_1]] = {DATE}\n\nand now?"


@pytest.mark.parametrize(
    ("where", "frozen"),
    [("tools", -1), ("system", -1), ("message", 2), ("none", None)],
)
def test_frozen_through_the_last_breakpoint(where: str, frozen: int | None) -> None:
    """Everything up to the last ``cache_control`` breakpoint is frozen (tools come first)."""
    body = messages_body()
    marker = {"type": "ephemeral"}
    if where == "tools":
        body["tools"][1]["cache_control"] = marker
    elif where == "system":
        body["system"][0]["cache_control"] = marker
    elif where == "message":
        body["messages"][2]["content"][0]["cache_control"] = marker
    assert frozen_through(MESSAGES_KIND, body) == frozen


def test_breakpoint_freezes_what_precedes_it() -> None:
    """With a breakpoint on message 2, tools, system and messages 0-2 are left byte for byte,
    nothing is relocated, and each rule reports the skip."""
    body = messages_body()
    body["messages"][2]["content"][0]["cache_control"] = {"type": "ephemeral"}
    body["messages"].insert(
        3,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "u", "name": "z", "input": {"q": 1, "p": 2}}],
        },
    )
    before = copy.deepcopy(body)
    result = canon(MESSAGES, body)
    out = result.body
    for key in ("tools", "system"):
        assert out[key] == before[key]
    assert list(out["tools"][0]["input_schema"]) == ["b", "a"]
    assert out["messages"][:3] == before["messages"][:3]
    assert list(out["messages"][1]["content"][0]["input"]) == ["y", "x"]  # before: kept
    assert list(out["messages"][3]["content"][0]["input"]) == ["p", "q"]  # after: sorted
    assert out["messages"][5] == before["messages"][5]  # no note: the date stays in place
    assert {s.reason for s in result.skipped} == {"cache_control_marker"}
    assert result.fired == ("stable_json",)


def test_breakpoint_on_the_newest_message_leaves_all_alone() -> None:
    """Claude Code's shape (breakpoint on the newest message): the request passes as it came."""
    body = messages_body()
    body["messages"][4] = {
        "role": "user",
        "content": [{"type": "text", "text": "and now?", "cache_control": {"type": "ephemeral"}}],
    }
    result = canon(MESSAGES, body)
    assert result.body is body and result.fired == ()


def test_anthropic_tool_results_stay_first() -> None:
    """``user_prefix`` never puts text before a user message's tool results (skip reported)."""
    body = messages_body()
    del body["messages"][3:]
    result = canon(MESSAGES, body)
    assert result.body["messages"][2] == body["messages"][2]
    assert "tool_result_first" in {s.reason for s in result.skipped}
    assert result.body["system"] == body["system"]


def test_anthropic_suffix_after_tool_results() -> None:
    """``last_suffix`` appends a text block after the tool results of the newest message."""
    body = messages_body()
    del body["messages"][3:]
    out = canon(MESSAGES, body, "last_suffix").body
    blocks = out["messages"][2]["content"]
    assert blocks[0]["type"] == "tool_result"
    assert blocks[1] == {"type": "text", "text": f"\n\n[[datetime_1]] = {DATE}"}


def test_anthropic_system_suffix_adds_a_block() -> None:
    """``system_suffix`` on a system block list: the note becomes one more text block."""
    out = canon(MESSAGES, messages_body(), "system_suffix").body
    assert out["system"][0]["text"] == "Now: [[datetime_1]]."
    assert out["system"][1] == {"type": "text", "text": f"\n\n[[datetime_1]] = {DATE}"}
