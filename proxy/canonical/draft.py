"""Copy-on-write edits of a parsed JSON body.

Rules never mutate the request they are given. A ``Draft`` copies, once, each container on the
way to an edited value (shallow copies: everything off the edited paths stays shared with the
original), so rewriting one system message of a long conversation copies the top-level dict,
the messages list and that one message, nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Path = tuple[str | int, ...]


def format_path(path: Sequence[str | int]) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    out: list[str] = []
    for key in path:
        if isinstance(key, int):
            out.append(f"[{key}]")
        else:
            out.append(f".{key}" if out else key)
    return "".join(out)


class Draft:
    """A body being rewritten; ``body`` is the original object until the first ``set``."""

    __slots__ = ("_fresh", "body", "original")

    def __init__(self, body: dict[str, Any]) -> None:
        self.original = body
        self.body = body
        self._fresh: set[int] = set()  # ids of the containers this draft has copied

    @property
    def changed(self) -> bool:
        return self.body is not self.original

    def get(self, path: Path) -> Any:
        """The current value at ``path`` (which must exist)."""
        node: Any = self.body
        for key in path:
            node = node[key]
        return node

    def set(self, path: Path, value: Any) -> None:
        """Replace the value at ``path``, copying the containers above it that are not copies."""
        fresh = self._fresh
        if self.body is self.original:
            self.body = dict(self.original)
            fresh.add(id(self.body))
        node: Any = self.body
        for key in path[:-1]:
            child = node[key]
            if id(child) not in fresh:
                child = dict(child) if isinstance(child, dict) else list(child)
                node[key] = child
                fresh.add(id(child))
            node = child
        node[path[-1]] = value
