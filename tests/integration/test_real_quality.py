"""``prefixgate quality`` against a real llama-server."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from analyzers.quality import read_requests, replay, summarize

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


async def test_quality_replay_reports_agreement(llama_url: str, tmp_path: Path) -> None:
    """Requests with dated system prompts replay in both forms, each original cold and warm;
    the report has every figure, the noise floor and a verdict."""
    path = tmp_path / "requests.jsonl"
    with path.open("wb") as f:
        for day in range(1, 4):
            body = {
                "model": "smollm2",
                "messages": [
                    {"role": "system", "content": f"Today is 2026-11-0{day}. Answer briefly."},
                    {"role": "user", "content": "What is two plus two?"},
                ],
            }
            f.write(orjson.dumps({"event": "request", "body": body}) + b"\n")
    bodies = list(read_requests([str(path)]))
    assert len(bodies) == 3
    pairs = await replay(bodies, llama_url, max_tokens=12)
    report = summarize(pairs)
    print("\n", report)
    assert report["requests"] == 3 and report["rewritten"] == 3
    assert all(p.rules == ("volatile_timestamps",) for p in pairs)
    assert all(p.original.text and p.canonical.text for p in pairs)
    assert 0.0 <= report["mean_similarity"] <= 1.0
    assert report["prompt_tokens"]["original"] > 0 and report["prompt_tokens"]["canonical"] > 0
    assert report["noise"]["repeated"] == 3
    assert 0.0 <= report["noise"]["cold_vs_warm_agreement"] <= 1.0
    assert all(p.repeat is not None and p.repeat.text for p in pairs)
    # The warm repeat reuses what the cold ask left in the cache.
    assert any((p.repeat.cached_tokens or 0) > 0 for p in pairs if p.repeat is not None)
    assert report["verdict"]
