"""``stable_json`` and ``whitespace`` with learned forms: rewrite a part only where it varies.

The fixed rules (``proxy.canonical.stable_json``, ``proxy.canonical.whitespace`` and their
Responses / Messages mappings in ``proxy.canonical.apis``) compute each part's normal form: the
tool list sorted by name with every schema's keys sorted, tool-call arguments as compact sorted
JSON, owned text with normalised line ends. Here that normal form is only the part's identity
(its digest keys the form memory, ``proxy.canonical.forms``); what the backend gets is the form
first seen for that identity:

- a part whose identity is new is forwarded as it came, and its bytes become the form;
- a part already in its form is forwarded as it came;
- a part with a known identity in other bytes is rewritten to the form.

The parts, by rule and API:

    stable_json  chat       tools, functions, messages[*].tool_calls[*].function.arguments,
                            messages[*].function_call.arguments
                 responses  tools, input[*].arguments of function_call items
                 messages   tools, messages[*].content[*].input of tool_use blocks
    whitespace   chat       every system/developer text, every tool and schema description
                 completion prompt strings (only with ``raw_prompts``)
                 responses / messages: the system text and tool descriptions

The response format schema is not a part: it never reaches the prompt, so rewriting it buys no
cache, and under constrained decoding its order is the order the model writes in. Whatever the
fixed rule leaves alone (a tool list with a ``cache_control`` marker keeps its order, arguments
that cannot be rewritten losslessly) is its own identity, so it is never rewritten here either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import orjson
import xxhash

from proxy.canonical import apis
from proxy.canonical.config import WHITESPACE, RuleConfig
from proxy.canonical.draft import Draft, Path
from proxy.canonical.forms import FormView
from proxy.canonical.outcome import Change, RuleOutcome
from proxy.canonical.slots import is_system, system_slots, tool_slots

RewriteRule = Callable[[str, dict[str, Any], RuleConfig], RuleOutcome]
PartLister = Callable[[str, dict[str, Any], RuleConfig], Iterator[Path]]

FIRST_SEEN = "first_seen_form"
_TOOL_KEYS = ("tools", "functions")
_TEXT = b"s"
_JSON = b"j"


def _chat_arguments(body: dict[str, Any]) -> Iterator[Path]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if type(message) is not dict or message.get("role") != "assistant":
            continue
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            for j, call in enumerate(calls):
                function = call.get("function") if type(call) is dict else None
                if type(function) is dict and "arguments" in function:
                    yield ("messages", i, "tool_calls", j, "function", "arguments")
        call = message.get("function_call")
        if type(call) is dict and "arguments" in call:
            yield ("messages", i, "function_call", "arguments")


def _api_arguments(kind: str, body: dict[str, Any]) -> Iterator[Path]:
    if kind == apis.RESPONSES_KIND:
        items = body.get("input")
        if isinstance(items, list):
            for i, item in enumerate(items):
                if (
                    type(item) is dict
                    and item.get("type") == "function_call"
                    and isinstance(item.get("arguments"), str)
                ):
                    yield ("input", i, "arguments")
        return
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if type(message) is not dict or message.get("role") != "assistant":
            continue
        content = message.get("content")
        if type(content) is list:
            for j, block in enumerate(content):
                if type(block) is dict and block.get("type") == "tool_use" and "input" in block:
                    yield ("messages", i, "content", j, "input")


def stable_json_parts(kind: str, body: dict[str, Any], rule: RuleConfig) -> Iterator[Path]:
    """The parts ``stable_json`` learns forms for (module docstring)."""
    keys = ("tools", "functions") if kind == "chat" else ("tools",)
    for key in keys:
        if isinstance(body.get(key), list) and body[key]:
            yield (key,)
    if not rule.flag("tool_call_arguments"):
        return
    if kind == "chat":
        yield from _chat_arguments(body)
    elif kind in apis.API_KINDS:
        yield from _api_arguments(kind, body)


def whitespace_parts(kind: str, body: dict[str, Any], rule: RuleConfig) -> Iterator[Path]:
    """The parts ``whitespace`` learns forms for (module docstring)."""
    if kind == "chat":
        for slot in (*system_slots(body, leading_only=False), *tool_slots(body)):
            yield slot.path
    elif kind == "completion" and rule.flag("raw_prompts"):
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            yield ("prompt",)
        elif isinstance(prompt, list):
            for i, item in enumerate(prompt):
                if isinstance(item, str):
                    yield ("prompt", i)
    elif kind in apis.API_KINDS and apis.frozen_through(kind, body) is None:
        for slot in (*apis.system_slots(kind, body), *apis.tool_slots(kind, body)):
            yield slot.path


def chat_forms_hold(view: FormView, body: dict[str, Any]) -> bool:
    """Whether a chat request is, for both learned rules, already in its forms: no tool list,
    no tool-call arguments, and every system or developer text a whole string marked as a
    ``whitespace`` form. Then ``learned_rule`` would pass every part untouched, and it need not
    run (the common request of an application that is stable already). False whenever in
    doubt: the rules then run as ever."""
    if body.get("tools") or body.get("functions"):
        return False
    messages = body.get("messages")
    if type(messages) is not list:
        return False
    is_form = view.is_form
    for message in messages:
        if type(message) is not dict:
            continue
        if message.get("role") == "assistant":
            if message.get("tool_calls") or message.get("function_call") is not None:
                return False
        elif is_system(message):  # (a part of ``whitespace_parts``, through ``system_slots``)
            content = message.get("content")
            if type(content) is str:
                if not is_form(WHITESPACE, content):
                    return False
            elif content is not None:
                return False
    return True


def _encode(value: Any) -> bytes | None:
    """A part's value as tagged bytes (None: not representable, so not learned)."""
    try:
        if isinstance(value, str):
            return _TEXT + value.encode("utf-8", "surrogatepass")
        return _JSON + orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        return None


def _decode(form: bytes) -> Any:
    if form[:1] == _TEXT:
        return form[1:].decode("utf-8", "surrogatepass")
    return orjson.loads(form[1:])


def _at(body: Any, path: Path) -> Any:
    node = body
    for key in path:
        node = node[key]
    return node


def _pattern(path: Path) -> str:
    """``messages[3].tool_calls[0].function.arguments`` as ``messages[*].tool_calls[*]...``
    (one change entry per kind of part, with a count: a long history has hundreds)."""
    out: list[str] = []
    for key in path:
        if isinstance(key, int):
            out.append("[*]" if out and out[0] != "tools" else f"[{key}]")
        else:
            out.append(f".{key}" if out else key)
    return "".join(out)


def learned_rule(
    name: str,
    fixed: RewriteRule,
    parts: PartLister,
    view: FormView,
    kind: str,
    body: dict[str, Any],
    rule: RuleConfig,
    *,
    also: tuple[RewriteRule, RuleConfig] | None = None,
) -> RuleOutcome:
    """Rule ``name`` with learned forms: ``fixed`` gives each part's identity, ``view`` the
    forms; a part is rewritten only to a different form already seen for its identity.

    ``also``: a later fixed rule folded into the identity, so that a tool list shuffled *and*
    with other line ends in a description is still the same set (``stable_json`` takes the
    ``whitespace`` rule's normal form of the descriptions into its tools' identity).
    """
    normal: RuleOutcome | None = None  # the fixed rule runs only if some part needs it
    normal_body: dict[str, Any] = body
    draft = Draft(body)
    counts: dict[str, int] = {}
    for path in parts(kind, body, rule):
        # A text part of a content list normalises differently from a whole string.
        mark = f"{name}.part" if path[-1] == "text" or type(path[-1]) is int else name
        try:
            seen = _at(body, path)
        except (KeyError, IndexError, TypeError):
            continue
        seen_key: str | bytes | None = seen if type(seen) is str else _encode(seen)
        if seen_key is None:
            continue
        if view.is_form(mark, seen_key):
            continue  # already in its form: the common case, one dict lookup
        if normal is None:
            normal = fixed(kind, body, rule)
            normal_body = normal.body
            tools = {k: normal_body[k] for k in _TOOL_KEYS if isinstance(normal_body.get(k), list)}
            if also is not None and tools:  # only the tool lists: the rest is not needed
                normal_body = {**normal_body, **also[0](kind, tools, also[1]).body}
        try:
            ident = _at(normal_body, path)
        except (KeyError, IndexError, TypeError):  # the fixed rule reshaped it: leave it
            continue
        seen_b = seen_key if isinstance(seen_key, bytes) else _encode(seen)
        ident_b = seen_b if ident is seen else _encode(ident)
        if seen_b is None or ident_b is None:
            continue
        key = f"{name}:{xxhash.xxh3_128_hexdigest(ident_b)}"
        form = view.form(key)
        if form is None:
            view.learn(key, seen_b)
            view.mark_form(mark, seen_key)
        elif form == seen_b:
            view.mark_form(mark, seen_key)
        else:
            draft.set(path, _decode(form))
            where = _pattern(path)
            counts[where] = counts.get(where, 0) + 1
    changes = tuple(Change(name, where, FIRST_SEEN, n) for where, n in counts.items())
    return RuleOutcome(draft.body, changes, () if normal is None else normal.skipped)
