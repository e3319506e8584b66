"""The record's published JSON Schema: generated from ``RequestRecord`` and kept current."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from record_check import SCHEMA_PATH, as_logged, violations

from analyzers import readers
from proxy.record_schema import LOG_LINE_KEYS, main, record_schema, render
from proxy.records import DERIVED, DOC, RECORD_KEYS, RequestRecord, record_key


def full_record() -> RequestRecord:
    """A record with every field written only for some requests set."""
    return RequestRecord(
        ts="2026-12-01T00:00:00.000Z",
        request_id="r",
        route="/v1/chat/completions",
        model="m",
        backend="http://b:1",
        stream=True,
        status=200,
        prompt_tokens=100,
        cached_tokens=64,
        cached_tokens_source="reported",
        predicted_cached_tokens=60,
        cache_source="slot",
        canonical_dry_run_rules=["relocate_timestamps"],
        canonical_notes_restored=1,
        canonical_note_values_omitted=2,
        canonical_learned_spans=["73ed1a84d1c6"],
        canonical_stable_bytes={"relocate_timestamps": 120},
        affinity_key="00000000000000ff",
        affinity_source="prompt_cache_key",
        control_group=False,
        hosted_fields_stripped=["prompt_cache_key"],
        route_reason="affinity",
        template_clock="date",
        replica_load=0,
        retried_from="http://a:1",
        prefix_block_bytes=64,
        prefix_matched_blocks=2,
        prefix_segments=[["00000000000000aa", 12, "model"], ["00000000000000bb", 80, "system"]],
        body={"model": "m", "messages": []},
        schedule_reason="slot_hit",
        held_ms=0.0,
        slot=1,
        miss_new_tokens=20,
        miss_breaker_tokens=10,
        miss_breaker_rules=["volatile_timestamps"],
        miss_routing_tokens=4,
        miss_routing_why="load_gate",
        miss_evicted_tokens=2,
        miss_unexplained_tokens=0,
    )


def test_published_schema_is_the_generated_one() -> None:
    """docs/schemas/record-v1.schema.json is what ``python -m proxy.record_schema`` writes."""
    assert SCHEMA_PATH.read_bytes() == render(), (
        "the record changed: run `python -m proxy.record_schema --write`"
    )


def test_schema_covers_every_field_with_a_description() -> None:
    """Each dataclass field, each derived rate and the log line's keys are properties."""
    schema = record_schema()
    names = {f.name for f in dataclasses.fields(RequestRecord)}
    assert set(schema["properties"]) == names | set(DERIVED) | set(LOG_LINE_KEYS)
    assert set(schema["properties"]) - set(LOG_LINE_KEYS) == RECORD_KEYS
    assert all(f.metadata[DOC] for f in dataclasses.fields(RequestRecord))
    assert all(p["description"] for p in schema["properties"].values())


def test_minimal_and_full_records_validate() -> None:
    """A record with only the fields every record has, and one with all of them, are valid."""
    minimal = RequestRecord(
        ts="t", request_id="r", route="/x", model=None, backend=None, stream=False, status=500
    )
    assert violations(as_logged(minimal)) == []
    full = as_logged(full_record())
    assert set(full) == RECORD_KEYS
    assert violations(full) == []


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"route_reason": None}, "a field set only when it applies is never null"),
        ({"slot": "1"}, "wrong type"),
        ({"cached_tokens_source": "guessed"}, "outside its enum"),
        ({"surprise": 1}, "no key the record does not define"),
        ({"prefix_segments": [["zz", 1, "model"]]}, "segment hash is 16 hex digits"),
    ],
)
def test_schema_rejects_what_a_record_never_is(change: dict[str, object], why: str) -> None:
    """The schema is strict enough to catch a drifted field."""
    line = {**as_logged(full_record()), **change}
    assert violations(line), why


def test_a_missing_field_is_reported() -> None:
    """Fields every record has are required."""
    line = as_logged(full_record())
    del line["prompt_tokens"]
    assert violations(line)


def test_record_key_names_only_record_fields() -> None:
    """Readers name keys through ``record_key``, which refuses a key the record lacks."""
    assert record_key("prefix_segments") == "prefix_segments"
    assert record_key("hit_rate") == "hit_rate"
    with pytest.raises(KeyError):
        record_key("prefix_segment")


def test_analyzer_reads_record_keys_only() -> None:
    """Every record key the analyzer reads is a key of the published record."""
    read = {v for k, v in vars(readers).items() if k.startswith("K_")}
    assert read and read <= RECORD_KEYS


def test_schema_cli_prints_and_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m proxy.record_schema`` prints the schema; ``--write DIR`` writes the file."""
    assert main([]) == 0
    assert capsys.readouterr().out.encode() == render()
    assert main(["--write", str(tmp_path)]) == 0
    assert (tmp_path / "record-v1.schema.json").read_bytes() == render()
