"""Analyzer inputs as they lie on disk: gzip and xz files, directories of logs, and the public
traces shipped under tests/data/traces."""

from __future__ import annotations

import gzip
import hashlib
import lzma
import re
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from analyzers.cli import main as analyze_main
from analyzers.inputs import input_files, input_stem, is_compressed, is_input_name, read_input
from analyzers.quality import read_requests
from analyzers.readers import detect_format, read_paths
from analyzers.simulate import output_tokens
from analyzers.trace import Trace
from proxy.cli import main as prefixgate_main

FIXTURES = Path(__file__).parents[1] / "data" / "analyzer"
TRACES = Path(__file__).parents[1] / "data" / "traces"
COMPRESSORS: dict[str, Callable[[bytes], bytes]] = {".gz": gzip.compress, ".xz": lzma.compress}


def rows(trace: Trace) -> list[tuple[object, ...]]:
    """What a trace says of each request, for comparing two reads of the same input."""
    return [
        (r.ts, r.source, tuple(r.keys), r.prompt_tokens, r.block_tokens) for r in trace.requests
    ]


def compressed_copy(src: Path, directory: Path, suffix: str) -> Path:
    out = directory / (src.name + suffix)
    out.write_bytes(COMPRESSORS[suffix](src.read_bytes()))
    return out


@pytest.mark.parametrize("suffix", sorted(COMPRESSORS))
@pytest.mark.parametrize(
    "name", ["mooncake.jsonl", "kvcache.json", "bodies.jsonl", "records.jsonl"]
)
def test_compressed_files_read_like_plain_ones(name: str, suffix: str, tmp_path: Path) -> None:
    """A gzip or xz copy of every input format is detected and read exactly as the original."""
    plain = FIXTURES / name
    packed = compressed_copy(plain, tmp_path, suffix)
    assert is_compressed(packed) and not is_compressed(plain)
    assert detect_format(packed) == detect_format(plain)
    assert read_input(packed) == plain.read_bytes()
    assert rows(read_paths([packed])) == rows(read_paths([plain]))


def test_compression_is_told_by_content_not_by_name(tmp_path: Path) -> None:
    """A gzip file without ``.gz`` is decompressed; a plain one named ``.xz`` is read plain."""
    src = (FIXTURES / "mooncake.jsonl").read_bytes()
    hidden = tmp_path / "trace.jsonl"
    hidden.write_bytes(gzip.compress(src))
    misnamed = tmp_path / "other.jsonl.xz"
    misnamed.write_bytes(src)
    expected = len(read_paths([FIXTURES / "mooncake.jsonl"]).requests)
    assert len(read_paths([hidden]).requests) == expected
    assert len(read_paths([misnamed]).requests) == expected


def test_source_names_drop_the_compression_suffix(tmp_path: Path) -> None:
    """``trace.json.xz`` is the source ``trace``, as ``trace.json`` is."""
    assert input_stem(Path("a/trace_0001.json.xz")) == "trace_0001"
    assert input_stem(Path("requests.jsonl.gz")) == "requests"
    assert input_stem(Path("requests.jsonl")) == "requests"
    packed = compressed_copy(FIXTURES / "kvcache.json", tmp_path, ".xz")
    assert {r.source for r in read_paths([packed]).requests} == {"kvcache"}


@pytest.mark.parametrize(
    ("name", "taken"),
    [
        ("requests.jsonl", True),
        ("requests.jsonl.1", True),
        ("requests.jsonl.2.gz", True),
        ("trace_0001.json.xz", True),
        ("proxy.log", True),
        ("events.ndjson", True),
        ("README.md", False),
        ("LICENSE", False),
        ("report.html", False),
        ("notes.txt.gz", False),
        (".requests.jsonl", False),
    ],
)
def test_which_names_a_directory_contributes(name: str, taken: bool) -> None:
    """Log and trace files (rotated, compressed) count; READMEs, licenses, hidden files do not."""
    assert is_input_name(name) is taken


def test_a_directory_stands_for_every_input_file_below_it(tmp_path: Path) -> None:
    """Files in name order, sub-folders included, others and hidden ones left out, none twice."""
    logs = tmp_path / "logs"
    (logs / "old").mkdir(parents=True)
    (logs / ".cache").mkdir()
    records = (FIXTURES / "records.jsonl").read_bytes()
    (logs / "requests.jsonl").write_bytes(records)
    (logs / "requests.jsonl.1").write_bytes(records)
    (logs / "requests.jsonl.2.gz").write_bytes(gzip.compress(records))
    (logs / "old" / "trace.jsonl.xz").write_bytes(
        lzma.compress((FIXTURES / "mooncake.jsonl").read_bytes())
    )
    (logs / "README.md").write_text("# logs\n")
    (logs / ".cache" / "x.jsonl").write_bytes(records)
    found = input_files([logs, logs / "requests.jsonl"])
    assert [p.relative_to(logs).as_posix() for p in found] == [
        "old/trace.jsonl.xz",
        "requests.jsonl",
        "requests.jsonl.1",
        "requests.jsonl.2.gz",
    ]
    assert rows(read_paths([logs])) == rows(read_paths(found))
    assert list(read_paths([logs]).formats) == [str(p) for p in found]


def test_progress_counts_the_bytes_on_disk(tmp_path: Path) -> None:
    """The progress callback adds up to the files' sizes, compressed or not (the bar's total)."""
    plain = FIXTURES / "mooncake.jsonl"
    packed = compressed_copy(FIXTURES / "records.jsonl", tmp_path, ".gz")
    told: list[int] = []
    read_paths([plain, packed], progress=told.append)
    assert sum(told) == plain.stat().st_size + packed.stat().st_size


def test_output_lengths_are_read_back_from_compressed_traces(tmp_path: Path) -> None:
    """The simulator's second pass over outputs reads compressed files and directories too."""
    compressed_copy(FIXTURES / "mooncake.jsonl", tmp_path, ".xz")
    compressed_copy(FIXTURES / "kvcache.json", tmp_path, ".gz")
    trace = read_paths([tmp_path])
    assert output_tokens([tmp_path], trace) == [1.0, 5.0, 5.0, 5.0, 1.0, 5.0]  # by time, name order


def test_analyze_command_reads_a_directory(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """``prefixgate analyze logs/`` reports on every file in it, plain and compressed."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "requests.jsonl").write_bytes((FIXTURES / "records.jsonl").read_bytes())
    compressed_copy(FIXTURES / "records.jsonl", logs, ".gz")
    one = len(read_paths([FIXTURES / "records.jsonl"]).requests)
    assert prefixgate_main(["analyze", str(logs), "--json"]) == 0
    doc = orjson.loads(capsysbinary.readouterr().out)
    assert doc["requests"] == 2 * one


def test_analyze_command_refuses_a_directory_without_inputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A directory holding no log or trace file prints one line and exits 2."""
    (tmp_path / "README.md").write_text("nothing here\n")
    assert analyze_main([str(tmp_path)]) == 2
    assert "no input files in" in capsys.readouterr().err


def test_simulate_command_reads_a_compressed_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``prefixgate simulate DIR`` replays the compressed traces in it."""
    compressed_copy(FIXTURES / "mooncake.jsonl", tmp_path, ".xz")
    args = ["simulate", str(tmp_path), "--replicas", "2", "--capacity-blocks", "100", "--json"]
    assert prefixgate_main(args) == 0
    doc = orjson.loads(capsys.readouterr().out.splitlines()[0])
    assert doc["requests"] == 4


def test_quality_reads_compressed_request_files(tmp_path: Path) -> None:
    """``prefixgate quality`` takes the same gzip, xz and directory inputs as the analyzer."""
    compressed_copy(FIXTURES / "bodies.jsonl", tmp_path, ".gz")
    plain = list(read_requests([str(FIXTURES / "bodies.jsonl")]))
    assert plain and list(read_requests([str(tmp_path)])) == plain


def test_shipped_traces_are_the_published_files() -> None:
    """The bundled Mooncake traces decompress to the published bytes; every folder carries its
    license and source note, and only compressed traces besides them."""
    note = (TRACES / "mooncake" / "README.md").read_text()
    for name in ("conversation_trace.jsonl", "synthetic_trace.jsonl"):
        digest = hashlib.sha256(read_input(TRACES / "mooncake" / f"{name}.xz")).hexdigest()
        assert re.search(rf"`{name}`: `{digest}`", note)
    for folder in ("mooncake", "claude-code"):
        files = {p.name for p in (TRACES / folder).iterdir()}
        assert {"LICENSE", "README.md"} <= files
        assert "Apache License" in (TRACES / folder / "LICENSE").read_text()
        assert all(n.endswith(".xz") for n in files - {"LICENSE", "README.md"})
    assert len(input_files([TRACES / "claude-code"])) == 60
