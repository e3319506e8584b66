"""The analyzer names a volatile rule only where the proxy's detectors would find the value."""

from __future__ import annotations

import pytest

from analyzers.spans import RULE_TIMESTAMPS, classify, resync
from proxy.canonical import Canonicalizer
from proxy.canonical.spans import common_run as first_difference


def _kind(a: bytes, b: bytes) -> str:
    i = first_difference(a, 0, b, 0)
    end = resync(a, i, b, i)
    assert end is not None
    return classify(a, i, end[0], b, i, end[1]).rule


@pytest.mark.parametrize("line", ["Clock: {}", "updated_at={}", "timestamp: {}"])
def test_epoch_seconds_after_a_keyword_are_relocated_and_named_alike(line: str) -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You help.\n" + line.format(1764542467) + "\nBe brief."},
            {"role": "user", "content": "hi"},
        ],
    }
    result = Canonicalizer().apply("/v1/chat/completions", body)
    assert result.fired == (RULE_TIMESTAMPS,)
    assert "1764542467" not in result.body["messages"][0]["content"]
    a = ("You help.\n" + line.format(1764542467) + "\nBe brief. " + "x" * 40).encode()
    b = ("You help.\n" + line.format(1764542999) + "\nBe brief. " + "x" * 40).encode()
    assert _kind(a, b) == RULE_TIMESTAMPS


def test_a_bare_number_the_proxy_leaves_alone_is_not_named_a_timestamp() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Order 1764542467 ships soon."},
            {"role": "user", "content": "hi"},
        ],
    }
    assert Canonicalizer().apply("/v1/chat/completions", body).fired == ()
    a = b"Order 1764542467 ships soon. " + b"x" * 40
    b = b"Order 1764542999 ships soon. " + b"x" * 40
    assert _kind(a, b) != RULE_TIMESTAMPS
