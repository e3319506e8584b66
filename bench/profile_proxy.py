"""Where prefixgate's CPU goes under the overhead benchmark's load: a py-spy profile.

Starts the fake backend and ``prefixgate serve`` (``--redis`` adds a redis-server), warms it up,
then offers closed-loop load (``--concurrency``, ``--seconds``, 8 KB prompts) while ``py-spy
record`` samples the proxy process. Writes the raw collapsed stacks (``--out``, flamegraph
input) and prints the functions with the most samples, by self and inclusive time.

py-spy is not a project dependency; install it anywhere (``python3 -m venv /tmp/prof &&
/tmp/prof/bin/pip install py-spy``) and pass ``--py-spy /tmp/prof/bin/py-spy``.

Run: ``python bench/profile_proxy.py --py-spy PATH [--concurrency 64] [--seconds 10]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen
import procs
from bench_overhead import salted_bodies


def top_functions(raw: Path, limit: int) -> str:
    """A table of the hottest functions from py-spy's raw (collapsed) output."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        total += count
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    lines = [f"{total} samples (the proxy's busy time)", "-- self"]
    lines += [f"{100 * n / total:5.1f}%  {f}" for f, n in own.most_common(limit)]
    lines.append("-- inclusive (project code)")
    ours = [(f, n) for f, n in inclusive.most_common() if "(proxy/" in f]
    lines += [f"{100 * n / total:5.1f}%  {f}" for f, n in ours[:limit]]
    return "\n".join(lines)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process has used so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--prompt-bytes", type=int, default=8192)
    parser.add_argument("--redis", action="store_true", help="prefixgate with a Redis store")
    parser.add_argument("--fake-slots", type=int, default=8, help="slots the fake reports")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument(
        "--cpu-only",
        action="store_true",
        help="no profile: the proxy's CPU time per request under the same load",
    )
    parser.add_argument("--extra", default="", help="more `prefixgate serve` flags")
    parser.add_argument("--out", default=str(procs.BENCH / "results" / "profile.txt"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bodies = salted_bodies(args.prompt_bytes, 16)
    with tempfile.TemporaryDirectory(prefix="pg-prof-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        fake = stack.enter_context(procs.start_fake(workdir, slots=args.fake_slots))
        redis_url = stack.enter_context(procs.start_redis(workdir)).url if args.redis else None
        proxy = stack.enter_context(
            procs.start_prefixgate(workdir, fake.url, redis_url=redis_url, extra=args.extra.split())
        )
        url = proxy.url + loadgen.CHAT_PATH
        asyncio.run(loadgen.closed_loop(url, bodies, concurrency=8, requests=64))
        if args.cpu_only:
            cpu0 = cpu_seconds(proxy.popen.pid)
            results, window = asyncio.run(
                loadgen.closed_loop(
                    url, bodies, concurrency=args.concurrency, duration_s=args.seconds
                )
            )
            cpu = cpu_seconds(proxy.popen.pid) - cpu0
            summary = loadgen.summarize(results, window, loadgen.Slo())
            print(
                f"{args.concurrency} streams: {summary['rps']} req/s, TTFT p50 "
                f"{summary['ttft_ms']['p50']} ms, proxy CPU {1000 * cpu / len(results):.3f} "
                f"ms/request ({cpu / args.seconds:.2f} cores), errors {summary['errors']}"
            )
            return 0
        spy = subprocess.Popen(
            [
                args.py_spy,
                "record",
                "-p",
                str(proxy.popen.pid),
                "-o",
                str(out),
                "--format",
                "raw",
                "-r",
                str(args.rate),
                "-d",
                str(int(args.seconds) + 1),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(0.5)  # py-spy attaches
        results, window = asyncio.run(
            loadgen.closed_loop(url, bodies, concurrency=args.concurrency, duration_s=args.seconds)
        )
        _, err = spy.communicate(timeout=60)
        summary = loadgen.summarize(results, window, loadgen.Slo())
    print(
        f"{args.concurrency} streams: {summary['rps']} req/s, TTFT p50 "
        f"{summary['ttft_ms']['p50']} ms, errors {summary['errors']}"
    )
    if spy.returncode != 0 or not out.exists():
        print(f"py-spy failed ({spy.returncode}): {err.decode(errors='replace')[-500:]}")
        return 1
    print(top_functions(out, args.top))
    print(f"raw stacks in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
