"""Volatile-span relocation: placeholders in the stable segments, values in a note."""

from __future__ import annotations

import copy
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "data" / "canonical"))

import itertools

import agent_requests  # the realistic request builder

from proxy.canonical import CanonicalConfig, Canonicalizer, CustomPattern, RuleConfig
from proxy.canonical.config import NOTE_PLACEMENTS, NotePlacement
from proxy.config import ConfigError

CHAT = "/v1/chat/completions"
ARIA = (
    "You are Aria, a scheduling assistant.\n"
    "Current date: Monday, November 30, 2026\n"
    "Session: 550e8400-e29b-41d4-a716-446655440000"
)


def canonical(
    body: dict[str, Any], placement: NotePlacement = "user_prefix", **config: Any
) -> dict[str, Any]:
    before = copy.deepcopy(body)
    result = Canonicalizer(CanonicalConfig(note_placement=placement, **config)).apply(CHAT, body)
    assert body == before and orjson.dumps(body) == orjson.dumps(before)
    return result.body


def chat(system: Any, *turns: Any, tools: Any = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": system}]}
    roles = ["user", "assistant"]
    body["messages"] += [{"role": roles[i % 2], "content": c} for i, c in enumerate(turns)]
    if tools is not None:
        body["tools"] = tools
    return body


def test_what_the_model_sees() -> None:
    """The relocation module's documented example, byte for byte."""
    out = canonical(chat(ARIA, "What is on my calendar today?"))
    assert out["messages"] == [
        {
            "role": "system",
            "content": "You are Aria, a scheduling assistant.\n"
            "Current date: [[date_1]]\n"
            "Session: [[uuid_1]]",
        },
        {
            "role": "user",
            "content": "[[date_1]] = Monday, November 30, 2026\n"
            "[[uuid_1]] = 550e8400-e29b-41d4-a716-446655440000\n"
            "\n"
            "What is on my calendar today?",
        },
    ]


def test_same_value_same_placeholder_numbered_by_first_appearance() -> None:
    """A repeated value reuses its placeholder; labels count separately; tools come first."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calendar",
                "description": "Events after 2026-11-30T22:41:07Z only.",
            },
        }
    ]
    system = (
        "Today: 2026-11-29. Now: 2026-11-30T22:41:07Z. Tomorrow: 2026-12-01.\n"
        "Again today: 2026-11-29."
    )
    out = canonical(chat(system, "hi", tools=tools))
    assert out["tools"][0]["function"]["description"] == "Events after [[datetime_1]] only."
    assert out["messages"][0]["content"] == (
        "Today: [[date_1]]. Now: [[datetime_1]]. Tomorrow: [[date_2]].\nAgain today: [[date_1]]."
    )
    assert out["messages"][1]["content"] == (
        "[[datetime_1]] = 2026-11-30T22:41:07Z\n[[date_1]] = 2026-11-29\n"
        "[[date_2]] = 2026-12-01\n\nhi"
    )


def test_the_note_goes_to_the_newest_user_message_only() -> None:
    """Older user turns and assistant turns keep their objects; the newest gets the note."""
    body = chat(ARIA, "first question", "first answer", "second question")
    out = canonical(body)
    assert out["messages"][1] is body["messages"][1]
    assert out["messages"][2] is body["messages"][2]
    assert out["messages"][3]["content"].endswith("\n\nsecond question")


def test_content_parts_get_a_new_first_part() -> None:
    """With a parts list the note is a new text part; the user's parts are the same objects."""
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    text = {"type": "text", "text": "What is this?"}
    body = chat(ARIA, [image, text])
    parts = canonical(body)["messages"][1]["content"]
    assert parts[0]["type"] == "text" and parts[0]["text"].startswith("[[date_1]] = ")
    assert parts[0]["text"].endswith("\n\n")
    assert parts[1] is image and parts[2] is text


def test_user_suffix_placement() -> None:
    """user_suffix puts the note after the user's text (a last part for a parts list)."""
    out = canonical(chat(ARIA, "hello"), "user_suffix")
    assert out["messages"][1]["content"] == (
        "hello\n\n[[date_1]] = Monday, November 30, 2026\n"
        "[[uuid_1]] = 550e8400-e29b-41d4-a716-446655440000"
    )
    parts = canonical(chat(ARIA, [{"type": "text", "text": "hello"}]), "user_suffix")
    assert parts["messages"][1]["content"][-1]["text"].startswith("\n\n[[date_1]] = ")


def test_last_suffix_placement_follows_the_newest_tool_result() -> None:
    """last_suffix puts the note after the newest message when it is a tool result, and the
    history before it (the user message, tool calls and earlier results) is left as written."""
    body = chat(ARIA, "book a room")
    call = {"id": "c1", "type": "function", "function": {"name": "rooms", "arguments": "{}"}}
    body["messages"] += [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "room 4 is free"},
    ]
    out = canonical(body, "last_suffix")
    assert out["messages"][-1]["content"] == (
        "room 4 is free\n\n[[date_1]] = Monday, November 30, 2026\n"
        "[[uuid_1]] = 550e8400-e29b-41d4-a716-446655440000"
    )
    assert out["messages"][1:3] == body["messages"][1:3]
    # With a user message last it is user_suffix.
    assert canonical(chat(ARIA, "hello"), "last_suffix") == canonical(
        chat(ARIA, "hello"), "user_suffix"
    )


def test_last_suffix_turn_after_turn_keeps_the_history_identical() -> None:
    """Each turn's request is the last one plus new messages (the application never sees the
    note), so everything up to the newest message renders the same as in the turn before."""
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Now: 2026-11-30T10:00:00Z. You book rooms."},
        {"role": "user", "content": "book a room"},
    ]
    sent = []
    for turn in range(3):
        history[0] = {
            "role": "system",
            "content": f"Now: 2026-11-30T10:00:{turn:02d}Z. You book rooms.",
        }
        sent.append(canonical({"messages": [dict(m) for m in history]}, "last_suffix"))
        call = {"id": f"c{turn}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        history.append({"role": "assistant", "content": None, "tool_calls": [call]})
        history.append({"role": "tool", "tool_call_id": f"c{turn}", "content": f"result {turn}"})
    for before, after in itertools.pairwise(sent):
        kept = len(before["messages"]) - 1
        assert after["messages"][:kept] == before["messages"][:kept]
        assert after["messages"][kept]["content"].startswith(
            _unnoted(before["messages"][kept]["content"])
        )


def _unnoted(content: str) -> str:
    return content.split("\n\n[[", 1)[0]


def test_system_suffix_placement() -> None:
    """system_suffix appends the note to the last leading system message."""
    body = chat(ARIA, "hello")
    body["messages"].insert(1, {"role": "developer", "content": "Be brief."})
    out = canonical(body, "system_suffix")
    assert out["messages"][1]["content"] == (
        "Be brief.\n\n[[date_1]] = Monday, November 30, 2026\n"
        "[[uuid_1]] = 550e8400-e29b-41d4-a716-446655440000"
    )
    assert out["messages"][2] is body["messages"][2]


def test_custom_note_format() -> None:
    """note_format wraps the entries."""
    out = canonical(chat("Date: 2026-11-30", "hi"), note_format="<context>\n{entries}\n</context>")
    assert out["messages"][1]["content"] == "<context>\n[[date_1]] = 2026-11-30\n</context>\n\nhi"


@pytest.mark.parametrize(
    ("messages", "placement", "reason"),
    [
        ([{"role": "system", "content": ARIA}], "user_prefix", "no_user_message"),
        (
            [{"role": "system", "content": ARIA}, {"role": "user", "content": None}],
            "user_suffix",
            "message_content_not_text",
        ),
        ([{"role": "user", "content": "x"}], "system_suffix", "no_system_message"),
        (
            [
                {"role": "system", "content": ARIA},
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "Sure, "},
            ],
            "last_suffix",
            "newest_message_not_user_or_tool",
        ),
    ],
)
def test_nothing_is_relocated_without_a_place_for_the_note(
    messages: list[dict[str, Any]], placement: NotePlacement, reason: str
) -> None:
    """A value never disappears: with no place for the note, nothing changes; skip reported."""
    tools = [{"function": {"description": "As of 2026-11-30.", "name": "f"}, "type": "function"}]
    body = {"messages": messages, "tools": tools}
    result = Canonicalizer(CanonicalConfig(note_placement=placement)).apply(CHAT, body)
    assert result.body is body
    assert {(s.rule, s.reason) for s in result.skipped} >= {("volatile_timestamps", reason)}


def test_later_system_messages_and_user_text_are_not_stable_segments() -> None:
    """Only the leading system messages and tools are cleaned; history stays as sent."""
    body = chat(
        "Static instructions.",
        "My id is 550e8400-e29b-41d4-a716-446655440000, today is 2026-11-30.",
    )
    body["messages"].insert(2, {"role": "system", "content": "Reminder at 2026-11-30T10:00:00Z"})
    assert canonical(body) is body


def test_text_already_shaped_like_a_placeholder() -> None:
    """A prompt's own [[date_1]] is never a value, and new placeholders step over it."""
    out = canonical(chat("Template uses [[date_1]]. Today: 2026-11-30.", "q"))
    assert out["messages"][0]["content"] == "Template uses [[date_1]]. Today: [[date_2]]."
    assert out["messages"][1]["content"] == "[[date_2]] = 2026-11-30\n\nq"


def test_custom_patterns_are_relocated_under_their_name() -> None:
    """A custom pattern's value gets a placeholder labelled with the pattern's name."""
    patterns = (CustomPattern("request_id", r"Request: (req_\w+)"),)
    out = canonical(chat("Request: req_01HX8ZK2M\nBe nice.", "q"), custom_patterns=patterns)
    assert out["messages"][0]["content"] == "Request: [[request_id_1]]\nBe nice."
    assert out["messages"][1]["content"] == "[[request_id_1]] = req_01HX8ZK2M\n\nq"


def test_disabled_volatile_rules_leave_their_values() -> None:
    """Switching volatile_uuids off keeps the UUID in the system prompt."""
    out = canonical(chat(ARIA, "q"), rules={"volatile_uuids": RuleConfig(enabled=False)})
    assert "550e8400-e29b-41d4-a716-446655440000" in out["messages"][0]["content"]
    assert "[[uuid_1]]" not in out["messages"][1]["content"]


@pytest.mark.parametrize("placement", NOTE_PLACEMENTS)
def test_relocation_is_idempotent(placement: NotePlacement) -> None:
    """A canonical request canonicalizes to the same bytes, whatever the placement."""
    body = agent_requests.request(seed=1, crlf=True)
    canonicalizer = Canonicalizer(CanonicalConfig(note_placement=placement))
    once = canonicalizer.apply(CHAT, body).body
    twice = canonicalizer.apply(CHAT, once)
    assert twice.body is once and not twice.fired


def test_an_agent_system_prompt_keeps_its_prefix_across_requests() -> None:
    """Two requests a minute apart with another session share the whole system prompt."""
    a = canonical(agent_requests.request())
    b = canonical(
        agent_requests.request(
            when=agent_requests.WHEN + timedelta(minutes=1),
            session="6fa459ea-ee8a-3ca4-894e-db77e160355e",
        )
    )
    assert a["messages"][0] == b["messages"][0]
    assert "[[datetime_1]]" in a["messages"][0]["content"]
    assert a["messages"][-1] != b["messages"][-1]


def test_placeholders_in_other_stable_text_are_never_reused() -> None:
    """A [[date_1]] that a tool description already holds is passed over in numbering."""
    tools = [{"function": {"description": "Fill [[date_1]] in.", "name": "f"}, "type": "function"}]
    out = canonical(chat("Today: 2026-11-30.", "q", tools=tools))
    assert out["messages"][0]["content"] == "Today: [[date_2]]."
    assert out["tools"] == tools


def test_system_suffix_needs_entries_at_a_line_start() -> None:
    """With system_suffix the note's lines must start lines, so they are never re-detected."""
    with pytest.raises(ConfigError):
        CanonicalConfig(note_placement="system_suffix", note_format="Values: {entries}")
    CanonicalConfig(note_placement="system_suffix", note_format="Values:\n{entries}")


@pytest.mark.parametrize(
    "system",
    [
        "Monday, November 30, 20262026-11-30T22:41:07Z",
        "at 10:41 p.m.November 30, 2026",
        "2026-11-30Monday, November 30, 2026",
        "ids 4bf92f3577b34da6a3ce929d0e0e4736550e8400-e29b-41d4-a716-446655440000",
    ],
)
def test_values_glued_together_are_settled_in_one_pass(system: str) -> None:
    """A value that shows only once its neighbour is a placeholder is relocated at once."""
    canonicalizer = Canonicalizer(CanonicalConfig(note_placement="system_suffix"))
    once = canonicalizer.apply(CHAT, chat(system, "q")).body
    again = canonicalizer.apply(CHAT, once)
    assert again.body is once and not again.fired
