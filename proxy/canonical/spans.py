"""Learned volatile spans: the values no detector knows, recognised from the template around them.

Two texts of the same place (a system prompt, a tool description) are *one template* when they
agree everywhere except in a few short spans (``template_spans``). Each differing span is then
judged (``judge``): widened to the whole token around it, it is a *value* if it is short (at
most ``MAX_VALUE`` characters), holds no blank, and sits between literal text the two texts
share. The judgement is a ``SpanPattern``:

- ``left``: the literal text just before the value on its line and in its sentence, at most
  ``LEFT_ANCHOR`` characters (at least ``MIN_ANCHOR`` with a letter among them: a value at the
  start of a line, with nothing before it, is not learned);
- ``value_class``: ``digits`` (``[0-9]``), ``alnum`` (``[A-Za-z0-9]``) or ``token`` (also
  ``_ . + / -`` and trailing ``=``, which covers base64 and dashed ids), the narrowest that
  holds both values;
- ``right``: up to ``RIGHT_ANCHOR`` characters of literal text after the value, or the line
  end (``eol``).

``Build: 7f3a-19`` against ``Build: 8c21-04`` gives ``("Build: ", token, "", eol)``; ``Request
#4812 from`` against ``Request #4813 from`` gives ``("Request #", digits, " from")``;
``ticket=AB12CD;`` gives ``("ticket=", alnum, ";")``. Texts that differ in more than a few short
spans, or mostly (new content, not a template), give nothing.

The proxy (``proxy.canonical.span_memory``) learns a pattern once it has seen it match enough
requests with enough distinct values, and then finds its values like a detector's (``finder``)
so that they are relocated into the note. ``prefixgate analyze`` judges a differing span with
the same ``judge``, so it names ``volatile_learned`` exactly where the proxy would learn.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, AnyStr

import xxhash

from proxy.canonical.config import VOLATILE_LEARNED
from proxy.canonical.detectors import Detector, Found

MAX_VALUE = 64  # longest value: a longer span is content, not an id or a counter
MAX_SPANS = 4  # differing spans per pair of texts: more is an edited text, not a template
RESYNC = 16  # characters that must agree again after a span
MIN_ANCHOR = 3  # characters of literal text before a value
LEFT_ANCHOR = 24  # at most this much of it is kept
RIGHT_ANCHOR = 8
MIN_AGREEMENT = 3  # the texts must agree on this many times the characters they differ in

_TOKEN = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.+/-")
_TRAIL = ".,-/+"  # a sentence's full stop is not part of the value before it
_BLANKS = frozenset(" \t\r\n\f\v")
_MARK = re.compile(r"\[\[[a-z][a-z0-9_]*_[0-9]+\]\]")  # a placeholder or a masked value
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_]*")

VALUE_CLASSES: dict[str, str] = {
    "digits": "[0-9]{1,64}",
    "alnum": "[A-Za-z0-9]{1,64}",
    "token": "[A-Za-z0-9_.+/-]{1,64}={0,3}",
}
_CLASS_CHARS: tuple[tuple[str, frozenset[str]], ...] = (
    ("digits", frozenset("0123456789")),
    ("alnum", frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")),
    ("token", _TOKEN | {"="}),
)


@dataclass(frozen=True, slots=True)
class SpanPattern:
    """A learned value's place: literal text before it, its class, literal text after it."""

    left: str
    value_class: str
    right: str
    eol: bool  # the value ends its line (``right`` is then the empty string)
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)
    id: str = field(init=False, compare=False)
    label: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        after = re.escape(self.right) + (r"(?:\r?\n|\Z)" if self.eol else "")
        body = f"{re.escape(self.left)}(?P<value>{VALUE_CLASSES[self.value_class]})(?={after})"
        object.__setattr__(self, "regex", re.compile(body))
        digest = xxhash.xxh3_64_hexdigest(
            "\x00".join((self.left, self.value_class, self.right, str(self.eol))).encode()
        )
        object.__setattr__(self, "id", digest[:12])
        words = _WORD.findall(self.left)
        label = words[-1].lower() if words else ""
        if not label or len(label) > 16 or not label.isascii():
            label = "value"
        object.__setattr__(self, "label", label)

    def values(self, text: str) -> Iterator[tuple[int, int]]:
        """Where the pattern's values are in ``text``."""
        if self.left not in text:  # a literal search first: most texts hold no anchor at all
            return
        for m in self.regex.finditer(text):
            yield m.span("value")

    def as_json(self) -> dict[str, Any]:
        """The pattern as stored in the shared memory."""
        return {"l": self.left, "c": self.value_class, "r": self.right, "e": self.eol}

    @classmethod
    def from_json(cls, obj: Any) -> SpanPattern | None:
        """The pattern, or None for anything that is not one (a foreign or damaged value)."""
        try:
            left, value_class, right, eol = obj["l"], obj["c"], obj["r"], obj["e"]
        except (KeyError, TypeError):
            return None
        if (
            not isinstance(left, str)
            or not isinstance(right, str)
            or not isinstance(eol, bool)
            or value_class not in VALUE_CLASSES
            or not _anchor_ok(left)
            or len(right) > RIGHT_ANCHOR
        ):
            return None
        return cls(left, value_class, right, eol)

    def describe(self) -> str:
        """A readable form for reports: ``Build: ⟨token⟩⏎`` (⏎: the line ends there)."""
        return f"{self.left}⟨{self.value_class}⟩{self.right}{'⏎' if self.eol else ''}"


def common_run(a: AnyStr, i: int, b: AnyStr, j: int) -> int:
    """Length of the common run of ``a[i:]`` and ``b[j:]`` (text or bytes): slices compared in
    growing chunks, then the first unequal chunk bisected, so no Python step per character.
    The analyzer's span finder uses it too."""
    n = min(len(a) - i, len(b) - j)
    if n <= 0:
        return 0
    done, step = 0, 64
    while done < n:
        size = min(step, n - done)
        if a[i + done : i + done + size] != b[j + done : j + done + size]:
            lo, hi = 0, size - 1  # the common length within this chunk lies in [lo, hi]
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if a[i + done : i + done + mid] == b[j + done : j + done + mid]:
                    lo = mid
                else:
                    hi = mid - 1
            return done + lo
        done += size
        step = min(step * 2, 1 << 16)
    return n


def _resync(a: str, i: int, b: str, j: int) -> tuple[int, int] | None:
    """Ends of the shortest pair of spans after which ``a`` and ``b`` agree again: on the next
    ``RESYNC`` characters, or on all that is left of both."""
    best: tuple[int, int] | None = None
    for lb in range(min(MAX_VALUE, len(b) - j) + 1):
        if best is not None and lb >= best[0] + best[1]:
            break
        probe = b[j + lb : j + lb + RESYNC]
        if len(probe) < RESYNC:  # near the end of b: the rest of both must be equal
            la = len(a) - len(probe) - i
            if 0 <= la <= MAX_VALUE and a.endswith(probe) and (best is None or la + lb < sum(best)):
                best = (la, lb)
            continue
        found = a.find(probe, i, i + MAX_VALUE + RESYNC)
        if found >= 0 and (best is None or (found - i) + lb < best[0] + best[1]):
            best = (found - i, lb)
    return None if best is None else (i + best[0], j + best[1])


_SPLIT = re.compile(r"\S+")


def _refine(a: str, b: str, span: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """A span holding blanks split into the words that differ, when both sides have the same
    words and blanks around them (two values close together: ``7f3a-19 Request #4812``)."""
    a_lo, a_hi, b_lo, b_hi = span
    # Whole words: the span may start or end inside one.
    while a_lo > 0 and b_lo > 0 and not a[a_lo - 1].isspace() and a[a_lo - 1] == b[b_lo - 1]:
        a_lo, b_lo = a_lo - 1, b_lo - 1
    while a_hi < len(a) and b_hi < len(b) and not a[a_hi].isspace() and a[a_hi] == b[b_hi]:
        a_hi, b_hi = a_hi + 1, b_hi + 1
    wa = [m.span() for m in _SPLIT.finditer(a, a_lo, a_hi)]
    wb = [m.span() for m in _SPLIT.finditer(b, b_lo, b_hi)]
    if len(wa) < 2 or len(wa) != len(wb):
        return [span]
    gaps_a = [a[x[1] : y[0]] for x, y in pairwise(wa)]
    gaps_b = [b[x[1] : y[0]] for x, y in pairwise(wb)]
    if gaps_a != gaps_b or a[a_lo : wa[0][0]] != b[b_lo : wb[0][0]]:
        return [span]
    out: list[tuple[int, int, int, int]] = []
    same = True  # whether the word before is one both sides share
    for (sa, ea), (sb, eb) in zip(wa, wb, strict=True):
        if a[sa:ea] == b[sb:eb]:
            same = True
            continue
        if not same:
            return [span]  # two differing words in a row: words of a sentence, not values
        same = False
        head = common_run(a, sa, b, sb)
        head = min(head, ea - sa, eb - sb)
        tail = 0
        while tail < min(ea - sa, eb - sb) - head and a[ea - tail - 1] == b[eb - tail - 1]:
            tail += 1
        out.append((sa + head, ea - tail, sb + head, eb - tail))
    return out or [span]


def template_spans(a: str, b: str) -> list[tuple[int, int, int, int]] | None:
    """The spans ``(a_lo, a_hi, b_lo, b_hi)`` where ``b`` differs from ``a``, when the two are
    one template (a few short differences, long agreement); None when they are not, or equal."""
    if a == b:
        return None
    spans: list[tuple[int, int, int, int]] = []
    i = j = common_run(a, 0, b, 0)
    differing = 0
    while i < len(a) or j < len(b):
        if len(spans) == MAX_SPANS:
            return None
        found = _resync(a, i, b, j)
        if found is None:
            return None
        a_end, b_end = found
        spans += _refine(a, b, (i, a_end, j, b_end))
        differing += max(a_end - i, b_end - j)
        run = common_run(a, a_end, b, b_end)
        i, j = a_end + run, b_end + run
    agreed = len(b) - sum(hi - lo for _, _, lo, hi in spans)
    if len(spans) > MAX_SPANS or agreed < MIN_AGREEMENT * differing or agreed < LEFT_ANCHOR:
        return None
    return spans


def _anchor_ok(left: str) -> bool:
    """Enough literal text before a value to find it by: a letter among it, on one line."""
    return (
        len(left) >= MIN_ANCHOR
        and any(c.isalpha() for c in left)
        and "\n" not in left
        and left[-1:] not in _TOKEN
    )


def _widen(text: str, lo: int, hi: int) -> tuple[int, int]:
    """``text[lo:hi]`` widened to the whole token around it (trailing ``=`` padding too)."""
    while lo > 0 and text[lo - 1] in _TOKEN and hi - lo <= MAX_VALUE:
        lo -= 1
    while hi < len(text) and text[hi] in _TOKEN and hi - lo <= MAX_VALUE:
        hi += 1
    while hi < len(text) and text[hi] == "=" and hi - lo <= MAX_VALUE + 3:
        hi += 1
    while hi > lo and text[hi - 1] in _TRAIL:
        hi -= 1
    return lo, hi


def _value_class(values: Sequence[str]) -> str | None:
    joined = "".join(values)
    for name, chars in _CLASS_CHARS:
        if chars.issuperset(joined):
            if name == "token" and any(v.rstrip("=").find("=") >= 0 for v in values):
                return None  # "=" only as trailing padding
            return name
    return None


def judge(
    a: str,
    a_span: tuple[int, int],
    b: str,
    b_span: tuple[int, int],
    *,
    floor: int = 0,
    ceiling: int | None = None,
) -> SpanPattern | None:
    """The pattern of the value that differs between ``a[a_span]`` and ``b[b_span]``, or None
    when the difference is not a learnable value (module docstring).

    ``floor`` and ``ceiling``: offsets in ``b`` the anchors must not cross (the neighbouring
    spans, whose text is not literal).
    """
    a_lo, a_hi = _widen(a, *a_span)
    b_lo, b_hi = _widen(b, *b_span)
    va, vb = a[a_lo:a_hi], b[b_lo:b_hi]
    if not va or not vb or va == vb or max(len(va), len(vb)) > MAX_VALUE:
        return None
    if _BLANKS.intersection(va) or _BLANKS.intersection(vb) or "[[" in va + vb or "]]" in va + vb:
        return None
    if not any(c.isalnum() for c in va) or not any(c.isalnum() for c in vb):
        return None
    for text, lo, hi in ((a, a_lo, a_hi), (b, b_lo, b_hi)):
        if "[[" in text and any(m.start() < hi and lo < m.end() for m in _MARK.finditer(text)):
            return None  # inside a placeholder or a masked value: never a value of its own
    value_class = _value_class((va, vb))
    if value_class is None:
        return None
    start = max(floor, b_lo - LEFT_ANCHOR)
    left = b[start:b_lo]
    cut = max(left.rfind("\n"), left.rfind("\x1e"), left.rfind("\x1f"))
    if cut >= 0:
        left = left[cut + 1 :]
    marks = list(_MARK.finditer(left))
    if marks:
        left = left[marks[-1].end() :]
    sentence = left.rfind(". ")  # from the value's own sentence when that is anchor enough
    if sentence >= 0 and _anchor_ok(left[sentence + 2 :]):
        left = left[sentence + 2 :]
    if not _anchor_ok(left):
        return None
    end = len(b) if ceiling is None else min(ceiling, len(b))
    right = b[b_hi : min(end, b_hi + RIGHT_ANCHOR)]
    eol = False
    for stop in ("\r\n", "\n", "[["):
        cut = right.find(stop)
        if cut >= 0:
            right, eol = right[:cut], stop != "[["
            break
    else:
        if b_hi + len(right) == len(b):
            eol = True
    if not eol and not right:
        return None  # nothing literal after the value: it would end anywhere
    pattern = SpanPattern(left, value_class, right, eol)
    # The pattern must find exactly these values in both texts, or it is not their pattern.
    if (a_lo, a_hi) not in pattern.values(a) or (b_lo, b_hi) not in pattern.values(b):
        return None
    return pattern


def judge_pair(a: str, b: str) -> list[SpanPattern]:
    """Every learnable value between two texts of one template (none if they are not one)."""
    spans = template_spans(a, b)
    if not spans:
        return []
    out: list[SpanPattern] = []
    for k, (a_lo, a_hi, b_lo, b_hi) in enumerate(spans):
        floor = spans[k - 1][3] if k else 0
        ceiling = spans[k + 1][2] if k + 1 < len(spans) else None
        pattern = judge(a, (a_lo, a_hi), b, (b_lo, b_hi), floor=floor, ceiling=ceiling)
        if pattern is not None and pattern not in out:
            out.append(pattern)
    return out


def finder(patterns: Sequence[SpanPattern]) -> Detector:
    """A detector of the patterns' values (``Found`` with rule ``volatile_learned``)."""
    ordered = tuple(patterns)

    def find(text: str, view: bytes) -> Iterator[Found]:
        for pattern in ordered:
            for start, end in pattern.values(text):
                yield Found(start, end, pattern.label, VOLATILE_LEARNED)

    return find


def identify(patterns: Sequence[SpanPattern], text: str, start: int, end: int) -> str | None:
    """The id of the pattern whose value is ``text[start:end]``."""
    for pattern in patterns:
        if text.endswith(pattern.left, 0, start):
            m = pattern.regex.match(text, start - len(pattern.left))
            if m is not None and m.span("value") == (start, end):
                return pattern.id
    return None
