"""Time ``proxy.fingerprint.fingerprint`` on chat prompts of 8 KB, 128 KB and 512 KB.

Run: ``python bench/bench_fingerprint.py [--repeat N]``. Prints the median time per call and
the throughput over the rendered bytes. The prompts look like a long conversation: a system
prompt, a tool schema, then alternating user and assistant turns of ~2 KB each. The last column
is the conversation's next turn (one more user message) fingerprinted as the proxy does it,
with the chain memo holding the turn before (``ChainMemo``: only the new blocks are hashed);
each repetition starts from a fresh memo holding that one turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from proxy.fingerprint import ChainMemo, fingerprint, fingerprint_with_data

SIZES = (8 << 10, 128 << 10, 512 << 10)
TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the knowledge base.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}


def chat_body(size: int) -> dict[str, Any]:
    """A chat request whose message text adds up to about ``size`` bytes."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant. " * 40}
    ]
    total, turn = 0, 0
    while total < size:
        role = "user" if turn % 2 == 0 else "assistant"
        text = f"Turn {turn}: the quick brown fox jumps over the lazy dog. " * 36
        text = text[: max(1, min(len(text), size - total))]
        messages.append({"role": role, "content": text})
        total += len(text)
        turn += 1
    return {"model": "bench-model", "tools": [TOOL], "messages": messages}


def measure(size: int, repeat: int) -> tuple[int, float, float]:
    """Rendered bytes, the median seconds per fingerprint of a ``size``-byte prompt, and the
    median for its next turn with the turn before in the chain memo."""
    body = chat_body(size)
    route = "/v1/chat/completions"
    fp = fingerprint(route, body)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fingerprint(route, body)
        times.append(time.perf_counter() - t0)
    following = {**body, "messages": [*body["messages"], {"role": "user", "content": "And?"}]}
    next_times = []
    for _ in range(repeat):
        memo = ChainMemo()
        fingerprint_with_data(route, body, memo=memo)
        t0 = time.perf_counter()
        fingerprint_with_data(route, following, memo=memo)
        next_times.append(time.perf_counter() - t0)
    return fp.total_bytes, statistics.median(times), statistics.median(next_times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    table = Table(title="fingerprint() on chat prompts")
    columns = ("prompt", "rendered bytes", "blocks", "median µs", "MB/s", "next turn, memo µs")
    for column in columns:
        table.add_column(column, justify="right")
    for size in SIZES:
        total, seconds, next_seconds = measure(size, args.repeat)
        table.add_row(
            f"{size >> 10} KB",
            f"{total:,}",
            f"{total // 256:,}",
            f"{seconds * 1e6:,.1f}",
            f"{total / seconds / 1e6:,.0f}",
            f"{next_seconds * 1e6:,.1f}",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
