"""The two other inference APIs servers speak: OpenAI Responses and Anthropic Messages.

Both APIs always report usage, streamed or not, so the proxy never adds anything to a request to
learn it and never strips anything from an answer. What is read, per API:

Responses (``/v1/responses``)
    ``usage.input_tokens`` is the whole prompt, ``usage.input_tokens_details.cached_tokens`` what
    came from cache, ``usage.output_tokens`` the completion (``output_tokens_details.
    reasoning_tokens`` its reasoning part). A stream is ``event: <type>`` + ``data: {...}``
    events; ``response.output_text.delta``, ``response.refusal.delta`` and
    ``response.function_call_arguments.delta`` are visible tokens, ``response.reasoning_text.
    delta`` and ``response.reasoning_summary_text.delta`` are tokens the user does not see, and
    ``response.completed`` (or ``response.incomplete`` / ``response.failed``, which is also an
    error) carries the response with its usage. An ``error`` event, or a ``data: {"error": ...}``
    one (llama.cpp's mid-stream failure), is an error.

Messages (``/v1/messages``)
    ``usage.input_tokens`` is the prompt *not* read from or written to cache;
    ``cache_read_input_tokens`` and ``cache_creation_input_tokens`` are the rest (llama-server
    reports ``input_tokens = prompt - cached`` and ``cache_read_input_tokens = cached``). The
    record's ``prompt_tokens`` is therefore their sum and ``cached_tokens`` the cache read; a
    server that sends no ``cache_read_input_tokens`` has not said what it read (unknown, not 0).
    A stream opens with ``message_start`` (the message with its usage so far), then
    ``content_block_delta`` events (``text_delta`` and ``input_json_delta`` visible,
    ``thinking_delta`` not; ``signature_delta`` is no token), ``message_delta`` with the final
    usage (llama-server: ``output_tokens`` only) and ``message_stop``; an ``error`` event is an
    error (llama-server's carries its own error object, ``"type": "server_error"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.backends.events import EventKind
from proxy.backends.wire import as_count, nonempty
from proxy.records import Observation

RESPONSES = "/v1/responses"  # the OpenAI Responses API
MESSAGES = "/v1/messages"  # the Anthropic Messages API
API_ROUTES = frozenset({RESPONSES, MESSAGES})

RESPONSES_VISIBLE = frozenset(
    {
        "response.output_text.delta",
        "response.refusal.delta",
        "response.function_call_arguments.delta",
    }
)
RESPONSES_HIDDEN = frozenset(
    {"response.reasoning_text.delta", "response.reasoning_summary_text.delta"}
)
RESPONSES_FINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
MESSAGES_VISIBLE = frozenset({"text_delta", "input_json_delta"})
MESSAGES_HIDDEN = frozenset({"thinking_delta"})


def read_responses_usage(usage: Mapping[str, Any], obs: Observation) -> None:
    """A Responses ``usage`` object into ``obs``."""
    obs.prompt_tokens = as_count(usage.get("input_tokens"))
    obs.completion_tokens = as_count(usage.get("output_tokens"))
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):
        obs.cached_tokens = as_count(details.get("cached_tokens"))
    out_details = usage.get("output_tokens_details")
    if isinstance(out_details, dict):
        obs.reasoning_tokens = as_count(out_details.get("reasoning_tokens"))


def read_messages_usage(usage: Mapping[str, Any], obs: Observation) -> None:
    """An Anthropic ``usage`` object into ``obs``; fields it lacks leave ``obs`` as it was
    (``message_delta`` may carry ``output_tokens`` alone)."""
    uncached = as_count(usage.get("input_tokens"))
    read = as_count(usage.get("cache_read_input_tokens"))
    written = as_count(usage.get("cache_creation_input_tokens"))
    if uncached is not None:
        obs.prompt_tokens = uncached + (read or 0) + (written or 0)
    if read is not None:
        obs.cached_tokens = read
    output = as_count(usage.get("output_tokens"))
    if output is not None:
        obs.completion_tokens = output


def read_api_response(route: str, obj: Mapping[str, Any], obs: Observation) -> None:
    """Usage out of a complete (non-streamed) Responses or Messages answer."""
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return
    if route == RESPONSES:
        read_responses_usage(usage, obs)
    else:
        read_messages_usage(usage, obs)


def classify_api_event(route: str, obj: Mapping[str, Any], obs: Observation) -> EventKind:
    """One Responses or Messages stream event (its ``data`` object), usage read on the way."""
    kind = obj.get("type")
    if type(kind) is not str:  # any JSON value may come; only a string names an event
        kind = None
    if route == RESPONSES:
        return _responses_event(kind, obj, obs)
    return _messages_event(kind, obj, obs)


def _responses_event(kind: Any, obj: Mapping[str, Any], obs: Observation) -> EventKind:
    if kind in RESPONSES_VISIBLE:
        return EventKind.VISIBLE if nonempty(obj.get("delta")) else EventKind.OTHER
    if kind in RESPONSES_HIDDEN:
        return EventKind.TOKEN if nonempty(obj.get("delta")) else EventKind.OTHER
    if kind in RESPONSES_FINAL:
        response = obj.get("response")
        usage = response.get("usage") if isinstance(response, dict) else None
        if isinstance(usage, dict):
            read_responses_usage(usage, obs)
        return EventKind.ERROR if kind == "response.failed" else EventKind.OTHER
    if kind == "error" or (kind is None and "error" in obj):
        return EventKind.ERROR
    return EventKind.OTHER


def _messages_event(kind: Any, obj: Mapping[str, Any], obs: Observation) -> EventKind:
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if not isinstance(delta, dict):
            return EventKind.OTHER
        dtype = delta.get("type")
        if type(dtype) is not str:
            return EventKind.OTHER
        if dtype in MESSAGES_VISIBLE:
            text = delta.get("text") if dtype == "text_delta" else delta.get("partial_json")
            return EventKind.VISIBLE if nonempty(text) else EventKind.OTHER
        if dtype in MESSAGES_HIDDEN:
            return EventKind.TOKEN if nonempty(delta.get("thinking")) else EventKind.OTHER
        return EventKind.OTHER
    if kind == "message_start":
        message = obj.get("message")
        usage = message.get("usage") if isinstance(message, dict) else None
        if isinstance(usage, dict):
            read_messages_usage(usage, obs)
        return EventKind.OTHER
    if kind == "message_delta":
        usage = obj.get("usage")
        if isinstance(usage, dict):
            read_messages_usage(usage, obs)
        return EventKind.OTHER
    # ``event: error``: Anthropic's ``{"type": "error", ...}``; llama-server sends its own error
    # object there (``{"code", "message", "type": "server_error"}``).
    if (isinstance(kind, str) and kind.endswith("error")) or "error" in obj:
        return EventKind.ERROR
    return EventKind.OTHER
