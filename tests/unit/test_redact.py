"""Redaction of logged prompts: what each kind redacts, linear time on hostile text, the cap."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.redact import DEFAULT_MAX_CHARS, DEFAULT_PATTERNS, Redactor, default_rules

RULES = {rule.kind: rule for rule in default_rules()}
REDACTOR = Redactor.build()

JWT = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U"
PRIVATE_KEY = "-----BEGIN RSA PRIVATE KEY-----\nMIIBOgIBAAJBAK\nabc=\n-----END RSA PRIVATE KEY-----"
SECRETS = {
    "private_key": PRIVATE_KEY,
    "api_key": "sk-proj-abcdefghijklmnop1234",
    "github_token": "ghp_" + "a1" * 18,
    "slack_token": "xoxb-1234567890-abcdef",
    "aws_access_key": "AKIAABCDEFGHIJKLMNOP",
    "google_api_key": "AIza" + "B" * 35,
    "jwt": JWT,
    "bearer": "Bearer abcdefghijklmnopqrstuvwx",
    "email": "bob.smith+tag@mail.example.com",
}
NEAR_MISSES = [
    "sk-short123",  # under 16 characters
    "ghp_tooshort",
    "AKIAabcdefghijklmnop",  # lower case
    "eyJabc.def.ghi",  # segments under 8
    "bearer short",
    "user@localhost",  # no dot in the domain
    "@example.com",  # no local part
    "-----BEGIN RSA PRIVATE KEY-----\nno end",
]


@pytest.mark.parametrize("kind", sorted(SECRETS))
def test_each_kind_redacts_its_secret(kind: str) -> None:
    text = f"before {SECRETS[kind]} after"
    out = REDACTOR.text(text)
    assert out == f"before [REDACTED:{kind}] after"
    assert RULES[kind].sub(text) == out


@pytest.mark.parametrize("text", NEAR_MISSES)
def test_near_misses_are_left_alone(text: str) -> None:
    assert REDACTOR.text(text) == text


def test_redactor_defaults_and_custom() -> None:
    assert REDACTOR.value({"a": ["x@y.io", 3, None]}) == {"a": ["[REDACTED:email]", 3, None]}
    assert REDACTOR.value({"k@y.io": True}) == {"[REDACTED:email]": True}
    assert Redactor.build(defaults=False).text("x@y.io") == "x@y.io"
    assert Redactor.build([r"ticket-\d+"], defaults=False).text("ticket-42") == "[REDACTED:custom]"
    # A match glued to the previous one still starts where that one ended, as re.sub does.
    assert REDACTOR.text("a@b.com1x@c.org") == "[REDACTED:email][REDACTED:email]"


# -- the two-phase scanners redact exactly what their regular expression does -----------------

FRAGMENTS = {
    "email": ["a", "Z", "9", ".", "_", "%", "+", "-", "@", " ", "é", "com", "@a.bc", ".io"],
    "jwt": ["eyJ", "-eyJ", "a", "_", "-", ".", " ", "é", "aaaaaaaa", ".bbbbbbbb", "9"],
    "private_key": [
        "-----BEGIN ",
        "-----END ",
        "RSA ",
        "PRIVATE KEY-----",
        "A",
        " ",
        "\n",
        "x",
        "-",
    ],
}


@pytest.mark.parametrize("kind", sorted(FRAGMENTS))
def test_scanner_matches_its_regular_expression(kind: str) -> None:
    reference = re.compile(DEFAULT_PATTERNS[kind])
    repl = f"[REDACTED:{kind}]"

    @settings(max_examples=3000, deadline=None)
    @given(st.lists(st.sampled_from(FRAGMENTS[kind]), max_size=30))
    def check(parts: list[str]) -> None:
        text = "".join(parts)
        assert RULES[kind].sub(text) == reference.sub(repl, text)

    check()


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from([*SECRETS.values(), *NEAR_MISSES, " ", "\n", "x", "@", "."])))
def test_redactor_matches_the_regular_expressions_in_order(parts: list[str]) -> None:
    text = "".join(parts)
    expected = text
    for kind, pattern in DEFAULT_PATTERNS.items():
        expected = re.sub(pattern, f"[REDACTED:{kind}]", expected)
    assert REDACTOR.text(text) == expected


# -- linear time on text built to make each pattern backtrack ---------------------------------

N = 200_000
HOSTILE = {
    "letters": "a" * N,
    "dots": "." * N,
    "dashes": "-" * N,
    "ats": "@" * N,
    "letter_at": "a@" * (N // 2),
    "letter_dot": "a." * (N // 2),
    "at_then_letters": "x@" + "b" * N,
    "at_then_dotted": "x@" + "a." * (N // 2),
    "local_parts": "aaaa.bbbb-cccc@" * (N // 15),
    "begin_lines": "-----BEGIN PRIVATE KEY-----" * (N // 27),
    "begin_caps": "-----BEGIN " + "A" * N,
    "end_lines": "-----END " * (N // 9),
    "jwt_heads": "eyJ-" * (N // 4),
    "jwt_segments": "eyJaaaaaaaa." * (N // 12),
    "sk_dashes": "sk-" * (N // 3),
    "sk_near": ("sk-" + "a" * 15 + " ") * (N // 19),
    "bearers": "bearer " * (N // 7),
    "bearer_spaces": "bearer" + " " * N,
    "ghp_near": ("ghp_" + "a" * 29 + " ") * (N // 34),
    "slack": "xoxb-" * (N // 5),
    "aws": "AKIA" * (N // 4),
    "google": "AIza" * (N // 4),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_every_pattern_is_linear_on_hostile_text(name: str) -> None:
    """Each rule on 200 KB built to backtrack: milliseconds (the regular expressions took
    seconds to minutes for email, jwt and private_key)."""
    text = HOSTILE[name]
    for rule in REDACTOR.patterns:
        start = time.perf_counter()
        rule.sub(text)
        elapsed = time.perf_counter() - start
        assert elapsed < 0.25, (rule.kind, name, elapsed)


# -- the cap on a logged body -----------------------------------------------------------------


def _size(obj: Any) -> int:
    if isinstance(obj, str):
        return len(obj)
    if isinstance(obj, dict):
        return sum(len(k) + _size(v) for k, v in obj.items())
    if isinstance(obj, list):
        return sum(_size(v) for v in obj)
    return 1


def test_small_bodies_are_logged_whole() -> None:
    body = {"messages": [{"role": "user", "content": "hello " * 1000}], "n": 1}
    assert REDACTOR.value(body) == body


def test_huge_bodies_are_cut_at_the_budget() -> None:
    big = ("word " * 20 + "\n") * 400_000  # 40 MB of text
    body = {"model": "m", "messages": [{"role": "user", "content": big}], "max_tokens": 5}
    start = time.perf_counter()
    out = REDACTOR.value(body)
    assert time.perf_counter() - start < 1.0
    content = out["messages"][0]["content"]
    assert content.endswith(f"[TRUNCATED:{len(big) - content.index('[TRUNCATED')} chars]")
    assert DEFAULT_MAX_CHARS - 1000 < content.index("[TRUNCATED") <= DEFAULT_MAX_CHARS
    assert out["model"] == "m"
    assert out["[TRUNCATED]"] == "1 more entries"  # max_tokens, past the budget


def test_many_small_values_are_bounded() -> None:
    body = {"prompt": ["ab@c.de"] * 2_000_000, "ids": list(range(5_000_000))}
    start = time.perf_counter()
    out = REDACTOR.value(body)
    assert time.perf_counter() - start < 1.0
    assert _size(out) < DEFAULT_MAX_CHARS
    assert out["prompt"][0] == "[REDACTED:email]"
    assert out["prompt"][-1].startswith("[TRUNCATED] ")
    assert out["[TRUNCATED]"] == "1 more entries"


def test_a_cut_never_leaves_half_a_secret() -> None:
    r = Redactor.build(max_chars=100)
    for secret in (SECRETS["api_key"], SECRETS["jwt"], SECRETS["email"], "Bearer " + "t" * 40):
        for pad in range(0, 100, 7):
            text = "x" * pad + " " + secret + " tail"
            out = r.value(text)
            assert secret[8:] not in out and secret[-8:] not in out, (pad, out)
    # A key block open at the cut is dropped whole, however much of it fits.
    text = "intro " + PRIVATE_KEY.replace("abc=", "abc=\n" * 50)
    out = r.value(text)
    assert "MIIBOgIBAAJBAK" not in out and out.startswith("intro ")
    # Without whitespace there is nothing safe to keep.
    assert r.value("a" * 500) == "[TRUNCATED:500 chars]"


def test_deep_values_do_not_raise() -> None:
    deep: Any = "x@y.io"
    for _ in range(5000):
        deep = [deep]
    out = REDACTOR.value({"a": deep})
    assert "[TRUNCATED]" in str(out)
