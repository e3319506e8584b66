"""Routing policies on public traces, and what the routing lookup costs on the critical path.

Run: ``python bench/bench_routing.py [--replicas 4 16] [--skip-lookup] [--redis-url URL]``.

1. **Fleet simulation** (``analyzers.simulate``, the proxy's own ``Router``): the Mooncake
   conversation and synthetic traces and the 60 Claude Code sessions under
   ``tests/data/traces``, for each fleet size, with round-robin, least-loaded, prefix-affinity
   and the pooled bound (one LRU of the whole capacity). Capacities are the fleet's total, split
   evenly: 20,000 blocks of 512 tokens for the conversation trace (its footprint is ~183,000),
   10,000 for synthetic (~44,000) and 5,000 for Claude Code (~20,000), so that every trace is
   capacity-bound. Default load model (20,000 prefill tokens/s per replica, 20 ms per output
   token). Prints a Markdown table: token-weighted hit rate, share of pooled, imbalance
   (max / mean requests per replica), uncached prefill tokens, TTFT p50 / p99.
2. **Lookup cost**: ``lookup`` (index match + loads + traffic counts, one pipelined round trip)
   against ``longest_match`` alone, embedded and Redis (a throw-away ``redis-server`` unless
   ``--redis-url``), 4 and 16 replicas, 8 KB and 128 KB chat prompts; median / p99 in µs.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analyzers.quantile import percentile
from analyzers.readers import read_paths
from analyzers.simulate import POOLED, FleetResult, output_tokens, run_policies
from proxy.fingerprint import fingerprint
from proxy.routing import POLICIES
from proxy.store import EmbeddedStore, PrefixStore, RedisStore, StoreOptions, StoreTimeouts
from tests.ports import free_port

TRACES = Path(__file__).resolve().parents[1] / "tests" / "data" / "traces"  # xz, as published
BLOCK_TOKENS = 512
ROUTE = "/v1/chat/completions"


def traces() -> list[tuple[str, list[Path], int]]:
    """(name, files, fleet capacity in 512-token blocks) per trace."""
    mooncake = TRACES / "mooncake"
    return [
        ("Mooncake conversation", [mooncake / "conversation_trace.jsonl.xz"], 20_000),
        ("Mooncake synthetic", [mooncake / "synthetic_trace.jsonl.xz"], 10_000),
        ("Claude Code (60 sessions)", sorted((TRACES / "claude-code").glob("*.json.xz")), 5_000),
    ]


def simulation_table(replica_counts: Sequence[int]) -> list[str]:
    lines = [
        "| trace | replicas | policy | hit rate | of pooled | imbalance | prefill tokens "
        "| TTFT p50 | TTFT p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, paths, blocks in traces():
        started = time.perf_counter()
        trace = read_paths(paths)
        outputs = output_tokens(paths, trace)
        for replicas in replica_counts:
            results = run_policies(
                trace,
                [*POLICIES, POOLED],
                replicas=replicas,
                capacity_tokens=float(blocks * BLOCK_TOKENS),
                outputs=outputs,
            )
            pooled = results[-1].hit_rate
            for r in results:
                lines.append(_row(f"{name}, {blocks:,} blocks", replicas, r, pooled))
        print(f"{name}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return lines


def _row(name: str, replicas: int, r: FleetResult, pooled: float) -> str:
    share = f"{r.hit_rate / pooled:.0%}" if pooled else "-"
    imbalance = "-" if r.imbalance is None else f"{r.imbalance:.2f}"
    p50 = "-" if r.ttft_p50_s is None else f"{r.ttft_p50_s:.2f} s"
    p99 = "-" if r.ttft_p99_s is None else f"{r.ttft_p99_s:.1f} s"
    return (
        f"| {name} | {replicas} | {r.policy} | {r.hit_rate:.1%} | {share} | {imbalance} "
        f"| {r.prefill_tokens / 1e6:,.1f} M | {p50} | {p99} |"
    )


# -- lookup cost ----------------------------------------------------------------------------------


def chat_body(size: int) -> dict[str, Any]:
    """A chat request whose rendered text is about ``size`` bytes."""
    text = "the quick brown fox jumps over the lazy dog. " * (size // 45 + 1)
    return {"model": "m", "messages": [{"role": "user", "content": text[:size]}]}


async def timed(call: Callable[[], Awaitable[Any]], repeat: int) -> str:
    for _ in range(min(20, repeat)):
        await call()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await call()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    p99 = percentile(times, 0.99) or 0.0
    return f"{statistics.median(times):,.0f} / {p99:,.0f}"


async def lookup_table(redis_url: str, repeat: int) -> list[str]:
    generous = StoreOptions(timeouts=StoreTimeouts(lookup_s=1.0, write_s=1.0))
    stores: dict[str, PrefixStore] = {
        "embedded": EmbeddedStore(generous),
        "Redis": RedisStore.from_url(redis_url, generous),
    }
    lines = [
        "| store | replicas | prompt (hashes) | longest_match | lookup (+ loads, traffic) |",
        "|---|---|---|---|---|",
    ]
    try:
        redis_store = stores["Redis"]
        assert isinstance(redis_store, RedisStore)
        await redis_store.client.flushdb()
        for name, store in stores.items():
            for replicas in (4, 16):
                urls = [f"http://10.0.0.{i}:8080" for i in range(replicas)]
                for size in (8 << 10, 128 << 10):
                    hashes = fingerprint(ROUTE, chat_body(size)).block_hashes
                    ns = f"bench-{replicas}-{size}"
                    for i, url in enumerate(urls):
                        await store.record_prefix(ns, url, hashes[: i + 1], 1 << 20)
                        await store.add_in_flight(ns, url, 1)
                    for _ in range(50):
                        await store.observe_traffic(ns, hashes)
                    got = await store.lookup(ns, urls, hashes)
                    assert got.available and got.window_requests == 50, name
                    assert got.matched == {u: i + 1 for i, u in enumerate(urls)}, name
                    old = await timed(partial(store.longest_match, ns, urls, hashes), repeat)
                    new = await timed(partial(store.lookup, ns, urls, hashes), repeat)
                    lines.append(
                        f"| {name} | {replicas} | {size >> 10} KB ({len(hashes)}) | {old} | {new} |"
                    )
        assert not redis_store.degraded, "Redis failed during the run"
    finally:
        for store in stores.values():
            await store.aclose()
    return lines


def run_lookup(redis_url: str | None, repeat: int) -> list[str]:
    proc = None
    if redis_url is None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found: install it or pass --redis-url")
        port = free_port()
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        proc = subprocess.Popen(
            [*cmd, "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        redis_url = f"redis://127.0.0.1:{port}/0"
        time.sleep(0.3)
    try:
        return asyncio.run(lookup_table(redis_url, repeat))
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--skip-simulation", action="store_true")
    parser.add_argument("--skip-lookup", action="store_true")
    parser.add_argument("--repeat", type=int, default=400, help="timed lookups per cell")
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    args = parser.parse_args(argv)
    if not args.skip_simulation:
        print("\n".join(simulation_table(args.replicas)))
    if not args.skip_lookup:
        print()
        print("\n".join(run_lookup(args.redis_url, args.repeat)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
