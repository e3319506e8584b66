"""The proxy's memory under a steady load of distinct prompts: RSS every few seconds.

Starts the fast fake backend and ``prefixgate serve`` (its defaults, or ``--extra`` flags), then
offers the overhead benchmark's closed-loop load (``--concurrency`` streams of distinct
``--prompt-bytes`` prompts sharing a short system prompt) for ``--seconds``, printing the
proxy's resident memory every ``--every`` seconds. What grows with the traffic rather than with
time shows here within a minute: the soak (``bench/soak.py``) runs a lower rate of shorter
prompts, under faults.

``--redis`` puts a throw-away redis-server behind the proxy and says at the end how often the
store's breaker opened (``store_degraded`` lines) and how many of the requests the traffic
counts in Redis saw (what reached Redis of the proxy's writes). ``--command`` runs another
installation's ``prefixgate`` (a path), to compare two.

Run: ``python bench/rss_under_load.py [--seconds 90] [--concurrency 64] [--redis]
[--extra "FLAGS"] [--command PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen
import procs
from bench_overhead import salted_bodies

_DEGRADED = '"event":"store_degraded"'


def traffic_requests(redis_url: str) -> int:
    """Requests the traffic buckets in Redis counted, summed over every bucket and tenant."""
    client = redis.Redis.from_url(redis_url)
    try:
        return sum(int(client.hget(key, "n") or 0) for key in client.scan_iter("*:tc:*"))
    finally:
        client.close()


def rss_mib(proxy: procs.Proc) -> float:
    """Resident memory of the proxy's process tree, MiB (0 once it has gone)."""
    return proxy.rss_kb() / 1024.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-bytes", type=int, default=8192)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between readings")
    parser.add_argument("--extra", default="", help="more `prefixgate serve` flags")
    parser.add_argument("--redis", action="store_true", help="a redis-server behind the proxy")
    parser.add_argument("--command", default="", help="another installation's prefixgate")
    args = parser.parse_args(argv)
    bodies = salted_bodies(args.prompt_bytes, 16)
    with tempfile.TemporaryDirectory(prefix="pg-rss-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        fake = stack.enter_context(procs.start_fake(workdir))
        redis_url = stack.enter_context(procs.start_redis(workdir)).url if args.redis else None
        proxy = stack.enter_context(
            procs.start_prefixgate(
                workdir,
                fake.url,
                redis_url=redis_url,
                extra=shlex.split(args.extra),
                command=[args.command] if args.command else None,
            )
        )
        done = threading.Event()

        def watch() -> None:
            t0 = time.monotonic()
            while True:
                rss = rss_mib(proxy)
                print(f"{time.monotonic() - t0:6.0f} s  RSS {rss:7.1f} MiB", flush=True)
                if done.wait(args.every):
                    return

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        results, _ = asyncio.run(
            loadgen.closed_loop(
                proxy.url + loadgen.CHAT_PATH,
                bodies,
                concurrency=args.concurrency,
                duration_s=args.seconds,
            )
        )
        done.set()
        watcher.join()
        errors = sum(1 for r in results if r.error is not None)
        end = rss_mib(proxy)
        print(f"{len(results)} requests, {errors} errors, RSS at the end {end:.1f} MiB")
        if redis_url is not None:
            time.sleep(0.5)  # the writes still queued land
            log = proxy.extra_files["records"].read_text(errors="replace")
            counted = traffic_requests(redis_url)
            opened = Counter(
                f"{line['op']} {line['error']}"
                for line in map(json.loads, (x for x in log.splitlines() if _DEGRADED in x))
            )
            print(
                f"store breaker opened {opened.total()} times; "
                f"the traffic counts in Redis saw {counted} of {len(results)} requests"
            )
            if opened:
                print("  opened by: " + ", ".join(f"{k} x{n}" for k, n in opened.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
