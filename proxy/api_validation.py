"""Checks of Responses and Anthropic Messages bodies: the fields the proxy itself reads.

Like ``proxy.validation`` for chat, only what the proxy routes, fingerprints, canonicalizes and
relays by is checked: the model, ``stream``, the system text (``instructions`` / ``system``),
the tools and the conversation (``input`` items / ``messages``). Everything else is the
backend's to judge. Errors use each API's own wording: OpenAI's (``param`` naming the field,
``input[0].content``) for Responses, Anthropic's (``messages.0.role: Field required``) for
Messages, whose handler renders them in Anthropic's error shape.
"""

from __future__ import annotations

from typing import Any

from proxy.backends import RESPONSES
from proxy.errors import BadRequest
from proxy.shapes import invalid_type, json_type

# One wording for a wrong JSON type across the OpenAI-shaped routes (``proxy.shapes``).
_json_type = json_type
_openai_type = invalid_type


def _anthropic_type(param: str, expected: str) -> BadRequest:
    return BadRequest(f"{param}: Input should be {expected}", param=param)


def _anthropic_missing(param: str) -> BadRequest:
    return BadRequest(f"{param}: Field required", param=param)


def validate_api(route: str, body: dict[str, Any]) -> None:
    """Reject, with a 400 naming the field, what the proxy must understand and cannot."""
    if route == RESPONSES:
        _validate_responses(body)
    else:
        _validate_messages(body)


def _validate_responses(body: dict[str, Any]) -> None:
    for name, kind, expected in (
        ("model", str, "a string"),
        ("stream", bool, "a boolean"),
        ("instructions", str, "a string"),
        ("tools", list, "an array"),
    ):
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise _openai_type(name, expected, value)
    for i, tool in enumerate(body.get("tools") or ()):
        if not isinstance(tool, dict):
            raise _openai_type(f"tools[{i}]", "an object", tool)
    items = body.get("input")
    if items is None or isinstance(items, str):
        return
    if not isinstance(items, list):
        raise _openai_type("input", "a string or an array", items)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _openai_type(where, "an object", item)
        role = item.get("role")
        if role is not None and not isinstance(role, str):
            raise _openai_type(f"{where}.role", "a string", role)
        content = item.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _openai_type(f"{where}.content", "a string or an array", content)


def _validate_messages(body: dict[str, Any]) -> None:
    for name, kind, expected in (
        ("model", str, "a valid string"),
        ("stream", bool, "a valid boolean"),
        ("tools", list, "a valid list"),
    ):
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise _anthropic_type(name, expected)
    for i, tool in enumerate(body.get("tools") or ()):
        if not isinstance(tool, dict):
            raise _anthropic_type(f"tools.{i}", "a valid dictionary")
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise _anthropic_type("system", "a valid string or a valid list")
    messages = body.get("messages")
    if messages is None:
        raise _anthropic_missing("messages")
    if not isinstance(messages, list):
        raise _anthropic_type("messages", "a valid list")
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise _anthropic_type(where, "a valid dictionary")
        role = message.get("role")
        if role is None:
            raise _anthropic_missing(f"{where}.role")
        if not isinstance(role, str):
            raise _anthropic_type(f"{where}.role", "'user' or 'assistant'")
        if "content" not in message:
            raise _anthropic_missing(f"{where}.content")
        content = message["content"]
        if not isinstance(content, str | list):
            raise _anthropic_type(f"{where}.content", "a valid string or a valid list")
