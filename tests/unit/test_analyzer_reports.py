"""Analyzer outputs: the JSON document, the HTML page, the terminal report and the CLI."""

from __future__ import annotations

import argparse
import io
import re
import sys
from pathlib import Path

import orjson
import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).parents[1] / "data" / "analyzer"))

import planted  # the known-answer input builders

from analyzers import analyze
from analyzers.cli import add_analyze_parser, main, run_analyze
from analyzers.html import render_html
from analyzers.report import print_report

FIXTURES = Path(__file__).parents[1] / "data" / "analyzer"
REQUIRED_KEYS = {
    "requests",
    "prompt_tokens",
    "ideal_hit_rate",
    "ideal_request_hit_rate",
    "measured_hit_rate",
    "capacity_curve",
    "breakers",
}


@pytest.fixture
def traffic_log(tmp_path: Path) -> Path:
    path = tmp_path / "traffic.jsonl"
    planted.write_jsonl(path, planted.traffic(8, 4, with_body=True))
    return path


def test_json_document_keys_and_values(traffic_log: Path) -> None:
    """The JSON carries the contract keys with the measured and ideal figures."""
    doc = orjson.loads(orjson.dumps(analyze([traffic_log]).to_json()))
    assert set(doc) >= REQUIRED_KEYS
    assert doc["requests"] == 32
    assert 0 < doc["measured_hit_rate"] < doc["ideal_hit_rate"] < 1
    assert doc["hit_rate_gap"] == pytest.approx(
        doc["ideal_hit_rate_where_measured"] - doc["measured_hit_rate"]
    )
    assert all(set(p) >= {"capacity_tokens", "hit_rate"} for p in doc["capacity_curve"])
    assert doc["breakers"][0]["rule"] == "volatile_timestamps"
    assert doc["goodput"]["slo_requests"] == 32
    assert doc["goodput"]["ttft_ms"]["hit"]["p50"] < doc["goodput"]["ttft_ms"]["miss"]["p50"]


def test_measured_is_null_without_reports() -> None:
    """Traces without cached_tokens report measured_hit_rate as null, not zero."""
    doc = analyze([FIXTURES / "mooncake.jsonl"]).to_json()
    assert doc["measured_hit_rate"] is None
    assert doc["breakers"] == []


def test_html_is_self_contained(traffic_log: Path) -> None:
    """The HTML page has the three plots and loads nothing from the network."""
    page = render_html(analyze([traffic_log]))
    assert page.startswith("<!doctype html>")
    assert page.count("<svg") == 3
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<(script|link|img|iframe)\b", page)
    assert "volatile_timestamps" in page


def test_html_escapes_input_text(tmp_path: Path) -> None:
    """Prompt text in examples is escaped, never interpreted as markup."""
    bodies = [
        planted.chat(f"<b>Run {i}</b> at 2025-01-0{i + 1} 10:00\n" + planted.POLICY, "q")
        for i in range(3)
    ]
    path = tmp_path / "x.jsonl"
    planted.write_jsonl(
        path, [planted.record(b, at=i, with_body=True) for i, b in enumerate(bodies)]
    )
    page = render_html(analyze([path]))
    assert "<b>Run" not in page and "&lt;b&gt;Run" in page


def test_terminal_report_renders(traffic_log: Path) -> None:
    """The rich report prints every section without markup errors."""
    out = io.StringIO()
    print_report(analyze([traffic_log]), Console(file=out, width=140))
    text = out.getvalue()
    for heading in ("prefix cache report", "Capacity curve", "Shared prefixes", "Cache breakers"):
        assert heading in text
    assert "volatile_timestamps" in text


def test_cli_json_and_html(
    traffic_log: Path, tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """`python -m analyzers --json --html` prints the document and writes the page."""
    html = tmp_path / "report.html"
    assert main([str(traffic_log), "--json", "--html", str(html), "--top", "3"]) == 0
    doc = orjson.loads(capsysbinary.readouterr().out)
    assert doc["requests"] == 32 and len(doc["capacity_curve"]) >= 8
    assert html.read_text().startswith("<!doctype html>")


def test_cli_missing_file_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing input prints one line on stderr and exits non-zero."""
    assert main([str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_subcommand_registration(traffic_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """add_analyze_parser wires `analyze` into a parent parser with run_analyze as func."""
    parser = argparse.ArgumentParser(prog="prefixgate")
    add_analyze_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["analyze", str(traffic_log), "--capacity", "1000", "--capacity", "5000"]
    )
    assert args.func is run_analyze
    assert args.func(args) == 0
    assert "Capacity curve" in capsys.readouterr().out
