"""``prefixgate simulate``: replay a trace through the router against a simulated fleet.

What a routing policy is worth depends on the traffic, so the simulator replays real traces
(Mooncake, Claude Code, prefixgate logs: whatever ``analyzers.readers`` reads) through the
proxy's own ``proxy.routing.Router`` and ``TrafficDepth`` code, against N simulated replicas:

* **Cache.** Each replica is an LRU of prefix keys (blocks or segments, each charged its
  tokens) holding ``capacity / N`` tokens, kept prefix-closed like the store's index: a request
  touches its whole chain, head most recent. The router sees each replica's cache as its index
  (what the proxy's index converges to), and the chosen replica's cache takes the request's
  blocks at routing time (``PrefixTracker.claim``).
* **Load.** Requests arrive at their trace timestamps. A replica prefills one request at a time,
  first come first served, at ``prefill_tokens_per_s`` uncached tokens a second, then decodes
  its output at ``decode_ms_per_token`` alongside the others. A request is in flight from its
  arrival to its last token, which gives the router real loads to gate on and a time to first
  token that shows what queueing behind a hot replica costs.
* **Conversation keys.** A prefixgate record's ``affinity_key`` (the hash of the client's
  ``prompt_cache_key`` or session header) goes to the router as the proxy passed it, so
  ``key_affinity`` decisions replay as they were made.
* **Traffic depth.** A ``TrafficWindow`` on the trace's clock counts leading blocks exactly as
  the store does, and ``TrafficDepth`` turns the counts into the shared depth.

Results per policy: token-weighted hit rate, imbalance (max over mean requests per replica),
uncached prompt tokens (the prefill the fleet pays) and TTFT percentiles. ``pooled`` is the
bound the fleet is measured against: one LRU of the whole capacity, as if every replica shared
one cache (no routing at all).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import repeat
from pathlib import Path
from typing import Any

import orjson
import xxhash

from analyzers.capacity import simulate_lru
from analyzers.inputs import input_files, open_input, read_input
from analyzers.quantile import percentile
from analyzers.readers import KVCACHE, MOONCAKE, read_paths
from analyzers.trace import PrefixKey, Trace, TraceRequest
from proxy.fingerprint import leading_run
from proxy.routing import (
    POLICIES,
    Candidate,
    Router,
    RoutingConfig,
    TrafficDepth,
    TrafficWindow,
    route_key,
)

POOLED = "pooled"
ALL = "all"
DEFAULT_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadModel:
    """How long a replica takes to serve a request."""

    prefill_tokens_per_s: float = 20_000.0
    """Uncached prompt tokens one replica prefills per second (one request at a time)."""
    decode_ms_per_token: float = 20.0
    """Time per output token; decoding runs alongside other requests."""
    default_output_tokens: int = 256
    """Output length for inputs that do not record one (prefixgate logs, request bodies)."""

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ValueError("prefill rate must be positive")
        if not self.decode_ms_per_token >= 0:
            raise ValueError("decode time per token must not be negative")


@dataclass(frozen=True, slots=True)
class FleetResult:
    """One policy's replay."""

    policy: str
    replicas: int
    requests: int
    hit_rate: float
    """Token-weighted: cached prompt tokens over prompt tokens."""
    imbalance: float | None
    """Max over mean requests per replica (1.0 is perfect; None for ``pooled``)."""
    prefill_tokens: int
    """Uncached prompt tokens: the prefill the fleet pays."""
    prompt_tokens: int
    per_replica: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    max_in_flight: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "replicas": self.replicas,
            "hit_rate": round(self.hit_rate, 4),
            "imbalance": None if self.imbalance is None else round(self.imbalance, 4),
            "prefill_tokens": self.prefill_tokens,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "per_replica": self.per_replica,
            "reasons": self.reasons,
            "ttft_p50_s": _round(self.ttft_p50_s),
            "ttft_p99_s": _round(self.ttft_p99_s),
            "max_in_flight": self.max_in_flight,
        }


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


class _Replica:
    """One simulated backend: its cache, its prefill queue and its requests in flight."""

    __slots__ = ("cache", "capacity", "ends", "prefill_free", "requests", "size", "url")

    def __init__(self, url: str, capacity_tokens: float) -> None:
        self.url = url
        self.capacity = capacity_tokens
        self.cache: OrderedDict[int, float] = OrderedDict()
        self.size = 0.0
        self.prefill_free = 0.0
        self.ends: list[float] = []
        self.requests = 0

    def in_flight(self, now: float) -> int:
        ends = self.ends
        while ends and ends[0] <= now:
            heapq.heappop(ends)
        return len(ends)

    def touch(self, request: TraceRequest, chain: Sequence[int], matched: int) -> None:
        """Cache the chain, head most recent, and evict the least recent past capacity."""
        cache = self.cache
        n = len(chain)
        if matched < n:
            new = chain[n - 1 : matched - 1 : -1] if matched else chain[::-1]
            if request.cum_tokens is None:  # uniform blocks: C-level update
                cache.update(zip(new, repeat(request.block_tokens)))
            else:
                cache.update(
                    (chain[i], request.charge(i, i + 1)) for i in range(n - 1, matched - 1, -1)
                )
            self.size += request.charge(matched, n)
        if matched:
            deque(map(cache.move_to_end, chain[matched - 1 :: -1]), maxlen=0)
        if self.size <= self.capacity:
            return
        evict = cache.popitem
        if request.cum_tokens is None and request.block_tokens > 0:
            # Blocks of one size (a trace): evict the excess by count, in C. Traces of different
            # block sizes replayed together make the count approximate.
            excess = math.ceil((self.size - self.capacity) / request.block_tokens)
            deque(map(evict, repeat(False, min(excess, len(cache)))), maxlen=0)
            self.size = max(self.size - excess * request.block_tokens, 0.0)
            return
        while self.size > self.capacity and cache:
            self.size -= evict(last=False)[1]


def _int_chain(keys: Sequence[PrefixKey]) -> list[int]:
    """Prefix keys as 64-bit ints: block ids as they are, hex segment hashes parsed."""
    out: list[int] = []
    for key in keys:
        if isinstance(key, int):
            out.append(key)
        elif isinstance(key, str):
            try:
                out.append(int(key, 16))
            except ValueError:
                out.append(xxhash.xxh3_64_intdigest(key.encode()))
        else:
            out.append(xxhash.xxh3_64_intdigest(repr(key).encode()))
    return out


def simulate_fleet(
    requests: Sequence[TraceRequest],
    *,
    replicas: int,
    capacity_tokens: float,
    routing: RoutingConfig,
    load: LoadModel | None = None,
    outputs: Sequence[float] | None = None,
    traffic_window_s: float = 120.0,
) -> FleetResult:
    """Replay ``requests`` (in time order) through ``Router(routing)`` over ``replicas``."""
    if replicas < 1:
        raise ValueError("at least one replica")
    model = load or LoadModel()
    fleet = [
        _Replica(f"http://replica-{i}:8000", capacity_tokens / replicas) for i in range(replicas)
    ]
    router = Router(routing)
    depth = TrafficDepth.from_config(routing)
    window = TrafficWindow(bucket_s=traffic_window_s)
    decode_s = model.decode_ms_per_token / 1000.0
    rate = model.prefill_tokens_per_s
    reasons: dict[str, int] = {}
    ttfts: list[float] = []
    prompt_total = hit_total = 0.0
    max_in_flight = 0
    chains = _chains(requests)
    for index, (r, chain) in enumerate(zip(requests, chains, strict=True)):
        now = r.ts
        candidates = []
        for rep in fleet:
            inflight = rep.in_flight(now)
            max_in_flight = max(max_in_flight, inflight)
            candidates.append(Candidate(rep.url, leading_run(chain, rep.cache), float(inflight)))
        counts = window.counts(chain, now)
        shared = depth.shared_blocks(*counts)
        key = route_key(chain, shared)
        decision = router.choose(
            candidates, key=key, shared_blocks=shared, affinity_key=r.affinity_key
        )
        window.observe(chain, now)
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        chosen = next(rep for rep in fleet if rep.url == decision.replica)
        matched = decision.matched_blocks
        hit = r.tokens_upto(matched)
        prompt_total += r.prompt_tokens
        hit_total += hit
        chosen.touch(r, chain, matched)
        chosen.requests += 1
        start = max(now, chosen.prefill_free)
        prefill_end = start + (r.prompt_tokens - hit) / rate
        chosen.prefill_free = prefill_end
        ttfts.append(prefill_end - now)
        output = outputs[index] if outputs is not None else model.default_output_tokens
        heapq.heappush(chosen.ends, prefill_end + output * decode_s)
    per_replica = [rep.requests for rep in fleet]
    mean = sum(per_replica) / len(per_replica)
    ttfts.sort()
    return FleetResult(
        policy=routing.policy,
        replicas=replicas,
        requests=len(requests),
        hit_rate=hit_total / prompt_total if prompt_total else 0.0,
        imbalance=max(per_replica) / mean if mean else None,
        prefill_tokens=round(prompt_total - hit_total),
        prompt_tokens=round(prompt_total),
        per_replica=per_replica,
        reasons=dict(sorted(reasons.items())),
        ttft_p50_s=percentile(ttfts, 0.5),
        ttft_p99_s=percentile(ttfts, 0.99),
        max_in_flight=max_in_flight,
    )


def _chains(requests: Sequence[TraceRequest]) -> list[Sequence[int]]:
    """Every request's keys as ints (traces already are: kept as they are, not copied)."""
    out: list[Sequence[int]] = []
    for r in requests:
        keys = r.keys
        if all(type(k) is int for k in keys[:1]) and all(type(k) is int for k in keys[-1:]):
            out.append(keys)  # type: ignore[arg-type]  # checked: a trace's int block ids
        else:
            out.append(_int_chain(keys))
    return out


def simulate_pooled(
    requests: Sequence[TraceRequest], *, replicas: int, capacity_tokens: float
) -> FleetResult:
    """The bound: one LRU of the whole capacity, every request hitting it."""
    hit_rate, _ = simulate_lru(requests, capacity_tokens)
    prompt = sum(r.prompt_tokens for r in requests)
    return FleetResult(
        policy=POOLED,
        replicas=replicas,
        requests=len(requests),
        hit_rate=hit_rate,
        imbalance=None,
        prefill_tokens=round(prompt * (1.0 - hit_rate)),
        prompt_tokens=round(prompt),
    )


def output_tokens(paths: Sequence[Path], trace: Trace) -> list[float] | None:
    """Each request's output length, for traces that record one (Mooncake, kv-cache-tester).

    The readers keep prompts only; this reads the outputs again in the same order (files in
    turn, then a stable sort by time) and checks that timestamps and prompts line up. None when
    a file records no outputs or anything does not line up: the caller uses a default.
    """
    rows: list[tuple[float, float, float]] = []
    for path in input_files(paths):
        fmt = trace.formats.get(str(path))
        if fmt == MOONCAKE:
            with open_input(path) as fh:
                for line in fh:
                    try:
                        obj = orjson.loads(line)
                        ids = obj["hash_ids"]
                    except (orjson.JSONDecodeError, TypeError, KeyError):
                        continue
                    ts = float(obj.get("timestamp") or 0) / 1000.0
                    prompt = float(obj.get("input_length") or len(ids) * 512)
                    rows.append((ts, prompt, float(obj.get("output_length") or 0)))
        elif fmt == KVCACHE:
            doc = orjson.loads(read_input(path))
            block = float(doc.get("block_size") or 64)
            for r in doc["requests"]:
                ids = r.get("hash_ids") or []
                prompt = float(r.get("in") or len(ids) * block)
                rows.append((float(r.get("t") or 0.0), prompt, float(r.get("out") or 0)))
        else:
            return None
    rows.sort(key=lambda row: row[0])
    if len(rows) != len(trace.requests):
        return None
    for (ts, prompt, _), request in zip(rows, trace.requests, strict=True):
        if ts != request.ts or prompt != request.prompt_tokens:
            return None
    return [row[2] for row in rows]


def run_policies(
    trace: Trace,
    policies: Sequence[str],
    *,
    replicas: int,
    capacity_tokens: float,
    routing: RoutingConfig | None = None,
    load: LoadModel | None = None,
    outputs: Sequence[float] | None = None,
    traffic_window_s: float = 120.0,
) -> list[FleetResult]:
    """One result per policy (``pooled`` included when asked), in the order given."""
    base = routing or RoutingConfig()
    results = []
    for policy in policies:
        if policy == POOLED:
            results.append(
                simulate_pooled(trace.requests, replicas=replicas, capacity_tokens=capacity_tokens)
            )
            continue
        results.append(
            simulate_fleet(
                trace.requests,
                replicas=replicas,
                capacity_tokens=capacity_tokens,
                routing=dataclasses.replace(base, policy=policy),
                load=load,
                outputs=outputs,
                traffic_window_s=traffic_window_s,
            )
        )
    return results


# -- command line --------------------------------------------------------------------------------


def add_simulate_parser(subparsers: Any) -> None:
    """Register ``simulate`` on a ``parser.add_subparsers()`` object."""
    parser = subparsers.add_parser(
        "simulate",
        help="replay a trace through the router against a simulated fleet",
        description=(
            "Replay Mooncake, kv-cache-tester traces or prefixgate logs through the proxy's "
            "router against N simulated replicas (an LRU cache and a prefill queue each); "
            "print hit rate, imbalance and prefill cost per routing policy."
        ),
    )
    configure_parser(parser)
    parser.set_defaults(func=run_simulate)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """The simulate arguments."""
    d = RoutingConfig()
    m = LoadModel()
    parser.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="TRACE",
        help="input files (gzip or xz too), or directories of them",
    )
    parser.add_argument("--replicas", type=int, required=True, help="backend replicas")
    parser.add_argument(
        "--capacity-blocks",
        type=int,
        required=True,
        help="prefix-cache capacity of the whole fleet, in blocks (split evenly)",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help="tokens per capacity block (default: %(default)s)",
    )
    parser.add_argument(
        "--policy",
        default="prefix-affinity",
        choices=(*POLICIES, POOLED, ALL),
        help="routing policy, 'pooled' (one shared LRU: the bound) or 'all' (default: %(default)s)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per policy per line")
    tuning = parser.add_argument_group("prefix-affinity")
    tuning.add_argument("--min-affinity-blocks", type=int, default=d.min_affinity_blocks)
    tuning.add_argument("--load-gate-ratio", type=float, default=d.load_gate_ratio)
    tuning.add_argument("--load-gate-slack", type=float, default=d.load_gate_slack)
    tuning.add_argument("--shared-share", type=float, default=d.shared_share)
    tuning.add_argument("--min-window-requests", type=int, default=d.min_window_requests)
    tuning.add_argument(
        "--traffic-window-s", type=float, default=120.0, help="traffic-count bucket length"
    )
    service = parser.add_argument_group("load model")
    service.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=m.prefill_tokens_per_s,
        help="uncached tokens one replica prefills per second (default: %(default)s)",
    )
    service.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=m.decode_ms_per_token,
        help="time per output token (default: %(default)s)",
    )
    service.add_argument(
        "--output-tokens",
        type=int,
        default=m.default_output_tokens,
        help="output length when the input records none (default: %(default)s)",
    )


def run_simulate(args: argparse.Namespace) -> int:
    """Run ``simulate`` for parsed arguments; the process exit status."""
    missing = [p for p in args.paths if not p.exists()]
    if missing:
        print(f"prefixgate simulate: no such file: {missing[0]}", file=sys.stderr)
        return 2
    paths = input_files(args.paths)
    try:
        routing = RoutingConfig(
            min_affinity_blocks=args.min_affinity_blocks,
            load_gate_ratio=args.load_gate_ratio,
            load_gate_slack=args.load_gate_slack,
            shared_share=args.shared_share,
            min_window_requests=args.min_window_requests,
        )
        load = LoadModel(
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            decode_ms_per_token=args.decode_ms_per_token,
            default_output_tokens=args.output_tokens,
        )
        if args.replicas < 1 or args.capacity_blocks < 1 or args.block_tokens < 1:
            raise ValueError("--replicas, --capacity-blocks and --block-tokens must be positive")
        if not args.traffic_window_s > 0:
            raise ValueError("--traffic-window-s must be positive")
        trace = read_paths(paths)
    except (OSError, ValueError) as exc:
        print(f"prefixgate simulate: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    if not trace.requests:
        print("prefixgate simulate: no requests in the input", file=sys.stderr)
        return 1
    policies = [*POLICIES, POOLED] if args.policy == ALL else [args.policy]
    started = time.perf_counter()
    results = run_policies(
        trace,
        policies,
        replicas=args.replicas,
        capacity_tokens=float(args.capacity_blocks * args.block_tokens),
        routing=routing,
        load=load,
        outputs=output_tokens(paths, trace),
        traffic_window_s=args.traffic_window_s,
    )
    elapsed = time.perf_counter() - started
    if args.json:
        for result in results:
            sys.stdout.buffer.write(orjson.dumps(result.to_json()) + b"\n")
    else:
        _print_table(results, len(trace.requests), args, elapsed)
    sys.stdout.flush()
    return 0


def _print_table(
    results: Sequence[FleetResult], requests: int, args: argparse.Namespace, elapsed: float
) -> None:
    print(
        f"{requests} requests, {args.replicas} replicas, "
        f"{args.capacity_blocks} blocks of {args.block_tokens} tokens in all "
        f"({elapsed:.1f} s)"
    )
    header = f"{'policy':<16} {'hit rate':>9} {'imbalance':>9} {'prefill tokens':>15} "
    header += f"{'TTFT p50':>9} {'TTFT p99':>9}"
    print(header)
    for r in results:
        imbalance = "-" if r.imbalance is None else f"{r.imbalance:.3f}"
        p50 = "-" if r.ttft_p50_s is None else f"{r.ttft_p50_s:.2f}s"
        p99 = "-" if r.ttft_p99_s is None else f"{r.ttft_p99_s:.2f}s"
        print(
            f"{r.policy:<16} {r.hit_rate:>9.1%} {imbalance:>9} {r.prefill_tokens:>15,} "
            f"{p50:>9} {p99:>9}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m analyzers.simulate TRACE…``."""
    parser = argparse.ArgumentParser(prog="python -m analyzers.simulate", description=__doc__)
    configure_parser(parser)
    return run_simulate(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
