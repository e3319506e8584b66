"""``prefixgate analyze`` over records: the miss attribution section adds up and recommends."""

from __future__ import annotations

from pathlib import Path

import orjson
from rich.console import Console

from analyzers.analysis import analyze
from analyzers.report import print_report


def line(n: int, **misses: object) -> bytes:
    rec = {
        "event": "request", "ts": f"2026-12-02T00:00:{n:02d}.000Z", "request_id": str(n),
        "route": "/v1/chat/completions", "model": "m", "backend": "http://a", "stream": False,
        "status": 200, "prompt_tokens": 100, "cached_tokens": 20,
        "prefix_segments": [["00000000000000aa", 40, "model"], ["00000000000000bb", 400, "system"]],
        **misses,
    }  # fmt: skip
    return orjson.dumps(rec) + b"\n"


def test_the_report_adds_up_the_causes_and_names_the_fixes(tmp_path: Path) -> None:
    """Two attributed records and one from before attribution: the section sums the two, names
    the rule to turn on and the routing knob, and the JSON carries the same numbers."""
    log = tmp_path / "requests.jsonl"
    log.write_bytes(
        line(1, miss_new_tokens=10, miss_breaker_tokens=70, miss_breaker_rules=["stable_json"],
             miss_routing_tokens=0, miss_evicted_tokens=0, miss_unexplained_tokens=0)
        + line(2, miss_new_tokens=20, miss_breaker_tokens=0, miss_routing_tokens=60,
               miss_routing_why="round_robin", miss_evicted_tokens=0, miss_unexplained_tokens=0)
        + line(3)
    )  # fmt: skip
    a = analyze([log])
    out = a.to_json()["miss_attribution"]
    assert out["requests"] == 2 and out["uncached_tokens"] == 160
    assert out["tokens"] == {"new": 30, "breaker": 70, "routing": 60, "evicted": 0,
                             "unexplained": 0}  # fmt: skip
    assert out["breaker_rules"] == {"stable_json": 70}
    assert "turn on stable_json" in out["fixes"]["breaker"]
    assert "--policy prefix-affinity" in out["fixes"]["routing"]
    console = Console(record=True, width=200)
    print_report(a, console)
    text = console.export_text()
    assert "Why prompt tokens missed the cache" in text and "turn on stable_json" in text
