"""Applications whose requests are already stable are forwarded untouched: no rule fires on the
bench's shared_system, multi_turn, rag and claude_code workloads (their bodies, canonicalized in
order with learned forms and learned volatile spans, as the proxy does)."""

from __future__ import annotations

from typing import Any

import pytest

from bench import workloads
from bench.loadgen import Result
from proxy.canonical import Canonicalizer
from proxy.canonical.forms import FormMemory

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("name", ["shared_system", "multi_turn", "rag", "claude_code"])
async def test_no_rule_fires_on_a_stable_workload(name: str) -> None:
    """Every request of the workload reaches the backend as the client built it."""
    canon = Canonicalizer(forms=FormMemory())
    sent: list[dict[str, Any]] = []

    async def send(body: dict[str, Any]) -> Result:
        result = canon.apply(CHAT, body)
        assert result.body is body, (len(sent), result.fired, result.changes)
        assert result.fired == () and result.dry_run_fired == ()
        sent.append(body)
        return Result(start_s=0.0, ok=True, status=200, text="Sure, here it is.")

    await workloads.WORKLOADS[name](send, workloads.Scale())
    assert len(sent) > 3
    assert sum(canon.counters.values()) == 0
    assert canon.spans is not None and canon.spans.patterns("default") == ()
