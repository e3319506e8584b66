"""The canonicalizer pipeline: modes, routes, counters, gains and the end-to-end promise."""

from __future__ import annotations

import random
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "data" / "canonical"))

import agent_requests  # the realistic request builder

from proxy.canonical import RULE_NAMES, CanonicalConfig, Canonicalizer, RuleConfig, pipeline
from proxy.canonical.gain import common_prefix
from proxy.canonical.outcome import RuleOutcome
from proxy.fingerprint import fingerprint, render

CHAT = agent_requests.CHAT
ALL = ("stable_json", "whitespace", "volatile_timestamps", "volatile_uuids", "volatile_hex_ids")


def later(minutes: int, seed: int) -> dict[str, Any]:
    """The agent's request ``minutes`` later, another session, shuffled by ``seed``."""
    return agent_requests.request(
        when=agent_requests.WHEN + timedelta(minutes=minutes, seconds=seed),
        session=f"6fa459ea-ee8a-3ca4-894e-{seed:012x}",
        seed=seed,
        crlf=bool(seed % 2),
    )


def shuffle_top_level(body: dict[str, Any], seed: int) -> dict[str, Any]:
    keys = list(body)
    random.Random(seed).shuffle(keys)
    return {k: body[k] for k in keys}


def test_requests_differing_in_volatile_ways_share_everything_up_to_the_newest_user_message() -> (
    None
):
    """Timestamps, session ids, tool order, key order, CRLF and argument spacing all vanish."""
    canonicalizer = Canonicalizer()
    outs = [
        canonicalizer.apply(CHAT, shuffle_top_level(later(m, seed), seed)).body
        for m, seed in ((0, 1), (7, 2), (60 * 24, 3))
    ]
    first = outs[0]
    newest_user = max(i for i, m in enumerate(first["messages"]) if m["role"] == "user")
    for out in outs[1:]:
        assert orjson.dumps(out["tools"]) == orjson.dumps(first["tools"])
        assert orjson.dumps(out["messages"][:newest_user]) == orjson.dumps(
            first["messages"][:newest_user]
        )
        a, b = render(CHAT, first), render(CHAT, out)
        user_segment = b.segments[-1].start
        assert common_prefix(a.data, b.data) >= user_segment
    # Without the canonicalizer the same requests share almost nothing.
    raw = [render(CHAT, later(m, seed)).data for m, seed in ((0, 1), (7, 2))]
    assert common_prefix(raw[0], raw[1]) < 100


def test_result_reports_rules_changes_and_gains() -> None:
    """fired lists the applied rules in order; gains are positive rendered-byte counts."""
    result = Canonicalizer().apply(CHAT, later(0, 1))
    assert result.fired == ALL
    assert result.dry_run_fired == ()
    gains = result.stable_bytes_gained
    assert set(gains) == set(ALL) and all(v > 0 for v in gains.values())
    assert {c.rule for c in result.changes} == set(ALL)
    text = orjson.dumps([(c.rule, c.path, c.kind) for c in result.changes])
    assert b"Atlas" not in text and b"2026" not in text


def test_gain_of_a_relocated_timestamp_is_measured_on_the_rendered_prompt() -> None:
    """The gain runs from the timestamp to the note, in the forwarded prompt's bytes."""
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief. Date: 2026-11-30. Answer in English."},
            {"role": "user", "content": "old question"},
            {"role": "assistant", "content": "old answer"},
            {"role": "user", "content": "new question"},
        ],
    }
    result = Canonicalizer(CanonicalConfig(note_placement="user_prefix")).apply(CHAT, body)
    data = render(CHAT, result.body).data
    timestamp_at = data.index(b"[[date_1]]")
    note_at = data.index(b"[[date_1]] = ")
    assert result.stable_bytes_gained == {"volatile_timestamps": note_at - timestamp_at}


def test_global_dry_run_reports_and_forwards_the_original() -> None:
    """Dry-run computes everything, returns the original body and lists the would-be rules."""
    body = later(0, 1)
    canonicalizer = Canonicalizer(CanonicalConfig(dry_run=True))
    result = canonicalizer.apply(CHAT, body)
    assert result.body is body
    assert result.fired == ()
    assert result.dry_run_fired == ALL
    assert set(result.stable_bytes_gained) == set(ALL)
    assert dict(canonicalizer.dry_run_counters) == {n: int(n in ALL) for n in RULE_NAMES}
    assert sum(canonicalizer.counters.values()) == 0


def test_per_rule_dry_run_only_holds_that_rule_back() -> None:
    """A rule in dry-run is reported; the others apply; its change is not in the body."""
    config = CanonicalConfig(rules={"volatile_timestamps": RuleConfig(dry_run=True)})
    result = Canonicalizer(config).apply(CHAT, later(0, 1))
    assert result.dry_run_fired == ("volatile_timestamps",)
    assert "volatile_timestamps" not in result.fired and "volatile_uuids" in result.fired
    system = result.body["messages"][0]["content"]
    assert "[[uuid_1]]" in system and "[[date" not in system and "2026" in system
    assert result.stable_bytes_gained["volatile_timestamps"] > 0
    assert [c for c in result.changes if c.rule == "volatile_timestamps"]


def test_disabled_canonicalizer_and_rules() -> None:
    """enabled = false passes everything through; a disabled rule never runs."""
    body = later(0, 1)
    assert Canonicalizer(CanonicalConfig(enabled=False)).apply(CHAT, body).body is body
    rules = {name: RuleConfig(enabled=False) for name in RULE_NAMES}
    assert Canonicalizer(CanonicalConfig(rules=rules)).apply(CHAT, body).body is body


@pytest.mark.parametrize("route", ["/v1/embeddings", "/health", "/v1/models"])
def test_other_routes_pass_through(route: str) -> None:
    """Only chat and completion routes are canonicalized."""
    body = later(0, 1)
    result = Canonicalizer().apply(route, body)
    assert result.body is body and not result.fired and result.stable_bytes_gained == {}


@pytest.mark.parametrize("route", ["/v1/completions", "/completion"])
def test_raw_prompts_never_get_a_note(route: str) -> None:
    """Raw completion prompts have no user message: volatile rules do not touch them."""
    body = {
        "model": "m",
        "prompt": "Date: 2026-11-30 \r\nSession 550e8400-e29b-41d4-a716-446655440000\n",
    }
    assert Canonicalizer().apply(route, body).body is body
    config = CanonicalConfig(rules={"whitespace": RuleConfig(options={"raw_prompts": True})})
    result = Canonicalizer(config).apply(route, body)
    assert result.fired == ("whitespace",)
    assert result.body["prompt"] == (
        "Date: 2026-11-30\nSession 550e8400-e29b-41d4-a716-446655440000\n"
    )
    assert result.stable_bytes_gained["whitespace"] > 0


def test_counters_count_requests() -> None:
    """Counters count requests per rule: fired, dry-run fired and skipped."""
    canonicalizer = Canonicalizer()
    for seed in range(3):
        canonicalizer.apply(CHAT, later(seed, seed))
    canonicalizer.apply(CHAT, {"messages": [{"role": "system", "content": "Date: 2026-11-30"}]})
    assert canonicalizer.counters["stable_json"] == 3
    assert canonicalizer.counters["volatile_timestamps"] == 3
    assert canonicalizer.counters["custom_patterns"] == 0
    assert canonicalizer.skipped_counters["volatile_timestamps"] == 1
    assert sum(canonicalizer.error_counters.values()) == 0


def test_non_object_bodies_are_left_alone() -> None:
    """A body that is not a JSON object passes through unchanged."""
    bodies: list[Any] = [[1, 2], "text", None, 3]
    for body in bodies:
        assert Canonicalizer().apply(CHAT, body).body is body


def test_a_failing_rule_costs_only_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Should a rule raise, it is skipped with reason error and counted; the others still run."""

    def broken(kind: str, body: dict[str, Any], rule: RuleConfig) -> RuleOutcome:
        raise RuntimeError("bug")

    rules = dict(pipeline.REWRITE_RULES)
    rules["stable_json"] = broken
    monkeypatch.setattr(pipeline, "REWRITE_RULES", tuple(rules.items()))
    canonicalizer = Canonicalizer()
    result = canonicalizer.apply(CHAT, later(0, 1))
    assert "stable_json" not in result.fired and "whitespace" in result.fired
    assert [(s.rule, s.reason) for s in result.skipped] == [("stable_json", "error")]
    assert canonicalizer.error_counters["stable_json"] == 1


def test_gains_can_reuse_the_fingerprint_layout() -> None:
    """Given the fingerprint's segments of the forwarded body, gains match a fresh render."""
    body = later(0, 1)
    fresh = Canonicalizer().apply(CHAT, body).stable_bytes_gained
    result = Canonicalizer().apply(CHAT, body)
    fp = fingerprint(CHAT, result.body)
    assert result.measure_gains(fp.segments, fp.total_bytes) == fresh
    assert result.stable_bytes_gained == fresh  # the first answer is kept
