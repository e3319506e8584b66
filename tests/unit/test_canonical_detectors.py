"""Volatile-value detectors: the date, time, UUID and hex-id formats found, and what is not."""

from __future__ import annotations

import pytest

from proxy.canonical.config import CanonicalConfig, CustomPattern, RuleConfig
from proxy.canonical.detectors import ascii_view, build_detectors


def found(text: str, config: CanonicalConfig | None = None) -> list[tuple[str, str, str]]:
    """(rule, label, value) of every find, in text order."""
    detectors = build_detectors(config or CanonicalConfig())
    view = ascii_view(text)
    finds = [f for dets in detectors.values() for det in dets for f in det(text, view)]
    return [(f.rule, f.label, text[f.start : f.end]) for f in sorted(finds)]


def values(text: str, config: CanonicalConfig | None = None) -> list[str]:
    return [v for _, _, v in found(text, config)]


@pytest.mark.parametrize(
    ("text", "value", "label"),
    [
        ("Current date: Monday, November 30, 2026.", "Monday, November 30, 2026", "date"),
        ("Today is 2026-11-30T22:41:07Z.", "2026-11-30T22:41:07Z", "datetime"),
        ("now=2026-11-30T22:41:07.123456+00:00;", "2026-11-30T22:41:07.123456+00:00", "datetime"),
        ("Date: 2026-11-30 22:41\n", "2026-11-30 22:41", "datetime"),
        ("(as of 2026-11-30)", "2026-11-30", "date"),
        ("Date:2026-11-30", "2026-11-30", "date"),
        ("Sent: Mon, 30 Nov 2026 22:41:00 +0000", "Mon, 30 Nov 2026 22:41:00 +0000", "datetime"),
        (
            "It is November 30, 2026 at 10:41 PM PST.",
            "November 30, 2026 at 10:41 PM PST",
            "datetime",
        ),
        ("Monday, November 30, 2026 22:41", "Monday, November 30, 2026 22:41", "datetime"),
        ("on 30 November 2026 we", "30 November 2026", "date"),
        ("Sunday 1 March 2026", "Sunday 1 March 2026", "date"),
        ("Wed, Sept 30th, 2026", "Wed, Sept 30th, 2026", "date"),
        ("Mon Nov 30 22:41:07 UTC 2026", "Mon Nov 30 22:41:07 UTC 2026", "datetime"),
        ("Mon Nov  3 22:41:07 UTC 2026", "Mon Nov  3 22:41:07 UTC 2026", "datetime"),
        ("US date 11/30/2026.", "11/30/2026", "date"),
        ("EU date 30.11.2026.", "30.11.2026", "date"),
        ("local time 22:41:07.", "22:41:07", "time"),
        ("at 10:41 PM today", "10:41 PM", "time"),
        ("at 10:41 p.m. EST", "10:41 p.m. EST", "time"),
        ("timestamp: 1764542467", "1764542467", "epoch"),
        ("Unix time 1764542467123 ms", "1764542467123", "epoch"),
        ("epoch=1764542467.25", "1764542467.25", "epoch"),
        ("Heute ist 2026-11-30 — schön.", "2026-11-30", "date"),
    ],
)
def test_timestamp_formats(text: str, value: str, label: str) -> None:
    """Each supported date/time format is found whole, with the right label."""
    assert found(text) == [("volatile_timestamps", label, value)]


@pytest.mark.parametrize(
    "text",
    [
        "Use Python 3.11.7 and node 20.10.0.",
        "The score was 3:16 at half time; meet at 10:30.",
        "Call 555-123-4567 or +1 (555) 123 4567.",
        "Order 1764542467 shipped.",
        "In 2026 we plan ahead; ISO 8601 is a standard.",
        "Knowledge cutoff: 2024-06.",
        "Ratio 1/2/3 and fraction 3/4.",
        "Build 2026-13-45 is not a date.",
        "Mark the Decimal Monday meeting.",
        "path /var/log/2026-11-30.log",
    ],
)
def test_ordinary_text_is_not_a_timestamp(text: str) -> None:
    """Versions, scores, phone and order numbers, bare years and paths are left alone."""
    assert [v for r, _, v in found(text) if r == "volatile_timestamps"] == []


def test_ambiguous_detectors_are_options() -> None:
    """Bare HH:MM and bare epoch numbers are found only when switched on."""
    text = "Standup 10:30; order 1764542467."
    assert values(text) == []
    rules = {"volatile_timestamps": RuleConfig(options={"bare_times": True, "bare_epochs": True})}
    assert values(text, CanonicalConfig(rules=rules)) == ["10:30", "1764542467"]


def test_uuids_any_case_as_whole_tokens() -> None:
    """RFC 4122 UUIDs in either case are found; one glued to a word is not."""
    text = (
        "session 550e8400-e29b-41d4-a716-446655440000, trace 550E8400-E29B-41D4-A716-446655440000;"
        " x550e8400-e29b-41d4-a716-446655440000 req_550e8400-e29b-41d4-a716-446655440000"
    )
    assert found(text) == [
        ("volatile_uuids", "uuid", "550e8400-e29b-41d4-a716-446655440000"),
        ("volatile_uuids", "uuid", "550E8400-E29B-41D4-A716-446655440000"),
        ("volatile_uuids", "uuid", "550e8400-e29b-41d4-a716-446655440000"),
    ]


def test_hex_ids_need_a_digit_a_letter_and_a_token_of_their_own() -> None:
    """Long hex runs with digits and letters are ids; numbers, words and glued runs are not."""
    text = (
        "trace 4bf92f3577b34da6a3ce929d0e0e4736 commit 3f2a9c81d4e5b6a7 "
        "n 1234567890123456 w deadbeefcafebabedeadbeef x_3f2a9c81d4e5b6a7 3f2a9c81d4e5b6a7z "
        "short 3f2a9c81d4e5"
    )
    assert values(text) == ["4bf92f3577b34da6a3ce929d0e0e4736", "3f2a9c81d4e5b6a7"]
    rules = {"volatile_hex_ids": RuleConfig(options={"min_length": 24})}
    assert values(text, CanonicalConfig(rules=rules)) == ["4bf92f3577b34da6a3ce929d0e0e4736"]


def test_custom_patterns_find_their_group() -> None:
    """A custom pattern's value group is the value; the words around it stay put."""
    config = CanonicalConfig(
        custom_patterns=(
            CustomPattern("request_id", r"request id: (\S+)"),
            CustomPattern("user", r"user=(?P<value>\w+)"),
        )
    )
    text = "request id: req_01HX8Z, user=ada\nrequest id: req_9"
    assert found(text, config) == [
        ("custom_patterns", "request_id", "req_01HX8Z,"),
        ("custom_patterns", "user", "ada"),
        ("custom_patterns", "request_id", "req_9"),
    ]


def test_disabled_rules_have_no_detector() -> None:
    """A switched-off rule finds nothing."""
    rules = {name: RuleConfig(enabled=False) for name in ("volatile_timestamps", "volatile_uuids")}
    text = "2026-11-30 550e8400-e29b-41d4-a716-446655440000 4bf92f3577b34da6"
    assert found(text, CanonicalConfig(rules=rules)) == [
        ("volatile_hex_ids", "id", "4bf92f3577b34da6")
    ]


def test_many_values_in_a_long_prompt() -> None:
    """Every occurrence in a long text is found, in order, once."""
    block = (
        "Line {i}: 2026-11-{d:02d}T10:00:00Z, session 550e8400-e29b-41d4-a716-4466554400{i:02d}\n"
    )
    text = "".join(block.format(i=i, d=i % 28 + 1) for i in range(50))
    assert len(found(text)) == 100
