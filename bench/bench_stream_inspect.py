"""Time the relay's look at each streamed token event: chat, Responses and Anthropic Messages.

Run: ``python bench/bench_stream_inspect.py [--tokens N] [--repeat R]``. Feeds a llama-server
shaped stream of N text tokens (one upstream read per token, as the server writes them, then
the closing events) through ``EventSplitter`` and ``StreamInspector`` and prints the best time
per token event, with the fast path for plain token events and with it disabled (every event
parsed).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson
from rich.console import Console
from rich.table import Table

import proxy.relay as relay
from proxy.backends import CHAT, MESSAGES, RESPONSES, LlamaCppDialect
from proxy.exchange import Exchange
from proxy.records import Observation
from proxy.sse import EventSplitter
from proxy.stream_inspect import StreamInspector


def event(name: str, data: object) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def chat_stream(tokens: list[str]) -> list[bytes]:
    meta = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    out = [
        b"data: "
        + orjson.dumps(
            {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": t}}], **meta}
        )
        + b"\n\n"
        for t in tokens
    ]
    usage = {"prompt_tokens": 10, "completion_tokens": len(tokens), "total_tokens": 0}
    out.append(b"data: " + orjson.dumps({"choices": [], **meta, "usage": usage}) + b"\n\n")
    return out


def responses_stream(tokens: list[str]) -> list[bytes]:
    out = [
        event(
            "response.output_text.delta",
            {"type": "response.output_text.delta", "item_id": "msg_1", "delta": t},
        )
        for t in tokens
    ]
    usage = {"input_tokens": 10, "output_tokens": len(tokens), "total_tokens": 0}
    done = {"type": "response.completed", "response": {"usage": usage}}
    return [*out, event("response.completed", done)]


def messages_stream(tokens: list[str]) -> list[bytes]:
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 10}}}
    out = [
        event(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": t}},
        )
        for t in tokens
    ]
    out[0] = event("message_start", start) + out[0]
    delta = {"type": "message_delta", "usage": {"output_tokens": len(tokens)}}
    return [*out, event("message_delta", delta), event("message_stop", {"type": "message_stop"})]


STREAMS: tuple[tuple[str, str, Callable[[list[str]], list[bytes]]], ...] = (
    ("chat", CHAT, chat_stream),
    ("responses", RESPONSES, responses_stream),
    ("messages", MESSAGES, messages_stream),
)


def run_once(route: str, chunks: list[bytes]) -> float:
    ex = Exchange(request_id="r", route=route, upstream_path=route, obs=Observation(t_start=0.0))
    ex.dialect = LlamaCppDialect()
    inspector, splitter = StreamInspector(ex), EventSplitter()
    t0 = time.perf_counter()
    for chunk in chunks:  # the relay's loop, without the writes
        now = time.perf_counter()
        if not splitter.pending and inspector.plain_chunk(chunk, now):
            continue
        out: list[bytes] = []
        for ev in splitter.feed(chunk):
            inspector.process(ev, now, out)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    tokens = [f" tok{i}" for i in range(args.tokens)]
    table = Table(
        title=f"relay inspection per token event ({args.tokens} tokens, best of {args.repeat})"
    )
    for column in ("API", "fast path µs", "all parsed µs"):
        table.add_column(column, justify="right")
    fast_path = relay.plain_token_event
    for name, route, build in STREAMS:
        chunks = build(tokens)
        fast = min(run_once(route, chunks) for _ in range(args.repeat))
        relay.plain_token_event = lambda event, route: False  # every event parsed
        try:
            slow = min(run_once(route, chunks) for _ in range(args.repeat))
        finally:
            relay.plain_token_event = fast_path
        n = len(tokens)
        table.add_row(name, f"{fast / n * 1e6:.2f}", f"{slow / n * 1e6:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
