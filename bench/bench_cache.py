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

Run: ``python bench/bench_cache.py [--quick] [--workloads a,b] [--slots 2] [--out DIR]``.
Writes ``cache.json`` in ``--out`` (default ``bench/results``). Five to ten minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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


def summary_of(results: list[Result], own_s: float, rules: dict[str, int]) -> dict[str, Any]:
    summary = loadgen.summarize(results, Window(0.0, own_s), SLO)
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


def run_workload(
    name: str, scale: workloads.Scale, workdir: Path, slots: int, proxy_args: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """The workload direct and through prefixgate, in lockstep, each on a fresh llama-server."""
    # --poll 0: the server waiting for its turn sleeps instead of spinning its threads, which
    # would take the cores from the one computing.
    extra = ("--poll", "0")
    with (
        procs.start_llama_server(workdir, slots=slots, ctx=4096 * slots, extra=extra) as direct,
        procs.start_llama_server(workdir, slots=slots, ctx=4096 * slots, extra=extra) as behind,
        procs.start_prefixgate(
            workdir, behind.url, name=f"prefixgate-{name}", extra=proxy_args
        ) as proxy,
    ):
        workload = workloads.WORKLOADS[name]

        Run = tuple[list[Result], float]

        async def both() -> tuple[Run, Run]:
            turns = Turns(list(MODES))
            return await asyncio.gather(
                drive("direct", direct.url, workload, scale, turns),
                drive("prefixgate", proxy.url, workload, scale, turns),
            )

        with procs.OtherLoad() as other:
            (d_results, d_own), (p_results, p_own) = asyncio.run(both())
        time.sleep(0.3)  # records are written just after each response ends
        rules = fired_rules(proxy.extra_files["records"])
    runs = {
        "direct": summary_of(d_results, d_own, {}),
        "prefixgate": summary_of(p_results, p_own, rules),
    }
    for summary in runs.values():
        summary["other_cpu_cores"] = other.cores
    return runs


def run(
    scale: workloads.Scale,
    names: list[str],
    out_dir: Path,
    slots: int,
    note_placement: str | None = None,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": [round(x, 2) for x in os.getloadavg()],
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "backend": (
            f"llama-server, SmolLM2-135M Q4_1, -np {slots}, -c {4096 * slots}, -t 2, --poll 0"
        ),
        "slo": {"ttft_ms": SLO.ttft_ms, "tpot_ms": SLO.tpot_ms},
        "scale": vars_of(scale),
        "workloads": {},
    }
    with tempfile.TemporaryDirectory(prefix="pg-cache-") as tmp:
        proxy_args: list[str] = []
        if note_placement is not None:
            config = Path(tmp) / "prefixgate.toml"
            config.write_text(f'[canonical]\nnote_placement = "{note_placement}"\n')
            proxy_args = ["--config", str(config)]
            report["note_placement"] = note_placement
        for name in names:
            print(f"== {name}", flush=True)
            t0 = time.monotonic()
            runs = run_workload(name, scale, Path(tmp), slots, proxy_args)
            for summary in runs.values():
                summary["seconds"] = round(time.monotonic() - t0, 1)
                summary["loadavg"] = [round(x, 2) for x in os.getloadavg()]
            report["workloads"][name] = runs
    report["machine"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cache.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return report


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
        "TTFT p50 ms",
        "TTFT p90 ms",
        "SLO met",
        "goodput req/s",
        "rules fired",
    ):
        table.add_column(col, justify="right")
    for name, modes in report["workloads"].items():
        for mode, s in modes.items():
            share = s["cached_share"]
            table.add_row(
                name,
                mode,
                str(s["requests"]),
                f"{s['prompt_tokens']:,}",
                "-" if share is None else f"{share:.1%}",
                f"{s['ttft_ms']['p50']:,.0f}",
                f"{s['ttft_ms']['p90']:,.0f}",
                f"{s['slo_met_share']:.0%}",
                f"{s['goodput_rps']:.2f}",
                ", ".join(f"{k} {v}" for k, v in s["canonical_rules"].items()) or "-",
            )
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny workloads (smoke)")
    parser.add_argument("--workloads", default=",".join(workloads.WORKLOADS))
    parser.add_argument("--slots", type=int, default=2, help="llama-server -np")
    parser.add_argument("--out", default=str(procs.BENCH / "results"))
    parser.add_argument(
        "--note-placement",
        choices=NOTE_PLACEMENTS,
        help="the canonicalizer's note_placement for the proxied runs (default: its default)",
    )
    args = parser.parse_args(argv)
    scale = workloads.QUICK if args.quick else workloads.Scale()
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in workloads.WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: {', '.join(workloads.WORKLOADS)}")
    report = run(scale, names, Path(args.out), args.slots, args.note_placement)
    print_table(report)
    print(f"wrote {Path(args.out) / 'cache.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
