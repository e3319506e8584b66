"""Cache breakers: planted volatile values, shuffled keys and whitespace are found exactly."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "data" / "analyzer"))

import planted  # the known-answer input builders

from analyzers import analyze
from analyzers.breakers import UNKNOWN_RULE
from analyzers.spans import RULE_NOTE, classify, resync, suggest_pattern
from proxy.canonical import Canonicalizer
from proxy.canonical.spans import common_run as first_difference


def write_log(tmp_path: Path, bodies: list[dict[str, object]], *, with_body: bool) -> Path:
    path = tmp_path / "log.jsonl"
    planted.write_jsonl(
        path, [planted.record(b, at=float(i), with_body=with_body) for i, b in enumerate(bodies)]
    )
    return path


EXPECTED = {
    "timestamp": ("volatile_timestamps", "system"),
    "uuid": ("volatile_uuids", "system"),
    "hex": ("volatile_hex_ids", "system"),
    "shuffled": ("stable_json", "tools"),
    "whitespace": ("whitespace", "system"),
    # A value no detector knows, in the system prompt: the proxy learns it (volatile_learned).
    "custom": ("volatile_learned", "system"),
}


def test_each_planted_breaker_is_found_exactly(tmp_path: Path) -> None:
    """Six applications, one planted breaker each: six breakers, four occurrences apiece."""
    bodies = [b for group in planted.breaker_bodies().values() for b in group]
    result = analyze([write_log(tmp_path, bodies, with_body=True)])
    got = {(b.rule, b.where): b for b in result.breakers}
    assert set(got) == set(EXPECTED.values())
    for breaker in got.values():
        assert breaker.occurrences == 4
        assert len(breaker.requests) == 4
        assert breaker.evidence == "spans"
        # the rest of the ~2 KB system prompt (or tools) was lost each time: ~500 tokens
        assert 350 * 4 < breaker.tokens_lost < 700 * 4


@pytest.mark.parametrize("app", sorted(EXPECTED))
def test_breaker_examples_show_the_values(tmp_path: Path, app: str) -> None:
    """Each breaker's example shows the two differing values side by side."""
    bodies = planted.breaker_bodies()[app]
    result = analyze([write_log(tmp_path, bodies, with_body=True)])
    assert len(result.breakers) == 1
    b = result.breakers[0]
    assert (b.rule, b.where) == EXPECTED[app]
    assert b.earlier != b.later
    if app == "timestamp":
        assert b.before.startswith("2025-03-01 12:00") and b.after.startswith("2025-03-01 12:0")
        assert b.label == "Current time:"
    if app == "uuid":
        assert len(b.before) == 36 and b.before != b.after
    if app == "hex":
        assert b.before == "0000deadbeef1234"


def test_clean_conversation_has_no_breakers(tmp_path: Path) -> None:
    """A conversation that only grows breaks nothing, with or without bodies."""
    bodies = planted.conversation(6)
    for with_body in (True, False):
        result = analyze([write_log(tmp_path, bodies, with_body=with_body)])
        assert result.breakers == []
        assert result.ideal.hit_rate > 0.5


def test_segment_breakers_without_bodies(tmp_path: Path) -> None:
    """Without bodies, a changing system prompt is located at its segment, rule unknown."""
    path = tmp_path / "log.jsonl"
    planted.write_jsonl(path, planted.traffic(8, 4))
    result = analyze([path])
    assert len(result.breakers) == 1
    b = result.breakers[0]
    assert (b.rule, b.where, b.evidence) == (UNKNOWN_RULE, "system", "segments")
    assert b.occurrences == 2 * 4  # conversations 3 and 7, four turns each
    assert "volatile_timestamps" in b.hint
    assert b.tokens_lost > 0


def test_traffic_with_bodies_names_the_timestamp(tmp_path: Path) -> None:
    """The same traffic with bodies names the rule and the literal text before the value."""
    path = tmp_path / "log.jsonl"
    planted.write_jsonl(path, planted.traffic(8, 4, with_body=True))
    result = analyze([path])
    assert [(b.rule, b.label) for b in result.breakers] == [("volatile_timestamps", "Now:")]
    # the first stamped request has no earlier request with the same stamped prompt
    assert result.breakers[0].occurrences == 2 * 4 - 1


def test_first_difference_and_resync() -> None:
    """The common run and the point where two texts agree again are found exactly."""
    a = b"prefix " * 40 + b"at 10:00:07 the rest of the text is long enough to agree " * 3
    b = b"prefix " * 40 + b"at 10:00:12 the rest of the text is long enough to agree " * 3
    p = first_difference(a, 0, b, 0)
    assert a[:p] == b[:p] and a[p] != b[p]
    assert p == len(b"prefix " * 40 + b"at 10:00:")
    found = resync(a, p, b, p)
    assert found == (p + 2, p + 2)
    kind = classify(a, p, p + 2, b, p, p + 2)
    assert kind.rule == "volatile_timestamps" and kind.before == "10:00:07"
    assert resync(a, p, b"x" * len(b), p) is None


def test_custom_pattern_suggestion() -> None:
    """Suggestions keep the literal context and generalise the value's character class."""
    assert suggest_pattern(b"count: ", b"17", b"18") == r"count:\ \d+"
    assert suggest_pattern(b"id=", b"ab12", b"cd34") == r"id=[A-Za-z0-9]+"


def agent_turns(placement: str, turns: int = 5) -> list[dict[str, object]]:
    """The bodies an agent loop sends through prefixgate: a clock in the system prompt,
    one user message, then a growing history of tool calls and results."""
    from proxy.backends.base import CHAT
    from proxy.canonical import Canonicalizer
    from proxy.canonical.config import CanonicalConfig

    canonicalizer = Canonicalizer(CanonicalConfig(note_placement=placement))  # type: ignore[arg-type]
    history: list[dict[str, object]] = [{"role": "user", "content": "Plan my week."}]
    sent = []
    for turn in range(turns):
        system = {"role": "system", "content": f"Now: 2026-11-30T10:0{turn}:17Z. You plan weeks."}
        body = {"model": "m", "messages": [system, *history]}
        sent.append(canonicalizer.apply(CHAT, body).body)
        call = {"id": f"c{turn}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        history.append({"role": "assistant", "content": None, "tool_calls": [call]})
        history.append({"role": "tool", "tool_call_id": f"c{turn}", "content": "event " * 120})
    return sent


def test_a_relocation_note_before_tool_turns_is_named(tmp_path: Path) -> None:
    """Logged bodies of an agent loop canonicalized with user_prefix: the value that breaks the
    prefix is in prefixgate's own note, and the report says which placement avoids it."""
    result = analyze([write_log(tmp_path, agent_turns("user_prefix"), with_body=True)])
    notes = [b for b in result.breakers if b.rule == RULE_NOTE]
    assert notes and notes[0].where == "message"
    assert "last_suffix" in notes[0].hint
    assert notes[0].before.startswith("2026-11-30T10:0")


def test_last_suffix_leaves_an_agent_loop_without_breakers(tmp_path: Path) -> None:
    result = analyze([write_log(tmp_path, agent_turns("last_suffix"), with_body=True)])
    assert result.breakers == []


def test_the_analyzer_names_the_span_the_proxy_learns(tmp_path: Path) -> None:
    """The analyzer's volatile_learned breaker is labelled with the very pattern the proxy
    learns from the same requests (one judge for both), and the proxy relocates it."""
    bodies = planted.breaker_bodies()["custom"]
    result = analyze([write_log(tmp_path, bodies, with_body=True)])
    (breaker,) = result.breakers
    canon = Canonicalizer()
    fired = []
    for body in bodies:
        fired.append(canon.apply("/v1/chat/completions", body).fired)
    assert canon.spans is not None
    (pattern,) = canon.spans.patterns("default")
    assert breaker.rule == "volatile_learned" and breaker.label == pattern.describe()
    assert breaker.label == "Visitor number: ⟨digits⟩⏎"
    assert fired[-1] == ("volatile_learned",)


def test_a_value_outside_the_stable_segments_is_not_learned() -> None:
    """The same value in a conversation message: a custom pattern is suggested, not the
    learned rule (the proxy never learns from conversation content)."""
    a = b"\x1euser\x1fPlease help. Visitor number: 41\nThe rest of the message is long enough."
    b = b"\x1euser\x1fPlease help. Visitor number: 54\nThe rest of the message is long enough."
    lo = a.index(b"41")
    assert classify(a, lo, lo + 2, b, lo, lo + 2).rule.startswith("custom pattern: ")
    assert classify(a, lo, lo + 2, b, lo, lo + 2, stable=True).rule == "volatile_learned"
