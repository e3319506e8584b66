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
  ``epoch=1764542467000``, ``current time 1764542467``, ``Clock: 1764542467``,
  ``updated_at=1764542467`` (the number is the value).

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
_DAY_FIRST = (
    rf"(?<![0-9A-Za-z])(?:{_WEEKDAY},? )?{_DAY} (?:of )?{_MONTH},? {_YEAR}(?![0-9]){_THEN_CLOCK}"
)
_MONTH_FIRST = (
    rf"(?<![0-9A-Za-z])(?:{_WEEKDAY},? )?{_MONTH} {_DAY},? {_YEAR}(?![0-9]){_THEN_CLOCK}"
    rf"|(?<![0-9A-Za-z]){_WEEKDAY} {_MONTH} {{1,2}}{_DAY} {_CLOCK} {_YEAR}(?![0-9])"
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


_P_ISO = re.compile(_ISO)
_P_LONG = re.compile(f"{_DAY_FIRST}|{_MONTH_FIRST}")
_P_NUMERIC = re.compile(_NUMERIC)
_P_TIME = re.compile(_TIME)
_P_BARE_TIME = re.compile(_BARE_TIME)
_P_EPOCH = re.compile(rf"(?<![0-9.])1{_D}{{9}}(?:{_D}{{3}})?(?:\.{_D}{{1,6}})?(?!\.?[0-9])")
_P_EPOCH_KEYWORD = re.compile(
    r"(?i:\b(?:unix time(?:stamp)?|timestamp|time|epoch|now|ts|clock|date"
    r"|(?:created|updated|generated|issued|sent)(?:[ _]at)?)\b)[ \t]*(?:[:=]|is)?[ \t]*\Z"
)
_UUID_TAIL = re.compile(  # from the first dash: a literal prefix, which re searches fast
    r"-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}(?![0-9A-Za-z])"
)
_HEX_CHARS = frozenset("0123456789abcdefABCDEF")
_ALNUM = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _table(keep: bytes, groups: dict[bytes, int], other: int) -> bytes:
    """A ``bytes.translate`` table: ``keep`` as is, each group to one byte, the rest ``other``."""
    table = bytearray([other] * 256)
    for c in keep:
        table[c] = c
    for chars, to in groups.items():
        for c in chars:
            table[c] = to
    return bytes(table)


# The digit-class view: digits become "0", date and time separators stay, the rest is "~".
_DIGIT_CLASS = _table(b"-:/., ", {b"0123456789": 0x30}, 0x7E)
# The hex-class view: hex digits become "h", other word characters "w", the rest " ".
_HEX_CLASS = _table(
    b"",
    {b"0123456789abcdefABCDEF": 0x68, b"ghijklmnopqrstuvwxyzGHIJKLMNOPQRSTUVWXYZ_": 0x77},
    0x20,
)
# Every timestamp holds one of these anchors; each match is the anchor's first digit (a
# literal prefix, which the regex engine searches fast) and names the anchor it starts.
_ANCHORS = re.compile(
    rb"0(?=(?P<epoch>0{9})|(?P<iso>000-00-)|(?P<clock>:00)|(?P<slash>/)"
    rb"|(?P<dots>\.00?\.0000)|(?P<year>000(?<=[ ,]0000)))"
)
_WORD = re.compile(r"[0-9A-Za-z]+")
_LONG_REACH = 40  # characters a long date may start before its year


def _run_start(view: bytes, end: int) -> int:
    """Start of the run of digits that ends at ``end`` in the digit-class view."""
    while end > 0 and view[end - 1] == 0x30:
        end -= 1
    return end


class _Timestamps:
    """The ``volatile_timestamps`` detector, driven by anchors.

    Running the full patterns over a prompt costs Python's regex engine 10-20 ns a
    character. Instead the ASCII view is mapped to a digit-class view by ``bytes.translate``
    and one literal-prefixed regex finds the anchors every timestamp holds: a date's
    ``0000-00-``, a clock's ``0:00``, a numeric date's ``0/`` or ``.00.0000``, a year after a
    space or comma, an epoch's ten digits. Each anchor says where its timestamp can start,
    and only there is the full pattern tried.
    """

    def __init__(self, *, bare_times: bool, bare_epochs: bool) -> None:
        self.bare_times = bare_times
        self.bare_epochs = bare_epochs

    def __call__(self, text: str, view: bytes) -> Iterator[Found]:
        digits = view.translate(_DIGIT_CLASS)
        finds: list[Found] = []
        for anchor in _ANCHORS.finditer(digits):
            at = anchor.start()
            kind = anchor.lastgroup
            if kind == "iso":
                found = self._dated(_P_ISO.match(text, at))
            elif kind == "clock":
                found = self._clock(text, _run_start(digits, at + 1))
            elif kind == "slash":
                found = self._dated(_P_NUMERIC.match(text, _run_start(digits, at + 1)))
            elif kind == "dots":
                found = self._dots(text, at)
            elif kind == "year":
                found = self._long(text, at)
            else:
                found = self._epoch(text, digits, at)
            if found is not None:
                finds.append(found)
        finds.sort(key=lambda f: (f.start, f.start - f.end))
        end = -1
        for found in finds:  # the same timestamp is often reached from two anchors
            if found.start >= end:
                end = found.end
                yield found

    @staticmethod
    def _dated(m: re.Match[str] | None) -> Found | None:
        if m is None:
            return None
        label = "datetime" if ":" in m.group() else "date"
        return Found(m.start(), m.end(), label, VOLATILE_TIMESTAMPS)

    def _dots(self, text: str, at: int) -> Found | None:
        for start in (at - 1, at):  # dd.mm.yyyy or d.mm.yyyy
            if start >= 0 and (m := _P_NUMERIC.match(text, start)) is not None:
                return self._dated(m)
        return None

    def _long(self, text: str, at: int) -> Found | None:
        for word in _WORD.finditer(text, max(0, at - _LONG_REACH), at + 1):
            m = _P_LONG.match(text, word.start())
            if m is not None and m.end() > at:
                return self._dated(m)
        return None

    def _clock(self, text: str, start: int) -> Found | None:
        m = _P_TIME.match(text, start)
        if m is None and self.bare_times:
            m = _P_BARE_TIME.match(text, start)
        return None if m is None else Found(m.start(), m.end(), "time", VOLATILE_TIMESTAMPS)

    def _epoch(self, text: str, digits: bytes, at: int) -> Found | None:
        if at and digits[at - 1] == 0x30:
            return None  # inside a longer run, already tried from its start
        m = _P_EPOCH.match(text, at)
        if m is None:
            return None
        if not self.bare_epochs and not _P_EPOCH_KEYWORD.search(text, max(0, at - 40), at):
            return None
        return Found(m.start(), m.end(), "epoch", VOLATILE_TIMESTAMPS)


Detector = Callable[[str, bytes], Iterator[Found]]


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
        out[VOLATILE_TIMESTAMPS] = [
            _Timestamps(bare_times=rule.flag("bare_times"), bare_epochs=rule.flag("bare_epochs"))
        ]
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
