"""The whitespace rule: line endings and line-end blanks in system prompts and tool docs only."""

from __future__ import annotations

import copy
from typing import Any

from proxy.canonical.config import WHITESPACE, CanonicalConfig, RuleConfig
from proxy.canonical.whitespace import normalise, normalise_raw, whitespace

RULE = CanonicalConfig().rule(WHITESPACE)
RAW = CanonicalConfig(rules={WHITESPACE: RuleConfig(options={"raw_prompts": True})}).rule(
    WHITESPACE
)


def run(kind: str, body: dict[str, Any], rule: RuleConfig = RULE) -> dict[str, Any]:
    before = copy.deepcopy(body)
    out = whitespace(kind, body, rule).body
    assert body == before
    return out


def test_line_endings_and_trailing_blanks_in_system_prompts() -> None:
    """CRLF and CR become LF and line-end blanks go; indentation and inner spaces stay."""
    system = "You are Atlas.  \r\n\r\n# Rules\r\n  1. Be  precise.\t\r\n    code:   x = 1 \rEnd  "
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    out = run("chat", body)
    assert out["messages"][0]["content"] == (
        "You are Atlas.\n\n# Rules\n  1. Be  precise.\n    code:   x = 1\nEnd"
    )
    assert out["messages"][1] is body["messages"][1]


def test_developer_messages_and_later_system_messages() -> None:
    """Developer messages and system messages later in the conversation are normalised too."""
    body = {
        "messages": [
            {"role": "developer", "content": "a \r\nb"},
            {"role": "user", "content": "q \r\n"},
            {"role": "system", "content": "reminder \n"},
        ]
    }
    out = run("chat", body)
    assert out["messages"][0]["content"] == "a\nb"
    assert out["messages"][1] is body["messages"][1]
    assert out["messages"][2]["content"] == "reminder\n"


def test_text_parts_keep_blanks_at_their_end() -> None:
    """A part's last blank may be the space between two words when parts are joined: kept."""
    parts = [
        {"type": "text", "text": "Current task: ", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "review \r\nthe diff "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA \r\n"}},
        "plain \r\nstring part ",
    ]
    out = run("chat", {"messages": [{"role": "system", "content": parts}]})
    new = out["messages"][0]["content"]
    assert new[0] is parts[0]
    assert new[1] == {"type": "text", "text": "review\nthe diff "}
    assert new[2] is parts[2]
    assert new[3] == "plain\nstring part "


def test_user_assistant_and_tool_messages_are_never_touched() -> None:
    """Only system/developer text is owned; everything else keeps its bytes."""
    body = {
        "messages": [
            {"role": "user", "content": "code:  \r\n  x = 1  \r\n"},
            {"role": "assistant", "content": "ok  \r\n"},
            {"role": "tool", "content": "out \r\n", "tool_call_id": "a"},
        ]
    }
    assert run("chat", body) is body


def test_tool_descriptions_and_parameter_descriptions() -> None:
    """Tool and parameter descriptions are normalised; enum values and defaults are data."""
    tool: dict[str, Any] = {
        "type": "function",
        "function": {
            "name": "f",
            "description": "Search.  \r\nReturns hits. ",
            "parameters": {
                "type": "object",
                "properties": {
                    "q": {"type": "string", "description": "query \r\n"},
                    "mode": {"enum": ["a ", "b\r\n"], "default": "a ", "description": "mode"},
                    "description": {"type": "string", "description": "a field named description  "},
                },
            },
        },
    }
    out = run("chat", {"tools": [tool]})["tools"][0]["function"]
    assert out["description"] == "Search.\nReturns hits."
    props = out["parameters"]["properties"]
    assert props["q"]["description"] == "query\n"
    assert props["mode"] is tool["function"]["parameters"]["properties"]["mode"]
    assert props["description"]["description"] == "a field named description"


def test_raw_prompts_are_left_alone_by_default() -> None:
    """A raw completion prompt (often code) keeps its CRLF unless raw_prompts is on."""
    body = {"prompt": "def f():  \r\n    return 1\r\n"}
    assert run("completion", body) is body


def test_raw_prompts_keep_their_last_line_and_break() -> None:
    """With raw_prompts, lines before the last break are normalised; the end is kept as is."""
    body = {"prompt": "System: be brief.  \r\nUser: hi \r\nAssistant: "}
    assert run("completion", body, RAW)["prompt"] == "System: be brief.\nUser: hi\r\nAssistant: "
    batch: dict[str, Any] = {"prompt": ["a \r\nb \r\n", [1, 2, 3], "c"]}
    out = run("completion", batch, RAW)["prompt"]
    assert out[0] == "a\nb\r\n" and out[1] is batch["prompt"][1] and out[2] == "c"


def test_normalise_reports_what_it_did() -> None:
    """The counts are line breaks rewritten and blank runs cut."""
    assert normalise("a \r\nb\rc\t", strip_end=True) == ("a\nb\nc", 2, 2)
    assert normalise("a\tb\nc", strip_end=True) == ("a\tb\nc", 0, 0)
    assert normalise("x ", strip_end=False) == ("x ", 0, 0)
    assert normalise_raw("x\r\n") == ("x\r\n", 0, 0)


def test_changes_name_the_slot() -> None:
    """Each rewritten string is reported by path and kind, with counts."""
    body = {"messages": [{"role": "system", "content": "a \r\nb \r\n"}]}
    changes = whitespace("chat", body, RULE).changes
    assert [(c.path, c.kind, c.count) for c in changes] == [
        ("messages[0].content", "line_endings", 2),
        ("messages[0].content", "trailing_blanks", 2),
    ]
