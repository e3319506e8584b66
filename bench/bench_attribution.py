"""What miss attribution costs per request, in the record's builder (after the response).

Run: ``python bench/bench_attribution.py [--repeat N]``. For chat prompts of 8 KB and 128 KB
(``bench_fingerprint.chat_body``) with a clock in the system prompt, canonicalized as the proxy
does, looked up in an embedded index holding an earlier turn on two replicas: the median time
of ``MissAttributor.attribute`` with the canonicalizer on, and in global dry-run (where it
fingerprints the would-be prompt and keeps a dry-run index), beside ``fingerprint`` alone.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_fingerprint import chat_body
from rich.console import Console
from rich.table import Table

from proxy.attribution import MissAttributor
from proxy.canonical import Canonicalizer
from proxy.canonical.config import CanonicalConfig
from proxy.exchange import Exchange, Target
from proxy.fingerprint import fingerprint
from proxy.prefixes import PrefixTracker
from proxy.records import Observation, RequestRecord
from proxy.store import EmbeddedStore

ROUTE = "/v1/chat/completions"
REPLICAS = ["http://a:1", "http://b:1"]


def clocked(size: int, second: int) -> dict[str, Any]:
    body = copy.deepcopy(chat_body(size))
    system = body["messages"][0]
    system["content"] = f"Current time: 2026-12-02T01:02:{second:02d}Z. " + system["content"]
    return body


def median_us(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


async def case(size: int, dry_run: bool, repeat: int) -> tuple[float, float]:
    canon = Canonicalizer(CanonicalConfig(dry_run=dry_run))
    tracker = PrefixTracker(EmbeddedStore(), block_bytes=256)
    misses = MissAttributor(dry_run=dry_run, healthy=lambda url: True)
    earlier = canon.apply(ROUTE, clocked(size, 1))
    view = await tracker.lookup(ROUTE, earlier.body, REPLICAS)
    await tracker.store.record_prefix("default", REPLICAS[0], view.fp.block_hashes, 1 << 20)
    body = clocked(size, 2)
    result = canon.apply(ROUTE, body)
    view = await tracker.lookup(ROUTE, result.body, REPLICAS)
    replica: Any = SimpleNamespace(url=REPLICAS[1])  # only its URL is read
    ex = Exchange(request_id="r", route=ROUTE, upstream_path=ROUTE, obs=Observation(t_start=0))
    ex.canonical, ex.view, ex.body = result, view, result.body
    ex.target = Target(replica=replica, reason="round_robin", load=0.0)
    record = RequestRecord(
        ts="t", request_id="r", route=ROUTE, model="m", backend=REPLICAS[1], stream=False,
        status=200, prompt_tokens=view.fp.total_bytes // 4, cached_tokens=10,
    )  # fmt: skip
    result.stable_bytes_gained  # noqa: B018  # measured for the record anyway, not timed here
    attribute = median_us(lambda: misses.attribute(ex, record, 0.25), repeat)
    fp = median_us(lambda: fingerprint(ROUTE, result.body, block_bytes=256), repeat)
    return attribute, fp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    table = Table(title="Miss attribution per request (median, µs)")
    for col in ("prompt", "canonicalizer", "attribute", "fingerprint alone"):
        table.add_column(col, justify="right")
    for size in (8 << 10, 128 << 10):
        for dry in (False, True):
            attribute, fp = asyncio.run(case(size, dry, args.repeat))
            table.add_row(
                f"{size >> 10} KB", "dry-run" if dry else "on", f"{attribute:.1f}", f"{fp:.1f}"
            )
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
