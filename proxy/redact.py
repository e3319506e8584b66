"""Redaction of secrets in prompt text, applied before any prompt text is logged.

Prompt text reaches the logs only when the operator opts in (``--log-prompts``). Even then,
strings in the logged body pass through ``Redactor`` first: API keys and tokens of the common
providers, bearer tokens, private-key blocks, AWS access key ids, JSON web tokens and email
addresses are replaced by ``[REDACTED:<kind>]``. Operators add their own patterns with
``--redact-pattern`` (a Python regular expression; repeat the flag) or turn the defaults off with
``--no-redact-defaults``.

Linear time. Redaction runs on the event loop, on bodies of up to ``--max-body-bytes``, so no
default pattern may backtrack: every one runs in time linear in the text, whatever the text
(measured: 200 KB built to make each pattern backtrack takes milliseconds, where the plain
regular expressions in ``DEFAULT_PATTERNS`` took seconds to minutes). Most are linear as plain
regular expressions (a literal anchor, then character runs with no competing continuation).
Three are not, because a match may start at many places inside one long run of characters and
each start rescans the run: ``email`` (a long run of letters), ``jwt`` (``eyJ-eyJ-…``) and
``private_key`` (many ``BEGIN`` lines and no ``END``). Those run in two phases
(``_email_spans``, ``_jwt_spans``, ``_private_key_spans``): find the anchor of each candidate
once (the ``@``, the run before the first ``.``, the ``BEGIN`` line), then match the rest
anchored. They redact exactly what the regular expression in ``DEFAULT_PATTERNS`` redacts
(``tests/unit/test_redact.py`` checks it on generated text). Operator patterns run as given:
their cost is the operator's.

A bounded amount of work. Even linear, nine passes over a 32 MiB body cost seconds (about 3 s
here, all on the event loop), and a log line that size helps nobody. So ``Redactor.value``
keeps at most ``max_chars`` characters of a body's strings (``DEFAULT_MAX_CHARS``, 1 Mi: a full
128K-token prompt with room to spare; redacting it takes about 20 ms for ordinary text and under
0.2 s for text packed with near-miss secrets). Each string is also charged a fixed 32 and every
other value 8 (their own cost), so a body of millions of tiny values is bounded too. Past the
budget a string is cut and marked ``[TRUNCATED:<n> chars]``, and the rest of each list and object
is summarized (``"[TRUNCATED] <n> more items"``, ``{"[TRUNCATED]": "<n> more entries"}``). A cut
string first backs off to its last whitespace, so no token is logged half-way (the secret part
of every default kind but ``private_key`` holds no whitespace), and a private-key block opened
before the cut and not closed by it is dropped whole. ``Redactor.text`` has no cap.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

# What each default kind redacts, as one regular expression. Most are also how it is matched;
# the kinds in ``_SCANNERS`` are matched by a linear two-phase scan with the same result.
DEFAULT_PATTERNS: Mapping[str, str] = {
    "private_key": r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----",
    "api_key": r"\b(?:sk|pk|rk)-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_\-]{16,}",
    "github_token": r"\bgh[pousr]_[A-Za-z0-9]{30,}",
    "slack_token": r"\bxox[abprs]-[A-Za-z0-9\-]{10,}",
    "aws_access_key": r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    "google_api_key": r"\bAIza[0-9A-Za-z_\-]{35}",
    "jwt": r"\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}",
    "bearer": r"(?i)\bbearer\s+[A-Za-z0-9._~+/\-]{16,}=*",
    "email": r"[A-Za-z0-9._%+\-]+@[A-Za-z0-9.\-]+\.[A-Za-z]{2,}",
}

# Substrings a text must hold for a kind to match it at all (a fast ``in`` check first skips
# the pass; most prompts hold no secret). Kinds not listed always run.
_NEEDLES: Mapping[str, tuple[str, ...]] = {
    "private_key": ("-----BEGIN ",),
    "api_key": ("sk-", "pk-", "rk-"),
    "github_token": ("ghp_", "gho_", "ghu_", "ghs_", "ghr_"),
    "slack_token": ("xox",),
    "aws_access_key": ("AKIA", "ASIA"),
    "google_api_key": ("AIza",),
    "jwt": ("eyJ",),
    "email": ("@",),
}

DEFAULT_MAX_CHARS = 1 << 20
# Deeper values are not logged (validation refuses bodies nested past 128 levels anyway).
_MAX_DEPTH = 256
_MORE = "[TRUNCATED]"
# What each value costs against the budget besides its characters: the fixed cost of a string
# passing every rule (about 3 us, the price of some 30 characters) and of visiting a value.
_STRING_COST = 32
_VALUE_COST = 8

Spans = Callable[[str], Iterator[tuple[int, int]]]

# -- email: [L]+@[D]+\.[A-Za-z]{2,} -------------------------------------------------------------
# A match starts at the start of the run of local-part characters before its '@' (or where the
# previous match ended, inside that run). Runs are found whole, once: a start inside a run is
# refused by the lookbehind at once instead of rescanning the rest of the run.
_LOCAL = r"A-Za-z0-9._%+\-"
_EMAIL_RUN_AT = re.compile(rf"(?<![{_LOCAL}])[{_LOCAL}]+@")
_EMAIL_DOMAIN = re.compile(r"[A-Za-z0-9.\-]+\.[A-Za-z]{2,}")


def _email_spans(text: str) -> Iterator[tuple[int, int]]:
    pos = 0  # where the previous match ended: the next cannot start before it
    for run in _EMAIL_RUN_AT.finditer(text):
        at = run.end() - 1
        if at <= pos:  # the local part was consumed by the previous match (or is empty)
            continue
        domain = _EMAIL_DOMAIN.match(text, at + 1)  # anchored: one pass over the domain run
        if domain is None:
            continue
        yield max(run.start(), pos), domain.end()
        pos = domain.end()


# -- jwt: \beyJ[X]{8,}\.[X]{8,}\.[X]{8,} --------------------------------------------------------
# Each segment is a whole run of [X] (X excludes '.'), so whether a match starting at an "eyJ"
# succeeds depends only on the run it starts in and the two runs after it. Candidate runs are
# found whole (lookbehind), the tail checked by lookahead; then the first "eyJ" at a word
# boundary in the run, leaving at least 8 characters before the '.', is where the match starts.
_X = r"A-Za-z0-9_\-"
_JWT_FIRST_RUN = re.compile(rf"(?<![{_X}])[{_X}]+(?=\.[{_X}]{{8,}}\.[{_X}]{{8}})")
_JWT_HEAD = re.compile(r"\beyJ")
_JWT = re.compile(rf"eyJ[{_X}]{{8,}}\.[{_X}]{{8,}}\.[{_X}]{{8,}}")


def _jwt_spans(text: str) -> Iterator[tuple[int, int]]:
    pos = 0
    for run in _JWT_FIRST_RUN.finditer(text):
        start, dot = run.span()
        head = _JWT_HEAD.search(text, max(start, pos), dot - 8)
        if head is None:
            continue
        match = _JWT.match(text, head.start())
        if match is None:  # cannot happen: the run and its tail were checked
            continue
        yield match.span()
        pos = match.end()


# -- private_key: BEGIN line, then the first END line after it ----------------------------------
# When a BEGIN line has no END line after it, no later BEGIN line has one either: stop there
# (the regular expression tried every later BEGIN against the rest of the text).
_PK_BEGIN = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")
_PK_END = re.compile(r"-----END [A-Z ]*PRIVATE KEY-----")


def _private_key_spans(text: str) -> Iterator[tuple[int, int]]:
    pos = 0
    while (begin := _PK_BEGIN.search(text, pos)) is not None:
        end = _PK_END.search(text, begin.end())
        if end is None:
            return
        yield begin.start(), end.end()
        pos = end.end()


_SCANNERS: Mapping[str, Spans] = {
    "email": _email_spans,
    "jwt": _jwt_spans,
    "private_key": _private_key_spans,
}


@dataclass(frozen=True, slots=True)
class Rule:
    """One kind of secret: how it is found, and what a text must hold to be worth a pass."""

    kind: str
    pattern: re.Pattern[str] | None = None
    spans: Spans | None = None
    needles: tuple[str, ...] = ()

    def sub(self, text: str) -> str:
        """``text`` with every match replaced by ``[REDACTED:<kind>]``."""
        if self.needles and not any(n in text for n in self.needles):
            return text
        repl = f"[REDACTED:{self.kind}]"
        if self.pattern is not None:
            return self.pattern.sub(repl, text)
        assert self.spans is not None
        out: list[str] = []
        last = 0
        for start, end in self.spans(text):
            out += (text[last:start], repl)
            last = end
        if not out:
            return text
        out.append(text[last:])
        return "".join(out)


def default_rules() -> tuple[Rule, ...]:
    """The built-in kinds, each matched in linear time."""
    rules = []
    for kind, pattern in DEFAULT_PATTERNS.items():
        needles = _NEEDLES.get(kind, ())
        if kind in _SCANNERS:
            rules.append(Rule(kind, spans=_SCANNERS[kind], needles=needles))
        else:
            rules.append(Rule(kind, pattern=re.compile(pattern), needles=needles))
    return tuple(rules)


def _cut(text: str, keep: int) -> str:
    """At most ``keep`` characters of ``text``, ending before a token or a key block the cut
    would split (so that no part of one escapes redaction)."""
    head = text[:keep]
    space = max(head.rfind(c) for c in " \t\n\r\f\v")
    head = head[: space + 1]  # nothing at all when there is no whitespace
    closed = max((end for _, end in _private_key_spans(head)), default=0)
    unclosed = _PK_BEGIN.search(head, closed)  # a block the cut leaves open
    return head if unclosed is None else head[: unclosed.start()]


@dataclass(frozen=True, slots=True)
class Redactor:
    """Replaces every match of its rules in every string of a JSON value."""

    patterns: tuple[Rule, ...]
    max_chars: int = DEFAULT_MAX_CHARS

    @classmethod
    def build(
        cls,
        extra: Iterable[str] = (),
        *,
        defaults: bool = True,
        max_chars: int = DEFAULT_MAX_CHARS,
    ) -> Redactor:
        """The default rules (unless turned off) plus the operator's own, compiled once.

        Raises ``re.error`` for an operator pattern that does not compile.
        """
        rules = list(default_rules()) if defaults else []
        rules += [Rule("custom", pattern=re.compile(p)) for p in extra if p]
        return cls(tuple(rules), max_chars=max_chars)

    def text(self, value: str) -> str:
        """``value`` with every match replaced by ``[REDACTED:<kind>]`` (no length cap)."""
        for rule in self.patterns:
            value = rule.sub(value)
        return value

    def value(self, obj: Any) -> Any:
        """A copy of a JSON value with every string (keys included) redacted.

        At most ``max_chars`` characters of strings are kept, each value counting at least
        one; past that, strings are cut and the rest of each list and object is summarized
        (see the module docstring).
        """
        left = self.max_chars

        def text(s: str) -> str:
            nonlocal left
            if len(s) + _STRING_COST <= left:
                left -= len(s) + _STRING_COST
                return self.text(s)
            head = _cut(s, max(left, 0))
            left = 0
            return self.text(head) + f"[TRUNCATED:{len(s) - len(head)} chars]"

        def walk(o: Any, depth: int) -> Any:
            nonlocal left
            if isinstance(o, str):
                return text(o)
            left -= _VALUE_COST
            if isinstance(o, dict):
                out: dict[str, Any] = {}
                for i, (k, v) in enumerate(o.items()):
                    if left <= 0 or depth >= _MAX_DEPTH:
                        out[_MORE] = f"{len(o) - i} more entries"
                        break
                    key = text(str(k))  # before the value: it takes from the budget first
                    out[key] = walk(v, depth + 1)
                return out
            if isinstance(o, list | tuple):
                items: list[Any] = []
                for i, v in enumerate(o):
                    if left <= 0 or depth >= _MAX_DEPTH:
                        items.append(f"{_MORE} {len(o) - i} more items")
                        break
                    items.append(walk(v, depth + 1))
                return items
            return o

        return walk(obj, 0)
