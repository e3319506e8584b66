"""The ``whitespace`` rule: line endings and blanks at line ends, in text the rule owns.

Owned text: every system/developer message (string content, or each text part), each tool's
description and the ``description`` strings in its parameter schema. In it, ``\\r\\n`` and a
lone ``\\r`` become ``\\n``, and spaces and tabs just before a line break are dropped, as are
those at the end of a whole string. Nothing else: blanks inside a line and at its start stay
(indentation is meaning in code and in Markdown lists), and a text *part* keeps the blanks at its
end, because templates join parts with nothing between them and that blank may be the space
between two words. User, assistant and tool messages are never touched.

Raw completion prompts (``/v1/completions``, ``/completion``) are one string holding both the
application's template and the user's text, often code: a code model imitates the line endings
it sees, so turning a CRLF file into LF changes what it writes. The rule leaves them alone
unless ``raw_prompts = true``, and even then keeps the prompt's last line break and the line
after it (what the model continues from) byte for byte; blanks just before that break go.
"""

from __future__ import annotations

import re
from typing import Any

from proxy.canonical.config import WHITESPACE, RuleConfig
from proxy.canonical.draft import Draft, Path, format_path
from proxy.canonical.outcome import Change, RuleOutcome
from proxy.canonical.slots import system_slots, tool_slots

_LINE_BREAK = re.compile(r"\r\n?")
_BLANKS_BEFORE_BREAK = re.compile(r"[ \t]+(?=\n)")
_BLANKS_AT_END = re.compile(r"[ \t]+\Z")


def normalise(text: str, *, strip_end: bool) -> tuple[str, int, int]:
    """``text`` with line ends normalised: (new text, line breaks rewritten, blank runs cut)."""
    if (
        "\r" not in text
        and " \n" not in text
        and "\t\n" not in text
        and not (strip_end and text.endswith((" ", "\t")))
    ):
        return text, 0, 0
    breaks = trailing = 0
    if "\r" in text:
        text, breaks = _LINE_BREAK.subn("\n", text)
    text, trailing = _BLANKS_BEFORE_BREAK.subn("", text)
    if strip_end:
        text, cut = _BLANKS_AT_END.subn("", text)
        trailing += cut
    return text, breaks, trailing


def normalise_raw(text: str) -> tuple[str, int, int]:
    """A raw prompt normalised up to its last line break; that break and what follows are kept."""
    cut = max(text.rfind("\n"), text.rfind("\r"))
    if cut <= 0:
        return text, 0, 0
    if text[cut] == "\n" and text[cut - 1] == "\r":
        cut -= 1
    head, breaks, trailing = normalise(text[:cut], strip_end=True)
    return head + text[cut:], breaks, trailing


def _rewrite(
    draft: Draft, path: Path, text: str, strip_end: bool | None, out: list[Change]
) -> None:
    """Normalise one string: ``strip_end`` None for a raw prompt."""
    if strip_end is None:
        new, breaks, trailing = normalise_raw(text)
    else:
        new, breaks, trailing = normalise(text, strip_end=strip_end)
    if new == text:
        return
    draft.set(path, new)
    where = format_path(path)
    if breaks:
        out.append(Change(WHITESPACE, where, "line_endings", breaks))
    if trailing:
        out.append(Change(WHITESPACE, where, "trailing_blanks", trailing))


def whitespace(kind: str, body: dict[str, Any], rule: RuleConfig) -> RuleOutcome:
    """Apply the rule to a chat request, or to a raw prompt when ``raw_prompts`` is on."""
    draft = Draft(body)
    changes: list[Change] = []
    if kind == "chat":
        slots = (
            *system_slots(body, leading_only=False),
            *tool_slots(body, line_end_blanks_only=True),
        )
        for slot in slots:
            _rewrite(draft, slot.path, slot.text, slot.whole, changes)
    elif kind == "completion" and rule.flag("raw_prompts"):
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            _rewrite(draft, ("prompt",), prompt, None, changes)
        elif isinstance(prompt, list):
            for i, item in enumerate(prompt):
                if isinstance(item, str):
                    _rewrite(draft, ("prompt", i), item, None, changes)
    return RuleOutcome(draft.body, tuple(changes))
