"""Differing spans between two rendered prompts, and the canonicalizer rule that removes each.

Byte-level helpers for the breaker search: the first difference after an offset (galloping
``memcmp`` comparisons, no Python step per byte), the point where two prompts agree again after
a short difference, and a classification of the difference:

- ``volatile_uuids``, ``volatile_timestamps``, ``volatile_hex_ids``: the span lies inside a
  value that rule's detectors (the proxy's own, ``proxy.canonical.detectors``, with their
  default options) find on both sides, so a rule is named only where the proxy would fire;
- ``whitespace``: only line endings or trailing blanks differ;
- ``stable_json`` is decided at segment level (see ``breakers``), not here;
- ``volatile_learned``: in a stable segment (system prompt, tools), a value the proxy would learn
  from traffic: the span is judged by the proxy's own ``proxy.canonical.spans.judge`` (a short
  token between literal anchors), so it is named only where the proxy would learn it;
- otherwise a regex suggestion for a custom volatile pattern, built from the literal text just
  before the value and the value's character class.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.canonical.config import VOLATILE_LEARNED, CanonicalConfig
from proxy.canonical.detectors import ascii_view, build_detectors
from proxy.canonical.spans import SpanPattern, judge

RULE_STABLE_JSON = "stable_json"
RULE_WHITESPACE = "whitespace"
RULE_TIMESTAMPS = "volatile_timestamps"
RULE_UUIDS = "volatile_uuids"
RULE_HEX = "volatile_hex_ids"
RULE_LEARNED = VOLATILE_LEARNED
RULE_REWRITTEN = "none: content rewritten (no safe rule)"
RULE_NOTE = 'note_placement = "last_suffix" with note_memory = true (the defaults)'
"""The value differs inside prefixgate's own relocation note (``[[datetime_1]] = ...``): the
note sits before conversation that follows it, or was not restored on a later turn; the
defaults (the note after the newest message, earlier notes restored) avoid both."""
CUSTOM_PREFIX = "custom pattern: "

RESYNC_PROBE = 16  # bytes that must agree again for a difference to count as a span
MAX_SPAN = 160  # longer differences are new content, not a volatile value

# The proxy's own detectors judge a span, so a rule is named only when the proxy, configured
# with its defaults, would find the value: one detector implementation for both.
_DETECTORS = build_detectors(CanonicalConfig())
_RULE_ORDER = (RULE_UUIDS, RULE_TIMESTAMPS, RULE_HEX)
_DETECT_WINDOW = 64  # bytes either side of a span handed to the detectors
_BLANK = frozenset(b" \t\r\n")
_TOKEN = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:+-/")


def resync(a: bytes, i: int, b: bytes, j: int) -> tuple[int, int] | None:
    """Offsets after a short difference where ``a`` and ``b`` agree again, or None.

    Picks the pair of span lengths with the smallest sum such that the next ``RESYNC_PROBE``
    bytes agree; differences longer than ``MAX_SPAN`` on either side are not spans.
    """
    best: tuple[int, int] | None = None
    for lb in range(MAX_SPAN + 1):
        if best is not None and lb >= best[0] + best[1]:
            break
        probe = b[j + lb : j + lb + RESYNC_PROBE]
        if len(probe) < RESYNC_PROBE:
            break
        found = a.find(probe, i, i + MAX_SPAN + RESYNC_PROBE)
        if found >= 0 and (best is None or (found - i) + lb < best[0] + best[1]):
            best = (found - i, lb)
    if best is None:
        return None
    return i + best[0], j + best[1]


@dataclass(frozen=True, slots=True)
class SpanKind:
    """What a differing span is and which canonicalizer rule would remove it."""

    rule: str
    before: str  # the value in the earlier request
    after: str  # the value in this request
    context: str  # literal text just before the value


def _covering(rule: str, data: bytes, lo: int, hi: int) -> tuple[int, int] | None:
    """The value ``rule``'s detectors find that covers ``data[lo:hi]`` (an insertion point if
    empty), as the proxy would find it in the text around the span."""
    start = max(0, lo - _DETECT_WINDOW)
    # One character per byte, so offsets stay byte offsets; non-ASCII bytes match nothing.
    text = data[start : min(len(data), hi + _DETECT_WINDOW)].decode("latin-1")
    view = ascii_view(text)
    for detector in _DETECTORS.get(rule, ()):
        for f in detector(text, view):
            if start + f.start <= lo and start + f.end >= hi:
                return start + f.start, start + f.end
    return None


def _line_end_blanks(data: bytes, lo: int, hi: int) -> bool:
    """Whether ``data[lo:hi]`` is only carriage returns, or blanks that end their line."""
    span = data[lo:hi]
    if not _BLANK.issuperset(span):
        return False
    if not span.strip(b"\r"):
        return True
    return data[hi : hi + 1] in (b"\n", b"\r", b"")


def _token(data: bytes, lo: int, hi: int) -> tuple[int, int]:
    """Widen ``data[lo:hi]`` to the whole identifier-like token around it."""
    while lo > 0 and data[lo - 1] in _TOKEN and hi - lo < MAX_SPAN:
        lo -= 1
    while hi < len(data) and data[hi] in _TOKEN and hi - lo < MAX_SPAN:
        hi += 1
    return lo, hi


def _context(data: bytes, lo: int) -> bytes:
    """Up to two words of literal text before ``lo`` on the same line."""
    start = max(0, lo - 24)
    head = data[start:lo]
    for stop in (b"\n", b"\x1e", b'"'):
        cut = head.rfind(stop)
        if cut >= 0:
            head = head[cut + 1 :]
    words = head.split(b" ")
    return b" ".join(words[-3:]) if len(words) > 3 else head


def _show(data: bytes) -> str:
    return data.decode("utf-8", "replace").replace("\x1e", "⏎")


_NOTE_LINE = re.compile(r"\[\[[A-Za-z0-9_]+_\d+\]\] =")


_LEARN_WINDOW = 160  # bytes either side of a span handed to the span judge


def learnable(
    a: bytes, a_lo: int, a_hi: int, b: bytes, b_lo: int, b_hi: int
) -> tuple[SpanPattern, str, str] | None:
    """The pattern the proxy would learn for this span (``proxy.canonical.spans.judge``, on
    the text around it) and the two values it finds there, or None."""
    # One character per byte (latin-1), so offsets stay byte offsets.
    sa, sb = max(0, a_lo - _LEARN_WINDOW), max(0, b_lo - _LEARN_WINDOW)
    ta = a[sa : a_hi + _LEARN_WINDOW].decode("latin-1")
    tb = b[sb : b_hi + _LEARN_WINDOW].decode("latin-1")
    pattern = judge(ta, (a_lo - sa, a_hi - sa), tb, (b_lo - sb, b_hi - sb))
    if pattern is None:
        return None
    values = []
    for data, text, lo, hi in ((a, ta, a_lo - sa, a_hi - sa), (b, tb, b_lo - sb, b_hi - sb)):
        start = sa if data is a else sb
        span = next(((s, e) for s, e in pattern.values(text) if s <= lo and hi <= e), (lo, hi))
        values.append(_show(data[start + span[0] : start + span[1]]))
    return pattern, values[0], values[1]


def classify(
    a: bytes, a_lo: int, a_hi: int, b: bytes, b_lo: int, b_hi: int, *, stable: bool = False
) -> SpanKind:
    """Name the rule that would make ``a[a_lo:a_hi]`` and ``b[b_lo:b_hi]`` not matter.

    ``stable``: the span is in a stable segment (system prompt, tools), where the proxy learns
    volatile spans.
    """
    kind = _classify(a, a_lo, a_hi, b, b_lo, b_hi, stable)
    if _NOTE_LINE.fullmatch(kind.context.strip()):  # strip: also the content-start mark
        # A value in the note prefixgate's canonicalizer wrote: the value was relocated
        # already, but the note was placed before messages that follow it.
        return SpanKind(RULE_NOTE, kind.before, kind.after, kind.context)
    return kind


def _classify(
    a: bytes, a_lo: int, a_hi: int, b: bytes, b_lo: int, b_hi: int, stable: bool
) -> SpanKind:
    sa, sb = a[a_lo:a_hi], b[b_lo:b_hi]
    if _line_end_blanks(a, a_lo, a_hi) and _line_end_blanks(b, b_lo, b_hi):
        return SpanKind(RULE_WHITESPACE, _show(sa), _show(sb), _show(_context(b, b_lo)))
    for rule in _RULE_ORDER:
        ma = _covering(rule, a, a_lo, a_hi)
        mb = _covering(rule, b, b_lo, b_hi)
        if ma is not None and mb is not None:
            va, vb = a[ma[0] : ma[1]], b[mb[0] : mb[1]]
            return SpanKind(rule, _show(va), _show(vb), _show(_context(b, mb[0])))
    if stable and (learned := learnable(a, a_lo, a_hi, b, b_lo, b_hi)) is not None:
        pattern, before, after = learned
        return SpanKind(RULE_LEARNED, before, after, pattern.describe())
    ta, tb = _token(a, a_lo, a_hi), _token(b, b_lo, b_hi)
    va, vb = a[ta[0] : ta[1]], b[tb[0] : tb[1]]
    if (not va and not vb) or b"\x1e" in sa + sb or max(len(va), len(vb)) > 64:
        return SpanKind(RULE_REWRITTEN, _show(sa), _show(sb), _show(_context(b, b_lo)))
    context = _context(b, tb[0])
    return SpanKind(
        CUSTOM_PREFIX + suggest_pattern(context, va, vb), _show(va), _show(vb), _show(context)
    )


def suggest_pattern(context: bytes, before: bytes, after: bytes) -> str:
    """A regex for a volatile value: the literal text before it, then its character class."""
    values = before + after
    if values.isdigit():
        cls = r"\d+"
    elif values.isalnum():
        cls = r"[A-Za-z0-9]+"
    elif all(c in _TOKEN for c in values):
        cls = r"[\w.:+/-]+"
    else:
        cls = r"\S+"
    return re.escape(context.decode("utf-8", "replace")) + cls
