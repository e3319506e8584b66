"""OpenAI's structural rules on chat requests (proxy/shapes.py through validate_inference):
the 400's wording, param and code, null as absent, and what stays the backend's to judge."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.backends import CHAT, COMPLETIONS
from proxy.errors import BadRequest
from proxy.validation import validate_inference

USER = {"role": "user", "content": "hi"}


def refusal(body: dict[str, Any], route: str = CHAT) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        validate_inference(route, body)
    return info.value


def test_wrong_type_names_the_nested_field() -> None:
    """A tool's function given as a string: OpenAI's invalid_type wording and param."""
    err = refusal({"messages": [USER], "tools": [{"type": "function", "function": "f"}]})
    assert (err.param, err.code) == ("tools[0].function", "invalid_type")
    assert err.message == (
        "Invalid type for 'tools[0].function': expected an object, but got a string instead."
    )


def test_missing_member_and_unknown_discriminator() -> None:
    """A missing required member is missing_required_parameter; an unknown tool type is
    invalid_value listing OpenAI's two."""
    err = refusal({"messages": [USER], "tools": [{"type": "function", "function": {}}]})
    assert (err.param, err.code) == ("tools[0].function.name", "missing_required_parameter")
    err = refusal({"messages": [USER], "tools": [{"type": "web"}]})
    assert (err.param, err.code) == ("tools[0].type", "invalid_value")
    assert "Supported values are: 'function' and 'custom'." in err.message


def test_the_first_bad_field_is_named() -> None:
    """Messages come first, then tools, tool_choice, response_format; in order within them."""
    body = {
        "messages": [USER, {"role": "user", "content": [{"type": "text", "text": 1}]}],
        "tools": [5],
    }
    assert refusal(body).param == "messages[1].content[0].text"
    del body["messages"][1]
    assert refusal(body).param == "tools[0]"


def test_nulls_count_as_absent() -> None:
    """Optional members that are null pass; a required one that is null is missing."""
    validate_inference(
        CHAT,
        {
            "messages": [{"role": "assistant", "content": None, "tool_calls": None, "name": None}],
            "tools": [{"type": "function", "function": {"name": "f", "description": None}}],
            "tool_choice": None,
            "response_format": None,
        },
    )
    err = refusal({"messages": [{"role": "tool", "tool_call_id": None, "content": "x"}]})
    assert (err.param, err.code) == ("messages[0].tool_call_id", "missing_required_parameter")


@pytest.mark.parametrize(
    "extra",
    [
        {"tool_choice": "sometimes"},
        {"tools": [{"type": "custom", "custom": {"name": "grep"}}]},
        {"tools": [{"type": "function", "function": {"name": "a.b c", "x": 1}, "y": 2}]},
        {"response_format": {"type": "grammar", "grammar": 5}},
        {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": 7}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
        {"messages": [{"role": "robot", "content": "hi"}]},
    ],
)
def test_values_and_extensions_stay_the_backends(extra: dict[str, Any]) -> None:
    """Values (names, strings, roles) and types OpenAI does not define pass untouched."""
    validate_inference(CHAT, {"messages": [USER], **extra})


def test_completions_check_only_their_own_fields() -> None:
    """On completions, tools and response_format are not OpenAI's: the backend judges them;
    stream_options and prompt_cache_key are checked on every route."""
    validate_inference(COMPLETIONS, {"prompt": "x", "tools": [5], "response_format": 1})
    assert refusal({"prompt": "x", "stream_options": {"include_usage": 1}}, COMPLETIONS).param == (
        "stream_options.include_usage"
    )
    assert refusal({"prompt": "x", "prompt_cache_key": []}, COMPLETIONS).param == (
        "prompt_cache_key"
    )
