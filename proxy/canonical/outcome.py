"""What a rule did to a request: changes and skips, described without any prompt text."""

from __future__ import annotations

from typing import Any

from proxy.values import value


@value
class Change:
    """One place a rule rewrote (or, in dry-run, would rewrite).

    ``path`` names the JSON location (``messages[0].content``, ``tools``); ``kind`` says what
    happened there (``sort_keys``, ``reorder``, ``line_endings``, ``placeholder``, ``note``...);
    ``count`` how many values or lines. Never holds prompt text, so it is safe to log.
    """

    rule: str
    path: str
    kind: str
    count: int = 1


@value
class Skip:
    """A rule found something to do but left it alone, and why."""

    rule: str
    reason: str
    path: str = ""


@value
class RuleOutcome:
    """A rule's result: the rewritten body (the input object when unchanged) and what changed."""

    body: dict[str, Any]
    changes: tuple[Change, ...] = ()
    skipped: tuple[Skip, ...] = ()
