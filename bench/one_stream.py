"""Added TTFT at one stream, prefixgate installations against the bare relay, in shuffled rounds.

One run of the overhead benchmark gives one figure per target at one stream, and on a shared
machine that figure moves by ±0.15 ms from run to run, more than a change to the request path
does. This runs many short rounds instead: in each, every target (direct, the bare relay,
``bench/bare_relay.py``, and each prefixgate given) serves ``--requests`` requests at one stream
in a shuffled order, and the figure kept is each prefixgate's TTFT p50 less the relay's of the
same round. Their median over the rounds is the comparison to go by; drift of the machine
between rounds cancels out.

A prefixgate is ``this`` (this installation's) or the path of another installation's
``prefixgate`` (another tree, exported and run through a wrapper:
``git archive REV proxy | tar -x -C /tmp/t`` and ``PYTHONPATH=/tmp/t exec .venv/bin/prefixgate
"$@"``). Every target runs in front of one fake backend (``--tokens`` tokens ``--itl-ms``
apart, the overhead benchmark's 8 KB bodies).

A target may name serve flags after the first colon (split on spaces) and the Redis store
with ``+redis`` before it (a redis-server of its own): ``this+redis``,
``"this:--slot-scheduling off"``, ``"PATH:--no-canonicalize"``: what one feature costs, beside
the defaults, in the same rounds.

Run: ``python bench/one_stream.py [this] [PATH ...] [--rounds 20] [--requests 100]
[--tokens 4] [--itl-ms 5] [--seed 7]``.

``--streams N`` (N > 1): the same rounds under load instead, each target serving N streams
back to back for ``--seconds`` (after a second of ramp-up): the figure kept is each target's
requests/s over the relay's of the same round (issue 21's "0.9 x the relay's" read with the
machine's drift cancelled), and its TTFT p50.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen
import procs
from bench_overhead import salted_bodies

DIRECT, RELAY = "direct", "relay"
REDIS = "+redis"


def ttft_p50(url: str, bodies: loadgen.BodyFactory, requests: int) -> float:
    results, _ = asyncio.run(
        loadgen.closed_loop(url + loadgen.CHAT_PATH, bodies, concurrency=1, requests=requests)
    )
    return statistics.median(r.ttft_ms for r in results if r.ok and r.ttft_ms is not None)


def under_load(
    url: str, bodies: loadgen.BodyFactory, streams: int, seconds: float
) -> tuple[float, float]:
    """Requests/s and TTFT p50 (ms) of ``streams`` closed-loop streams for ``seconds``."""
    results, window = asyncio.run(
        loadgen.closed_loop(
            url + loadgen.CHAT_PATH,
            bodies,
            concurrency=streams,
            duration_s=seconds,
            warmup_s=1.0,
        )
    )
    summary = loadgen.summarize(results, window, loadgen.Slo(50.0, 10.0))
    return float(summary["rps"]), float(summary["ttft_ms"]["p50"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prefixgates", nargs="*", default=["this"])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=100, help="per target and round")
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--prompt-bytes", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=7, help="the rounds' shuffled orders")
    parser.add_argument("--streams", type=int, default=1, help="N > 1: requests/s at N streams")
    parser.add_argument("--seconds", type=float, default=6.0, help="with --streams: per round")
    args = parser.parse_args(argv)
    names = [DIRECT, RELAY, *args.prefixgates]
    if len(set(names)) != len(names):
        parser.error("each target is named once (and none is named direct or relay)")
    bodies = salted_bodies(args.prompt_bytes, args.tokens)
    with tempfile.TemporaryDirectory(prefix="pg-one-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        fake = stack.enter_context(
            procs.start_fake(workdir, tokens=args.tokens, itl_ms=args.itl_ms)
        )
        urls = {
            DIRECT: fake.url,
            RELAY: stack.enter_context(procs.start_bare_relay(workdir, fake.url)).url,
        }
        for i, spec in enumerate(args.prefixgates):
            base, _, flags = spec.partition(":")
            redis_url = None
            if base.endswith(REDIS):  # a redis-server of its own: no target sees another's
                base = base.removesuffix(REDIS)
                redis_url = stack.enter_context(procs.start_redis(workdir)).url
            proxy = procs.start_prefixgate(
                workdir,
                fake.url,
                name=f"pg{i}",
                command=None if base == "this" else [base],
                redis_url=redis_url,
                extra=flags.split(),
            )
            urls[spec] = stack.enter_context(proxy).url
        for url in urls.values():  # warm up
            ttft_p50(url, bodies, 50)
        order = list(urls)
        rng = random.Random(args.seed)
        if args.streams > 1:
            return _loaded_rounds(args, urls, bodies, order, rng)
        p50: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(args.rounds):
            rng.shuffle(order)
            for name in order:
                p50[name].append(ttft_p50(urls[name], bodies, args.requests))
    print(
        f"{args.rounds} rounds of {args.requests} requests a target, one stream, "
        f"{args.prompt_bytes} B prompts, {args.tokens} tokens {args.itl_ms} ms apart"
    )
    print("target: TTFT p50 median over the rounds; its p50 less the relay's, median (mean)")
    for name, values in p50.items():
        added = [v - r for v, r in zip(values, p50[RELAY], strict=True)]
        print(
            f"{name}: {statistics.median(values):.3f} ms; over the relay "
            f"{statistics.median(added):+.3f} ({statistics.mean(added):+.3f}) ms"
        )
    return 0


def _loaded_rounds(
    args: argparse.Namespace,
    urls: dict[str, str],
    bodies: loadgen.BodyFactory,
    order: list[str],
    rng: random.Random,
) -> int:
    rps: dict[str, list[float]] = {name: [] for name in urls}
    ttft: dict[str, list[float]] = {name: [] for name in urls}
    for _ in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            got, p50 = under_load(urls[name], bodies, args.streams, args.seconds)
            rps[name].append(got)
            ttft[name].append(p50)
    print(
        f"{args.rounds} rounds of {args.seconds:g} s a target, {args.streams} streams, "
        f"{args.prompt_bytes} B prompts, {args.tokens} tokens {args.itl_ms} ms apart"
    )
    print("target: requests/s and TTFT p50, medians over the rounds; x the relay's, median (mean)")
    for name in urls:
        ratio = [v / r for v, r in zip(rps[name], rps[RELAY], strict=True)]
        print(
            f"{name}: {statistics.median(rps[name]):,.0f} req/s, TTFT p50 "
            f"{statistics.median(ttft[name]):.2f} ms; x the relay's "
            f"{statistics.median(ratio):.3f} ({statistics.mean(ratio):.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
