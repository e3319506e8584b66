"""Time ``Canonicalizer.apply`` on realistic agent requests of 8 KB and 128 KB.

Run: ``python bench/bench_canonical.py [--repeat N]``. The requests are an agent's (system
prompt with the current date, time, session id and trace id; six OpenAI tools with nested
schemas; a conversation with tool calls, repeated to reach the size), built by
``tests/data/canonical/agent_requests.py``. Scenarios:

- ``steady``: what an agent loop sends: the same application, a new timestamp and session id
  on every request (every volatile rule fires, tools are re-sorted every time);
- ``shuffled``: the worst case: on every request the tool order, every object's key order and
  the tool-call arguments' serialization are shuffled too;
- ``canonical``: the input is already canonical (the output fed back): the cost of checking;
- ``learned_span``: ``steady`` with a build id no detector knows (``Build: 7f3a-19``) on the
  system prompt's first line, fresh on every request: the warm-up requests teach it
  (``volatile_learned``), then it is relocated like a detected value.

Each scenario runs twice, side by side: ``fixed`` (every part rewritten to its normal form, a
canonicalizer without a form memory) and ``learned`` (the proxy's default: each part rewritten
only to the form first seen for it; the memory warmed by the first requests, as in a running
proxy).

Prints the median and p90 microseconds per ``apply`` (the request path, learning included);
the cost of then
measuring ``stable_bytes_gained`` (done when the record is written, after the response), alone
and reusing the fingerprint's layout of the forwarded prompt; and, for scale, parsing the body
with orjson and rendering it for the fingerprint.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "data" / "canonical"))

import agent_requests  # the realistic request builder shared with the tests
import orjson
from rich.console import Console
from rich.table import Table

from analyzers.quantile import percentile
from proxy.canonical import Canonicalizer, CanonicalResult
from proxy.canonical.forms import FormMemory
from proxy.fingerprint import fingerprint, render

SIZES = (8 << 10, 128 << 10)
CHAT = agent_requests.CHAT


def bodies(size: int, scenario: str, count: int) -> list[dict[str, Any]]:
    """``count`` parsed request bodies of one scenario (parsed as the proxy parses them)."""
    out = []
    for i in range(count):
        body = agent_requests.request_of_size(
            size,
            when=agent_requests.WHEN + timedelta(seconds=37 * i),
            session=f"550e8400-e29b-41d4-a716-{i:012x}",
            seed=i if scenario == "shuffled" else 7,
        )
        out.append(orjson.loads(orjson.dumps(body)))
    return out


def with_build(body: dict[str, Any], build: str) -> dict[str, Any]:
    """``body`` with ``Build: <build>`` first in its system prompt."""
    messages = list(body["messages"])
    messages[0] = {**messages[0], "content": f"Build: {build}\n" + messages[0]["content"]}
    return {**body, "messages": messages}


def timed(fn: Callable[[Any], object], items: Sequence[Any]) -> list[float]:
    """Microseconds per call of ``fn`` over ``items``."""
    out = []
    for item in items:
        t0 = time.perf_counter_ns()
        fn(item)
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def p90(values: list[float]) -> float:
    return percentile(sorted(values), 0.9) or 0.0


def measure(size: int, scenario: str, repeat: int, forms: str) -> list[str]:
    """One table row: the scenario's request size, rules fired and timings; ``forms``:
    ``learned`` (the proxy's default: a form memory) or ``fixed`` (every part to its normal
    form)."""
    canonicalizer = Canonicalizer(forms=FormMemory() if forms == "learned" else None)
    items = bodies(size, "shuffled" if scenario == "shuffled" else "steady", repeat)
    if scenario == "canonical":
        items = [canonicalizer.apply(CHAT, b).body for b in items]
    if scenario == "learned_span":
        rng = random.Random(7)
        items = [
            with_build(b, f"{rng.getrandbits(16):04x}-{rng.randrange(100):02d}") for b in items
        ]
    for body in items[:20]:  # warm the caches (and learn) as a running proxy has them
        canonicalizer.apply(CHAT, body)
    # The bench holds hundreds of parsed requests at once, which a proxy does not: keep the
    # garbage collector from scanning them again and again while it measures.
    gc.collect()
    gc.freeze()
    results: list[CanonicalResult] = []
    apply_us = timed(lambda b: results.append(canonicalizer.apply(CHAT, b)), items)
    gains_us = timed(lambda r: r.measure_gains(), results)
    again = [canonicalizer.apply(CHAT, b) for b in items]
    layouts = [fingerprint(CHAT, r.body) for r in again]
    reuse_us = [0.0] * len(again)
    for i, (result, fp) in enumerate(zip(again, layouts, strict=True)):
        t0 = time.perf_counter_ns()
        result.measure_gains(fp.segments, fp.total_bytes)
        reuse_us[i] = (time.perf_counter_ns() - t0) / 1000
    raw = [orjson.dumps(b) for b in items]
    parse_us = timed(orjson.loads, raw)
    render_us = timed(lambda b: render(CHAT, b), items)
    gc.unfreeze()
    fired = ",".join(results[-1].fired) or "-"
    return [
        f"{len(raw[0]) / 1024:.0f} KB",
        scenario,
        forms,
        fired.replace("volatile_", "v_").replace("stable_json", "json"),
        f"{statistics.median(apply_us):.0f}",
        f"{p90(apply_us):.0f}",
        f"{statistics.median(gains_us):.0f}",
        f"{statistics.median(reuse_us):.0f}",
        f"{statistics.median(parse_us):.0f}",
        f"{statistics.median(render_us):.0f}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="requests per measurement")
    args = parser.parse_args()
    table = Table(title="Canonicalizer.apply, µs per request")
    for column in ("size", "scenario", "forms", "fired"):
        table.add_column(column)
    for column in (
        "apply p50",
        "apply p90",
        "gains p50",
        "gains, fp layout",
        "parse p50",
        "render p50",
    ):
        table.add_column(column, justify="right")
    for size in SIZES:
        for scenario in ("steady", "shuffled", "canonical", "learned_span"):
            for forms in ("fixed", "learned"):
                table.add_row(*measure(size, scenario, args.repeat, forms))
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
