"""What a proxy adds: direct vs nginx vs LiteLLM vs prefixgate (embedded, Redis) in front of a
fast fake backend, with the same load generator.

The backend (``bench/fake_backend.py``) answers at once and streams ``--tokens`` tokens
``--itl-ms`` apart, so everything above the direct figures is the proxy. Every target is
started and warmed up, then each phase runs on every target in turn:

* ``c1_8k``, ``c1_512k``: one stream at a time, 8 KB and 512 KB prompts: added TTFT and
  end-to-end latency (p50 / p99 over direct), and prefixgate's own ``proxy_overhead_ms`` from
  its records;
* ``c64``, ``c256``: 64 and 256 concurrent streams, closed loop: requests/s sustained, TTFT and
  end-to-end under load;
* ``open``: Poisson arrivals at a fixed rate: latency and goodput (SLO met) at the same offered
  load for every target;
* the proxy's resident memory (its process tree), peak per phase: at 1, 64 and 256 streams.

nginx is the physical limit of a reverse proxy: one worker, ``proxy_buffering off``, HTTP/1.1
keep-alive upstream. ``aiohttp-relay`` (``bench/bare_relay.py``) is the floor of a proxy built
on aiohttp in one process: it forwards and streams back, and does nothing else. LiteLLM runs
from its own venv (``bench/.venv-litellm``) as a plain OpenAI pass-through (no auth, no
database). Load generator, backend and proxy share the machine's cores; each phase records how
many cores other work used meanwhile (``other_cpu_cores``) and the load average.

Run: ``python bench/bench_overhead.py [--quick] [--targets direct,nginx,...] [--out DIR]``.
Writes ``overhead.json`` in ``--out`` (default ``bench/results``) and prints the tables.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen
import procs
from loadgen import Slo

from analyzers.quantile import percentile

TARGETS = ("direct", "nginx", "aiohttp-relay", "litellm", "prefixgate", "prefixgate-redis")
PROXIES = tuple(t for t in TARGETS if t != "direct")
PATH = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Plan:
    """How much load each phase offers."""

    c1_requests: int = 300
    big_requests: int = 60
    small_bytes: int = 8 * 1024
    big_bytes: int = 512 * 1024
    concurrency: tuple[int, ...] = (64, 256)
    load_s: float = 8.0
    warmup_s: float = 1.0
    open_rate: float = 100.0
    open_s: float = 6.0
    tokens: int = 16
    itl_ms: float = 2.0
    fake_slots: int = 8  # what the fake's /props reports, as a llama-server -np 8 would
    slo: Slo = field(default_factory=lambda: Slo(ttft_ms=50.0, tpot_ms=10.0))


QUICK = Plan(
    c1_requests=30,
    big_requests=4,
    concurrency=(64, 256),
    load_s=1.0,
    warmup_s=0.3,
    open_rate=50.0,
    open_s=1.0,
)


def salted_bodies(prompt_bytes: int, tokens: int) -> Callable[[int], bytes]:
    """Request *i*: a shared system prompt, then a user message starting with *i*.

    Every request is distinct (as real traffic is), built by splicing the number into one
    serialized template, so the load generator spends no time on JSON.
    """
    template = loadgen.chat_body(prompt_bytes, max_tokens=tokens, salt="@@SALT@@")
    head, _, tail = template.partition(b"@@SALT@@")

    def body(i: int) -> bytes:
        return head + b"%010d" % i + tail

    return body


# -- targets -------------------------------------------------------------------------------------


@contextmanager
def target(name: str, workdir: Path, backend_url: str) -> Iterator[procs.Proc | None]:
    """Start what ``name`` needs in front of the backend; yield the proxy (None for direct)."""
    with ExitStack() as stack:
        if name == "direct":
            yield None
        elif name == "nginx":
            yield stack.enter_context(procs.start_nginx(workdir, backend_url))
        elif name == "aiohttp-relay":
            yield stack.enter_context(procs.start_bare_relay(workdir, backend_url))
        elif name == "litellm":
            yield stack.enter_context(procs.start_litellm(workdir, backend_url))
        elif name == "prefixgate":
            yield stack.enter_context(procs.start_prefixgate(workdir, backend_url))
        elif name == "prefixgate-redis":
            redis = stack.enter_context(procs.start_redis(workdir))
            yield stack.enter_context(
                procs.start_prefixgate(
                    workdir, backend_url, redis_url=redis.url, name="prefixgate-redis"
                )
            )
        else:
            raise ValueError(f"unknown target {name!r}; one of {', '.join(TARGETS)}")


def proxy_overheads(proxy: procs.Proc | None, id_prefix: str, expected: int) -> dict[str, Any]:
    """``proxy_overhead_ms`` p50 / p99 from prefixgate's records of one phase."""
    if proxy is None or "records" not in proxy.extra_files:
        return {}
    path = proxy.extra_files["records"]
    values: list[float] = []
    deadline = time.monotonic() + 5.0  # records are written after each response ends
    while True:
        values = []
        with open(path, "rb") as f:
            for line in f:
                if id_prefix.encode() not in line:
                    continue
                rec = orjson.loads(line)
                if rec.get("event") == "request" and str(rec.get("request_id", "")).startswith(
                    id_prefix + "-"
                ):
                    values.append(float(rec["proxy_overhead_ms"]))
        if len(values) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    values.sort()
    return {
        "records": len(values),
        "p50": percentile(values, 0.5),
        "p99": percentile(values, 0.99),
    }


def run_phase(
    name: str,
    proxy: procs.Proc | None,
    run: Callable[[str], tuple[list[loadgen.Result], loadgen.Window]],
    slo: Slo,
    tag: str,
) -> dict[str, Any]:
    id_prefix = f"{tag}-{name}"
    with procs.RssSampler(proxy) as rss, procs.OtherLoad() as other:
        results, window = run(id_prefix)
    summary = loadgen.summarize(results, window, slo)
    summary["rss_mb"] = rss.peak_mb
    summary["other_cpu_cores"] = other.cores
    summary["proxy_overhead_ms"] = proxy_overheads(proxy, id_prefix, len(results))
    summary["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return summary


Runner = Callable[[str, str], tuple[list[loadgen.Result], loadgen.Window]]


def phases(plan: Plan) -> dict[str, Runner]:
    """Each phase as a function of (chat URL, request-id prefix)."""
    small = salted_bodies(plan.small_bytes, plan.tokens)
    big = salted_bodies(plan.big_bytes, plan.tokens)

    def c1(bodies: loadgen.BodyFactory, n: int) -> Runner:
        return lambda url, p: asyncio.run(
            loadgen.closed_loop(url, bodies, concurrency=1, requests=n, id_prefix=p)
        )

    def loaded(c: int) -> Runner:
        return lambda url, p: asyncio.run(
            loadgen.closed_loop(
                url,
                small,
                concurrency=c,
                duration_s=plan.load_s,
                warmup_s=plan.warmup_s,
                id_prefix=p,
            )
        )

    out: dict[str, Runner] = {
        "c1_8k": c1(small, plan.c1_requests),
        "c1_512k": c1(big, plan.big_requests),
    }
    for c in plan.concurrency:
        out[f"c{c}"] = loaded(c)
    out["open"] = lambda url, p: asyncio.run(
        loadgen.open_loop(url, small, rate=plan.open_rate, duration_s=plan.open_s, id_prefix=p)
    )
    return out


def warm_up(url: str, proxy: procs.Proc | None, plan: Plan) -> dict[str, Any]:
    """Connections, the proxy's code paths, its backend detection; then its idle memory."""
    small = salted_bodies(plan.small_bytes, plan.tokens)
    asyncio.run(loadgen.closed_loop(url, small, concurrency=8, requests=64))
    if proxy is None:
        return {}
    proxy.pids(refresh=True)
    return {"rss_idle_mb": round(proxy.rss_kb() / 1024.0, 1)}


# -- comparison ----------------------------------------------------------------------------------


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)  # type: ignore[assignment]
    return d


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def compare(results: dict[str, Any], plan: Plan) -> dict[str, Any]:
    """Added latency over direct, sustained rate and memory, per proxy."""
    direct = results.get("direct", {}).get("phases", {})
    table: dict[str, Any] = {}
    for name, res in results.items():
        phases = res.get("phases", {})
        row: dict[str, Any] = {}
        for phase in ("c1_8k", "c1_512k", *(f"c{c}" for c in plan.concurrency)):
            p, d = phases.get(phase, {}), direct.get(phase, {})
            for metric in ("ttft_ms", "e2e_ms"):
                for q in ("p50", "p99"):
                    row[f"{phase}.{metric}.{q}"] = _get(p, metric, q)
                    row[f"{phase}.added_{metric}.{q}"] = _sub(
                        _get(p, metric, q), _get(d, metric, q)
                    )
        loads = [phases.get(f"c{c}", {}) for c in plan.concurrency]
        clean = [p["rps"] for p in loads if p and not p.get("errors")]
        row["max_rps"] = max(clean) if clean else None
        for c in plan.concurrency:
            row[f"c{c}.rps"] = _get(phases, f"c{c}", "rps")
        row["rss_mb.1"] = _get(phases, "c1_8k", "rss_mb")
        for c in plan.concurrency:
            row[f"rss_mb.{c}"] = _get(phases, f"c{c}", "rss_mb")
        for phase in ("c1_8k", "c1_512k"):
            row[f"{phase}.proxy_overhead_ms.p50"] = _get(phases, phase, "proxy_overhead_ms", "p50")
            row[f"{phase}.proxy_overhead_ms.p99"] = _get(phases, phase, "proxy_overhead_ms", "p99")
        row["open.ttft_ms.p50"] = _get(phases, "open", "ttft_ms", "p50")
        row["open.ttft_ms.p99"] = _get(phases, "open", "ttft_ms", "p99")
        row["open.goodput_rps"] = _get(phases, "open", "goodput_rps")
        table[name] = row
    return table


# Lower is better for everything but requests/s.
BEAT_LITELLM = (
    "c1_8k.added_ttft_ms.p50",
    "c1_8k.added_ttft_ms.p99",
    "c1_8k.added_e2e_ms.p50",
    "c1_8k.added_e2e_ms.p99",
    "c1_512k.added_ttft_ms.p50",
    "c1_512k.added_ttft_ms.p99",
    "c1_512k.added_e2e_ms.p50",
    "c1_512k.added_e2e_ms.p99",
    "c64.added_ttft_ms.p50",
    "c64.added_ttft_ms.p99",
    "c64.added_e2e_ms.p50",
    "c64.added_e2e_ms.p99",
    "max_rps",
    "rss_mb.1",
    "rss_mb.64",
    "rss_mb.256",
)


def _check(name: str, value: Any, limit: Any, ok: bool | None, note: str = "") -> dict[str, Any]:
    return {"target": name, "value": value, "limit": limit, "pass": ok, "note": note}


def targets_check(table: dict[str, Any], proxy: str = "prefixgate") -> list[dict[str, Any]]:
    """The overhead targets, pass or fail (None: not measured in this run)."""
    pg, ng, ll = table.get(proxy), table.get("nginx"), table.get("litellm")
    checks: list[dict[str, Any]] = []
    if pg is None:
        return checks
    relay = table.get("aiohttp-relay")
    if relay is not None:
        checks += relay_checks(pg, relay)
    v = pg.get("c1_8k.added_ttft_ms.p50")
    checks.append(_check("1 stream: added TTFT p50 <= 1 ms", v, 1.0, None if v is None else v <= 1))
    v = pg.get("c1_8k.proxy_overhead_ms.p50")
    checks.append(
        _check("proxy_overhead_ms p50 <= 1 ms at 8 KB", v, 1.0, None if v is None else v <= 1)
    )
    if ng is not None:
        v, n = pg.get("c64.rps"), ng.get("c64.rps")
        ok = None if v is None or not n else v >= 0.8 * n
        checks.append(_check("64 streams: requests/s >= 80 % of nginx", v, _r(n, 0.8), ok))
        v, n = pg.get("c64.added_ttft_ms.p50"), ng.get("c64.added_ttft_ms.p50")
        ok = None if v is None or n is None else v <= 2 * max(n, 0.0)
        checks.append(
            _check(
                "64 streams: added TTFT p50 <= 2x nginx's added TTFT p50",
                v,
                _r(n, 2),
                ok,
                "strict reading: the latency each adds over direct",
            )
        )
        v, n = pg.get("c64.ttft_ms.p50"), ng.get("c64.ttft_ms.p50")
        ok = None if v is None or not n else v <= 2 * n
        checks.append(
            _check(
                "64 streams: TTFT p50 <= 2x nginx's TTFT p50", v, _r(n, 2), ok, "lenient reading"
            )
        )
    if ll is not None:
        lost = []
        for key in BEAT_LITELLM:
            a, b = pg.get(key), ll.get(key)
            if a is None or b is None:
                continue
            better = a > b if key == "max_rps" else a < b
            if not better:
                lost.append(f"{key}: {a} vs {b}")
        checks.append(
            _check(
                "beats LiteLLM on every overhead figure",
                f"{len(BEAT_LITELLM) - len(lost)}/{len(BEAT_LITELLM)}",
                "all",
                not lost,
                "; ".join(lost),
            )
        )
    return checks


def relay_checks(pg: dict[str, Any], relay: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 21's targets, against the bare aiohttp relay of the same run (CPU per request at
    64 streams is ``bench/profile_proxy.py --cpu-only --against relay``'s)."""
    checks = []
    v, r = pg.get("c1_8k.added_ttft_ms.p50"), relay.get("c1_8k.added_ttft_ms.p50")
    ok = None if v is None or r is None else v <= r + 0.3
    limit = None if r is None else round(r + 0.3, 3)
    checks.append(_check("1 stream: added TTFT p50 <= the relay's + 0.3 ms", v, limit, ok))
    v, r = pg.get("c64.rps"), relay.get("c64.rps")
    ok = None if v is None or not r else v >= 0.9 * r
    checks.append(_check("64 streams: requests/s >= 0.9 x the relay's", v, _r(r, 0.9), ok))
    v = pg.get("c1_512k.proxy_overhead_ms.p50")
    ok = None if v is None else v <= 3.0
    checks.append(_check("proxy_overhead_ms p50 <= 3 ms at 512 KB", v, 3.0, ok))
    v, r = pg.get("c1_512k.added_ttft_ms.p50"), relay.get("c1_512k.added_ttft_ms.p50")
    ok = None if v is None or r is None else v <= r + 3.0
    limit = None if r is None else round(r + 3.0, 3)
    checks.append(_check("512 KB: added TTFT p50 <= the relay's + 3 ms", v, limit, ok))
    return checks


def _r(x: float | None, k: float) -> float | None:
    return None if x is None else round(x * k, 3)


# -- output --------------------------------------------------------------------------------------


def print_tables(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200)
    table = report["comparison"]
    lat = Table(title="Added over direct, ms (p50 / p99); direct row: absolute")
    lat.add_column("target")
    for col in (
        "TTFT 1 stream 8 KB",
        "e2e 1 stream 8 KB",
        "TTFT 1 stream 512 KB",
        "e2e 1 stream 512 KB",
        "TTFT 64 streams",
        "e2e 64 streams",
    ):
        lat.add_column(col, justify="right")
    for name, row in table.items():
        key = "" if name == "direct" else "added_"
        cells = []
        for phase in ("c1_8k", "c1_512k", "c64"):
            for metric in ("ttft_ms", "e2e_ms"):
                cells.append(
                    f"{_fmt(row.get(f'{phase}.{key}{metric}.p50'))} / "
                    f"{_fmt(row.get(f'{phase}.{key}{metric}.p99'))}"
                )
        lat.add_row(name, *cells)
    console.print(lat)
    load = Table(title="Throughput, memory, prefixgate's own overhead")
    for col in (
        "target",
        "req/s 64",
        "req/s 256",
        "max req/s",
        "RSS MB 1/64/256",
        "proxy_overhead_ms 8 KB p50/p99",
        "512 KB p50/p99",
        "open TTFT p50/p99",
        "open goodput",
    ):
        load.add_column(col, justify="right")
    for name, row in table.items():
        load.add_row(
            name,
            _fmt(row.get("c64.rps")),
            _fmt(row.get("c256.rps")),
            _fmt(row.get("max_rps")),
            f"{_fmt(row.get('rss_mb.1'))} / {_fmt(row.get('rss_mb.64'))} / "
            f"{_fmt(row.get('rss_mb.256'))}",
            f"{_fmt(row.get('c1_8k.proxy_overhead_ms.p50'))} / "
            f"{_fmt(row.get('c1_8k.proxy_overhead_ms.p99'))}",
            f"{_fmt(row.get('c1_512k.proxy_overhead_ms.p50'))} / "
            f"{_fmt(row.get('c1_512k.proxy_overhead_ms.p99'))}",
            f"{_fmt(row.get('open.ttft_ms.p50'))} / {_fmt(row.get('open.ttft_ms.p99'))}",
            _fmt(row.get("open.goodput_rps")),
        )
    console.print(load)
    checks = Table(title="Targets")
    for col in ("target", "value", "limit", "result", "note"):
        checks.add_column(col)
    for proxy, items in report["targets"].items():
        for c in items:
            result = {True: "PASS", False: "FAIL", None: "n/a"}[c["pass"]]
            checks.add_row(
                f"[{proxy}] {c['target']}",
                str(c["value"]),
                str(c["limit"]),
                result,
                c["note"][:120],
            )
    console.print(checks)


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.2f}" if abs(x) < 100 else f"{x:,.0f}"
    return str(x)


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def run(plan: Plan, targets: list[str], out_dir: Path) -> dict[str, Any]:
    """Every phase against every target, phase by phase.

    All targets run side by side (idle but for the one under load), and each phase is measured
    on every target back to back, so that a change in the machine's load during the run
    (other work on a shared machine) affects the comparison as little as possible.
    """
    report: dict[str, Any] = {"machine": machine(), "plan": dataclasses.asdict(plan)}
    results: dict[str, Any] = {}
    tag = f"run{int(time.time())}"
    with tempfile.TemporaryDirectory(prefix="pg-bench-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        fake = stack.enter_context(
            procs.start_fake(workdir, tokens=plan.tokens, itl_ms=plan.itl_ms, slots=plan.fake_slots)
        )
        proxies: dict[str, procs.Proc | None] = {}
        for name in targets:
            print(f"== starting {name}", flush=True)
            proxy = stack.enter_context(target(name, workdir, fake.url))
            proxies[name] = proxy
            url = (proxy.url if proxy is not None else fake.url) + PATH
            results[name] = {**warm_up(url, proxy, plan), "phases": {}}
        for phase, runner in phases(plan).items():
            for name, proxy in proxies.items():
                print(f"== {phase} {name}", flush=True)
                url = (proxy.url if proxy is not None else fake.url) + PATH
                results[name]["phases"][phase] = run_phase(
                    phase, proxy, functools.partial(runner, url), plan.slo, f"{tag}-{name}"
                )
                if proxy is not None and not proxy.alive():
                    raise procs.BenchError(f"{name} died:\n{proxy.log_tail()}")
    report["results"] = results
    report["comparison"] = compare(results, plan)
    report["targets"] = {
        p: targets_check(report["comparison"], p)
        for p in ("prefixgate", "prefixgate-redis")
        if p in results
    }
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "overhead.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few seconds per target (smoke)")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated")
    parser.add_argument("--out", default=str(procs.BENCH / "results"), help="output directory")
    parser.add_argument("--fake-slots", type=int, help="slots the fake backend reports (8)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else Plan()
    if args.fake_slots:
        plan = dataclasses.replace(plan, fake_slots=args.fake_slots)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if "direct" not in targets:
        targets.insert(0, "direct")
    report = run(plan, targets, Path(args.out))
    print_tables(report)
    print(f"wrote {Path(args.out) / 'overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
