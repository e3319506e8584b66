"""Detectors of volatile values: dates and times, UUIDs, long hex ids, the user's patterns.

Each detector returns ``Found`` spans in one string: where the value is, the label its
placeholder gets (``date``, ``datetime``, ``time``, ``epoch``, ``uuid``, ``id`` or a custom
pattern's name) and the rule that found it. Values never span a line break.

Timestamps recognised (``volatile_timestamps``):

- ISO 8601: ``2026-11-30``, ``2026-11-30T22:41:07Z``, ``2026-11-30 22:41``,
  ``2026-11-30T22:41:07.123456+00:00``;
- RFC 2822 and day-first: ``Mon, 30 Nov 2026 22:41:00 +0000``, ``30 November 2026``;
- month-first: ``Monday, November 30, 2026``, ``November 30, 2026 at 10:41 PM``,
  ``Mon Nov 30 22:41:07 UTC 2026`` (the Unix ``date`` command);
- numeric: ``11/30/2026``, ``30/11/2026``, ``30.11.2026`` (four-digit year only);
- clock times with seconds (``22:41:07``) or AM/PM (``10:41 PM``), with a zone if one follows;
- epoch seconds or milliseconds after a keyword: ``timestamp: 1764542467``,
  ``epoch=1764542467000``, ``current time 1764542467`` (the number is the value).

Off unless asked: bare ``HH:MM`` (``bare_times``) and bare epoch numbers (``bare_epochs``), which
match scores, ratios, verses, phone and order numbers about as often as clock readings.

``volatile_uuids``: RFC 4122 textual UUIDs, any case. ``volatile_hex_ids``: runs of at least
``min_length`` (16) hex digits standing alone as a token, with at least one digit and one
letter among them, so that neither a long number nor a hex-spelled word counts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

from proxy.canonical.config import (
    CUSTOM_PATTERNS,
    VOLATILE_HEX_IDS,
    VOLATILE_TIMESTAMPS,
    VOLATILE_UUIDS,
    CanonicalConfig,
)


class Found(NamedTuple):
    """One volatile value in a string: ``text[start:end]``."""

    start: int
    end: int
    label: str
    rule: str


_D = "[0-9]"
_WEEKDAY = r"(?:Mon|Tue(?:s)?|Wed(?:nes)?|Thu(?:rs?)?|Fri|Sat(?:ur)?|Sun)(?:day)?\.?"
_MONTH = (
    r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)\.?"
)
_DAY = r"(?:[12][0-9]|3[01]|0?[1-9])(?:st|nd|rd|th)?"
_YEAR = r"[12][0-9]{3}"
_SECONDS = rf":[0-5]{_D}(?:[.,]{_D}{{1,9}})?"
_AMPM = r" ?[AaPp](?:\.[Mm]\.|[Mm])(?![A-Za-z])"
_ZONE = (
    rf" ?(?:(?:UTC|GMT)(?:[+-]{_D}{{1,2}}(?::?{_D}{{2}})?)?|[+-]{_D}{{2}}:?{_D}{{2}}"
    r"|[A-Z]{2,4}T(?![A-Za-z]))"
)
# A clock time after a date: 24-hour with optional seconds, or 12-hour with AM/PM.
_CLOCK = rf"(?:[01]?{_D}|2[0-3]):[0-5]{_D}(?:{_SECONDS})?(?:{_AMPM})?(?:{_ZONE})?"
_THEN_CLOCK = rf"(?:,? (?:at )?{_CLOCK})?"

_ISO = (
    rf"(?<![0-9A-Za-z./-]){_YEAR}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]{_D}|3[01])"
    rf"(?:[T ](?:[01]{_D}|2[0-3]):[0-5]{_D}(?:{_SECONDS})?"
    rf"(?:Z|[+-](?:[01]{_D}|2[0-3])(?::?[0-5]{_D})?| ?UTC)?)?(?![0-9])"
)
_DAY_FIRST = rf"(?<![0-9A-Za-z])(?:{_WEEKDAY},? )?{_DAY} (?:of )?{_MONTH},? {_YEAR}{_THEN_CLOCK}"
_MONTH_FIRST = (
    rf"(?<![0-9A-Za-z])(?:{_WEEKDAY},? )?{_MONTH} {_DAY},? {_YEAR}{_THEN_CLOCK}"
    rf"|(?<![0-9A-Za-z]){_WEEKDAY} {_MONTH} {{1,2}}{_DAY} {_CLOCK} {_YEAR}"
)
_NUMERIC = (
    r"(?<![0-9./-])(?:[12][0-9]|3[01]|0?[1-9])(?P<sep>[/.])(?:[12][0-9]|3[01]|0?[1-9])(?P=sep)"
    rf"{_YEAR}(?!\.?[0-9]){_THEN_CLOCK}"
)
_TIME = (
    rf"(?<![0-9:.])(?:(?:[01]?{_D}|2[0-3]):[0-5]{_D}{_SECONDS}(?:{_AMPM})?"
    rf"|(?:1[0-2]|0?[1-9]):[0-5]{_D}{_AMPM})(?:{_ZONE})?(?![0-9:])"
)
_BARE_TIME = rf"(?<![0-9:.])(?:[01]?{_D}|2[0-3]):[0-5]{_D}(?![0-9:])"
_EPOCH_KEYWORD = (
    r"(?i:\b(?:unix time(?:stamp)?|timestamp|time|epoch|now|ts)\b)"
    rf"[ \t]*(?:[:=]|is)?[ \t]*(?P<epoch>1{_D}{{9}}(?:{_D}{{3}})?(?:\.{_D}{{1,6}})?)(?![0-9.])"
)
_BARE_EPOCH = rf"(?<![0-9.])(?P<bare_epoch>1{_D}{{9}}(?:{_D}{{3}})?)(?![0-9.])"


def _timestamp_pattern(*, bare_times: bool, bare_epochs: bool) -> re.Pattern[str]:
    parts = [
        f"(?P<iso>{_ISO})",
        f"(?P<long>{_DAY_FIRST}|{_MONTH_FIRST})",
        f"(?P<numeric>{_NUMERIC})",
        f"(?P<time>{_TIME})",
        f"(?P<keyword>{_EPOCH_KEYWORD})",
    ]
    if bare_times:
        parts.append(f"(?P<bare_time>{_BARE_TIME})")
    if bare_epochs:
        parts.append(f"(?P<bare>{_BARE_EPOCH})")
    return re.compile("|".join(parts))


_UUID_TAIL = re.compile(  # from the first dash: a literal prefix, which re searches fast
    r"-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}(?![0-9A-Za-z])"
)
_HEX_CHARS = frozenset("0123456789abcdefABCDEF")
_ALNUM = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _table(groups: dict[bytes, bytes]) -> bytes:
    table = bytearray(range(256))
    for chars, to in groups.items():
        for c in chars:
            table[c] = to[0]
    return bytes(table)


# Scanning a prompt with the full patterns costs Python's regex engine 10-20 ns a character.
# Instead, the ASCII view of the text (one byte per character, "?" for anything else) is
# mapped to character classes with bytes.translate, and literal anchors that every match
# must contain are found by substring search; the full pattern then runs only around them.
_DIGIT_CLASS = _table({b"0123456789": b"0"})
_HEX_CLASS = _table(
    {
        b"0123456789abcdefABCDEF": b"h",
        b"ghijklmnopqrstuvwxyzGHIJKLMNOPQRSTUVWXYZ_": b"w",
    }
)
# Every timestamp holds one of these (in the digit-class view) within 40 characters of its
# start and 24 of its end: a date's dashes, a clock's colon, a slash or dotted date, a year
# after a space or comma, an epoch's ten digits.
_TIMESTAMP_ANCHORS = (b"-00-", b":00", b"0/", b".0000", b" 0000", b",0000", b"0" * 10)
_BEFORE, _AFTER = 40, 48


def _windows(view: bytes, anchors: tuple[bytes, ...]) -> list[tuple[int, int]]:
    """Merged ``[lo, hi)`` windows around every anchor occurrence."""
    hits: list[int] = []
    for anchor in anchors:
        at = view.find(anchor)
        while at >= 0:
            hits.append(at)
            at = view.find(anchor, at + 1)
    if not hits:
        return []
    hits.sort()
    out: list[tuple[int, int]] = []
    for at in hits:
        lo, hi = max(0, at - _BEFORE), min(len(view), at + _AFTER)
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


Detector = Callable[[str, bytes], Iterator[Found]]


def _timestamps(pattern: re.Pattern[str]) -> Detector:
    def find(text: str, view: bytes) -> Iterator[Found]:
        for lo, hi in _windows(view.translate(_DIGIT_CLASS), _TIMESTAMP_ANCHORS):
            for m in pattern.finditer(text, lo, hi):
                kind = m.lastgroup
                if kind == "keyword":
                    start, end = m.span("epoch")
                    yield Found(start, end, "epoch", VOLATILE_TIMESTAMPS)
                elif kind == "bare":
                    yield Found(m.start(), m.end(), "epoch", VOLATILE_TIMESTAMPS)
                elif kind in ("time", "bare_time"):
                    yield Found(m.start(), m.end(), "time", VOLATILE_TIMESTAMPS)
                else:
                    label = "datetime" if ":" in m.group() else "date"
                    yield Found(m.start(), m.end(), label, VOLATILE_TIMESTAMPS)

    return find


def _uuids(text: str, view: bytes) -> Iterator[Found]:
    for m in _UUID_TAIL.finditer(text, 8):
        start = m.start() - 8
        if _HEX_CHARS.issuperset(text[start : m.start()]) and (
            start == 0 or text[start - 1] not in _ALNUM
        ):
            yield Found(start, m.end(), "uuid", VOLATILE_UUIDS)


def _hex_ids(min_length: int) -> Detector:
    run = re.compile(b"h" * min_length + b"+")  # literal prefix: a fast search

    def find(text: str, view: bytes) -> Iterator[Found]:
        if len(text) < min_length:
            return
        classes = view.translate(_HEX_CLASS)
        for m in run.finditer(classes):
            start, end = m.span()
            if (start and classes[start - 1] == 0x77) or classes[end : end + 1] == b"w":
                continue  # part of a longer word
            value = text[start:end]
            if any(c.isdigit() for c in value) and not value.isdigit():
                yield Found(start, end, "id", VOLATILE_HEX_IDS)

    return find


def _custom(pattern: re.Pattern[str], label: str, group: int | str) -> Detector:
    def find(text: str, view: bytes) -> Iterator[Found]:
        for m in pattern.finditer(text):
            start, end = m.span(group)
            if start < end and "\n" not in text[start:end]:
                yield Found(start, end, label, CUSTOM_PATTERNS)

    return find


def build_detectors(config: CanonicalConfig) -> dict[str, list[Detector]]:
    """The detectors of every enabled volatile rule, by rule name.

    A detector is called with a string and its ASCII view, ``ascii_view(text)``.
    """
    out: dict[str, list[Detector]] = {}
    rule = config.rule(VOLATILE_TIMESTAMPS)
    if rule.enabled:
        pattern = _timestamp_pattern(
            bare_times=rule.flag("bare_times"), bare_epochs=rule.flag("bare_epochs")
        )
        out[VOLATILE_TIMESTAMPS] = [_timestamps(pattern)]
    if config.rule(VOLATILE_UUIDS).enabled:
        out[VOLATILE_UUIDS] = [_uuids]
    rule = config.rule(VOLATILE_HEX_IDS)
    if rule.enabled:
        out[VOLATILE_HEX_IDS] = [_hex_ids(rule.number("min_length"))]
    if config.rule(CUSTOM_PATTERNS).enabled and config.custom_patterns:
        out[CUSTOM_PATTERNS] = [_custom(p.pattern, p.name, p.group) for p in config.custom_patterns]
    return out


def ascii_view(text: str) -> bytes:
    """``text`` as one byte per character: itself if ASCII, ``?`` otherwise."""
    return text.encode("ascii", "replace")
