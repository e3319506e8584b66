"""The chat rules for the Responses and Anthropic Messages APIs, where their structure maps.

    chat                     Responses (``/v1/responses``)      Messages (``/v1/messages``)
    tools[*].function        tools[*] (flat function tools)     tools[*] (``input_schema``)
    leading system messages  ``instructions``, then leading     ``system`` (a string or text
                             system/developer ``input`` items   blocks)
    tool-call arguments      ``function_call`` items'           assistant ``tool_use`` blocks'
                             ``arguments`` (JSON text)          ``input`` (an object)
    newest user message      newest ``input`` item of role      newest message of role user
                             user (``input_text`` parts)        (``text`` blocks)

``stable_json`` sorts the keys of every tool and its schema and orders tools by name;
``whitespace`` normalises line ends in the system text and tool descriptions; the volatile rules
relocate values found there into a note on the newest user turn (``user_prefix``,
``user_suffix``), the newest user turn or ``function_call_output`` (``last_suffix``), or the end
of the system text (``system_suffix``). A string ``input`` is the user turn itself.

Anthropic ``cache_control`` breakpoints. A breakpoint marks the prompt up to it (tools, then
system, then messages, in that order) as what the client wants cached; the rules never rewrite
or move anything at or before the last breakpoint. Tools and system come before any breakpoint,
so a request with one keeps its tools, its system text and every message up to and including
the marked one byte for byte: only tool-use inputs in later messages are still canonicalized,
and no value is relocated (its slot is frozen). Each rule that leaves frozen parts alone says so
(skip reason ``cache_control_marker``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from proxy.canonical.config import STABLE_JSON, WHITESPACE, NotePlacement, RuleConfig
from proxy.canonical.draft import Draft, Path, format_path
from proxy.canonical.outcome import Change, RuleOutcome, Skip
from proxy.canonical.relocation import NoteTarget
from proxy.canonical.slots import TextSlot, tool_texts
from proxy.canonical.stable_json import canonical_arguments, sorted_json, sorted_schema
from proxy.canonical.whitespace import normalise
from proxy.fingerprint import CACHE_MARKER, SYSTEM_ROLES

RESPONSES_KIND = "responses"
MESSAGES_KIND = "messages"
API_KINDS = frozenset({RESPONSES_KIND, MESSAGES_KIND})


@dataclass(frozen=True, slots=True)
class Layout:
    """Where one API keeps what the rules read and write."""

    system: str  # the system text's key
    turns: str  # the conversation's key
    schema: str  # a tool's parameter schema's key
    text_parts: frozenset[str]  # content part types that are text
    note_part: str  # the type of the text part a note becomes


LAYOUTS = {
    RESPONSES_KIND: Layout(
        "instructions", "input", "parameters", frozenset({"input_text", "text"}), "input_text"
    ),
    MESSAGES_KIND: Layout("system", "messages", "input_schema", frozenset({"text"}), "text"),
}


# -- cache_control breakpoints ---------------------------------------------------------------


def _marked(value: Any) -> bool:
    """Whether a block (or any block of a content list) carries a breakpoint."""
    if type(value) is dict:
        return CACHE_MARKER in value
    if type(value) is list:
        return any(type(v) is dict and CACHE_MARKER in v for v in value)
    return False


def frozen_through(kind: str, body: dict[str, Any]) -> int | None:
    """None when nothing is frozen; else the index of the last message the rules must leave
    alone (-1: the breakpoint is in the tools or the system text). Tools and system text are
    frozen whenever this is not None."""
    if kind != MESSAGES_KIND:
        return None
    messages = body.get("messages")
    if type(messages) is list:
        for i in range(len(messages) - 1, -1, -1):
            message = messages[i]
            if type(message) is dict and (
                CACHE_MARKER in message or _marked(message.get("content"))
            ):
                return i
    tools = body.get("tools")
    if _marked(body.get("system")) or (type(tools) is list and _marked(tools)):
        return -1
    return None


# -- stable_json -------------------------------------------------------------------------------


def _sorted_keys(obj: dict[str, Any]) -> dict[str, Any]:
    try:
        keys = sorted(obj)
    except TypeError:
        return obj
    return obj if keys == list(obj) else {k: obj[k] for k in keys}


def canonical_tool(tool: Any, schema_key: str, keep_properties: bool) -> Any:
    """A tool with its keys sorted and its schema canonical (other values kept as they are)."""
    if type(tool) is not dict:
        return tool
    out = _sorted_keys(tool)
    schema = tool.get(schema_key)
    if isinstance(schema, dict | list):
        new = sorted_schema(schema, keep_properties=keep_properties)
        if new is not schema:
            out = dict(out) if out is tool else out
            out[schema_key] = new
    return out


def _tool_name(tool: Any) -> str:
    name = tool.get("name") if type(tool) is dict else None
    return name if isinstance(name, str) else ""


def _tools(draft: Draft, layout: Layout, rule: RuleConfig, out: list[Change]) -> None:
    tools = draft.original.get("tools")
    if not isinstance(tools, list):
        return
    keep = not rule.flag("sort_tool_properties")
    items = [canonical_tool(t, layout.schema, keep) for t in tools]
    rewritten = sum(1 for new, old in zip(items, tools, strict=True) if new is not old)
    if rewritten:
        out.append(Change(STABLE_JSON, "tools", "sort_keys", rewritten))
    if rule.flag("sort_tools") and len(items) > 1:
        names = [_tool_name(t) for t in items]
        order = sorted(range(len(items)), key=names.__getitem__)  # stable
        if order != sorted(order):
            items = [items[i] for i in order]
            out.append(Change(STABLE_JSON, "tools", "reorder"))
    if any(new is not old for new, old in zip(items, tools, strict=True)):
        draft.set(("tools",), items)


def _responses_arguments(draft: Draft, out: list[Change]) -> None:
    items = draft.original.get("input")
    if not isinstance(items, list):
        return
    rewritten = 0
    for i, item in enumerate(items):
        if type(item) is not dict or item.get("type") != "function_call":
            continue
        args = item.get("arguments")
        new = canonical_arguments(args) if isinstance(args, str) else None
        if new is not None and new != args:
            draft.set(("input", i, "arguments"), new)
            rewritten += 1
    if rewritten:
        out.append(Change(STABLE_JSON, "input[*].arguments", "sort_keys", rewritten))


def _messages_inputs(draft: Draft, after: int, out: list[Change]) -> None:
    messages = draft.original.get("messages")
    if not isinstance(messages, list):
        return
    rewritten = 0
    for i in range(after + 1, len(messages)):
        message = messages[i]
        if type(message) is not dict or message.get("role") != "assistant":
            continue
        content = message.get("content")
        if type(content) is not list:
            continue
        for j, block in enumerate(content):
            if type(block) is not dict or block.get("type") != "tool_use":
                continue
            value = block.get("input")
            new = sorted_json(value)
            if new is not value:
                draft.set(("messages", i, "content", j, "input"), new)
                rewritten += 1
    if rewritten:
        out.append(Change(STABLE_JSON, "messages[*].content[*].input", "sort_keys", rewritten))


def api_stable_json(kind: str, body: dict[str, Any], rule: RuleConfig) -> RuleOutcome:
    """``stable_json`` on a Responses or Messages request (module docstring)."""
    layout = LAYOUTS[kind]
    draft = Draft(body)
    changes: list[Change] = []
    skips: list[Skip] = []
    frozen = frozen_through(kind, body)
    if frozen is None:
        _tools(draft, layout, rule, changes)
    elif "tools" in body:
        skips.append(Skip(STABLE_JSON, "cache_control_marker", "tools"))
    if rule.flag("tool_call_arguments"):
        if kind == RESPONSES_KIND:
            _responses_arguments(draft, changes)
        else:
            _messages_inputs(draft, -1 if frozen is None else frozen, changes)
    return RuleOutcome(draft.body, tuple(changes), tuple(skips))


# -- text slots ------------------------------------------------------------------------------


def _content_slots(path: Path, content: Any, text_parts: frozenset[str]) -> Iterator[TextSlot]:
    if isinstance(content, str):
        yield TextSlot(path, content, True)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if (
                type(part) is dict
                and type(part.get("type")) is str
                and part["type"] in text_parts
                and isinstance(part.get("text"), str)
            ):
                yield TextSlot((*path, j, "text"), part["text"], False)


def _is_system_item(item: Any) -> bool:
    return (
        type(item) is dict
        and type(item.get("role")) is str
        and item["role"] in SYSTEM_ROLES
        and item.get("type", "message") == "message"
    )


def system_slots(kind: str, body: dict[str, Any]) -> Iterator[TextSlot]:
    """The system text: ``instructions`` and the leading system input items, or ``system``."""
    layout = LAYOUTS[kind]
    yield from _content_slots((layout.system,), body.get(layout.system), layout.text_parts)
    items = body.get("input") if kind == RESPONSES_KIND else None
    if isinstance(items, list):
        for i, item in enumerate(items):
            if not _is_system_item(item):
                return
            yield from _content_slots(
                ("input", i, "content"), item.get("content"), layout.text_parts
            )


def tool_slots(kind: str, body: dict[str, Any]) -> Iterator[TextSlot]:
    """Every tool's description and the descriptions in its schema."""
    schema_key = LAYOUTS[kind].schema
    tools = body.get("tools")
    if not isinstance(tools, list):
        return
    for i, tool in enumerate(tools):
        if type(tool) is not dict:
            continue
        view = {k: tool[k] for k in ("description",) if k in tool}
        if schema_key in tool:
            view["parameters"] = tool[schema_key]
        for rel, text in tool_texts(view).texts:
            where = (schema_key, *rel[1:]) if rel[0] == "parameters" else rel
            yield TextSlot(("tools", i, *where), text, True)


def stable_slots(kind: str, body: dict[str, Any]) -> list[TextSlot]:
    """The text slots of the stable segments, in rendered order; none when they are frozen."""
    if frozen_through(kind, body) is not None:
        return []
    return [*tool_slots(kind, body), *system_slots(kind, body)]


# -- whitespace --------------------------------------------------------------------------------


def api_whitespace(kind: str, body: dict[str, Any], rule: RuleConfig) -> RuleOutcome:
    """``whitespace`` on the system text and tool descriptions of a Responses or Messages
    request (never inside frozen parts)."""
    draft = Draft(body)
    changes: list[Change] = []
    if frozen_through(kind, body) is not None:
        return RuleOutcome(body, (), (Skip(WHITESPACE, "cache_control_marker"),))
    for slot in (*system_slots(kind, body), *tool_slots(kind, body)):
        new, breaks, trailing = normalise(slot.text, strip_end=slot.whole)
        if new == slot.text:
            continue
        draft.set(slot.path, new)
        where = format_path(slot.path)
        if breaks:
            changes.append(Change(WHITESPACE, where, "line_endings", breaks))
        if trailing:
            changes.append(Change(WHITESPACE, where, "trailing_blanks", trailing))
    return RuleOutcome(draft.body, tuple(changes))


# -- where the note goes ---------------------------------------------------------------------


def _is_user(turn: Any) -> bool:
    return (
        type(turn) is dict
        and turn.get("role") == "user"
        and turn.get("type", "message") == "message"
    )


def note_target(kind: str, body: dict[str, Any], placement: NotePlacement) -> NoteTarget | str:
    """Where ``placement`` puts the note in a Responses or Messages request, or why nowhere."""
    layout = LAYOUTS[kind]
    part = layout.note_part
    if placement == "system_suffix":
        system = body.get(layout.system)
        if not isinstance(system, str | list) or not system:
            return "no_system_message"
        return NoteTarget(-1, system, False, where=(layout.system,), part_type=part)
    turns = body.get(layout.turns)
    if isinstance(turns, str) and kind == RESPONSES_KIND:  # the input is the user's turn
        if placement == "last_suffix" or placement == "user_suffix":
            return NoteTarget(-1, turns, False, where=("input",), part_type=part)
        return NoteTarget(-1, turns, True, where=("input",), part_type=part)
    if not isinstance(turns, list) or not turns:
        return "no_user_message"
    if placement == "last_suffix":
        index = len(turns) - 1
        last = turns[index]
        if (
            kind == RESPONSES_KIND
            and type(last) is dict
            and last.get("type") == "function_call_output"
            and isinstance(last.get("output"), str)
        ):
            where = ("input", index, "output")
            return NoteTarget(index, last["output"], False, where=where, part_type=part)
        if not _is_user(last):
            return "newest_message_not_user_or_tool"
    else:
        found = next((i for i in range(len(turns) - 1, -1, -1) if _is_user(turns[i])), None)
        if found is None:
            return "no_user_message"
        index = found
    content = turns[index].get("content")
    if not isinstance(content, str | list):
        return "message_content_not_text"
    prefix = placement == "user_prefix"
    # Anthropic: a user message's tool results come before anything else in it.
    if (
        prefix
        and kind == MESSAGES_KIND
        and isinstance(content, list)
        and any(type(b) is dict and b.get("type") == "tool_result" for b in content)
    ):
        return "tool_result_first"
    where = (layout.turns, index, "content")
    return NoteTarget(index, content, prefix, where=where, part_type=part)
