"""Time the prefix lookup on the critical path: ``longest_match`` for four replicas.

Run: ``python bench/bench_store.py [--repeat N] [--redis-url URL] [--redis-cluster-url URL |
--no-cluster]``. Without ``--redis-url`` it starts a throw-away ``redis-server`` on a free port,
and without ``--redis-cluster-url`` a throw-away three-node Redis Cluster. Prompts of 8 KB,
128 KB and 512 KB at 256-byte blocks are 32, 512 and 2,048 chained hashes; the four replicas
hold 100 %, 50 %, 10 % and 0 % of the chain. Rows, in microseconds (median and p99):

* ``embedded``: the in-process store (no I/O).
* ``redis``: the Redis store (one pipelined round trip running the lookup script per replica).
* ``redis-cluster``: the same store on a three-node Redis Cluster (the tenant's index and the
  fleet's loads may sit on two nodes: one round trip to each, in parallel).
* ``redis ZMSCORE``: for comparison, the plain alternative: one ``ZMSCORE`` of every hash per
  replica in one pipeline, leading run counted in Python.
* ``fingerprint + lookup``: ``proxy.fingerprint.fingerprint`` of a chat body of that size plus the
  store lookup, the part of the critical path this room owns (budget: < 1 ms at 8 KB).

It also times the background calls, ``record_prefix`` and ``add_stats``, once per store.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from analyzers.quantile import percentile
from proxy.fingerprint import fingerprint
from proxy.store import (
    EmbeddedStore,
    PrefixStore,
    RedisStore,
    StatsSample,
    StoreOptions,
    StoreTimeouts,
)
from proxy.store.redis_scripts import pack_chain
from tests.ports import free_port
from tests.store.cluster_process import RedisClusterServer

SIZES = (8 << 10, 128 << 10, 512 << 10)
REPLICAS = [f"http://10.0.0.{i}:8080" for i in range(1, 5)]
HELD = (1.0, 0.5, 0.1, 0.0)
ROUTE = "/v1/chat/completions"
DEADLINE_US = StoreTimeouts().lookup_s * 1e6


def chat_body(size: int) -> dict[str, Any]:
    """A chat request whose rendered text is about ``size`` bytes."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse. " * 20}]
    total, turn = 0, 0
    while total < size:
        text = f"Turn {turn}: the quick brown fox jumps over the lazy dog. " * 36
        text = text[: max(1, size - total)]
        messages.append({"role": "user" if turn % 2 == 0 else "assistant", "content": text})
        total += len(text)
        turn += 1
    return {"model": "bench-model", "messages": messages}


def row(times: list[float], *, lookup: bool) -> tuple[str, str, str]:
    """Median, p99 and (for a lookup) the share over the default 5 ms deadline, formatted."""
    times = sorted(times)
    p99 = percentile(times, 0.99) or 0.0
    over = sum(t > DEADLINE_US for t in times) / len(times)
    return f"{statistics.median(times):,.0f}", f"{p99:,.0f}", f"{over:.1%}" if lookup else ""


async def timeit(
    call: Callable[[], Awaitable[Any]], repeat: int, *, lookup: bool = False
) -> tuple[str, str, str]:
    """Time ``call`` ``repeat`` times (µs) after a short warm-up."""
    for _ in range(min(20, repeat)):
        await call()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        await call()
        times.append((time.perf_counter() - t0) * 1e6)
    return row(times, lookup=lookup)


async def populate(store: PrefixStore, hashes: tuple[int, ...]) -> None:
    for replica, share in zip(REPLICAS, HELD, strict=True):
        held = hashes[: int(len(hashes) * share)]
        if held:
            await store.record_prefix("default", replica, held, 1 << 20)


async def zmscore_lookup(store: RedisStore, hashes: tuple[int, ...]) -> dict[str, int]:
    """The plain-command lookup the Lua script replaces."""
    chain = pack_chain(hashes)
    members = [chain[i : i + 8] for i in range(0, len(chain), 8)]
    pipe = store.client.pipeline(transaction=False)
    for replica in REPLICAS:
        # redis-py annotates members as str; bytes are sent as they are.
        pipe.zmscore(store.keys.index_key("default", replica), members)  # type: ignore[arg-type]
    out = {}
    for replica, scores in zip(REPLICAS, await pipe.execute(), strict=True):
        n = 0
        for score in scores:
            if score is None:
                break
            n += 1
        out[replica] = n
    return out


async def run(repeat: int, redis_url: str, cluster_url: str | None) -> Table:
    table = Table(title="longest_match, 4 replicas (µs)")
    for column in ("prompt", "hashes", "store", "median", "p99", "> 5 ms"):
        table.add_column(column, justify="right")
    # Deadlines far above the default so that the numbers are the real latency, not a
    # timeout's; the last column says how often the default 5 ms deadline would have cut in.
    generous = StoreOptions(timeouts=StoreTimeouts(lookup_s=1.0, write_s=1.0))
    stores: dict[str, PrefixStore] = {
        "embedded": EmbeddedStore(generous),
        "redis": RedisStore.from_url(redis_url, generous),
    }
    if cluster_url is not None:
        stores["redis-cluster"] = RedisStore.from_url(cluster_url, generous)
    redis_store = stores["redis"]
    assert isinstance(redis_store, RedisStore)
    await redis_store.client.flushdb()
    try:
        for size in SIZES:
            body = chat_body(size)
            hashes = fingerprint(ROUTE, body).block_hashes
            label = f"{size >> 10} KB"
            for name, store in stores.items():
                await populate(store, hashes)
                expected = {r: int(len(hashes) * s) for r, s in zip(REPLICAS, HELD, strict=True)}
                got = await store.longest_match("default", REPLICAS, hashes)
                assert got == expected, (name, got, expected)
                cells = await timeit(
                    partial(store.longest_match, "default", REPLICAS, hashes), repeat, lookup=True
                )
                table.add_row(label, str(len(hashes)), name, *cells)

                async def both(s: PrefixStore = store, b: dict[str, Any] = body) -> None:
                    fp = fingerprint(ROUTE, b)
                    await s.longest_match("default", REPLICAS, fp.block_hashes)

                cells = await timeit(both, repeat)
                table.add_row("", "", f"fingerprint + {name}", *cells)
            assert await zmscore_lookup(redis_store, hashes) == expected
            cells = await timeit(
                partial(zmscore_lookup, redis_store, hashes), repeat // 4, lookup=True
            )
            table.add_row("", "", "redis ZMSCORE", *cells)
            assert not any(isinstance(s, RedisStore) and s.degraded for s in stores.values()), (
                "Redis failed during the run"
            )
        table.add_section()
        hashes = fingerprint(ROUTE, chat_body(SIZES[1])).block_hashes
        sample = StatsSample(
            ts=time.time(),
            namespace="default",
            model="bench-model",
            backend=REPLICAS[0],
            status=200,
            error=False,
            prompt_tokens=30_000,
            cached_tokens=20_000,
            predicted_cached_tokens=21_000,
            ttft_ms=120.0,
            tpot_ms=20.0,
            e2e_ms=900.0,
            prefix_anchor="00ff00ff00ff00ff",
            canonical_rules=["json_keys"],
        )
        for name, store in stores.items():
            cells = await timeit(
                partial(store.record_prefix, "default", REPLICAS[0], hashes, 1 << 20), repeat
            )
            table.add_row("128 KB", str(len(hashes)), f"record_prefix {name}", *cells)
            cells = await timeit(partial(store.add_stats, sample), repeat)
            table.add_row("", "", f"add_stats {name}", *cells)
    finally:
        for store in stores.values():
            await store.aclose()
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=400)
    parser.add_argument("--redis-url", default=None, help="use this Redis instead of starting one")
    parser.add_argument(
        "--redis-cluster-url",
        default=None,
        help="use this Redis Cluster (redis+cluster://host:port) instead of starting one",
    )
    parser.add_argument(
        "--cluster",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the store on a Redis Cluster",
    )
    args = parser.parse_args(argv)
    proc = None
    url = args.redis_url
    if url is None:
        binary = shutil.which("redis-server")
        if binary is None:
            print("redis-server not found: install it or pass --redis-url", file=sys.stderr)
            return 1
        port = free_port()
        cmd = [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        time.sleep(0.3)
    cluster = None
    cluster_url = args.redis_cluster_url
    try:
        if args.cluster and cluster_url is None:
            cluster = RedisClusterServer()
            cluster.start()
            cluster_url = cluster.url
        table = asyncio.run(run(args.repeat, url, cluster_url if args.cluster else None))
    finally:
        if cluster is not None:
            cluster.stop()
        if proc is not None:
            proc.kill()
            proc.wait()
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
