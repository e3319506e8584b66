"""Time the relay's look at streamed token events, route by route, and beside another tree.

Run: ``python bench/bench_stream_inspect.py [--tokens N] [--repeat R] [--against PATH]``.
Feeds llama-server shaped streams of N text tokens through ``EventSplitter`` and
``StreamInspector`` as ``proxy.stream_relay`` does (a read that is one plain token event is
counted whole; anything else is split and each event observed) and prints the best time per
token event:

- one read per token, as a server writes them at one stream: chat; llama.cpp's native
  ``/completion`` (its events carry the token ids and a count, so no two are alike outside the
  text); the Responses API (a sequence number in each); Anthropic Messages;
- chat read under load: 16 token events to a read, the last read with the finish and usage;
- with every event parsed (the byte test disabled before the first event).

``--against PATH``: the same measured in a copy of another tree (a directory holding its
``proxy`` package, e.g. ``git archive <rev> proxy | tar -x -C PATH``), in a subprocess, after
this tree's rows, so the two are read side by side on one machine in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson

HERE = Path(__file__).resolve()

# Imported only after sys.path names the tree measured (``--tree``, or this checkout).
Stream = tuple[str, str, Callable[[list[str]], list[bytes]]]


def event(name: str, data: object) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def sse(data: object) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


CHAT_META = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m"}


def chat_events(tokens: list[str], tick: int = 0) -> list[bytes]:
    """A chat stream; ``tick``: its clock ("created", seconds in llama-server) moves every
    ``tick`` events."""
    role = {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant"}}]}
    out = [sse({**role, **CHAT_META})]
    for i, t in enumerate(tokens):
        choice = {"finish_reason": None, "index": 0, "delta": {"content": t}}
        clock = {"created": 1 + i // tick} if tick else {}
        out.append(sse({"choices": [choice], **CHAT_META, **clock}))
    finish = {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **CHAT_META}
    usage = {"prompt_tokens": 10, "completion_tokens": len(tokens), "total_tokens": 0}
    timings = {"prompt_n": 5, "prompt_ms": 1.0, "predicted_n": len(tokens), "predicted_ms": 9.0}
    out.append(sse(finish))
    out.append(sse({"choices": [], **CHAT_META, "usage": usage, "timings": timings}))
    out.append(b"data: [DONE]\n\n")
    return out


def native_events(tokens: list[str]) -> list[bytes]:
    out = [
        sse(
            {
                "index": 0,
                "content": t,
                "tokens": [1000 + i],
                "stop": False,
                "id_slot": 0,
                "tokens_predicted": i + 1,
                "tokens_evaluated": 10,
            }
        )
        for i, t in enumerate(tokens)
    ]
    out.append(sse({"content": "", "stop": True, "tokens_predicted": len(tokens)}))
    return out


def responses_events(tokens: list[str]) -> list[bytes]:
    out = [
        event(
            "response.output_text.delta",
            {
                "type": "response.output_text.delta",
                "sequence_number": i,
                "item_id": "msg_1",
                "output_index": 0,
                "content_index": 0,
                "delta": t,
            },
        )
        for i, t in enumerate(tokens)
    ]
    usage = {"input_tokens": 10, "output_tokens": len(tokens), "total_tokens": 0}
    done = {"type": "response.completed", "response": {"usage": usage}}
    return [*out, event("response.completed", done)]


def messages_events(tokens: list[str]) -> list[bytes]:
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


def under_load(events: list[bytes], per_read: int = 16) -> list[bytes]:
    """The same events, ``per_read`` to an upstream read (what a busy proxy reads)."""
    return [b"".join(events[i : i + per_read]) for i in range(0, len(events), per_read)]


def measure(tokens: int, repeat: int) -> list[tuple[str, float, float]]:
    """(case, fast path µs, every event parsed µs) per token event, in the tree on sys.path."""
    import proxy.stream_inspect as stream_inspect
    from proxy.backends import CHAT, MESSAGES, RESPONSES, LlamaCppDialect
    from proxy.backends.base import NATIVE_COMPLETION
    from proxy.exchange import Exchange
    from proxy.records import Observation
    from proxy.sse import EventSplitter
    from proxy.stream_inspect import StreamInspector

    texts = [f" tok{i}" for i in range(tokens)]
    cases = (
        ("chat, a read per token", CHAT, chat_events(texts)),
        ("native /completion, a read per token", NATIVE_COMPLETION, native_events(texts)),
        ("Responses, a read per token", RESPONSES, responses_events(texts)),
        ("Messages, a read per token", MESSAGES, messages_events(texts)),
        ("chat, 16 events a read", CHAT, under_load(chat_events(texts))),
        # 50 tokens a second: the clock moves every 3 reads or so
        ("chat, 16 a read, its clock moving", CHAT, under_load(chat_events(texts, tick=50))),
    )

    def run_once(route: str, reads: list[bytes]) -> float:
        obs = Observation(t_start=0.0)
        ex = Exchange(request_id="r", route=route, upstream_path=route, obs=obs)
        ex.dialect = LlamaCppDialect()
        ex.strip_usage = route == CHAT
        inspector, splitter = StreamInspector(ex), EventSplitter()
        t0 = time.perf_counter()
        for chunk in reads:  # the relay's loop (``_StreamRelay._feed``), without the writes
            now = time.perf_counter()
            if not splitter.pending and inspector.plain_chunk(chunk, now):
                continue
            inspector.process_all(list(splitter.feed(chunk)), now, [])
        return time.perf_counter() - t0

    rows = []
    for name, route, reads in cases:
        fast = min(run_once(route, reads) for _ in range(repeat))
        byte_test, run_test = stream_inspect.plain_token_event, stream_inspect.plain_token_run
        stream_inspect.plain_token_event = lambda event, route: False  # every event parsed
        stream_inspect.plain_token_run = lambda chunk, route: 0
        try:
            slow = min(run_once(route, reads) for _ in range(repeat))
        finally:
            stream_inspect.plain_token_event, stream_inspect.plain_token_run = byte_test, run_test
        rows.append((name, fast / tokens * 1e6, slow / tokens * 1e6))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--against", help="another tree's directory (holding its proxy package)")
    parser.add_argument("--tree", help=argparse.SUPPRESS)  # (the subprocess's own tree)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tree = Path(args.tree).resolve() if args.tree else HERE.parents[1]
    sys.path.insert(0, str(tree))
    rows = measure(args.tokens, args.repeat)
    if args.json:
        import proxy

        print(json.dumps({"proxy": proxy.__file__, "rows": rows}))
        return
    other: list[tuple[str, float, float]] = []
    if args.against:
        out = subprocess.run(
            [
                *(sys.executable, str(HERE), "--tree", args.against, "--json"),
                *("--tokens", str(args.tokens), "--repeat", str(args.repeat)),
            ],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": args.against},
        )
        answer = json.loads(out.stdout)
        measured = Path(answer["proxy"]).resolve()
        if not measured.is_relative_to(Path(args.against).resolve()):
            # (an installed prefixgate is found when the directory holds no proxy package)
            raise SystemExit(f"--against {args.against}: measured {measured.parent}, not it")
        other = [tuple(row) for row in answer["rows"]]

    from rich.console import Console
    from rich.table import Table

    title = f"inspection per token event, µs ({args.tokens} tokens, best of {args.repeat})"
    table = Table(title=title)
    for column in ("case", "this tree", "every event parsed"):
        table.add_column(column, justify="right")
    if other:
        table.add_column(f"{args.against}", justify="right")
        table.add_column("ratio", justify="right")
    for i, (name, fast, slow) in enumerate(rows):
        cells = [name, f"{fast:.2f}", f"{slow:.2f}"]
        if other:
            cells += [f"{other[i][1]:.2f}", f"{fast / other[i][1]:.2f}"]
        table.add_row(*cells)
    Console().print(table)


if __name__ == "__main__":
    main()
