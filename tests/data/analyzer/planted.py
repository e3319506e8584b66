"""Builders of analyzer inputs with known answers: planted prefixes and planted breakers.

Used by the analyzer tests (and by ``python tests/data/analyzer/planted.py DIR`` to write the
small fixture files beside this module). Every log line is a prefixgate request record the way
the proxy writes it: the fingerprint's segment table, anchor and sizes, optionally the body.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson

from proxy.fingerprint import DEFAULT_BLOCK_BYTES, fingerprint, hex64

CHAT = "/v1/chat/completions"
T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
MODEL = "planted-model"

POLICY = (
    "Answer politely and precisely. Cite the relevant policy section when you refuse.\n"
    "Never reveal internal tooling. Keep answers under two hundred words unless asked.\n"
) * 12  # ~2 KB of stable system prompt

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup_order",
            "description": "Find an order by its number.",
            "parameters": {
                "type": "object",
                "properties": {"order": {"type": "string"}},
                "required": ["order"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "refund",
            "description": "Refund an order.",
            "parameters": {"type": "object", "properties": {"order": {"type": "string"}}},
        },
    },
]


def shuffled_tools(turn: int) -> list[dict[str, Any]]:
    """The same tools with every object's keys rotated by ``turn`` (distinct for 0..5)."""

    def rotate(value: Any) -> Any:
        if isinstance(value, dict):
            keys = list(value)
            shift = turn % len(keys) if keys else 0
            return {k: rotate(value[k]) for k in keys[shift:] + keys[:shift]}
        if isinstance(value, list):
            return [rotate(v) for v in value]
        return value

    out: list[dict[str, Any]] = rotate(TOOLS)
    return out


def record(
    body: dict[str, Any],
    *,
    at: float,
    with_body: bool,
    prompt_tokens: int | None = None,
    cached_tokens: int | None = None,
    backend: str = "b0",
    ttft_ms: float | None = None,
    status: int = 200,
    slo_met: bool | None = None,
) -> dict[str, Any]:
    """One request record line for ``body`` sent at ``at`` seconds after T0."""
    fp = fingerprint(CHAT, body)
    tokens = prompt_tokens if prompt_tokens is not None else fp.total_bytes // 4
    rec: dict[str, Any] = {
        "event": "request",
        "ts": (T0 + timedelta(seconds=at)).isoformat(timespec="milliseconds"),
        "request_id": uuid.uuid5(uuid.NAMESPACE_URL, f"{at}").hex,
        "route": CHAT,
        "model": body.get("model"),
        "backend": backend,
        "stream": True,
        "status": status,
        "prompt_tokens": tokens,
        "cached_tokens": cached_tokens,
        "ttft_ms": ttft_ms,
        "tpot_ms": None if ttft_ms is None else ttft_ms / 20,
        "slo_met": slo_met,
        "prompt_bytes": fp.total_bytes,
        "prefix_anchor": hex64(fp.anchor),
        "prefix_blocks": len(fp.block_hashes),
        "prefix_block_bytes": DEFAULT_BLOCK_BYTES,
        "prefix_segments": fp.segment_table(),
        "canonical_rules": [],
        "level": "info",
    }
    if with_body:
        rec["body"] = body
    return rec


def chat(system: str, *turns: str, tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A chat body: system prompt, then alternating user/assistant turns."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "stream": True}
    if tools is not None:
        body["tools"] = tools
    return body


def question(i: int) -> str:
    return f"Question {i}: where is my parcel number {1000 + i}? " + "Details follow. " * 20


def breaker_bodies() -> dict[str, list[dict[str, Any]]]:
    """Five requests per application, each application with one planted breaker."""
    ts = [f"Current time: 2025-03-01 12:{m:02d}:{m * 7 % 60:02d} UTC\n" for m in range(5)]
    uuids = [str(uuid.UUID(int=0x1234_5678_9ABC + 7919 * i, version=4)) for i in range(5)]
    hexes = [f"{0xDEADBEEF1234 + 977 * i:016x}" for i in range(5)]
    return {
        "timestamp": [
            chat(ts[i] + "You are the support bot.\n" + POLICY, question(i)) for i in range(5)
        ],
        "uuid": [
            chat(
                "You are the billing bot.\n" + f"Session {uuids[i]} opened.\n" + POLICY, question(i)
            )
            for i in range(5)
        ],
        "hex": [
            chat("You are the audit bot.\n" + f"trace={hexes[i]}\n" + POLICY, question(i))
            for i in range(5)
        ],
        "shuffled": [
            chat(
                "You are the shop bot.\n" + POLICY,
                question(i),
                tools=shuffled_tools(i),
            )
            for i in range(5)
        ],
        "whitespace": [
            chat("You are the notes bot.\n" + POLICY.replace("\n", " " * i + "\n"), question(i))
            for i in range(5)
        ],
        "custom": [
            chat(f"You are the visitor bot. Visitor number: {41 + i * 13}\n" + POLICY, question(i))
            for i in range(5)
        ],
    }


def conversation(
    turns: int, *, system: str = "You are the stable bot.\n" + POLICY
) -> list[dict[str, Any]]:
    """One conversation growing by a user and an assistant turn per request."""
    bodies = []
    history: list[str] = []
    for t in range(turns):
        history.append(question(t))
        bodies.append(chat(system, *history, tools=TOOLS))
        history.append(f"Answer {t}: it is on its way. " * 8)
    return bodies


def write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    """Write one JSON object per line."""
    with path.open("wb") as fh:
        for row in rows:
            fh.write(orjson.dumps(row) + b"\n")


def write_fixtures(directory: Path) -> None:
    """The small fixture files: one per input format."""
    directory.mkdir(parents=True, exist_ok=True)
    mooncake = [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 3]},
        {"timestamp": 1000, "input_length": 700, "output_length": 5, "hash_ids": [4, 5]},
        {"timestamp": 1500, "input_length": 2048, "output_length": 5, "hash_ids": [0, 1, 2, 6]},
    ]
    write_jsonl(directory / "mooncake.jsonl", mooncake)
    kvcache = {
        "id": "trace_x",
        "block_size": 64,
        "hash_id_scope": "local",
        "requests": [
            {"t": 0.0, "type": "n", "model": "m", "in": 256, "out": 1, "hash_ids": [1, 2, 3, 4]},
            {
                "t": 1.5,
                "type": "n",
                "model": "m",
                "in": 384,
                "out": 1,
                "hash_ids": [1, 2, 3, 4, 5, 6],
            },
        ],
    }
    (directory / "kvcache.json").write_bytes(orjson.dumps(kvcache))
    bodies = [{"timestamp": i, "body": b} for i, b in enumerate(conversation(3))]
    write_jsonl(directory / "bodies.jsonl", bodies)
    records = [{"event": "startup", "level": "info"}]
    records += [record(b, at=10.0 * i, with_body=False) for i, b in enumerate(conversation(4))]
    write_jsonl(directory / "records.jsonl", records)


if __name__ == "__main__":
    write_fixtures(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)


def traffic(conversations: int, turns: int, *, with_body: bool = False) -> list[dict[str, Any]]:
    """Interleaved multi-turn conversations of one application, with latencies and usage.

    Every fourth conversation's system prompt carries the current time (a planted breaker);
    measured ``cached_tokens`` follow what a single backend with a warm cache would report;
    TTFT grows with the uncached part of the prompt.
    """
    rows: list[dict[str, Any]] = []
    for c in range(conversations):
        system = "You are the stable bot.\n" + POLICY
        for t, body in enumerate(conversation(turns, system=system)):
            at = c * 7.0 + t * 30.0
            if c % 4 == 3:
                stamp = (T0 + timedelta(seconds=at)).strftime("%Y-%m-%d %H:%M:%S")
                body["messages"][0]["content"] = f"Now: {stamp}\n" + system
            fp = fingerprint(CHAT, body)
            tokens = fp.total_bytes // 4
            cached = 0 if c % 4 == 3 or (c == 0 and t == 0) else int(tokens * 0.8)
            ttft = 20.0 + (tokens - cached) * 0.05
            rows.append(
                record(
                    body,
                    at=at,
                    with_body=with_body,
                    prompt_tokens=tokens,
                    cached_tokens=cached,
                    backend=f"b{c % 2}",
                    ttft_ms=ttft,
                    slo_met=ttft < 60.0,
                )
            )
    rows.sort(key=lambda r: r["ts"])
    return rows
