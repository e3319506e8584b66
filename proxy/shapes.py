"""The shapes of a chat request's structured fields, checked the way OpenAI's API checks them.

``tools``, ``tool_choice``, ``response_format``, ``stream_options``, message content parts and
an assistant message's ``tool_calls`` are nested objects with required members. OpenAI answers
400 when one is missing or of the wrong JSON type, with ``param`` naming the field
(``tools[0].function``, ``messages[2].content[1].type``); llama-server answers many of the same
mistakes with a 500 ("Failed to parse tools", "Failed to parse messages"). The proxy answers
them itself, in OpenAI's words, before anything reaches a backend.

What the backend judges stays the backend's: values (a tool name's pattern, a ``tool_choice``
string, an empty array), and the types OpenAI does not define, which servers add as extensions
(content parts ``input_video`` / ``video_url`` for llama.cpp, a plain-string ``image_url`` or
``audio_url`` for vLLM, ``response_format`` types beyond OpenAI's). Only the types OpenAI
defines are checked member by member; ``null`` counts as absent, as it does at the top level.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.errors import BadRequest

_JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    int: "a number",
    float: "a number",
    type(None): "null",
}


def json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, as OpenAI's messages say it ("an object")."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def invalid_type(param: str, expected: str, value: Any) -> BadRequest:
    return BadRequest(
        f"Invalid type for '{param}': expected {expected}, but got {json_type(value)} instead.",
        param=param,
        code="invalid_type",
    )


def missing(param: str) -> BadRequest:
    return BadRequest(
        f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
    )


def invalid_value(param: str, value: Any, supported: tuple[str, ...]) -> BadRequest:
    listed = " and ".join(", ".join(f"'{s}'" for s in supported).rsplit(", ", 1))
    shown = value if isinstance(value, str) else json_type(value)
    return BadRequest(
        f"Invalid value for '{param}': '{shown}'. Supported values are: {listed}.",
        param=param,
        code="invalid_value",
    )


_EXPECTED = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}


def member(
    obj: Mapping[str, Any], name: str, where: str, kind: type, *, required: bool = False
) -> Any:
    """``obj[name]`` checked to be of ``kind`` (None when absent or null, unless required)."""
    value = obj.get(name)
    if value is None:
        if required:
            raise missing(f"{where}.{name}" if where else name)
        return None
    if not isinstance(value, kind):
        raise invalid_type(f"{where}.{name}" if where else name, _EXPECTED[kind], value)
    return value


def element(value: Any, where: str) -> dict[str, Any]:
    """An array element that must be an object."""
    if not isinstance(value, dict):
        raise invalid_type(where, "an object", value)
    return value


TOOL_TYPES = ("function", "custom")


def _plain_function_tool(tool: Any) -> bool:
    """The common case, checked without building a field path: a named function tool with a
    string description and an object of parameters (or neither), and no ``strict``."""
    if type(tool) is not dict or tool.get("type") != "function":
        return False
    fn = tool.get("function")
    return (
        type(fn) is dict
        and type(fn.get("name")) is str
        and type(fn.get("description", "")) is str
        and type(fn.get("parameters", _EMPTY)) is dict
        and fn.get("strict") is None
    )


_EMPTY: dict[str, Any] = {}


def check_tools(tools: list[Any]) -> None:
    """Each tool: an object whose ``type`` is ``function`` (with a ``function`` object naming
    it) or ``custom`` (with a ``custom`` object naming it)."""
    for i, raw in enumerate(tools):
        if _plain_function_tool(raw):
            continue
        where = f"tools[{i}]"
        tool = element(raw, where)
        kind = member(tool, "type", where, str, required=True)
        if kind not in TOOL_TYPES:
            raise invalid_value(f"{where}.type", kind, TOOL_TYPES)
        if kind == "function":
            fn = member(tool, "function", where, dict, required=True)
            at = f"{where}.function"
            member(fn, "name", at, str, required=True)
            member(fn, "description", at, str)
            member(fn, "parameters", at, dict)
            member(fn, "strict", at, bool)
        else:
            custom = member(tool, "custom", where, dict, required=True)
            member(custom, "name", f"{where}.custom", str, required=True)
            member(custom, "description", f"{where}.custom", str)


def check_tool_choice(choice: Any) -> None:
    """A string (its value is the backend's to judge), or an object naming what to call."""
    if isinstance(choice, str):
        return
    if not isinstance(choice, dict):
        raise invalid_type("tool_choice", "a string or an object", choice)
    kind = member(choice, "type", "tool_choice", str, required=True)
    if kind in TOOL_TYPES:
        named = member(choice, kind, "tool_choice", dict, required=True)
        member(named, "name", f"tool_choice.{kind}", str, required=True)
    elif kind == "allowed_tools":
        allowed = member(choice, "allowed_tools", "tool_choice", dict, required=True)
        member(allowed, "mode", "tool_choice.allowed_tools", str, required=True)
        member(allowed, "tools", "tool_choice.allowed_tools", list, required=True)


def check_response_format(fmt: Any) -> None:
    """An object with a string ``type``; ``json_schema`` carries a named ``json_schema``."""
    if not isinstance(fmt, dict):
        raise invalid_type("response_format", "an object", fmt)
    kind = member(fmt, "type", "response_format", str, required=True)
    if kind == "json_schema":
        schema = member(fmt, "json_schema", "response_format", dict, required=True)
        at = "response_format.json_schema"
        member(schema, "name", at, str, required=True)
        member(schema, "description", at, str)
        member(schema, "schema", at, dict)
        member(schema, "strict", at, bool)


def check_stream_options(opts: Mapping[str, Any]) -> None:
    member(opts, "include_usage", "stream_options", bool)
    member(opts, "include_obfuscation", "stream_options", bool)


def check_content_parts(parts: list[Any], index: int) -> None:
    """Each part of ``messages[index].content`` an object with a string ``type``; the parts
    OpenAI defines carry their member (``text``, ``refusal``, ``image_url``, ``input_audio``,
    ``file``)."""
    for j, raw in enumerate(parts):
        if type(raw) is dict and raw.get("type") == "text" and type(raw.get("text")) is str:
            continue  # the common case, without building a field path
        at = f"messages[{index}].content[{j}]"
        part = element(raw, at)
        kind = member(part, "type", at, str, required=True)
        if kind == "text":
            member(part, "text", at, str, required=True)
        elif kind == "refusal":
            member(part, "refusal", at, str, required=True)
        elif kind == "image_url":
            image = part.get("image_url")
            if image is None:
                raise missing(f"{at}.image_url")
            if isinstance(image, dict):
                member(image, "url", f"{at}.image_url", str, required=True)
            elif not isinstance(image, str):  # a bare URL string: vLLM's extension
                raise invalid_type(f"{at}.image_url", "an object", image)
        elif kind in ("input_audio", "file"):
            member(part, kind, at, dict, required=True)


TOOL_CALL_TYPES = TOOL_TYPES


def _plain_function_call(call: Any) -> bool:
    if type(call) is not dict or call.get("type") != "function" or type(call.get("id")) is not str:
        return False
    fn = call.get("function")
    return type(fn) is dict and type(fn.get("name")) is str and type(fn.get("arguments")) is str


def check_tool_calls(calls: Any, where: str) -> None:
    """An assistant message's ``tool_calls``: objects with an ``id`` and a ``type``; a
    function call names its function and carries its ``arguments`` as a JSON string."""
    if not isinstance(calls, list):
        raise invalid_type(where, "an array", calls)
    for k, raw in enumerate(calls):
        if _plain_function_call(raw):
            continue
        at = f"{where}[{k}]"
        call = element(raw, at)
        member(call, "id", at, str, required=True)
        kind = member(call, "type", at, str, required=True)
        if kind not in TOOL_CALL_TYPES:
            raise invalid_value(f"{at}.type", kind, TOOL_CALL_TYPES)
        if kind == "function":
            fn = member(call, "function", at, dict, required=True)
            member(fn, "name", f"{at}.function", str, required=True)
            member(fn, "arguments", f"{at}.function", str, required=True)
        else:
            custom = member(call, "custom", at, dict, required=True)
            member(custom, "name", f"{at}.custom", str, required=True)
            member(custom, "input", f"{at}.custom", str, required=True)


def check_message(message: dict[str, Any], index: int) -> None:
    """``messages[index]``'s members past ``role`` and ``content``'s own type; field paths are
    built only on the way to an error."""
    content = message.get("content")
    if type(content) is list:
        check_content_parts(content, index)
    calls = message.get("tool_calls")
    if calls is not None and not (type(calls) is list and all(map(_plain_function_call, calls))):
        check_tool_calls(calls, f"messages[{index}].tool_calls")
    name = message.get("name")
    if name is not None and type(name) is not str:
        member(message, "name", f"messages[{index}]", str)
    call_id = message.get("tool_call_id")
    if type(call_id) is not str:
        required = message.get("role") == "tool"
        if call_id is not None or required:
            member(message, "tool_call_id", f"messages[{index}]", str, required=required)
