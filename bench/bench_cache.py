"""Cache gains on a real llama-server (SmolLM2): each workload direct vs through prefixgate.

For every workload in ``bench/workloads.py`` the same requests are sent twice, each run to its
own freshly started llama-server (so both begin with an empty cache): once straight to it, once
through ``prefixgate serve`` (canonicalizer on, its defaults). Each run sends its requests one
after another, as the workload's users would, and the two runs go in lockstep (direct request,
proxied request, direct, ...) so both meet the same machine load. Reported per run, from the
backend's own usage figures (``prompt_tokens_details.cached_tokens`` / ``timings.cache_n``): the
share of prompt tokens served from cache, TTFT p50 / p90 measured by the client, and goodput
against the SLO: the share of requests that met it, and SLO-met requests per second of the run's
own time (the sum of its requests' end-to-end times). For the proxied run, the canonicalizer
rules that fired (from prefixgate's records).

Every server runs with ``--jinja`` and a ChatML template that prints tools and tool calls
(``deploy/templates/chatml-tools.jinja``), so what the proxy does to tools reaches the prompt.

The fleet workloads (``fleet_fixed``, ``fleet_clock``: more agent conversations than slots, see
``workloads.fleet_bodies``) also report the **ideal**: the share an unbounded cache would serve
for the same conversations with nothing volatile in them, exact to the token (each request's
prompt rendered by the server's ``/apply-template`` and tokenized by its ``/tokenize``, reused up
to its longest common prefix with any earlier prompt). Every proxied run reports the prediction
error: mean ``|predicted_cached_tokens - cached_tokens| / prompt_tokens`` over its records.
Shares are over every request but the first of each run (the first can hit nothing).

Every proxied run also reports the miss attribution of its records (``proxy.attribution``): the
uncached prompt tokens by cause (new, breaker, routing, evicted, unexplained), with the rules
named for the breakers and the reasons for routing.

Run: ``python bench/bench_cache.py [--quick] [--workloads a,b] [--slots 2] [--out DIR]``
(``--slots 0``: llama-server's own slot setup, no ``-np``; ``--server-args "..."``: more
llama-server flags, for both runs, which the proxy is told of where it models them;
``--canonical-mode dry-run``: the canonicalizer only watches, and forwards the original requests;
``--replicas 2 --policy round-robin``: the proxied run spreads over that many llama-servers,
each as large as the direct run's one; ``--proxied-only``: no direct run).
Writes ``cache.json`` in ``--out`` (default ``bench/results``). Ten to twenty minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import shlex
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen
import procs
import workloads
from loadgen import Result, Slo, Window

from proxy.canonical.config import NOTE_PLACEMENTS

MODES = ("direct", "prefixgate")
SLO = Slo(ttft_ms=1000.0, tpot_ms=100.0)
TEMPLATE = procs.BENCH.parent / "deploy" / "templates" / "chatml-tools.jinja"
DEFAULT_SERVER_SLOTS = 4  # llama-server without -np


class Turns:
    """Lets several drivers send one request each, in turn: A, B, A, B, ...

    The direct run and the proxied run of a workload go in lockstep, so that both see the same
    machine at the same moment (on a shared machine the load changes by the minute).
    """

    def __init__(self, names: list[str]) -> None:
        self.active = list(names)
        self.turn = 0
        self.cond = asyncio.Condition()

    async def wait(self, name: str) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.active[self.turn % len(self.active)] == name)

    async def done(self) -> None:
        async with self.cond:
            self.turn += 1
            self.cond.notify_all()

    async def leave(self, name: str) -> None:
        async with self.cond:
            self.active.remove(name)
            self.turn = 0
            self.cond.notify_all()


async def drive(
    name: str, url: str, workload: workloads.Workload, scale: workloads.Scale, turns: Turns
) -> tuple[list[Result], float]:
    """Run one workload against ``url``, one request at a time, each streamed and timed.

    Returns the results and the run's own time (the sum of its requests' end-to-end times:
    the time spent waiting for the other driver's turn is not this run's).
    """
    results: list[Result] = []
    own = 0.0
    async with loadgen.new_session() as session:

        async def send(body: dict[str, Any]) -> Result:
            nonlocal own
            await turns.wait(name)
            try:
                r = await loadgen.send(
                    session,
                    url + loadgen.CHAT_PATH,
                    orjson.dumps(body),
                    start_s=own,
                    keep_text=True,
                )
            finally:
                await turns.done()
            if not r.ok:
                raise procs.BenchError(f"{name}: request failed: {r.error} (status {r.status})")
            own += r.e2e_ms / 1000.0
            results.append(r)
            return r

        try:
            await workload(send, scale)
        finally:
            await turns.leave(name)
    return results, own


def fired_rules(records_path: Path) -> dict[str, int]:
    counts: Counter[str] = Counter()
    try:
        lines = records_path.read_bytes().splitlines()
    except OSError:
        return {}
    for line in lines:
        rec = orjson.loads(line)
        if rec.get("event") == "request":
            counts.update(rec.get("canonical_rules") or [])
    return dict(counts)


def read_records(records_path: Path) -> list[dict[str, Any]]:
    try:
        lines = records_path.read_bytes().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        rec = orjson.loads(line)
        if rec.get("event") == "request":
            out.append(rec)
    return out


def prediction_error(records: list[dict[str, Any]]) -> float | None:
    """Mean |predicted - measured| cached tokens over prompt tokens, per request."""
    errors = [
        abs(r["predicted_cached_tokens"] - r["cached_tokens"]) / r["prompt_tokens"]
        for r in records
        if r.get("prompt_tokens")
        and r.get("cached_tokens") is not None
        and r.get("predicted_cached_tokens") is not None
    ]
    return round(sum(errors) / len(errors), 4) if errors else None


MISS_KEYS = {
    "new": "miss_new_tokens",
    "breaker": "miss_breaker_tokens",
    "routing": "miss_routing_tokens",
    "evicted": "miss_evicted_tokens",
    "unexplained": "miss_unexplained_tokens",
}


def miss_attribution(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The records' uncached prompt tokens by cause, with the breakers' rules and the routing
    reasons (tokens each), and each cause's share of the uncached tokens."""
    tokens = dict.fromkeys(MISS_KEYS, 0)
    rules: Counter[str] = Counter()
    why: Counter[str] = Counter()
    uncached = attributed = 0
    for r in records:
        if r.get("miss_new_tokens") is None:
            continue
        attributed += 1
        uncached += r["prompt_tokens"] - r["cached_tokens"]
        for cause, key in MISS_KEYS.items():
            tokens[cause] += r.get(key) or 0
        for rule in r.get("miss_breaker_rules") or ():
            rules[rule] += r.get("miss_breaker_tokens") or 0
        if r.get("miss_routing_why"):
            why[r["miss_routing_why"]] += r.get("miss_routing_tokens") or 0
    return {
        "requests": attributed,
        "uncached_tokens": uncached,
        "tokens": tokens,
        "shares": {c: round(n / uncached, 4) if uncached else None for c, n in tokens.items()},
        "breaker_rules": dict(rules),
        "routing_why": dict(why),
    }


def share_after_first(results: list[Result]) -> float | None:
    prompt = sum(r.prompt_tokens or 0 for r in results[1:])
    cached = sum(r.cached_tokens or 0 for r in results[1:])
    return round(cached / prompt, 4) if prompt else None


def summary_of(results: list[Result], own_s: float, rules: dict[str, int]) -> dict[str, Any]:
    summary = loadgen.summarize(results, Window(0.0, own_s), SLO)
    summary["cached_share_after_first"] = share_after_first(results)
    summary["canonical_rules"] = rules
    summary["per_request"] = [
        {
            "ttft_ms": None if r.ttft_ms is None else round(r.ttft_ms, 1),
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
        }
        for r in results
    ]
    return summary


def fleet_scale(scale: workloads.Scale, slots: int) -> workloads.Scale:
    """At least 1.5 conversations per slot."""
    n = slots if slots > 0 else DEFAULT_SERVER_SLOTS
    k = max(scale.fleet_conversations, math.ceil(1.5 * n))
    return dataclasses.replace(scale, fleet_conversations=k)


async def token_ids(url: str, bodies: list[dict[str, Any]]) -> list[list[int]]:
    """Each chat body's prompt as the server renders and tokenizes it."""
    out = []
    async with loadgen.new_session() as session:
        for body in bodies:
            async with session.post(url + "/apply-template", json=body) as resp:
                prompt = (await resp.json())["prompt"]
            tok = {"content": prompt, "add_special": True, "parse_special": True}
            async with session.post(url + "/tokenize", json=tok) as resp:
                out.append((await resp.json())["tokens"])
    return out


def ideal_share(prompts: list[list[int]]) -> float | None:
    """What an unbounded cache serves: each prompt's longest common prefix with any earlier one
    (at most all but one token), over every prompt but the first."""
    cached = total = 0
    for i, tokens in enumerate(prompts):
        best = 0
        for earlier in prompts[:i]:
            n = 0
            for a, b in zip(tokens, earlier, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        if i:
            cached += min(best, len(tokens) - 1)
            total += len(tokens)
    return round(cached / total, 4) if total else None


def run_workload(
    name: str,
    scale: workloads.Scale,
    workdir: Path,
    slots: int,
    proxy_args: Sequence[str] = (),
    server_args: Sequence[str] = (),
    records_out: Path | None = None,
    replicas: int = 1,
    proxied_only: bool = False,
) -> dict[str, Any]:
    """The workload direct and through prefixgate, in lockstep, each on a fresh llama-server.

    ``records_out``: where to keep a copy of prefixgate's records; ``replicas``: llama-servers
    behind the proxy; ``proxied_only``: no direct run (half the machine time, for what only
    the proxy's records say, such as the miss attribution).
    """
    modes = ("prefixgate",) if proxied_only else MODES
    # --poll 0: the server waiting for its turn sleeps instead of spinning its threads, which
    # would take the cores from the one computing.
    extra = ("--poll", "0", "--jinja", "--chat-template-file", str(TEMPLATE), *server_args)
    if "--slot-save-path" in extra[:-1]:  # llama-server wants the directory to exist
        Path(extra[extra.index("--slot-save-path") + 1]).mkdir(parents=True, exist_ok=True)
    ctx = 4096 * max(slots, 2)
    if name.startswith("fleet_"):
        scale = fleet_scale(scale, slots)
    with contextlib.ExitStack() as stack:
        direct = None
        if not proxied_only:
            direct = stack.enter_context(
                procs.start_llama_server(workdir, slots=slots, ctx=ctx, extra=extra)
            )
        behind = [
            stack.enter_context(
                procs.start_llama_server(workdir, slots=slots, ctx=ctx, extra=extra)
            )
            for _ in range(max(replicas, 1))
        ]
        more = [a for b in behind[1:] for a in ("--backend", b.url)]
        proxy = stack.enter_context(
            procs.start_prefixgate(
                workdir, behind[0].url, name=f"prefixgate-{name}", extra=[*more, *proxy_args]
            )
        )
        workload = workloads.WORKLOADS[name]

        Run = tuple[list[Result], float]

        urls = {"direct": direct.url if direct else "", "prefixgate": proxy.url}

        async def both() -> list[Run]:
            turns = Turns(list(modes))
            return list(
                await asyncio.gather(*(drive(m, urls[m], workload, scale, turns) for m in modes))
            )

        with procs.OtherLoad() as other:
            ran = dict(zip(modes, asyncio.run(both()), strict=True))
        time.sleep(0.3)  # records are written just after each response ends
        rules = fired_rules(proxy.extra_files["records"])
        records = read_records(proxy.extra_files["records"])
        if records_out is not None:
            records_out.write_bytes(proxy.extra_files["records"].read_bytes())
        ideal = None
        if name in workloads.CEILINGS:
            plain = workloads.CEILINGS[name](scale)
            server = direct.url if direct else behind[0].url  # stateless endpoints
            ideal = ideal_share(asyncio.run(token_ids(server, plain)))
    runs: dict[str, Any] = {
        m: summary_of(*ran[m], rules if m == "prefixgate" else {}) for m in modes
    }
    for summary in runs.values():
        summary["other_cpu_cores"] = other.cores
    runs["prefixgate"]["prediction_error"] = prediction_error(records)
    runs["prefixgate"]["miss_attribution"] = miss_attribution(records)
    runs["prefixgate"]["route_reasons"] = dict(Counter(r.get("route_reason") for r in records))
    runs["prefixgate"]["cache_sources"] = dict(Counter(r.get("cache_source") for r in records))
    runs["prefixgate"]["schedule_reasons"] = dict(
        Counter(r.get("schedule_reason") for r in records)
    )
    if ideal is not None:
        runs["ideal"] = {"cached_share_after_first": ideal}
        for mode in modes:
            share = runs[mode].get("cached_share_after_first")
            if share is not None and ideal:
                runs[mode]["share_of_ideal"] = round(share / ideal, 3)
    return runs


def run(
    scale: workloads.Scale,
    names: list[str],
    out_dir: Path,
    slots: int,
    note_placement: str | None = None,
    server_args: Sequence[str] = (),
    report_name: str = "cache",
    canonical: str | None = None,
    canonical_mode: str = "on",
    replicas: int = 1,
    policy: str | None = None,
    proxied_only: bool = False,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "backend": (
            f"llama-server, SmolLM2-135M Q4_1, {f'-np {slots}' if slots else 'no -np'}, "
            f"-c {4096 * max(slots, 2)}, -t 2, --poll 0, --jinja (tools template)"
            + (f", {' '.join(server_args)}" if server_args else "")
        ),
        "slo": {"ttft_ms": SLO.ttft_ms, "tpot_ms": SLO.tpot_ms},
        "canonical_mode": canonical_mode,
        "replicas": replicas,
        "policy": policy,
        "scale": vars_of(scale),
        "workloads": {},
    }
    with tempfile.TemporaryDirectory(prefix="pg-cache-") as tmp:
        proxy_args: list[str] = proxy_args_for(server_args)
        if canonical_mode == "dry-run":
            proxy_args.append("--canonical-dry-run")
        if policy is not None:
            proxy_args += ["--policy", policy]
        if note_placement is not None or canonical is not None:
            config = Path(tmp) / "prefixgate.toml"
            table = "[canonical]\n"
            if note_placement is not None:
                table += f'note_placement = "{note_placement}"\n'
                report["note_placement"] = note_placement
            if canonical is not None:  # e.g. "rules.volatile_learned.min_values = 2"
                table += canonical.replace(";", "\n") + "\n"
                report["canonical"] = canonical
            config.write_text(table)
            proxy_args += ["--config", str(config)]
        for name in names:
            print(f"== {name}", flush=True)
            t0 = time.monotonic()
            out_dir.mkdir(parents=True, exist_ok=True)
            kept = out_dir / f"{report_name}-{name}-records.jsonl"
            runs = run_workload(
                name, scale, Path(tmp), slots, proxy_args, server_args, kept, replicas, proxied_only
            )
            for summary in runs.values():
                summary["seconds"] = round(time.monotonic() - t0, 1)
                summary["loadavg"] = [round(x, 2) for x in os.getloadavg()]
            report["workloads"][name] = runs
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{report_name}.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return report


def proxy_args_for(server_args: Sequence[str]) -> list[str]:
    """Tell the proxy the llama-server flags its cache model follows."""
    args = list(server_args)
    for flag in ("--slot-prompt-similarity", "-sps"):
        if flag in args and args.index(flag) + 1 < len(args):
            return ["--server-slot-similarity", args[args.index(flag) + 1]]
    return []


def vars_of(scale: workloads.Scale) -> dict[str, Any]:
    return {f: getattr(scale, f) for f in scale.__dataclass_fields__}


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Cache gains, {report['backend']}; SLO TTFT <= {SLO.ttft_ms:.0f} ms")
    for col in (
        "workload",
        "mode",
        "requests",
        "prompt tokens",
        "cached share",
        "after first",
        "pred. error",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "SLO met",
        "goodput req/s",
        "rules fired",
    ):
        table.add_column(col, justify="right")
    for name, modes in report["workloads"].items():
        for mode, s in modes.items():
            after = s.get("cached_share_after_first")
            if mode == "ideal":
                ratios = " / ".join(
                    f"{m} {modes[m]['share_of_ideal']:.3f}"
                    for m in MODES
                    if "share_of_ideal" in modes.get(m, {})
                )
                table.add_row(name, mode, *["-"] * 3, f"{after:.1%}", *["-"] * 5, ratios)
                continue
            share = s["cached_share"]
            error = s.get("prediction_error")
            table.add_row(
                name,
                mode,
                str(s["requests"]),
                f"{s['prompt_tokens']:,}",
                "-" if share is None else f"{share:.1%}",
                "-" if after is None else f"{after:.1%}",
                "-" if error is None else f"{error:.3f}",
                f"{s['ttft_ms']['p50']:,.0f}",
                f"{s['ttft_ms']['p90']:,.0f}",
                f"{s['slo_met_share']:.0%}",
                f"{s['goodput_rps']:.2f}",
                ", ".join(f"{k} {v}" for k, v in s["canonical_rules"].items()) or "-",
            )
    Console(width=200).print(table)
    causes = list(MISS_KEYS)
    misses = Table(title="Uncached prompt tokens of the proxied runs, by cause (miss attribution)")
    for col in ("workload", "uncached tokens", *causes, "breaker rules", "routing why"):
        misses.add_column(col, justify="right")
    for name, modes in report["workloads"].items():
        m = modes["prefixgate"].get("miss_attribution")
        if not m:
            continue
        misses.add_row(
            name,
            f"{m['uncached_tokens']:,}",
            *(
                f"{m['tokens'][c]:,} ({m['shares'][c]:.1%})" if m["shares"][c] is not None else "-"
                for c in causes
            ),
            ", ".join(f"{k} {v:,}" for k, v in m["breaker_rules"].items()) or "-",
            ", ".join(f"{k} {v:,}" for k, v in m["routing_why"].items()) or "-",
        )
    Console(width=200).print(misses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny workloads (smoke)")
    parser.add_argument("--workloads", default=",".join(workloads.WORKLOADS))
    parser.add_argument(
        "--slots", type=int, default=2, help="llama-server -np (0: its own setup, no -np)"
    )
    parser.add_argument("--server-args", default="", help="more llama-server flags")
    parser.add_argument("--name", default="cache", help="report file name (without .json)")
    parser.add_argument("--out", default=str(procs.BENCH / "results"))
    parser.add_argument(
        "--note-placement",
        choices=NOTE_PLACEMENTS,
        help="the canonicalizer's note_placement for the proxied runs (default: its default)",
    )
    parser.add_argument(
        "--canonical",
        help="more [canonical] TOML lines for the proxied runs, ';'-separated "
        "(e.g. 'rules.volatile_learned.min_values = 2')",
    )
    parser.add_argument(
        "--canonical-mode",
        choices=("on", "dry-run"),
        default="on",
        help="the proxied runs' canonicalizer: on (its defaults) or dry-run (watches only)",
    )
    parser.add_argument(
        "--replicas", type=int, default=1, help="llama-servers behind the proxy (default 1)"
    )
    parser.add_argument("--policy", help="the proxy's routing policy (with --replicas > 1)")
    parser.add_argument(
        "--proxied-only", action="store_true", help="no direct run (the proxy's records only)"
    )
    args = parser.parse_args(argv)
    scale = workloads.QUICK if args.quick else workloads.Scale()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in workloads.WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(workloads.WORKLOADS)}")
    report = run(
        scale,
        names,
        Path(args.out),
        args.slots,
        args.note_placement,
        shlex.split(args.server_args),
        args.name,
        args.canonical,
        args.canonical_mode,
        args.replicas,
        args.policy,
        args.proxied_only,
    )
    print_table(report)
    print(f"wrote {Path(args.out) / (args.name + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
