"""Soak: mixed load through a proxy process for minutes, with faults injected on a schedule.

Run: ``python bench/soak.py [--duration 10m] [--concurrency 12] [--fault-every 20s]
[--json FILE]`` (``make soak``; ``--duration 60s`` for a quick run). It starts its own
redis-server, two fake llama.cpp backends (``tests/reliability/fake_backend.py``) and
``prefixgate serve`` in front of them, then runs ``--concurrency`` clients that loop over a mix
of requests:

* chat and completions, streamed and not, and llama.cpp's native ``/completion``; the chat
  requests come from three "applications" whose system prompts carry the current time and a
  request id and whose tools arrive shuffled (work for the canonicalizer and the prefix index);
* bad requests drawn from the hostile corpus in ``tests/data/fuzz/bodies.toml``;
* clients that go away mid-stream.

Every ``--fault-every`` seconds the next fault of the cycle is injected: a backend SIGKILLed and
restarted 3 s later, Redis SIGKILLed and restarted, a burst of streams the backend stalls
mid-way (the proxy's idle timeout ends them), Redis frozen (SIGSTOP: a blackhole) for 3 s, the
other backend killed and restarted, a burst of streams whose connection the backend resets.

Every request is judged as its client saw it (``tests/reliability/outcome.py``): complete, a
well-formed error, or **lost** (no response, a truncated stream, a body that is neither). The
report counts requests, errors by kind, errors outside any fault window, lost requests (must be
0), the proxy's RSS after warm-up and at the end (growth must stay under 10 %), and exits 1 if
either bound is broken or the proxy died. JSON with ``--json`` (``-``: stdout), and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import sys
import time
import tomllib
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from analyzers.quantile import percentile  # noqa: E402
from tests.reliability.outcome import COMPLETE, ERROR, LOST, Outcome, call, classify  # noqa: E402
from tests.reliability.processes import (  # noqa: E402
    FakeBackendProcess,
    ProxyProcess,
    raise_nofile,
)
from tests.store.redis_process import RedisServer  # noqa: E402

IDLE_S = 2.0  # the proxy's idle timeout: a stalled stream ends this long after its last byte
CONNECT_S = 1.0
REQUEST_LIMIT_S = 30.0  # the client's own deadline: a request without an answer by then is lost
FAULT_GRACE_S = IDLE_S + CONNECT_S + 2.0  # after a fault ends, errors still count as its own
RSS_GROWTH_LIMIT = 0.10
CORPUS = ROOT / "tests" / "data" / "fuzz"

APPS = [
    (
        "You are Aria, the scheduling assistant of Northwind Traders. Be brief and precise.\n"
        "Current time: {now}\nSession: {rid}\n" + "Policy: confirm every booking in writing. " * 30
    ),
    (
        "You are the support agent of Contoso Cloud. Answer from the knowledge base only.\n"
        "Request id {rid} received {now}.\n" + "Escalate outages to the on-call engineer. " * 30
    ),
    (
        "You are a code reviewer. Comment on correctness first, style last.\n"
        "Today is {day}. Trace {hexid}.\n" + "Prefer small, focused suggestions. " * 30
    ),
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} for the current user",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    for name in ("search_calendar", "book_room", "lookup_order", "open_ticket")
]
QUESTIONS = [
    "What is on my calendar tomorrow?",
    "Book the large room at 3pm.",
    "Where is order 1042?",
    "Why does the build fail on main?",
    "Summarize the last incident.",
    "Is this loop off by one?",
]
# Scenario weights (the fault cycle adds its own stalled and reset streams).
MIX = {
    "chat_stream": 30,
    "chat": 18,
    "completions_stream": 10,
    "completions": 10,
    "native": 6,
    "bad_request": 14,
    "disconnect": 6,
    "tiny": 6,
}
FAULT_CYCLE = [
    "kill_backend_0",
    "kill_redis",
    "stall_streams",
    "freeze_redis",
    "kill_backend_1",
    "reset_streams",
]


def parse_duration(text: str) -> float:
    """``600``, ``600s``, ``10m``, ``1h`` → seconds."""
    text = text.strip().lower()
    unit = {"s": 1, "m": 60, "h": 3600}.get(text[-1:])
    return float(text[:-1]) * unit if unit else float(text)


def load_bad_requests() -> list[dict[str, Any]]:
    cases = tomllib.loads((CORPUS / "bodies.toml").read_text())["case"]
    out = []
    for case in cases:
        if case["status"] == 200:
            continue
        out.append({**case, "body": (CORPUS / case["file"]).read_bytes()})
    return out


def chat_body(rng: random.Random, *, stream: bool) -> dict[str, Any]:
    """A request of one of the applications, built the way a careless client builds it."""
    now = datetime.now(UTC)
    system = rng.choice(APPS).format(
        now=now.isoformat(timespec="seconds"),
        day=now.strftime("%A, %B %d, %Y"),
        rid=uuid.UUID(int=rng.getrandbits(128)),
        hexid=f"{rng.getrandbits(64):016x}",
    )
    tools = [json.loads(json.dumps(t)) for t in rng.sample(TOOLS, k=len(TOOLS))]
    for t in tools:  # shuffled keys, as some serializers do
        params = t["function"]["parameters"]
        t["function"]["parameters"] = dict(rng.sample(list(params.items()), k=len(params)))
    messages = [{"role": "system", "content": system}]
    for _ in range(rng.randint(0, 2)):
        messages += [
            {"role": "user", "content": rng.choice(QUESTIONS)},
            {"role": "assistant", "content": "Done."},
        ]
    messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
    return {"model": "fake-model", "messages": messages, "tools": tools, "stream": stream}


@dataclass
class Window:
    """One injected fault: what, and when its effects may show."""

    kind: str
    start: float
    end: float = 0.0


@dataclass
class Tally:
    """Everything the clients saw."""

    started: float = field(default_factory=time.monotonic)
    by_scenario: Counter[str] = field(default_factory=Counter)
    by_label: Counter[str] = field(default_factory=Counter)
    outside_faults: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)

    def in_fault(self, t0: float, t1: float) -> bool:
        for w in self.windows:
            end = (w.end or time.monotonic()) + FAULT_GRACE_S
            if t0 <= end and t1 >= w.start:
                return True
        return False

    def record(
        self, scenario: str, outcome: Outcome, t0: float, *, expect_4xx: bool = False
    ) -> None:
        t1 = time.monotonic()
        self.by_scenario[scenario] += 1
        label = outcome.label
        self.by_label[label] += 1
        if outcome.kind == LOST:
            self.lost.append(
                {
                    "scenario": scenario,
                    "why": outcome.error,
                    "detail": outcome.detail[:200],
                    "at_s": round(t0 - self.started, 2),
                }
            )
            return
        if expect_4xx:
            if not (outcome.kind == ERROR and 400 <= outcome.status < 500):
                self.wrong.append(f"{scenario}: {label}")
            return
        if outcome.kind == COMPLETE:
            self.latencies.append(t1 - t0)
        elif not self.in_fault(t0, t1):
            self.outside_faults[label] += 1


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.duration = parse_duration(args.duration)
        self.fault_every = parse_duration(args.fault_every)
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.bad = load_bad_requests()
        self.redis = RedisServer()
        self.backends = [FakeBackendProcess(), FakeBackendProcess()]
        self.proxy: ProxyProcess | None = None
        self.deadline = 0.0
        self.faults_injected: Counter[str] = Counter()

    # -- processes --------------------------------------------------------------------------

    def start(self) -> ProxyProcess:
        raise_nofile(8192)
        self.redis.start()
        for b in self.backends:
            b.start()
        self.proxy = ProxyProcess(
            [b.url for b in self.backends],
            redis_url=self.redis.url,
            idle_timeout=IDLE_S,
            connect_timeout=CONNECT_S,
            client_timeout=5.0,
            store_timeout=0.02,
            extra=["--health-interval-s", "1"],
        ).start()
        return self.proxy

    def stop(self) -> None:
        """Stop everything and delete the processes' files (a long run logs 100 MB)."""
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy.remove_files()
        for b in self.backends:
            b.stop()
            b.remove_files()
        with contextlib.suppress(Exception):
            self.redis.thaw()
        self.redis.kill()

    # -- load ---------------------------------------------------------------------------------

    async def worker(self, http: aiohttp.ClientSession, n: int) -> None:
        rng = random.Random(self.args.seed * 1000 + n)
        names, weights = zip(*MIX.items(), strict=True)
        while time.monotonic() < self.deadline:
            scenario = rng.choices(names, weights)[0]
            await self.run(http, rng, scenario)

    async def run(self, http: aiohttp.ClientSession, rng: random.Random, scenario: str) -> None:
        assert self.proxy is not None
        url = self.proxy.url
        t0 = time.monotonic()
        headers = {"X-Fault": "tokens=8,token-delay=0.005"}
        if scenario in ("chat_stream", "chat"):
            body: Any = chat_body(rng, stream=scenario == "chat_stream")
            outcome = await call(
                http, url + "/v1/chat/completions", body, headers=headers, timeout_s=REQUEST_LIMIT_S
            )
        elif scenario in ("completions_stream", "completions"):
            body = {
                "prompt": rng.choice(APPS)[:300] + rng.choice(QUESTIONS),
                "stream": scenario == "completions_stream",
                "max_tokens": 8,
            }
            outcome = await call(
                http, url + "/v1/completions", body, headers=headers, timeout_s=REQUEST_LIMIT_S
            )
        elif scenario == "native":
            body = {"prompt": rng.choice(QUESTIONS), "stream": rng.random() < 0.5, "n_predict": 8}
            outcome = await call(
                http, url + "/completion", body, headers=headers, timeout_s=REQUEST_LIMIT_S
            )
        elif scenario == "tiny":
            body = {"messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]}
            outcome = await call(
                http, url + "/v1/chat/completions", body, timeout_s=REQUEST_LIMIT_S
            )
        elif scenario == "bad_request":
            case = rng.choice(self.bad)
            hdrs = {}
            if case.get("content_type", "application/json"):
                hdrs["Content-Type"] = case.get("content_type", "application/json")
            outcome = await call(
                http,
                url + case.get("route", "/v1/chat/completions"),
                case["body"],
                headers=hdrs,
                timeout_s=REQUEST_LIMIT_S,
            )
            self.tally.record(scenario, outcome, t0, expect_4xx=True)
            return
        else:  # disconnect
            await self.disconnect(http, rng)
            return
        self.tally.record(scenario, outcome, t0)

    async def disconnect(self, http: aiohttp.ClientSession, rng: random.Random) -> None:
        """A client that reads the first bytes of a stream and goes away."""
        assert self.proxy is not None
        t0 = time.monotonic()
        body = chat_body(rng, stream=True)
        slow = {"X-Fault": "tokens=40,token-delay=0.05"}
        try:
            async with asyncio.timeout(REQUEST_LIMIT_S):
                resp = await http.post(
                    self.proxy.url + "/v1/chat/completions", json=body, headers=slow
                )
                try:
                    if resp.status != 200:
                        payload = await resp.read()
                        self.tally.record(
                            "disconnect", classify(resp.status, resp.content_type, payload), t0
                        )
                        return
                    await resp.content.readany()
                finally:
                    resp.close()  # drops the connection mid-stream
        except (TimeoutError, aiohttp.ClientError) as exc:
            lost = Outcome(LOST, 0, type(exc).__name__, str(exc))
            self.tally.record("disconnect", lost, t0)
            return
        self.tally.by_scenario["disconnect"] += 1
        self.tally.by_label["client_disconnected"] += 1

    async def burst(self, http: aiohttp.ClientSession, scenario: str, fault: str) -> None:
        """Streams the backend breaks on purpose: each must end in an SSE error event."""
        assert self.proxy is not None
        url = self.proxy.url + "/v1/chat/completions"

        async def one() -> None:
            t0 = time.monotonic()
            body = chat_body(self.rng, stream=True)
            outcome = await call(
                http, url, body, headers={"X-Fault": fault}, timeout_s=REQUEST_LIMIT_S
            )
            self.tally.record(scenario, outcome, t0)
            if outcome.kind == COMPLETE:
                self.tally.wrong.append(f"{scenario}: completed although the backend broke it")

        await asyncio.gather(*(one() for _ in range(4)))

    # -- faults -------------------------------------------------------------------------------

    async def faults(self, http: aiohttp.ClientSession) -> None:
        cycle = itertools.cycle(FAULT_CYCLE)
        await asyncio.sleep(min(self.fault_every, self.warmup_s()))
        while time.monotonic() + 8 < self.deadline:
            kind = next(cycle)
            window = Window(kind, time.monotonic())
            self.tally.windows.append(window)
            self.faults_injected[kind] += 1
            await self.inject(http, kind)
            window.end = time.monotonic()
            await asyncio.sleep(max(self.fault_every - (window.end - window.start), 1.0))

    async def inject(self, http: aiohttp.ClientSession, kind: str) -> None:
        if kind.startswith("kill_backend"):
            backend = self.backends[int(kind[-1])]
            await asyncio.to_thread(backend.kill)
            await asyncio.sleep(3)
            await asyncio.to_thread(backend.start)
        elif kind == "kill_redis":
            await asyncio.to_thread(self.redis.kill)
            await asyncio.sleep(3)
            await asyncio.to_thread(self.redis.start)
        elif kind == "freeze_redis":
            self.redis.freeze()
            await asyncio.sleep(3)
            self.redis.thaw()
        elif kind == "stall_streams":
            await self.burst(http, "stalled_stream", "stall-after=2")
        elif kind == "reset_streams":
            await self.burst(http, "reset_stream", "reset-after=2")

    # -- memory -------------------------------------------------------------------------------

    def warmup_s(self) -> float:
        return min(30.0, max(5.0, self.duration * 0.1))

    async def sample_rss(self) -> None:
        assert self.proxy is not None
        while time.monotonic() < self.deadline:
            if self.proxy.alive:
                rss = await asyncio.to_thread(self.proxy.rss)
                self.tally.rss.append((round(time.monotonic() - self.tally.started, 1), rss))
            await asyncio.sleep(2.0)

    # -- the run ------------------------------------------------------------------------------

    async def run_all(self) -> None:
        self.deadline = time.monotonic() + self.duration
        self.tally.started = time.monotonic()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            await asyncio.gather(
                self.faults(http),
                self.sample_rss(),
                *(self.worker(http, n) for n in range(self.args.concurrency)),
            )

    def report(self) -> dict[str, Any]:
        assert self.proxy is not None
        t = self.tally
        warm = self.warmup_s()
        after_warmup = [rss for at, rss in t.rss if at >= warm]
        rss_start = after_warmup[0] if after_warmup else (t.rss[0][1] if t.rss else 0)
        rss_end = t.rss[-1][1] if t.rss else 0
        growth = (rss_end - rss_start) / rss_start if rss_start else 0.0
        requests = sum(t.by_scenario.values())
        errors = {k: v for k, v in sorted(t.by_label.items()) if k.startswith("error:")}
        lat = sorted(t.latencies)
        records = self.proxy.records()
        alive = self.proxy.alive
        passed = not t.lost and growth < RSS_GROWTH_LIMIT and alive and not t.wrong
        return {
            "duration_s": self.duration,
            "concurrency": self.args.concurrency,
            "requests": requests,
            "requests_per_s": round(requests / self.duration, 1),
            "complete": t.by_label.get(COMPLETE, 0),
            "client_disconnected": t.by_label.get("client_disconnected", 0),
            "errors": sum(errors.values()),
            "errors_by_kind": errors,
            "errors_outside_fault_windows": dict(t.outside_faults),
            "lost": len(t.lost),
            "lost_examples": t.lost[:20],
            "wrong": t.wrong[:20],
            "by_scenario": dict(sorted(t.by_scenario.items())),
            "faults_injected": dict(self.faults_injected),
            "latency_ms": {
                "p50": round(percentile(lat, 0.5) * 1000, 1) if lat else None,
                "p99": round(percentile(lat, 0.99) * 1000, 1) if lat else None,
            },
            "proxy_records": len(records),
            "proxy_alive": alive,
            "rss_start_mb": round(rss_start / 2**20, 1),
            "rss_end_mb": round(rss_end / 2**20, 1),
            "rss_peak_mb": round(max((r for _, r in t.rss), default=0) / 2**20, 1),
            "rss_growth_pct": round(growth * 100, 2),
            "rss_measured_from_s": warm,
            "rss_mb_series": [
                [at, round(rss / 2**20, 1)] for at, rss in t.rss[:: max(1, len(t.rss) // 30)]
            ],
            "passed": passed,
        }


def print_table(report: dict[str, Any]) -> None:
    console = Console()
    table = Table(title=f"soak: {report['duration_s']:.0f} s, {report['concurrency']} clients")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("requests", f"{report['requests']:,} ({report['requests_per_s']}/s)"),
        ("complete", f"{report['complete']:,}"),
        ("client disconnects (on purpose)", f"{report['client_disconnected']:,}"),
        ("well-formed errors", f"{report['errors']:,}"),
        *((f"  {k}", f"{v:,}") for k, v in report["errors_by_kind"].items()),
        ("errors outside fault windows", str(sum(report["errors_outside_fault_windows"].values()))),
        ("lost (must be 0)", str(report["lost"])),
        ("faults injected", ", ".join(f"{k} x{v}" for k, v in report["faults_injected"].items())),
        (
            "latency p50 / p99 (complete)",
            f"{report['latency_ms']['p50']} / {report['latency_ms']['p99']} ms",
        ),
        (
            "proxy RSS start / end / peak",
            f"{report['rss_start_mb']} / {report['rss_end_mb']} / {report['rss_peak_mb']} MiB",
        ),
        ("RSS growth (must be < 10 %)", f"{report['rss_growth_pct']} %"),
        ("proxy alive", str(report["proxy_alive"])),
        ("passed", str(report["passed"])),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", default="10m", help="how long to run: 600, 60s, 10m")
    parser.add_argument("--concurrency", type=int, default=12, help="clients looping at once")
    parser.add_argument("--fault-every", default="20s", help="seconds between two faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': stdout)")
    args = parser.parse_args(argv)
    soak = Soak(args)
    try:
        soak.start()
        asyncio.run(soak.run_all())
        report = soak.report()
    finally:
        soak.stop()
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print_table(report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
