"""The control group's measured lift against two separate runs, on real llama-servers (SmolLM2).

Many agent conversations (``workloads.fleet_bodies`` with ``clock``: a clock to the second and
a session id in the system prompt, the tools reordered on every request, the conversations
interleaved turn by turn, more of them than the server has slots) are sent three times, each
run to its own freshly started llama-server, the three in lockstep (one request of each in
turn) so that all meet the same machine load:

* ``mixed``: through ``prefixgate --control-share SHARE``: the control conversations are sent
  as the client wrote them, round-robin, unpinned; the others as prefixgate does;
* ``treated``: through ``prefixgate`` (every conversation canonicalized, routed, scheduled);
* ``plain``: through ``prefixgate --no-canonicalize --slot-scheduling off``: the client's bytes,
  the server choosing its slots (what a control request gets, run on its own).

Per run and group (from the client's measurements: the usage the backend reported, TTFT timed
by the client, the SLO met), the cached share of prompt tokens, TTFT p50 and p90 and goodput,
with the 95 % intervals ``proxy.lift`` computes (clustered by conversation). The question the
bench answers: does the lift measured inside the mixed run (treated minus control) agree with
the difference of the two separate runs (treated minus plain) within its interval? It also
reports the lift the proxy itself computed (its ``/stats`` ``control_group`` block, from its
own records).

Run: ``python bench/bench_control.py [--conversations 32] [--turns 5] [--share 0.5]
[--slots 2] [--quick] [--out DIR]``; writes ``control.json`` in ``--out`` (default
``bench/results``). About ten minutes on 2 cores at the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen
import procs
import workloads
from bench_cache import SLO, TEMPLATE, Turns
from loadgen import Result

from proxy.backends import CHAT
from proxy.control import CONTROL, TREATED, ControlGroup, conversation_key
from proxy.lift import Conversation, Estimate, GroupFigures, compare, lift

RUNS = ("mixed", "treated", "plain")
PLAIN_ARGS = ("--no-canonicalize", "--slot-scheduling", "off")
SERVER_ARGS = ("--poll", "0", "--jinja", "--slot-prompt-similarity", "0")
PROXY_ARGS = ("--server-slot-similarity", "0", "--slo-ttft-ms", str(SLO.ttft_ms))
PROXY_ARGS += ("--slo-tpot-ms", str(SLO.tpot_ms))


async def drive(
    name: str, url: str, bodies: list[dict[str, Any]], turns: Turns
) -> list[tuple[int, Result]]:
    """Send ``bodies`` one at a time (in turn with the other runs); each result with the index
    of the body it answers."""
    out: list[tuple[int, Result]] = []
    async with loadgen.new_session() as session:
        try:
            for i, body in enumerate(bodies):
                await turns.wait(name)
                try:
                    r = await loadgen.send(session, url + loadgen.CHAT_PATH, orjson.dumps(body))
                finally:
                    await turns.done()
                if not r.ok:
                    raise procs.BenchError(f"{name}: request failed: {r.error} ({r.status})")
                out.append((i, r))
        finally:
            await turns.leave(name)
    return out


def tallies(
    results: list[tuple[int, Result]], conversation_of: list[int]
) -> dict[int, Conversation]:
    """Each conversation's tally of the client's measurements (as ``proxy.lift`` keeps them)."""
    convs: dict[int, Conversation] = {}
    for i, r in results:
        conv = convs.setdefault(conversation_of[i], Conversation())
        conv.requests += 1
        if r.prompt_tokens and r.cached_tokens is not None:
            conv.prompt_tokens += r.prompt_tokens
            conv.cached_tokens += min(r.cached_tokens, r.prompt_tokens)
        conv.slo_evaluated += 1
        conv.slo_met += SLO.met(r)
        if r.ttft_ms is not None:
            conv.ttft_ms.append(r.ttft_ms)
    return convs


def estimates(figures: GroupFigures) -> dict[str, Any]:
    return figures.to_json()


def agreement(inside: Estimate, separate: Estimate) -> dict[str, Any]:
    """Whether the mixed run's lift and the separate runs' difference agree: the separate
    difference inside the mixed lift's interval, and the two within their joint interval."""
    out: dict[str, Any] = {"mixed": inside.to_json(), "separate": separate.to_json()}
    if inside.value is None or separate.value is None:
        return out
    out["separate_inside_mixed_ci"] = (
        inside.low is not None
        and inside.high is not None
        and inside.low <= separate.value <= inside.high
    )
    gap = lift(inside, separate)
    out["gap"] = gap.to_json()
    out["gap_ci_holds_zero"] = (
        gap.low is not None and gap.high is not None and (gap.low <= 0.0 <= gap.high)
    )
    return out


def read_stats(admin_url: str) -> dict[str, Any] | None:
    with urllib.request.urlopen(admin_url + "/stats", timeout=10) as resp:
        block = orjson.loads(resp.read()).get("control_group")
    return block if isinstance(block, dict) else None


def run(scale: workloads.Scale, share: float, slots: int, out_dir: Path) -> dict[str, Any]:
    bodies = workloads.fleet_bodies(scale, "clock")
    k = scale.fleet_conversations
    conversation_of = [n % k for n in range(len(bodies))]
    group = ControlGroup(share=share)
    keys = [conversation_key(CHAT, b) for b in bodies]
    assert all(keys[n] == keys[n % k] for n in range(len(bodies))), (
        "a conversation's turns key apart"
    )
    in_control = {c: group.is_control(keys[c]) for c in range(k)}
    ctx = 4096 * max(slots, 2)
    extra = (*SERVER_ARGS, "--chat-template-file", str(TEMPLATE))
    with tempfile.TemporaryDirectory(prefix="pg-control-") as tmp:
        work = Path(tmp)
        with (
            procs.start_llama_server(work, slots=slots, ctx=ctx, extra=extra) as s_mixed,
            procs.start_llama_server(work, slots=slots, ctx=ctx, extra=extra) as s_treated,
            procs.start_llama_server(work, slots=slots, ctx=ctx, extra=extra) as s_plain,
            procs.start_prefixgate(
                work,
                s_mixed.url,
                name="pg-mixed",
                extra=(*PROXY_ARGS, "--control-share", str(share)),
            ) as p_mixed,
            procs.start_prefixgate(
                work, s_treated.url, name="pg-treated", extra=PROXY_ARGS
            ) as p_treated,
            procs.start_prefixgate(
                work, s_plain.url, name="pg-plain", extra=(*PROXY_ARGS, *PLAIN_ARGS)
            ) as p_plain,
        ):

            async def all_three() -> list[list[tuple[int, Result]]]:
                turns = Turns(list(RUNS))
                return await asyncio.gather(
                    drive("mixed", p_mixed.url, bodies, turns),
                    drive("treated", p_treated.url, bodies, turns),
                    drive("plain", p_plain.url, bodies, turns),
                )

            t0 = time.monotonic()
            with procs.OtherLoad() as other:
                mixed, treated, plain = asyncio.run(all_three())
            seconds = time.monotonic() - t0
            time.sleep(0.5)  # records are written just after each response ends
            proxy_view = read_stats(p_mixed.admin_url)
            for proc, name in ((p_mixed, "mixed"), (p_treated, "treated"), (p_plain, "plain")):
                kept = out_dir / f"control-{name}-records.jsonl"
                out_dir.mkdir(parents=True, exist_ok=True)
                kept.write_bytes(proc.extra_files["records"].read_bytes())
    m = tallies(mixed, conversation_of)
    figures = {
        ("mixed", TREATED): GroupFigures.of(c for i, c in m.items() if not in_control[i]),
        ("mixed", CONTROL): GroupFigures.of(c for i, c in m.items() if in_control[i]),
        ("treated", TREATED): GroupFigures.of(tallies(treated, conversation_of).values()),
        ("plain", CONTROL): GroupFigures.of(tallies(plain, conversation_of).values()),
    }
    inside = compare(figures["mixed", TREATED], figures["mixed", CONTROL])
    separate = compare(figures["treated", TREATED], figures["plain", CONTROL])
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "other_cpu_cores": other.cores,
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "seconds": round(seconds, 1),
        },
        "backend": (
            f"llama-server, SmolLM2-135M, -np {slots}, -c {ctx}, -t 2, "
            f"{' '.join(SERVER_ARGS)}, tools template"
        ),
        "workload": {
            "name": "fleet_clock",
            "conversations": k,
            "turns": scale.fleet_turns,
            "system_words": scale.fleet_system_words,
            "max_tokens": scale.max_tokens,
            "requests": len(bodies),
            "control_conversations": sum(in_control.values()),
        },
        "share": share,
        "slo": {"ttft_ms": SLO.ttft_ms, "tpot_ms": SLO.tpot_ms},
        "groups": {f"{run}/{g}": estimates(f) for (run, g), f in figures.items()},
        "lift": {name: agreement(inside[name], separate[name]) for name in inside},
        "proxy_stats": proxy_view,
    }


def print_table(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(
        f"\n{w['conversations']} conversations x {w['turns']} turns "
        f"({w['control_conversations']} in the control group at share {report['share']})"
    )
    print(
        f"{'run/group':<18}{'conv':>5}{'req':>5}{'cached share [95% CI]':>28}"
        f"{'TTFT p50 ms [95% CI]':>28}{'goodput':>9}"
    )
    for name, g in report["groups"].items():
        cs, p50 = g["cached_share"], g["ttft_p50_ms"]
        print(
            f"{name:<18}{g['conversations']:>5}{g['requests']:>5}"
            f"{_fmt(cs, 100, '%'):>28}{_fmt(p50, 1, ''):>28}"
            f"{_pct(g['goodput_share']['value']):>9}"
        )
    print(f"\n{'lift':<16}{'mixed (treated - control)':>32}{'separate runs':>32}  agree")
    for name, a in report["lift"].items():
        scale, unit = (100, " pt") if "share" in name else (1, " ms")
        print(
            f"{name:<16}{_fmt(a['mixed'], scale, unit):>32}{_fmt(a['separate'], scale, unit):>32}"
            f"  {a.get('separate_inside_mixed_ci')}"
        )


def _fmt(est: dict[str, Any], scale: float, unit: str) -> str:
    v, (lo, hi) = est["value"], est["ci"]
    if v is None:
        return "-"
    if lo is None or hi is None:
        return f"{v * scale:.1f}{unit}"
    return f"{v * scale:.1f}{unit} [{lo * scale:.1f}, {hi * scale:.1f}]"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f} %"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--share", type=float, default=0.5)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--system-words", type=int, default=400, help="shared instructions")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--out", type=Path, default=procs.BENCH / "results")
    args = parser.parse_args(argv)
    base = workloads.QUICK if args.quick else workloads.Scale()
    scale = dataclasses.replace(
        base,
        fleet_conversations=4 if args.quick else args.conversations,
        fleet_turns=2 if args.quick else args.turns,
        fleet_system_words=base.fleet_system_words if args.quick else args.system_words,
        max_tokens=base.max_tokens if args.quick else args.max_tokens,
    )
    try:
        report = run(scale, args.share, args.slots, args.out)
    except procs.BenchError as exc:
        print(f"bench_control: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "control.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
