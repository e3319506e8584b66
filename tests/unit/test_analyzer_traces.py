"""The analyzer on the public traces: Mooncake and Claude Code reuse, as published."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzers import analyze
from analyzers.ideal import replay_unbounded
from analyzers.readers import read_paths

TRACES = Path(__file__).parents[1] / "data" / "traces"  # xz-compressed, as published
MOONCAKE = TRACES / "mooncake"


def test_mooncake_conversation_ideal_and_curve() -> None:
    """Conversation trace: ~37% token-weighted ideal; a 3M-token LRU gets under half of it."""
    result = analyze([MOONCAKE / "conversation_trace.jsonl.xz"])
    assert len(result.trace.requests) == 12_031
    assert result.ideal.hit_rate == pytest.approx(0.3736, abs=0.001)
    assert result.ideal_request_hit_rate == pytest.approx(0.4094, abs=0.001)
    near_3m = min(result.curve.points, key=lambda p: abs(p.capacity_tokens - 3_000_000))
    assert near_3m.hit_rate < result.ideal.hit_rate / 2
    assert result.tree.groups[0].requests == 12_031  # the shared system-prompt block
    assert result.tree.total_saved_tokens == round(result.ideal.cached_tokens)


def test_mooncake_synthetic_ideal() -> None:
    """Synthetic trace: ~65% token-weighted ideal (paper: 66%)."""
    trace = read_paths([MOONCAKE / "synthetic_trace.jsonl.xz"])
    ideal = replay_unbounded(trace.requests)
    assert len(trace.requests) == 3_993
    assert ideal.hit_rate == pytest.approx(0.6512, abs=0.001)


def test_claude_code_ideal() -> None:
    """Claude Code sessions: ~93% of input tokens reusable (published mean 93%)."""
    paths = sorted((TRACES / "claude-code").glob("*.json.xz"))
    assert len(paths) == 60
    trace = read_paths(paths)
    ideal = replay_unbounded(trace.requests)
    assert len(trace.requests) == 1_548
    assert ideal.hit_rate == pytest.approx(0.927, abs=0.002)
