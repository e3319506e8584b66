"""The soak harness, run short: it keeps working, and a short run loses no request."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.processes import REPO

pytestmark = pytest.mark.redis


def test_short_soak_loses_nothing(tmp_path: Path) -> None:
    """25 s of mixed load with a fault every 4 s (each kind at least once): no request lost,
    nothing answered wrongly, the proxy alive at the end."""
    out = tmp_path / "soak.json"
    argv = [sys.executable, str(REPO / "bench" / "soak.py"), "--duration", "25s"]
    argv += ["--fault-every", "4s", "--concurrency", "6", "--json", str(out)]
    run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert out.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["lost"] == 0, report["lost_examples"]
    assert report["wrong"] == []
    assert report["proxy_alive"]
    assert report["requests"] > 300
    assert set(report["faults_injected"]) >= {"kill_backend_0", "kill_redis", "stall_streams"}
    assert report["errors_outside_fault_windows"] == {}
