"""Analyzer input formats: detection, token accounting and namespacing per format."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "data" / "analyzer"))

import planted  # the known-answer input builders

from analyzers.readers import (
    BODIES,
    KVCACHE,
    MOONCAKE,
    RECORDS,
    UNKNOWN,
    detect_format,
    parse_ts,
    read_paths,
)
from proxy.fingerprint import fingerprint

FIXTURES = Path(__file__).parents[1] / "data" / "analyzer"


@pytest.mark.parametrize(
    ("name", "fmt"),
    [
        ("mooncake.jsonl", MOONCAKE),
        ("kvcache.json", KVCACHE),
        ("bodies.jsonl", BODIES),
        ("records.jsonl", RECORDS),
    ],
)
def test_detects_each_format(name: str, fmt: str) -> None:
    """Each fixture file is recognised as its format from its content."""
    assert detect_format(FIXTURES / name) == fmt


def test_unknown_format(tmp_path: Path) -> None:
    """A file of unrelated JSON is reported, not guessed."""
    path = tmp_path / "other.jsonl"
    path.write_text('{"hello": 1}\n')
    assert detect_format(path) == UNKNOWN
    trace = read_paths([path])
    assert trace.requests == [] and trace.notes


def test_mooncake_blocks_and_timestamps() -> None:
    """Mooncake ids become 512-token blocks, ms timestamps become seconds."""
    trace = read_paths([FIXTURES / "mooncake.jsonl"])
    assert [r.ts for r in trace.requests] == [0.0, 0.5, 1.0, 1.5]
    first = trace.requests[0]
    assert first.block_tokens == 512 and first.prompt_tokens == 1100
    assert first.tokens_upto(3) == 1100  # the last block is partial
    assert first.tokens_upto(2) == 1024


def test_kvcache_ids_are_namespaced_per_file(tmp_path: Path) -> None:
    """Two kv-cache-tester files with the same local ids never share a key."""
    src = (FIXTURES / "kvcache.json").read_bytes()
    (tmp_path / "a.json").write_bytes(src)
    (tmp_path / "b.json").write_bytes(src)
    trace = read_paths([tmp_path / "a.json", tmp_path / "b.json"])
    by_source: dict[str, set[int]] = {}
    for r in trace.requests:
        by_source.setdefault(r.source, set()).update(r.keys)
    assert len(by_source) == 2
    a, b = by_source.values()
    assert not a & b
    assert trace.requests[0].block_tokens == 64


def test_records_use_segments_and_skip_other_events() -> None:
    """Records give segment keys with byte-proportional tokens; other log lines are skipped."""
    trace = read_paths([FIXTURES / "records.jsonl"])
    assert trace.skipped == 1
    assert trace.granularity == {"segment"}
    r = trace.requests[0]
    assert r.kinds is not None and tuple(r.kinds[:3]) == ("model", "tools", "system")
    assert r.stable_keys == 3
    assert r.anchor is not None
    assert r.tokens_upto(len(r.keys)) == pytest.approx(r.prompt_tokens)


def test_failed_records_are_counted_not_replayed(tmp_path: Path) -> None:
    """Requests with status >= 400 count as failures and stay out of the cache replay."""
    body = planted.chat("sys", "hi")
    rows = [
        planted.record(body, at=0, with_body=False),
        planted.record(body, at=1, with_body=False, status=502, slo_met=False),
    ]
    planted.write_jsonl(tmp_path / "log.jsonl", rows)
    trace = read_paths([tmp_path / "log.jsonl"])
    assert len(trace.requests) == 1
    assert trace.errors == 1 and trace.errors_slo_missed == 1


def test_records_with_bodies_are_fingerprinted(tmp_path: Path) -> None:
    """A record carrying its body is re-fingerprinted at block granularity."""
    body = planted.chat("sys " * 200, "hello")
    planted.write_jsonl(tmp_path / "log.jsonl", [planted.record(body, at=0, with_body=True)])
    r = read_paths([tmp_path / "log.jsonl"]).requests[0]
    assert r.body == body and r.route == planted.CHAT
    assert r.kinds is None
    assert r.keys == fingerprint(planted.CHAT, body).block_hashes


def test_body_files_get_tiktoken_counts() -> None:
    """Bare OpenAI bodies are counted with tiktoken and ordered by their timestamps."""
    trace = read_paths([FIXTURES / "bodies.jsonl"])
    assert len(trace.requests) == 3
    assert [r.ts for r in trace.requests] == [0.0, 1.0, 2.0]
    assert all(r.prompt_tokens > 100 for r in trace.requests)
    assert trace.requests[0].prompt_tokens < trace.requests[2].prompt_tokens


def test_wrapped_and_bare_bodies(tmp_path: Path) -> None:
    """Bodies may be wrapped in {timestamp, body} or carry a top-level timestamp."""
    body = planted.chat("sys", "hello")
    lines = [{"timestamp": "2025-01-01T00:00:05Z", "body": body}, {**body, "timestamp": 1}]
    path = tmp_path / "b.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines))
    trace = read_paths([path])
    assert len(trace.requests) == 2
    assert trace.requests[0].ts == 1.0


def test_parse_ts_forms() -> None:
    """ISO strings, seconds and milliseconds are all read as epoch seconds."""
    assert parse_ts("1970-01-01T00:00:10Z") == 10.0
    assert parse_ts(12.5) == 12.5
    assert parse_ts(1_700_000_000_000) == 1_700_000_000.0
    assert parse_ts(None, default=3.0) == 3.0
    assert parse_ts("garbage", default=4.0) == 4.0
