"""Where the rules may read and write text in a chat request.

A *text slot* is one string the canonicalizer owns: the content of a system or developer
message (a string, or one text part of a content list), a tool's description, or a
``description`` inside a tool's parameter schema. User, assistant and tool messages are never
slots; nor is anything inside a schema's data keywords (``enum``, ``const``, ``default``,
``examples``), which are values, not prose.

The *stable segments* are the tools and the leading run of system/developer messages: what an
application sends unchanged on every turn, and so what the volatile rules clean. A system
message later in the conversation is history; it is resent as it was, so it is left alone.

Anything of an unexpected type (a message that is not an object, content that is neither a
string nor a list) is skipped, never an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import orjson

from proxy.canonical.draft import Path
from proxy.fingerprint import SYSTEM_ROLES

_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples", "example"})
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions"})


class TextSlot(NamedTuple):
    """One owned string: where it is, what it holds, and whether it ends its message.

    ``whole`` is False for a text part of a content list: templates join parts with nothing
    in between, so a blank at a part's end may be the space between two words.
    """

    path: Path
    text: str
    whole: bool


def is_system(message: Any) -> bool:
    """Whether ``message`` is a system or developer message."""
    # ``role`` may be any JSON value; an unhashable one (a list) must not reach the set lookup.
    return (
        type(message) is dict
        and type(message.get("role")) is str
        and message["role"] in SYSTEM_ROLES
    )


def content_slots(path: Path, content: Any) -> Iterator[TextSlot]:
    """The text slots of one message's ``content`` at ``path``."""
    if isinstance(content, str):
        yield TextSlot(path, content, True)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            if isinstance(part, str):
                yield TextSlot((*path, j), part, False)
            elif (
                type(part) is dict
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                yield TextSlot((*path, j, "text"), part["text"], False)


def system_slots(body: dict[str, Any], *, leading_only: bool) -> Iterator[TextSlot]:
    """Text slots of the system/developer messages (only the leading run if ``leading_only``)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        if is_system(message):
            yield from content_slots(("messages", i, "content"), message.get("content"))
        elif leading_only:
            return


def leading_system_indexes(body: dict[str, Any]) -> list[int]:
    """Indexes of the leading run of system/developer messages."""
    messages = body.get("messages")
    out: list[int] = []
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if not is_system(message):
                break
            out.append(i)
    return out


def newest_user_index(body: dict[str, Any]) -> int | None:
    """Index of the last message with role ``user``, or None."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if type(message) is dict and message.get("role") == "user":
            return i
    return None


def _walk_descriptions(schema: Any) -> list[tuple[Path, str]]:
    """(relative path, text) of every ``description`` string in a schema, in document order."""
    out: list[tuple[Path, str]] = []
    stack: list[tuple[Path, Any]] = [((), schema)]
    while stack:
        where, node = stack.pop()
        children: list[tuple[Path, Any]] = []
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "description" and isinstance(value, str):
                    out.append(((*where, key), value))
                elif key in _DATA_KEYWORDS:
                    continue
                elif key in _NAME_MAPS and isinstance(value, dict):
                    children += [((*where, key, name), sub) for name, sub in value.items()]
                elif isinstance(value, dict | list):
                    children.append(((*where, key), value))
        elif isinstance(node, list):
            children = [((*where, i), item) for i, item in enumerate(node)]
        stack.extend(reversed(children))
    return out


def _has_line_end_blanks(text: str) -> bool:
    return "\r" in text or " \n" in text or "\t\n" in text or text.endswith((" ", "\t"))


class ToolTexts:
    """The owned strings of one tool's function object, relative to it."""

    __slots__ = ("_placed", "line_end_blanks", "texts")

    def __init__(self, texts: tuple[tuple[Path, str], ...]) -> None:
        self.texts = texts
        # Whether any of them has a CR or blanks before a line end (work for ``whitespace``).
        self.line_end_blanks = any(_has_line_end_blanks(t) for _, t in texts)
        self._placed: dict[Path, tuple[TextSlot, ...]] = {}

    def slots(self, where: Path) -> tuple[TextSlot, ...]:
        """The strings as slots of a tool at ``where`` (remembered: tools keep their place)."""
        placed = self._placed.get(where)
        if placed is None:
            if len(self._placed) >= 16:
                self._placed.clear()
            placed = self._placed[where] = tuple(
                TextSlot(where + rel, text, True) for rel, text in self.texts
            )
        return placed


def _tool_texts(function: dict[str, Any]) -> ToolTexts:
    texts: list[tuple[Path, str]] = []
    description = function.get("description")
    if isinstance(description, str):
        texts.append((("description",), description))
    parameters = function.get("parameters")
    if isinstance(parameters, dict | list):
        texts += [(("parameters", *rel), text) for rel, text in _walk_descriptions(parameters)]
    return ToolTexts(tuple(texts))


# Applications send the same tools on every request: remember each tool's owned strings,
# keyed by its exact JSON. Cleared when full; the cache only saves time.
_TOOL_TEXTS: dict[bytes, ToolTexts] = {}
_TOOL_TEXTS_MAX = 4096


def tool_texts(function: dict[str, Any]) -> ToolTexts:
    """The description and parameter descriptions of a tool's function object."""
    try:
        key = orjson.dumps(function)
    except (TypeError, orjson.JSONEncodeError):
        return _tool_texts(function)
    cached = _TOOL_TEXTS.get(key)
    if cached is None:
        if len(_TOOL_TEXTS) >= _TOOL_TEXTS_MAX:
            _TOOL_TEXTS.clear()
        cached = _TOOL_TEXTS[key] = _tool_texts(function)
    return cached


def tool_slots(body: dict[str, Any], *, line_end_blanks_only: bool = False) -> Iterator[TextSlot]:
    """Descriptions of every tool (and legacy function) and of their parameters.

    ``line_end_blanks_only``: only tools with a text that has a CR or blanks before a line end.
    """
    for key, nested in (("tools", True), ("functions", False)):
        items = body.get(key)
        if not isinstance(items, list):
            continue
        for i, item in enumerate(items):
            function = item.get("function") if nested and type(item) is dict else item
            if type(function) is not dict:
                continue
            found = tool_texts(function)
            if line_end_blanks_only and not found.line_end_blanks:
                continue
            yield from found.slots((key, i, "function") if nested else (key, i))
