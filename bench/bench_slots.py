"""Slot scheduling on a real llama-server (SmolLM2, ``-np 4``): bursts direct vs through prefixgate.

An agent fans out: four requests arrive at once carrying the same new ~1,200-token system prompt.
Sent straight to llama-server they land on four idle slots and each prefills the prompt; through
prefixgate they are pinned (``id_slot``) to the slot that is prefilling it and reuse its cache.

Scenarios (four concurrent chat requests, temperature 0):

* ``shared, 16-token answers``: one new system prompt, four different questions;
* ``unrelated, 16-token answers``: four different system prompts of the same length;
* ``shared, 256-token answers``: as the first, answers forced to 256 tokens (``ignore_eos``).

Each run starts a fresh llama-server (``-np 4 -c 8192``: 2,048 tokens per slot, ``--metrics``,
``--slot-save-path`` for fan-out) and, through the same path as the burst, one unrelated warm-up
request (so prefixgate has measured the backend's prefill and decode speed, as it would have in
service). Measured: wall time of the burst, and prompt tokens the server processed during it
(``llamacpp:prompt_tokens_total``, cached tokens excluded). Modes: ``direct``, ``prefixgate``
(defaults: ``--slot-scheduling auto``) and ``prefixgate --fanout on``.

Run: ``python bench/bench_slots.py [--repeat N] [--scenarios a,b] [--out FILE]``; writes a
Markdown table (default ``/tmp/pg/readme/scheduling-bench.md``) and prints it. About six minutes
per repetition on 2 cores; other load on the machine slows every mode, so the load average is
recorded with each run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

import procs

QUESTIONS = (
    "What is the return window for category 3?",
    "Are exchanges free for category 7?",
    "How long do I have to return category 12 items?",
    "Do I need a receipt for category 20?",
)
WARMUP = "Summarize in one line: " + " ".join(f"note {i} is about logistics." for i in range(60))


def system_prompt(tag: str) -> str:
    """A ~1,200-token system prompt, made new by ``tag``."""
    policies = " ".join(
        f"Policy {i}: items in category {i} may be returned within {10 + i} days with a "
        f"receipt, and exchanges for category {i} are free of charge at every store."
        for i in range(1, 32)
    )
    return f"[{tag}] You are the support assistant of Northwind Outfitters. {policies}"


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    shared: bool
    max_tokens: int
    ignore_eos: bool = False


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("shared-short", "shared prefix, 16-token answers", True, 16),
        Scenario("unrelated-short", "unrelated prompts, 16-token answers", False, 16),
        Scenario("shared-long", "shared prefix, 256-token answers", True, 256, ignore_eos=True),
    )
}
MODES = {
    "direct": None,
    "prefixgate": [],
    "prefixgate --fanout on": ["--fanout", "on"],
    "prefixgate --slot-scheduling off": ["--slot-scheduling", "off"],
}
DEFAULT_MODES = ("direct", "prefixgate", "prefixgate --fanout on")


@dataclass
class Run:
    scenario: str
    mode: str
    wall_s: float
    prompt_tokens: float
    load: float
    reasons: Counter[str] = field(default_factory=Counter)


def start_llama(workdir: Path) -> procs.Proc:
    """llama-server, four slots of 2,048 tokens, with metrics and slot saving."""
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    save = workdir / "slots"
    save.mkdir(exist_ok=True)
    args = [procs.llama_server_binary(), "-m", procs.smollm2_model(), "--host", "127.0.0.1"]
    args += ["--port", str(port), "-c", "8192", "-np", "4", "-t", "2", "--metrics"]
    args += ["--slot-save-path", str(save)]
    return procs._spawn(  # the harness's own spawner: waits for /health, logs to workdir
        "llama-server", args, workdir=workdir, ready_url=url + "/health", url=url, timeout_s=120
    )


async def prompt_tokens_total(session: aiohttp.ClientSession, llama_url: str) -> float:
    async with session.get(llama_url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith("llamacpp:prompt_tokens_total "):
            return float(line.split()[1])
    raise procs.BenchError("llama-server /metrics has no llamacpp:prompt_tokens_total")


async def chat(
    session: aiohttp.ClientSession, url: str, system: str, question: str, sc: Scenario | None
) -> None:
    body: dict[str, Any] = {
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": sc.max_tokens if sc else 8,
        "temperature": 0,
    }
    if sc is not None and sc.ignore_eos:
        body["ignore_eos"] = True
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        payload = await resp.read()
        if resp.status != 200:
            raise procs.BenchError(f"{url} answered {resp.status}: {payload[:200]!r}")


async def burst(
    session: aiohttp.ClientSession, url: str, llama_url: str, sc: Scenario, tag: str
) -> tuple[float, float]:
    """Wall seconds of the burst and prompt tokens the server processed during it."""
    before = await prompt_tokens_total(session, llama_url)
    t0 = time.perf_counter()
    await asyncio.gather(
        *(
            chat(
                session,
                url,
                system_prompt(tag if sc.shared else f"{tag}-{i}"),
                QUESTIONS[i],
                sc,
            )
            for i in range(4)
        )
    )
    wall = time.perf_counter() - t0
    return wall, await prompt_tokens_total(session, llama_url) - before


def reasons_of(records: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    if not records.exists():
        return counts
    for line in records.read_bytes().splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "request":
            counts[str(rec.get("schedule_reason"))] += 1
    return counts


async def one_run(sc: Scenario, mode: str, n: int) -> Run:
    with tempfile.TemporaryDirectory(prefix="bench-slots-") as tmp:
        workdir = Path(tmp)
        load = os.getloadavg()[0]
        with start_llama(workdir) as llama:
            flags = MODES[mode]
            gate = None
            if flags is not None:
                gate = procs.start_prefixgate(workdir, llama.url, extra=flags)
            try:
                url = gate.url if gate is not None else llama.url
                timeout = aiohttp.ClientTimeout(total=900)
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    await chat(session, url, WARMUP, "Go.", None)
                    wall, tokens = await burst(session, url, llama.url, sc, f"{sc.name}-{n}")
            finally:
                if gate is not None:
                    gate.close()
            reasons = reasons_of(gate.extra_files["records"]) if gate is not None else Counter()
    reasons.pop("None", None)
    return Run(sc.name, mode, wall, tokens, load, reasons)


def table(runs: list[Run]) -> str:
    lines = [
        "| scenario | how | wall time for all four | prompt tokens processed | decisions "
        "| load avg |",
        "|---|---|---|---|---|---|",
    ]
    keyed: dict[tuple[str, str], list[Run]] = {}
    for r in runs:
        keyed.setdefault((r.scenario, r.mode), []).append(r)
    for (name, mode), rs in keyed.items():
        wall = statistics.median(r.wall_s for r in rs)
        tokens = statistics.median(r.prompt_tokens for r in rs)
        direct = keyed.get((name, "direct"))
        vs = ""
        if direct and mode != "direct":
            # Each run against the direct run just before it: both saw about the same load.
            pairs = [d.wall_s / r.wall_s for d, r in zip(direct, rs, strict=False)]
            vs = f" ({statistics.median(pairs):.2f}x as fast as direct)"
        decisions = ", ".join(f"{k} {v}" for k, v in sorted(rs[-1].reasons.items())) or "—"
        load = ", ".join(f"{r.load:.1f}" for r in rs)
        lines.append(
            f"| {SCENARIOS[name].title} | {mode} | {wall:.1f} s{vs} | {tokens:,.0f} | "
            f"{decisions} | {load} |"
        )
    return "\n".join(lines)


def fragment(runs: list[Run], repeat: int) -> str:
    """The Markdown section for bench/README.md: what was run, how, and the table."""
    loads = [r.load for r in runs]
    lo, hi = (f(Counter((r.scenario, r.mode) for r in runs).values()) for f in (min, max))
    counts = f"{lo}" if lo == hi else f"{lo} to {hi}"
    return "\n".join(
        [
            "## Slot scheduling: agent fan-out bursts on llama-server",
            "",
            "```bash",
            ".venv/bin/python bench/bench_slots.py"
            + (f" --repeat {repeat}" if repeat > 1 else "")
            + "   # starts its own llama-server (-np 4 -c 8192) and prefixgate per run",
            "```",
            "",
            "Four concurrent chat requests (temperature 0) to a fresh llama-server (SmolLM2,",
            "four slots of 2,048 tokens, 2 threads) after one unrelated warm-up request;",
            "~1,200-token system prompts. Prompt tokens processed: `llamacpp:prompt_tokens_total`",
            "over the burst (cached tokens excluded). Decisions: the records' `schedule_reason`",
            "(warm-up included).",
            f"Median of {counts} run(s) per row (the speed-up: median of each run against the "
            "direct run just before it); 1-minute load average at each run's start "
            f"{min(loads):.1f} to {max(loads):.1f} (2 cores, shared with other work; the runs "
            "themselves keep it near 2).",
            "",
            table(runs),
        ]
    )


async def measure(scenarios: list[str], modes: list[str], repeat: int) -> list[Run]:
    runs: list[Run] = []
    for n in range(repeat):
        for name in scenarios:
            for mode in modes:
                if mode.endswith("--fanout on") and not SCENARIOS[name].shared:
                    continue
                run = await one_run(SCENARIOS[name], mode, n)
                print(
                    f"{name:16} {mode:24} wall {run.wall_s:6.1f} s  prompt tokens "
                    f"{run.prompt_tokens:6.0f}  load {run.load:.1f}  {dict(run.reasons)}",
                    flush=True,
                )
                runs.append(run)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES))
    parser.add_argument("--out", default="/tmp/pg/readme/scheduling-bench.md")
    args = parser.parse_args()
    runs = asyncio.run(measure(args.scenarios.split(","), args.modes.split(","), args.repeat))
    out = fragment(runs, args.repeat)
    print(out)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(out + "\n")


if __name__ == "__main__":
    main()
