"""The fleet simulator: the router's policies on generated and public traces, the load model,
the pooled bound, output lengths read back from traces, and the command line."""

from __future__ import annotations

import random
from pathlib import Path

import orjson
import pytest

from analyzers.capacity import simulate_lru
from analyzers.readers import read_paths
from analyzers.simulate import (
    POOLED,
    LoadModel,
    output_tokens,
    run_policies,
    simulate_fleet,
    simulate_pooled,
)
from analyzers.trace import TraceRequest
from proxy.cli import main
from proxy.routing import RoutingConfig

DATA = Path(__file__).parents[1] / "data" / "analyzer"
TRACES = Path(__file__).parents[1] / "data" / "traces"  # xz-compressed, as published
BLOCK = 512.0
SYSTEM = [0, 1, 2, 3]  # a 4-block system prompt every request starts with
NAIVE = RoutingConfig(
    min_affinity_blocks=1,
    min_window_requests=10**9,  # no traffic-shared depth
    load_gate_ratio=1e9,
    load_gate_slack=1e9,  # no load gate
)


def request(ts: float, keys: list[int]) -> TraceRequest:
    return TraceRequest(
        ts=ts, source="t", keys=keys, prompt_tokens=len(keys) * BLOCK, block_tokens=BLOCK
    )


def chat_trace(conversations: int = 40, turns: int = 6, seed: int = 7) -> list[TraceRequest]:
    """Conversations behind one system prompt, turns interleaved over time, each turn
    extending its conversation by a few blocks."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    next_id = 100
    for _ in range(conversations):
        chain = list(SYSTEM)
        t = rng.uniform(0, 60)
        for _ in range(turns):
            chain = chain + list(range(next_id, next_id + rng.randint(2, 6)))
            next_id += 10
            out.append(request(t, chain))
            t += rng.uniform(5, 30)
    out.sort(key=lambda r: r.ts)
    return out


def fleet(requests: list[TraceRequest], config: RoutingConfig, replicas: int = 4) -> object:
    return simulate_fleet(requests, replicas=replicas, capacity_tokens=4000 * BLOCK, routing=config)


def test_affinity_reaches_the_pooled_bound_without_piling_up() -> None:
    """Conversations behind a shared prompt: affinity hits like one pooled cache, balanced."""
    requests = chat_trace()
    pooled = simulate_pooled(requests, replicas=4, capacity_tokens=4000 * BLOCK)
    affinity = simulate_fleet(
        requests, replicas=4, capacity_tokens=4000 * BLOCK, routing=RoutingConfig()
    )
    rr = simulate_fleet(
        requests,
        replicas=4,
        capacity_tokens=4000 * BLOCK,
        routing=RoutingConfig(policy="round-robin"),
    )
    assert affinity.hit_rate >= 0.97 * pooled.hit_rate
    assert rr.hit_rate < 0.7 * pooled.hit_rate
    assert affinity.imbalance is not None and affinity.imbalance <= 1.25
    assert affinity.reasons["affinity"] >= 150
    assert sum(affinity.per_replica) == len(requests)


def test_naive_prefix_routing_sends_everything_to_one_replica() -> None:
    """Without the shared depth and the load gate, the system prompt pins all traffic."""
    naive = simulate_fleet(chat_trace(), replicas=4, capacity_tokens=4000 * BLOCK, routing=NAIVE)
    assert naive.imbalance == 4.0
    assert sorted(naive.per_replica)[:3] == [0, 0, 0]


def test_the_load_gate_alone_spreads_a_hot_replica() -> None:
    """Naive matching with the gate on: the hot replica stops attracting traffic."""
    gated = RoutingConfig(min_affinity_blocks=1, min_window_requests=10**9)
    result = simulate_fleet(
        chat_trace(),
        replicas=4,
        capacity_tokens=4000 * BLOCK,
        routing=gated,
        load=LoadModel(prefill_tokens_per_s=2000.0),
    )
    assert result.reasons.get("load_gate", 0) > 0
    assert min(result.per_replica) > 0


def test_replays_are_deterministic() -> None:
    """The same trace and settings give the same result, run after run."""
    requests = chat_trace(seed=3)
    first = fleet(requests, RoutingConfig())
    assert fleet(requests, RoutingConfig()) == first


def test_one_replica_queues_its_prefills() -> None:
    """Two requests arriving together on one replica: the second waits for the first."""
    requests = [request(0.0, [1, 2]), request(0.0, [7, 8])]
    result = simulate_fleet(
        requests,
        replicas=1,
        capacity_tokens=100 * BLOCK,
        routing=RoutingConfig(),
        load=LoadModel(prefill_tokens_per_s=1024.0, decode_ms_per_token=0.0),
    )
    assert result.reasons == {"single": 2}
    assert result.ttft_p50_s == pytest.approx(1.0)
    assert result.ttft_p99_s == pytest.approx(2.0)
    assert result.max_in_flight == 1


def test_cached_blocks_are_not_prefilled_again() -> None:
    """A repeated prompt on one replica hits its cached blocks; prefill counts the rest."""
    requests = [request(0.0, [1, 2, 3]), request(10.0, [1, 2, 3, 4])]
    result = simulate_fleet(
        requests, replicas=1, capacity_tokens=100 * BLOCK, routing=RoutingConfig()
    )
    assert result.prompt_tokens == 7 * 512
    assert result.prefill_tokens == 4 * 512
    assert result.hit_rate == pytest.approx(3 / 7)


def test_a_replica_cache_keeps_its_capacity() -> None:
    """Each replica holds capacity / replicas; past it the least recent blocks go, a prompt's
    tail before its head."""
    requests = [request(0.0, [1, 2, 3]), request(1.0, [4, 5, 6]), request(2.0, [1, 2, 3])]

    def hit_rate(blocks: int, replicas: int = 1) -> float:
        return simulate_fleet(
            requests,
            replicas=replicas,
            capacity_tokens=blocks * BLOCK,
            routing=RoutingConfig(policy="round-robin"),
        ).hit_rate

    assert hit_rate(3) == 0.0
    assert hit_rate(4) == pytest.approx(1 / 9)  # the first prompt's head survived
    assert hit_rate(6) == pytest.approx(3 / 9)
    assert hit_rate(18, replicas=3) == 0.0  # round-robin: the repeat lands on a third one


def test_pooled_is_one_lru_of_the_whole_capacity() -> None:
    """The pooled bound is the analyzer's LRU replay at the fleet's total capacity."""
    requests = chat_trace(seed=5)
    pooled = simulate_pooled(requests, replicas=4, capacity_tokens=600 * BLOCK)
    assert pooled.policy == POOLED
    assert pooled.hit_rate == simulate_lru(requests, 600 * BLOCK)[0]
    assert pooled.imbalance is None


def test_outputs_are_read_back_in_request_order() -> None:
    """Output lengths of Mooncake and kv-cache-tester traces line up with the requests."""
    paths = [DATA / "mooncake.jsonl", DATA / "kvcache.json"]
    trace = read_paths(paths)
    assert output_tokens(paths, trace) == [5.0, 1.0, 5.0, 5.0, 5.0, 1.0]  # by time, file order
    records = [DATA / "records.jsonl"]
    assert output_tokens(records, read_paths(records)) is None  # logs keep no output length


def test_segment_records_replay(tmp_path: Path) -> None:
    """prefixgate logs (hex segment hashes, per-segment tokens) go through the same code."""
    trace = read_paths([DATA / "records.jsonl"])
    results = run_policies(trace, ["prefix-affinity", POOLED], replicas=2, capacity_tokens=1e6)
    assert [r.policy for r in results] == ["prefix-affinity", POOLED]
    assert results[0].requests == len(trace.requests)
    assert 0.0 <= results[0].hit_rate <= 1.0


def test_cli_prints_one_json_object_per_policy(capsys: pytest.CaptureFixture[str]) -> None:
    """``prefixgate simulate --policy all --json``: three policies and the pooled bound."""
    args = [str(DATA / "mooncake.jsonl"), "--replicas", "2", "--capacity-blocks", "100"]
    assert main(["simulate", *args, "--policy", "all", "--json"]) == 0
    lines = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["policy"] for d in lines] == [
        "round-robin",
        "least-loaded",
        "prefix-affinity",
        "pooled",
    ]
    for d in lines:
        assert {"policy", "replicas", "hit_rate", "imbalance", "prefill_tokens"} <= d.keys()
        assert d["replicas"] == 2
    assert main(["simulate", *args]) == 0
    out = capsys.readouterr().out
    assert "prefix-affinity" in out and "round-robin" not in out


def test_cli_refuses_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A missing file or an impossible setting prints one line and exits 2."""
    assert (
        main(
            ["simulate", str(tmp_path / "none.jsonl"), "--replicas", "2", "--capacity-blocks", "9"]
        )
        == 2
    )
    assert "no such file" in capsys.readouterr().err
    trace = str(DATA / "mooncake.jsonl")
    assert main(["simulate", trace, "--replicas", "0", "--capacity-blocks", "9"]) == 2
    assert (
        main(
            [
                "simulate",
                trace,
                "--replicas",
                "2",
                "--capacity-blocks",
                "9",
                "--load-gate-ratio",
                "0.5",
            ]
        )
        == 2
    )
    assert "load_gate_ratio" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert main(["simulate", str(empty), "--replicas", "2", "--capacity-blocks", "9"]) == 1


def test_mooncake_conversation_four_replicas() -> None:
    """The published conversation trace, 4 replicas, 20,000 blocks: round-robin ~12 %, pooled
    ~29 %, prefix-affinity within 95 % of pooled at imbalance <= 1.1."""
    trace = read_paths([TRACES / "mooncake" / "conversation_trace.jsonl.xz"])
    rr, affinity, pooled = run_policies(
        trace,
        ["round-robin", "prefix-affinity", POOLED],
        replicas=4,
        capacity_tokens=20_000 * 512,
        outputs=output_tokens([TRACES / "mooncake" / "conversation_trace.jsonl.xz"], trace),
    )
    assert rr.hit_rate == pytest.approx(0.12, abs=0.01)
    assert pooled.hit_rate == pytest.approx(0.29, abs=0.01)
    assert affinity.hit_rate >= 0.95 * pooled.hit_rate
    assert affinity.imbalance is not None and affinity.imbalance <= 1.1


def test_conversation_keys_replay_as_key_affinity() -> None:
    """Requests carrying a record's affinity_key replay through the router's key affinity: one
    key's requests on one replica, keys spread over the fleet."""
    requests = []
    for i in range(40):
        r = request(float(i), [*SYSTEM, 1000 + i])
        r.affinity_key = 0xABC0 + i % 8
        requests.append(r)
    result = simulate_fleet(requests, replicas=4, capacity_tokens=1e6, routing=RoutingConfig())
    assert result.reasons == {"key_affinity": 40}
    assert sum(1 for n in result.per_replica if n) >= 2


def test_records_carry_their_affinity_key_into_the_trace(tmp_path: Path) -> None:
    """A record's hex affinity_key is read back as the integer the router hashed."""
    lines = (DATA / "records.jsonl").read_bytes().splitlines()
    first = next(obj for obj in map(orjson.loads, lines) if obj.get("event") == "request")
    line = {**first, "affinity_key": "00000000000000ff"}
    path = tmp_path / "r.jsonl"
    path.write_bytes(orjson.dumps(line) + b"\n" + orjson.dumps({**line, "affinity_key": "zz"}))
    got = [r.affinity_key for r in read_paths([path]).requests]
    assert got == [255, None]
