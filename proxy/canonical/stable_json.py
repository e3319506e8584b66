"""The ``stable_json`` rule: tool schemas, tool order and tool-call arguments in one order.

An application's serializer decides the key order of the JSON it sends (a Go map shuffles it on
every request; two code paths may disagree), and the tools it offers may come in a different
order each time. The backend's chat template prints all of it into the prompt, so any shuffle
breaks the prefix cache at the tools, which come first. This rule rewrites, and only rewrites:

- every tool (``tools[*]``) and legacy function (``functions[*]``): the keys of the tool object
  and of its ``function`` object in sorted order, and the ``parameters`` schema with every
  object's keys sorted at every depth (values of other keys, e.g. ``cache_control``, are kept
  as they are, object for object);
- the tool list, ordered by function name (a stable sort: tools with equal names, and tools
  without one, keep their order, since anything else to sort them by is text the other rules
  may still rewrite), unless a tool carries a ``cache_control`` marker: moving it would move
  the provider's cache breakpoint, so then the order is kept and the skip is reported;
- ``response_format.json_schema.schema`` (and llama.cpp's ``response_format.schema``): keyword
  order sorted, but the order of the names under ``properties`` kept by default, because under
  constrained decoding it is the order the model writes the fields in (a "reasoning" field put
  before "answer" on purpose). The schema is not part of the prompt, so keeping it costs no
  cache hits. ``sort_response_properties = true`` sorts those names too;
- assistant ``tool_calls[*].function.arguments`` (and legacy ``function_call.arguments``), a JSON
  document inside a string: parsed and re-serialized compact with sorted keys, only when that
  is lossless (valid JSON, no duplicate keys, no number that does not survive as a double or an
  exact integer, no lone surrogate). Anything else is kept byte for byte.

Lists other than the tool list keep their order: in JSON Schema (``enum``, ``anyOf``,
``required``) and in arguments, array order is meaning. Property names inside tool parameter
schemas are sorted (``sort_tool_properties``): the model then sees, and under grammar-constrained
tool calls writes, arguments in sorted key order, which is the order this rule gives the
arguments of past calls, so the turn the model just generated renders the same way when it
comes back as history. No application reads meaning into the key order of arguments.

An application that resends the arguments exactly as the model wrote them gains nothing from
the rewrite on its own history, but one that parses and re-serializes them (or a model whose
spacing varies) does; the rewrite is cheap and cached (hundreds of calls in a long agent
history cost well under a millisecond), so it is on by default (``tool_call_arguments``).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any

import orjson

from proxy.canonical.config import STABLE_JSON, RuleConfig
from proxy.canonical.draft import Draft, format_path
from proxy.canonical.outcome import Change, RuleOutcome, Skip

_SORT_KEYS = orjson.OPT_SORT_KEYS
# One change entry for all tool-call arguments of a request (a long agent history has hundreds).
ARGUMENTS_PATH = "messages[*].tool_calls[*].function.arguments"
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example"})
_NAME_MAPS = frozenset({"patternProperties", "$defs", "definitions", "dependentSchemas"})


def _sorted_py(value: Any) -> tuple[Any, bool]:
    """``value`` with keys sorted at every depth, and whether anything moved (Python walk)."""
    if isinstance(value, dict):
        keys = sorted(value)
        moved = keys != list(value)
        out = {}
        for key in keys:
            out[key], sub = _sorted_py(value[key])
            moved = moved or sub
        return (out, True) if moved else (value, False)
    if isinstance(value, list):
        items = [_sorted_py(v) for v in value]
        if any(sub for _, sub in items):
            return [v for v, _ in items], True
        return value, False
    return value, False


def sorted_json(value: Any) -> Any:
    """``value`` with every object's keys sorted; the same object when they already are."""
    try:
        plain = orjson.dumps(value)
        ordered = orjson.dumps(value, option=_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        # Integers past 64 bits or lone surrogates (only from a body built in Python).
        try:
            return _sorted_py(value)[0]
        except TypeError:  # keys that do not compare: leave the value as it is
            return value
    return value if plain == ordered else orjson.loads(ordered)


def sorted_schema(schema: Any, *, keep_properties: bool) -> Any:
    """A JSON Schema with keyword keys sorted; ``properties`` names kept in order if asked."""
    if not keep_properties:
        return sorted_json(schema)
    if isinstance(schema, list):
        items = [sorted_schema(v, keep_properties=True) for v in schema]
        return items if any(a is not b for a, b in zip(items, schema, strict=True)) else schema
    if not isinstance(schema, dict):
        return schema
    try:
        keys = sorted(schema)
    except TypeError:
        return schema
    out: dict[Any, Any] = {}
    for key in keys:
        value = schema[key]
        if key in _DATA_KEYWORDS:
            out[key] = sorted_json(value)
        elif key == "properties" and isinstance(value, dict):
            props = {n: sorted_schema(s, keep_properties=True) for n, s in value.items()}
            same = all(props[n] is value[n] for n in value)
            out[key] = value if same else props
        elif key in _NAME_MAPS and isinstance(value, dict):
            try:
                names = sorted(value)
            except TypeError:
                names = list(value)
            subs = {n: sorted_schema(value[n], keep_properties=True) for n in names}
            same = names == list(value) and all(subs[n] is value[n] for n in names)
            out[key] = value if same else subs
        else:
            out[key] = sorted_schema(value, keep_properties=True)
    if keys == list(schema) and all(out[k] is schema[k] for k in keys):
        return schema
    return out


def _sorted_keys(obj: dict[Any, Any]) -> dict[Any, Any]:
    """``obj`` with its own keys (not its values) in sorted order."""
    try:
        keys = sorted(obj)
    except TypeError:
        return obj
    return obj if keys == list(obj) else {k: obj[k] for k in keys}


def _canonical_function(function: dict[str, Any], keep_properties: bool) -> dict[str, Any]:
    out = _sorted_keys(function)
    parameters = function.get("parameters")
    if isinstance(parameters, dict | list):
        new = sorted_schema(parameters, keep_properties=keep_properties)
        if new is not parameters:
            out = dict(out) if out is function else out
            out["parameters"] = new
    return out


_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def _canonical_tool(tool: Any, nested: bool, keep_properties: bool) -> Any:
    if type(tool) is not dict:
        return tool
    try:
        plain = orjson.dumps(tool)
        ordered = orjson.dumps(tool, option=_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):
        pass
    else:
        if plain == ordered:
            return tool
        function = tool.get("function") if nested else tool
        if (
            not keep_properties
            and (not nested or _TOOL_KEYS.issuperset(tool))
            and type(function) is dict
            and _FUNCTION_KEYS.issuperset(function)
        ):
            return orjson.loads(ordered)  # the rule owns every key in it: one round trip
    if not nested:
        return _canonical_function(tool, keep_properties)
    out = _sorted_keys(tool)
    function = tool.get("function")
    if type(function) is dict:
        new = _canonical_function(function, keep_properties)
        if new is not function:
            out = dict(out) if out is tool else out
            out["function"] = new
    return out


def _tool_name(tool: Any, nested: bool) -> str:
    function = tool.get("function") if nested and type(tool) is dict else tool
    name = function.get("name") if type(function) is dict else None
    return name if isinstance(name, str) else ""


def _has_cache_marker(tool: Any) -> bool:
    if type(tool) is not dict:
        return False
    function = tool.get("function")
    return "cache_control" in tool or (type(function) is dict and "cache_control" in function)


def _tools(draft: Draft, key: str, rule: RuleConfig, out: list[Change], skips: list[Skip]) -> None:
    tools = draft.original.get(key)
    if not isinstance(tools, list):
        return
    nested = key == "tools"
    keep = not rule.flag("sort_tool_properties")
    items = [_canonical_tool(t, nested, keep) for t in tools]
    rewritten = sum(1 for new, old in zip(items, tools, strict=True) if new is not old)
    if rewritten:
        out.append(Change(STABLE_JSON, key, "sort_keys", rewritten))
    if rule.flag("sort_tools") and len(items) > 1:
        names = [_tool_name(t, nested) for t in items]
        order = sorted(range(len(items)), key=names.__getitem__)  # stable: equal names keep order
        if order != sorted(order):
            if any(_has_cache_marker(t) for t in items):
                skips.append(Skip(STABLE_JSON, "cache_control_marker", key))
            else:
                items = [items[i] for i in order]
                out.append(Change(STABLE_JSON, key, "reorder"))
    if any(new is not old for new, old in zip(items, tools, strict=True)):
        draft.set((key,), items)


def _response_format(draft: Draft, rule: RuleConfig, out: list[Change]) -> None:
    fmt = draft.original.get("response_format")
    if type(fmt) is not dict:
        return
    keep = not rule.flag("sort_response_properties")
    wrapper = fmt.get("json_schema")
    candidates: list[tuple[tuple[str, ...], Any]] = [(("response_format", "schema"), fmt)]
    if type(wrapper) is dict:
        candidates.insert(0, (("response_format", "json_schema", "schema"), wrapper))
    for path, holder in candidates:
        schema = holder.get("schema")
        if isinstance(schema, dict):
            new = sorted_schema(schema, keep_properties=keep)
            if new is not schema:
                draft.set(path, new)
                out.append(Change(STABLE_JSON, format_path(path), "sort_keys"))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key")
    return out


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number out of range")
    return value


def _reject_constant(text: str) -> Any:
    raise ValueError(f"not JSON: {text}")


_DECODER = json.JSONDecoder(
    object_pairs_hook=_no_duplicates, parse_float=_finite, parse_constant=_reject_constant
)
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_CACHED_ARGUMENTS = 4096  # entries; an agent resends its whole history on every turn
_CACHED_LENGTH = 4096  # characters; longer arguments are canonicalized every time


def _canonical_arguments(text: str) -> str | None:
    try:
        out = _ENCODER.encode(_DECODER.decode(text))
        out.encode()  # a lone surrogate from a \ud800 escape cannot be forwarded raw
    except (ValueError, TypeError, RecursionError, UnicodeEncodeError):
        return None
    return out


_canonical_arguments_cached = lru_cache(maxsize=_CACHED_ARGUMENTS)(_canonical_arguments)


def canonical_arguments(text: str) -> str | None:
    """Tool-call arguments re-serialized compact with sorted keys, or None if not lossless."""
    if len(text) <= _CACHED_LENGTH:
        return _canonical_arguments_cached(text)
    return _canonical_arguments(text)


def _canonical_function_call(function: Any) -> tuple[Any, bool]:
    """A ``function`` object of a tool call with canonical arguments, and whether the
    arguments were JSON that could not be rewritten losslessly."""
    if type(function) is not dict or "arguments" not in function:
        return function, False
    args = function["arguments"]
    if isinstance(args, str):
        new = canonical_arguments(args)
        if new is None:
            return function, args.lstrip()[:1] in ("{", "[")
        if new == args:
            return function, False
    else:
        new = sorted_json(args)
        if new is args:
            return function, False
    return {**function, "arguments": new}, False


def _assistant_message(message: dict[str, Any], index: int) -> tuple[dict[str, Any], int, str]:
    """An assistant message with canonical tool-call arguments, how many were rewritten, and
    the path of the first call whose arguments could not be rewritten losslessly."""
    rewritten = 0
    lossy = ""
    out = message
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        new_calls = calls
        for j, call in enumerate(calls):
            if type(call) is not dict:
                continue
            old = call.get("function")
            function, bad = _canonical_function_call(old)
            if bad and not lossy:
                lossy = format_path(("messages", index, "tool_calls", j, "function", "arguments"))
            if function is not old:
                if new_calls is calls:
                    new_calls = list(calls)
                new_calls[j] = {**call, "function": function}
                rewritten += 1
        if new_calls is not calls:
            out = {**message, "tool_calls": new_calls}
    if "function_call" in message:
        old = message["function_call"]
        function, bad = _canonical_function_call(old)
        if bad and not lossy:
            lossy = format_path(("messages", index, "function_call", "arguments"))
        if function is not old:
            out = {**out, "function_call": function}
            rewritten += 1
    return out, rewritten, lossy


def _arguments(draft: Draft, out: list[Change], skips: list[Skip]) -> None:
    messages = draft.original.get("messages")
    if not isinstance(messages, list):
        return
    rewritten = 0
    lossy = ""
    new_messages = messages
    for i, message in enumerate(messages):
        if type(message) is not dict or message.get("role") != "assistant":
            continue
        new, count, bad = _assistant_message(message, i)
        lossy = lossy or bad
        if new is not message:
            if new_messages is messages:
                new_messages = list(messages)
            new_messages[i] = new
            rewritten += count
    if new_messages is not messages:
        draft.set(("messages",), new_messages)
        out.append(Change(STABLE_JSON, ARGUMENTS_PATH, "sort_keys", rewritten))
    if lossy:  # one skip per request, at the first such call
        skips.append(Skip(STABLE_JSON, "arguments_not_lossless", lossy))


def stable_json(kind: str, body: dict[str, Any], rule: RuleConfig) -> RuleOutcome:
    """Apply the rule to a chat request (``kind == "chat"``); other kinds are left alone."""
    if kind != "chat":
        return RuleOutcome(body)
    draft = Draft(body)
    changes: list[Change] = []
    skips: list[Skip] = []
    _tools(draft, "tools", rule, changes, skips)
    _tools(draft, "functions", rule, changes, skips)
    _response_format(draft, rule, changes)
    if rule.flag("tool_call_arguments"):
        _arguments(draft, changes, skips)
    return RuleOutcome(draft.body, tuple(changes), tuple(skips))
