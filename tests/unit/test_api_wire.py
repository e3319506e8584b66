"""Responses and Anthropic Messages: usage, stream events, fingerprint segments, validation."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxy.backends import MESSAGES, RESPONSES, Dialect, EventKind, LlamaCppDialect
from proxy.backends.apis import classify_api_event, read_api_response, read_messages_usage
from proxy.canonical import Canonicalizer
from proxy.errors import BadRequest, anthropic_error_body
from proxy.fingerprint import fingerprint, render
from proxy.prefixes import prefix_label
from proxy.records import Observation
from proxy.stream_inspect import plain_token_event
from proxy.validation import validate_inference


def obs() -> Observation:
    return Observation(t_start=0.0)


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        ({"type": "response.output_text.delta", "delta": "Hi"}, EventKind.VISIBLE),
        ({"type": "response.function_call_arguments.delta", "delta": "{"}, EventKind.VISIBLE),
        ({"type": "response.reasoning_text.delta", "delta": "hm"}, EventKind.TOKEN),
        ({"type": "response.output_text.delta", "delta": ""}, EventKind.OTHER),
        ({"type": "response.created", "response": {}}, EventKind.OTHER),
        ({"type": "error", "code": "server_error", "message": "x"}, EventKind.ERROR),
        ({"error": {"code": 500, "message": "x"}}, EventKind.ERROR),
        ({"type": "response.failed", "response": {"status": "failed"}}, EventKind.ERROR),
        ({"type": "response.incomplete", "response": {}}, EventKind.OTHER),
    ],
)
def test_responses_events(event: dict[str, Any], kind: EventKind) -> None:
    """Responses stream events: text and call deltas visible, reasoning deltas hidden tokens."""
    assert classify_api_event(RESPONSES, event, obs()) is kind


@pytest.mark.parametrize(
    ("event", "kind"),
    [
        ({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "a"}}, "V"),
        (
            {
                "type": "content_block_delta",
                "delta": {"type": "input_json_delta", "partial_json": "{"},
            },
            "V",
        ),
        (
            {"type": "content_block_delta", "delta": {"type": "thinking_delta", "thinking": "h"}},
            "T",
        ),
        (
            {"type": "content_block_delta", "delta": {"type": "signature_delta", "signature": ""}},
            "O",
        ),
        ({"type": "content_block_start", "index": 0, "content_block": {}}, "O"),
        ({"type": "ping"}, "O"),
        ({"type": "error", "error": {"type": "overloaded_error", "message": "x"}}, "E"),
        ({"code": 500, "message": "the slot failed", "type": "server_error"}, "E"),
    ],
)
def test_messages_events(event: dict[str, Any], kind: str) -> None:
    """Anthropic stream events: text and tool input visible, thinking hidden, errors (also
    llama-server's own error object) recognised."""
    kinds = {
        "V": EventKind.VISIBLE,
        "T": EventKind.TOKEN,
        "O": EventKind.OTHER,
        "E": EventKind.ERROR,
    }
    assert classify_api_event(MESSAGES, event, obs()) is kinds[kind]


def test_responses_completed_reads_usage() -> None:
    """``response.completed`` carries the whole usage, reasoning tokens included."""
    o = obs()
    usage = {
        "input_tokens": 120,
        "output_tokens": 9,
        "input_tokens_details": {"cached_tokens": 96},
        "output_tokens_details": {"reasoning_tokens": 4},
    }
    event = {"type": "response.completed", "response": {"usage": usage}}
    assert classify_api_event(RESPONSES, event, o) is EventKind.OTHER
    assert (o.prompt_tokens, o.cached_tokens, o.completion_tokens, o.reasoning_tokens) == (
        120,
        96,
        9,
        4,
    )


def test_messages_start_then_delta() -> None:
    """``message_start`` gives the prompt; ``message_delta`` with output only keeps it."""
    o = obs()
    start = {
        "type": "message_start",
        "message": {
            "usage": {"input_tokens": 3, "cache_read_input_tokens": 40, "output_tokens": 0}
        },
    }
    classify_api_event(MESSAGES, start, o)
    classify_api_event(MESSAGES, {"type": "message_delta", "usage": {"output_tokens": 7}}, o)
    assert (o.prompt_tokens, o.cached_tokens, o.completion_tokens) == (43, 40, 7)


def test_messages_cache_writes_count_in_the_prompt() -> None:
    """Anthropic's three input counts add up to the prompt; only the read is cached."""
    o = obs()
    usage = {"input_tokens": 5, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 900}
    read_messages_usage(usage, o)
    assert (o.prompt_tokens, o.cached_tokens) == (905, 0)


def test_messages_without_cache_read_is_unknown() -> None:
    """No ``cache_read_input_tokens``: the cached count stays unknown, never 0."""
    o = obs()
    read_api_response(MESSAGES, {"usage": {"input_tokens": 50, "output_tokens": 2}}, o)
    assert (o.prompt_tokens, o.cached_tokens) == (50, None)


@pytest.mark.parametrize("route", [RESPONSES, MESSAGES])
@pytest.mark.parametrize("dialect", [Dialect(), LlamaCppDialect()])
def test_no_usage_is_asked_for(route: str, dialect: Dialect) -> None:
    """Both APIs always report usage: no ``stream_options`` is added, nothing to strip."""
    body: dict[str, Any] = {"stream": True}
    assert dialect.prepare(route, body, stream=True) is False
    assert body == {"stream": True}


def test_llamacpp_messages_route_carries_no_slot() -> None:
    """llama-server's Messages route drops ``id_slot``; its other routes honour it."""
    d = LlamaCppDialect()
    assert not d.carries_slot(MESSAGES)
    assert d.carries_slot(RESPONSES) and d.carries_slot("/v1/chat/completions")


def test_llamacpp_reads_timings_on_response_completed() -> None:
    """llama-server puts ``timings`` on ``response.completed``: prefill time is read."""
    o = obs()
    event = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 10, "output_tokens": 2}},
        "timings": {"cache_n": 4, "prompt_n": 6, "prompt_ms": 3.0, "predicted_n": 2},
    }
    LlamaCppDialect().classify_event(RESPONSES, event, o)
    assert (o.prompt_tokens, o.cached_tokens, o.backend_prefill_ms) == (10, 4, 3.0)


# -- fingerprint -------------------------------------------------------------------------------

MSG_BODY: dict[str, Any] = {
    "model": "m",
    "tools": [{"name": "t", "input_schema": {}}],
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "more"},
    ],
}


def test_messages_segments_follow_the_template() -> None:
    """Messages render model, tools, system, then each message."""
    kinds = [s.kind for s in render(MESSAGES, MSG_BODY).segments]
    assert kinds == ["model", "tools", "system", "message", "message", "message"]


def test_moving_breakpoint_keeps_the_fingerprint() -> None:
    """``cache_control`` is not seen by the template: moving it changes no block hash."""
    marked = copy.deepcopy(MSG_BODY)
    marked["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral"}
    marked["tools"][0]["cache_control"] = {"type": "ephemeral"}
    a, b = fingerprint(MESSAGES, MSG_BODY), fingerprint(MESSAGES, marked)
    assert a.segment_hashes == b.segment_hashes


def test_responses_segments_and_anchor() -> None:
    """Responses: ``instructions`` is the stable system segment; a string input one message."""
    body = {"model": "m", "instructions": "Be brief.", "input": "hi"}
    fp = fingerprint(RESPONSES, body)
    assert [s.kind for s in fp.segments] == ["model", "system", "message"]
    other = fingerprint(RESPONSES, {**body, "input": "something else"})
    assert fp.anchor == other.anchor and fp.segment_hashes[1] == other.segment_hashes[1]


def test_responses_items_of_a_conversation_share_a_prefix() -> None:
    """A second turn renders the first turn's items to the same bytes, then more."""
    first = [{"role": "user", "content": "hello " * 100}]
    second = [
        *first,
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "42"},
    ]
    a = render(RESPONSES, {"model": "m", "input": first}).data
    b = render(RESPONSES, {"model": "m", "input": second}).data
    assert b.startswith(a)


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": ["x"]}, "input[0]"),
        ({"input": [{"role": 1}]}, "input[0].role"),
        ({"instructions": ["x"]}, "instructions"),
        ({"tools": {}}, "tools"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_responses_validation_names_the_param(body: dict[str, Any], param: str) -> None:
    """Responses: the field the proxy cannot read is named in ``param``."""
    with pytest.raises(BadRequest) as info:
        validate_inference(RESPONSES, body)
    assert info.value.param == param


def test_valid_bodies_pass() -> None:
    """Well-formed bodies of both APIs pass; unknown fields are the backend's to judge."""
    validate_inference(RESPONSES, {"model": "m", "input": "hi", "whatever": [1]})
    validate_inference(RESPONSES, {"input": [{"type": "function_call_output", "output": "x"}]})
    validate_inference(MESSAGES, MSG_BODY)


def test_anthropic_error_types_by_status() -> None:
    """Anthropic's error envelope, with its type names by status."""
    assert anthropic_error_body(400, "m") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "m"},
    }
    assert anthropic_error_body(502, "m")["error"]["type"] == "api_error"
    assert anthropic_error_body(504, "m")["error"]["type"] == "timeout_error"
    assert anthropic_error_body(413, "m")["error"]["type"] == "request_too_large"


# -- the relay's fast path -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "event", "plain"),
    [
        (
            RESPONSES,
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"item_id":"msg_1","delta":"Hi"}\n\n',
            True,
        ),
        (
            RESPONSES,
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"item_id":"msg_1","delta":""}\n\n',
            False,
        ),
        (
            RESPONSES,
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"delta":"Hi","timings":{}}\n\n',
            False,
        ),
        (
            RESPONSES,
            b'event: response.completed\ndata: {"type":"response.completed","delta":"x"}\n\n',
            False,
        ),
        (
            MESSAGES,
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"Hi"}}\n\n',
            True,
        ),
        (
            MESSAGES,
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"thinking_delta","thinking":"hm"}}\n\n',
            False,
        ),
        (
            MESSAGES,
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"Hi"}}\n\nevent: message_delta\ndata: {}\n\n',
            False,
        ),
    ],
)
def test_plain_api_token_events(route: str, event: bytes, plain: bool) -> None:
    """Only a lone visible text delta of either API skips parsing; anything else is parsed."""
    assert plain_token_event(event, route) is plain


def test_prefix_labels_of_both_apis() -> None:
    """The label of a Responses or Messages prefix is the start of its system text."""
    same = str
    assert prefix_label({"instructions": "You are Aria.", "input": "hi"}, same) == "You are Aria."
    assert prefix_label({"input": [{"role": "user", "content": "Hello"}]}, same) == "Hello"
    assert prefix_label({"input": "Just this"}, same) == "Just this"
    system = [{"type": "text", "text": "You are Claude Code."}]
    assert prefix_label({"system": system, "messages": []}, same) == "You are Claude Code."


def test_unhashable_types_never_raise() -> None:
    """A part or event whose ``type`` is a list (any JSON may come) is rendered, canonicalized
    and classified, never a crash."""
    body = {"model": "m", "system": [{"type": [], "text": "x"}], "messages": []}
    assert fingerprint(MESSAGES, body).total_bytes > 0
    result = Canonicalizer().apply(MESSAGES, body)
    assert result.body is body
    event = {"type": "content_block_delta", "delta": {"type": ["text_delta"], "text": "a"}}
    assert classify_api_event(MESSAGES, event, obs()) is EventKind.OTHER
    assert classify_api_event(RESPONSES, {"type": ["x"]}, obs()) is EventKind.OTHER
