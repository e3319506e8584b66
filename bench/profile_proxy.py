"""Where prefixgate's CPU goes under the overhead benchmark's load: a py-spy profile.

Starts the fake backend and ``prefixgate serve`` (``--redis`` adds a redis-server), warms it up,
then offers closed-loop load (``--concurrency``, ``--seconds``, 8 KB prompts) while ``py-spy
record`` samples the proxy process. Writes the raw collapsed stacks (``--out``, flamegraph
input) and prints the functions with the most samples, by self and inclusive time.

py-spy is not a project dependency; install it anywhere (``python3 -m venv /tmp/prof &&
/tmp/prof/bin/pip install py-spy``) and pass ``--py-spy /tmp/prof/bin/py-spy``.

``--cpu-only`` skips the profile and prints the proxy's CPU time per request instead;
``--target relay`` measures ``bench/bare_relay.py`` the same way (the floor of an aiohttp proxy).
``--against PATH`` runs this tree's prefixgate and another installation's side by side under
one load (``--against relay``: the bare relay beside it, the issue-21 CPU target read at once).
``--sizes 8192,65536,...`` prints a size-linearity table, one stream at a time: for each prompt
size, prefixgate and the relay alternately (a fresh process each), CPU per request, TTFT p50 and
prefixgate's ``proxy_overhead_ms`` p50 from its records.

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
from bench_overhead import proxy_overheads, salted_bodies


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
    ours = [(f, n) for f, n in inclusive.most_common() if "(proxy/" in f or "bare_relay" in f]
    lines += [f"{100 * n / total:5.1f}%  {f}" for f, n in ours[:limit]]
    return "\n".join(lines)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process has used so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_per_request(
    workdir: Path,
    backend_url: str,
    *,
    target: str,
    prompt_bytes: int,
    concurrency: int,
    seconds: float,
    extra: list[str],
) -> dict[str, float | None]:
    """One target started afresh, warmed up, then timed: CPU ms per request, TTFT p50, req/s,
    and (prefixgate) ``proxy_overhead_ms`` p50 of the timed requests."""
    bodies = salted_bodies(prompt_bytes, 16)
    with ExitStack() as stack:
        if target == "relay":
            proxy = stack.enter_context(procs.start_bare_relay(workdir, backend_url))
        else:
            proxy = stack.enter_context(procs.start_prefixgate(workdir, backend_url, extra=extra))
        url = proxy.url + loadgen.CHAT_PATH
        asyncio.run(loadgen.closed_loop(url, bodies, concurrency=min(concurrency, 8), requests=32))
        prefix = f"size{prompt_bytes}"
        cpu0 = cpu_seconds(proxy.popen.pid)
        results, window = asyncio.run(
            loadgen.closed_loop(
                url, bodies, concurrency=concurrency, duration_s=seconds, id_prefix=prefix
            )
        )
        cpu = cpu_seconds(proxy.popen.pid) - cpu0
        summary = loadgen.summarize(results, window, loadgen.Slo())
        overhead = proxy_overheads(proxy, prefix, len(results)) if target != "relay" else {}
    return {
        "cpu_ms": 1000 * cpu / max(len(results), 1),
        "ttft_p50": summary["ttft_ms"]["p50"],
        "rps": summary["rps"],
        "overhead_p50": overhead.get("p50"),
    }


def side_by_side(args: argparse.Namespace) -> int:
    """This tree's prefixgate and another installation's (``--against``) under the same load at
    the same time: each gets ``--concurrency`` streams from one load generator, in front of one
    fake backend, so whatever else the machine runs weighs on both alike."""
    bodies = salted_bodies(args.prompt_bytes, 16)
    with tempfile.TemporaryDirectory(prefix="pg-prof-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        fake = stack.enter_context(procs.start_fake(workdir, slots=args.fake_slots))
        extra = args.extra.split()
        proxies = {
            "this tree": stack.enter_context(
                procs.start_prefixgate(
                    workdir,
                    fake.url,
                    name="pg-this",
                    extra=extra,
                    command=[args.this] if args.this else None,
                )
            ),
            "against": stack.enter_context(
                procs.start_bare_relay(workdir, fake.url)
                if args.against == "relay"
                else procs.start_prefixgate(
                    workdir, fake.url, name="pg-against", extra=extra, command=[args.against]
                )
            ),
        }
        urls = {k: p.url + loadgen.CHAT_PATH for k, p in proxies.items()}

        async def load(
            concurrency: int, seconds: float | None, requests: int | None
        ) -> list[tuple[list[loadgen.Result], loadgen.Window]]:
            return await asyncio.gather(
                *(
                    loadgen.closed_loop(
                        url,
                        bodies,
                        concurrency=concurrency,
                        duration_s=seconds,
                        requests=requests,
                        id_prefix=f"ab{i}",
                    )
                    for i, url in enumerate(urls.values())
                )
            )

        asyncio.run(load(min(args.concurrency, 8), None, 64))
        cpu0 = {k: cpu_seconds(p.popen.pid) for k, p in proxies.items()}
        runs = asyncio.run(load(args.concurrency, args.seconds, None))
        for (name, proxy), (results, window) in zip(proxies.items(), runs, strict=True):
            cpu = cpu_seconds(proxy.popen.pid) - cpu0[name]
            summary = loadgen.summarize(results, window, loadgen.Slo())
            print(
                f"{name}: {args.concurrency} streams, {summary['rps']} req/s, TTFT p50 "
                f"{summary['ttft_ms']['p50']} ms, proxy CPU {1000 * cpu / len(results):.3f} "
                f"ms/request, errors {summary['errors']}"
            )
    return 0


def size_table(args: argparse.Namespace) -> int:
    """Prefixgate against the relay, one stream at a time, at each of ``--sizes``."""
    sizes = [int(x) for x in args.sizes.split(",") if x]
    rows = []
    with tempfile.TemporaryDirectory(prefix="pg-prof-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        fake = stack.enter_context(procs.start_fake(workdir, slots=args.fake_slots))
        for size in sizes:
            row: dict[str, dict[str, float | None]] = {}
            for target in ("prefixgate", "relay"):
                row[target] = cpu_per_request(
                    workdir,
                    fake.url,
                    target=target,
                    prompt_bytes=size,
                    concurrency=args.concurrency,
                    seconds=args.seconds,
                    extra=args.extra.split(),
                )
            rows.append((size, row))
            pg, relay = row["prefixgate"], row["relay"]
            print(
                f"{size} B: prefixgate {pg['cpu_ms']:.2f} ms CPU, TTFT p50 {pg['ttft_p50']} ms, "
                f"proxy_overhead_ms p50 {pg['overhead_p50']}; relay {relay['cpu_ms']:.2f} ms "
                f"CPU, TTFT p50 {relay['ttft_p50']} ms",
                flush=True,
            )
    print(
        f"\n{args.concurrency} stream(s), {args.seconds:g} s per target and size\n"
        "| prompt | prefixgate CPU ms/request | relay CPU ms/request | difference | "
        "prefixgate TTFT p50 ms | relay TTFT p50 ms | proxy_overhead_ms p50 |\n"
        "|---|---|---|---|---|---|---|"
    )
    for size, row in rows:
        pg, relay = row["prefixgate"], row["relay"]
        assert pg["cpu_ms"] is not None and relay["cpu_ms"] is not None
        print(
            f"| {size // 1024} KB | {pg['cpu_ms']:.2f} | {relay['cpu_ms']:.2f} | "
            f"{pg['cpu_ms'] - relay['cpu_ms']:.2f} | {pg['ttft_p50']} | {relay['ttft_p50']} | "
            f"{pg['overhead_p50']} |"
        )
    return 0


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
        "--native", action="store_true", help="py-spy --native: C frames too (memcpy, orjson...)"
    )
    parser.add_argument(
        "--cpu-only",
        action="store_true",
        help="no profile: the proxy's CPU time per request under the same load",
    )
    parser.add_argument(
        "--target",
        choices=("prefixgate", "relay"),
        default="prefixgate",
        help="relay: bench/bare_relay.py, the floor of an aiohttp proxy",
    )
    parser.add_argument(
        "--sizes",
        default="",
        help="comma-separated prompt sizes in bytes: a linearity table against the relay",
    )
    parser.add_argument(
        "--against",
        default="",
        help="another installation's prefixgate (a path), or 'relay' (bench/bare_relay.py): "
        "both measured side by side, at once",
    )
    parser.add_argument(
        "--this",
        default="",
        help="with --against: the first one's prefixgate (a path; default: this installation's)",
    )
    parser.add_argument("--extra", default="", help="more `prefixgate serve` flags")
    parser.add_argument("--out", default=str(procs.BENCH / "results" / "profile.txt"))
    args = parser.parse_args(argv)
    if args.sizes:
        return size_table(args)
    if args.against:
        return side_by_side(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    bodies = salted_bodies(args.prompt_bytes, 16)
    with tempfile.TemporaryDirectory(prefix="pg-prof-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        fake = stack.enter_context(procs.start_fake(workdir, slots=args.fake_slots))
        redis_url = stack.enter_context(procs.start_redis(workdir)).url if args.redis else None
        if args.target == "relay":
            proxy = stack.enter_context(procs.start_bare_relay(workdir, fake.url))
        else:
            proxy = stack.enter_context(
                procs.start_prefixgate(
                    workdir, fake.url, redis_url=redis_url, extra=args.extra.split()
                )
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
                *(["--native"] if args.native else []),
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
