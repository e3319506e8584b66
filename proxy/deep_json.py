"""JSON text for values nested deeper than the interpreter's recursion limit.

``json.dumps`` recurses once per level and raises ``RecursionError`` past about 1,000; the
fingerprint must render any JSON object whatever its depth (``proxy.fingerprint._json`` falls
back to this). ``deep_json`` writes the text ``json.dumps(value, separators=(",", ":"),
ensure_ascii=False, default=repr)`` gives, with an explicit stack.
"""

from __future__ import annotations

from json.encoder import encode_basestring
from typing import Any

_END: Any = object()  # the end of a container on the stack
_INF = float("inf")


def _json_scalar(value: Any) -> str:
    """A non-container as ``json.dumps(..., ensure_ascii=False, default=repr)`` writes it."""
    if isinstance(value, str):
        return encode_basestring(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value in (_INF, -_INF):
            return "Infinity" if value > 0 else "-Infinity"
        return float.__repr__(value)
    return encode_basestring(repr(value))


def _json_key(key: Any) -> str:
    """A dict key as ``json.dumps`` writes it (``repr`` for the types it would refuse)."""
    if isinstance(key, str):
        return encode_basestring(key)
    if key is None or isinstance(key, int | float):
        return '"' + _json_scalar(key) + '"'
    return encode_basestring(repr(key))


class _Frame:
    """An open container of ``deep_json``: what is left of it and how to close it."""

    __slots__ = ("closer", "ident", "is_dict", "items", "written")

    def __init__(self, obj: Any, *, is_dict: bool) -> None:
        self.items = iter(obj.items() if is_dict else obj)
        self.is_dict = is_dict
        self.closer = "}" if is_dict else "]"
        self.ident = id(obj)
        self.written = False


def deep_json(value: Any) -> str:
    """The text ``json.dumps`` (compact, ``ensure_ascii=False``, ``default=repr``) gives,
    built with an explicit stack: nesting depth is bounded by memory, not by the C stack.

    Only reached for values nested past the recursion limit. A cycle (which no parsed JSON
    holds) raises ``ValueError``, as ``json.dumps`` does.
    """
    parts: list[str] = []
    stack: list[_Frame] = []
    active: set[int] = set()

    def write(obj: Any) -> None:
        if isinstance(obj, dict):
            frame, opener = _Frame(obj, is_dict=True), "{"
        elif isinstance(obj, list | tuple):
            frame, opener = _Frame(obj, is_dict=False), "["
        else:
            parts.append(_json_scalar(obj))
            return
        if frame.ident in active:
            raise ValueError("Circular reference detected")
        active.add(frame.ident)
        parts.append(opener)
        stack.append(frame)

    write(value)
    while stack:
        frame = stack[-1]
        item: Any = next(frame.items, _END)
        if item is _END:
            stack.pop()
            active.discard(frame.ident)
            parts.append(frame.closer)
            continue
        if frame.written:
            parts.append(",")
        frame.written = True
        if frame.is_dict:
            key, item = item
            parts.append(_json_key(key))
            parts.append(":")
        write(item)
    return "".join(parts)
