"""The benchmark harnesses still run end to end and write their JSON (numbers not asserted).

``make bench`` takes about ten minutes; these run the same scripts with ``--quick`` for a few
seconds each: the overhead harness against direct, nginx and prefixgate (embedded and Redis:
hence the ``redis`` marker; nginx comes from apt like redis-server), then the plots; and one tiny
cache-gains workload against the real llama-server (``real``). LiteLLM is not installed in CI
and is not part of the smoke run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SMOKE_TARGETS = ("direct", "nginx", "aiohttp-relay", "prefixgate", "prefixgate-redis")


def run_script(*args: str, timeout_s: float) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def load(path: Path) -> dict[str, Any]:
    assert path.exists(), f"{path.name} was not written"
    report: dict[str, Any] = orjson.loads(path.read_bytes())
    return report


@pytest.mark.redis
@pytest.mark.timeout(420)
def test_overhead_harness_quick_run_writes_results_and_plots(tmp_path: Path) -> None:
    run_script(
        str(BENCH / "bench_overhead.py"),
        "--quick",
        "--targets",
        ",".join(SMOKE_TARGETS),
        "--out",
        str(tmp_path),
        timeout_s=400,
    )
    report = load(tmp_path / "overhead.json")
    assert list(report["results"]) == list(SMOKE_TARGETS)
    for name, result in report["results"].items():
        for phase in ("c1_8k", "c1_512k", "c64", "c256", "open"):
            summary = result["phases"][phase]
            assert summary["ok"] > 0, (name, phase, summary["errors"])
            assert summary["ttft_ms"]["p50"] is not None
            if name != "direct":
                assert summary["rss_mb"] > 0
    for name in ("prefixgate", "prefixgate-redis"):
        overhead = report["results"][name]["phases"]["c1_8k"]["proxy_overhead_ms"]
        assert overhead["records"] > 0 and overhead["p50"] is not None
        checks = {c["target"]: c for c in report["targets"][name]}
        assert set(checks) >= {
            "1 stream: added TTFT p50 <= 1 ms",
            "64 streams: requests/s >= 80 % of nginx",
            "1 stream: added TTFT p50 <= the relay's + 0.3 ms",
            "64 streams: requests/s >= 0.9 x the relay's",
            "proxy_overhead_ms p50 <= 3 ms at 512 KB",
            "512 KB: added TTFT p50 <= the relay's + 3 ms",
        }
        assert all(c["pass"] is not None for c in checks.values())  # (every figure measured)
    assert report["comparison"]["nginx"]["c1_8k.added_ttft_ms.p50"] is not None

    run_script(str(BENCH / "plots.py"), "--results", str(tmp_path), timeout_s=120)
    for png in ("overhead_latency.png", "overhead_throughput.png", "overhead_rss.png"):
        assert (tmp_path / png).stat().st_size > 1000


@pytest.mark.real
@pytest.mark.timeout(420)
def test_cache_harness_quick_run_against_real_llama_server(tmp_path: Path) -> None:
    run_script(
        str(BENCH / "bench_cache.py"),
        "--quick",
        "--workloads",
        "shared_system",
        "--out",
        str(tmp_path),
        timeout_s=400,
    )
    report = load(tmp_path / "cache.json")
    runs = report["workloads"]["shared_system"]
    assert set(runs) == {"direct", "prefixgate"}
    for summary in runs.values():
        assert summary["ok"] == summary["requests"] > 0
        assert summary["prompt_tokens"] > 0
        assert summary["cached_share"] is not None
    misses = runs["prefixgate"]["miss_attribution"]  # every record's uncached tokens by cause
    assert misses["requests"] == runs["prefixgate"]["requests"]
    assert sum(misses["tokens"].values()) == misses["uncached_tokens"] > 0


@pytest.mark.real
@pytest.mark.timeout(900)
def test_control_harness_quick_run_against_real_llama_servers(tmp_path: Path) -> None:
    """bench_control.py --quick: three runs in lockstep, both groups and the lift reported."""
    run_script(str(BENCH / "bench_control.py"), "--quick", "--out", str(tmp_path), timeout_s=880)
    report = load(tmp_path / "control.json")
    assert set(report["groups"]) == {
        "mixed/treated",
        "mixed/control",
        "treated/treated",
        "plain/control",
    }
    assert report["workload"]["requests"] == 8
    for figures in report["groups"].values():
        assert figures["requests"] > 0 and figures["prompt_tokens"] > 0
    assert set(report["lift"]) == {"cached_share", "ttft_p50_ms", "ttft_p90_ms", "goodput_share"}
    assert report["proxy_stats"] is not None  # the mixed run's own /stats block


def test_stream_inspection_bench_runs_beside_another_tree(tmp_path: Path) -> None:
    """``bench_stream_inspect.py`` (in-process: seconds), with ``--against`` a copy of this
    tree's ``proxy`` package; a directory without one is refused, not measured as this tree."""
    other = tmp_path / "other"
    shutil.copytree(ROOT / "proxy", other / "proxy")
    args = ("bench/bench_stream_inspect.py", "--tokens", "40", "--repeat", "1")
    out = run_script(*args, "--against", str(other), timeout_s=120)
    for word in ("chat", "native", "Responses", "Messages", "clock", "ratio"):
        assert word in out
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = subprocess.run(
        [sys.executable, *args, "--against", str(empty)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0 and "not it" in proc.stderr
