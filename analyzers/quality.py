"""``prefixgate quality``: show that canonicalization does not change answers.

Replays a sample of chat requests against a backend twice — as the application sent them and as
the canonicalizer rewrites them — at temperature 0, and compares the answers: exact agreement and
a similarity score (``difflib`` ratio over the answer text), with each form's prompt tokens,
cached tokens and time to first token. Requests come from a prefixgate log written with
``--log-prompts`` (records carrying ``body``) or from a JSONL file of OpenAI request bodies.

Reading it: agreement near 100 % and similarity near 1.0 mean the rewrite is transparent to the
model. Small models at temperature 0 can still flip a token when any byte of the prompt moves;
look at the pairs listed as differing before concluding a rule changes meaning.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from analyzers.inputs import input_files, open_input
from proxy.canonical import Canonicalizer

CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Answer:
    """One replayed request's answer and its timings."""

    text: str
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_ms: float | None


@dataclass(frozen=True, slots=True)
class Pair:
    """The original and canonical answers to one request."""

    original: Answer
    canonical: Answer
    rules: tuple[str, ...]

    @property
    def exact(self) -> bool:
        return self.original.text == self.canonical.text

    @property
    def similarity(self) -> float:
        return difflib.SequenceMatcher(None, self.original.text, self.canonical.text).ratio()


def read_requests(paths: Sequence[str]) -> Iterator[dict[str, Any]]:
    """Chat request bodies from prefixgate records (``body``) or plain request JSONL
    (gzip or xz too; a directory for every input file in it)."""
    for path in input_files(Path(p) for p in paths):
        with open_input(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(obj, dict):
                    continue
                body = obj.get("body") if isinstance(obj.get("body"), dict) else obj
                if isinstance(body, dict) and isinstance(body.get("messages"), list):
                    yield body


async def ask(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], max_tokens: int
) -> Answer:
    """Send one request (streamed, temperature 0) and collect its answer and timings."""
    req = dict(body)
    req.update(
        temperature=0, stream=True, max_tokens=max_tokens, stream_options={"include_usage": True}
    )
    req.pop("n", None)
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with session.post(url + CHAT, json=req) as resp:
        if resp.status != 200:
            raise RuntimeError(f"backend answered {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            if not raw.startswith(b"data: {"):
                continue
            event = orjson.loads(raw[6:])
            if isinstance(event.get("usage"), dict):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = (time.perf_counter() - t0) * 1000.0
                text.append(piece)
    details = usage.get("prompt_tokens_details") or {}
    return Answer(
        text="".join(text),
        prompt_tokens=usage.get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        ttft_ms=ttft,
    )


async def replay(
    bodies: Sequence[dict[str, Any]], backend: str, *, max_tokens: int = 64
) -> list[Pair]:
    """Ask ``backend`` every request in both forms, one at a time (timings stay comparable)."""
    canonicalizer = Canonicalizer()
    pairs: list[Pair] = []
    # A fresh connection per request: llama-server may close idle keep-alive connections.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        for body in bodies:
            result = canonicalizer.apply(CHAT, body)
            original = await ask(session, backend, body, max_tokens)
            canonical = await ask(session, backend, result.body, max_tokens)
            pairs.append(Pair(original=original, canonical=canonical, rules=result.fired))
    return pairs


def summarize(pairs: Sequence[Pair]) -> dict[str, Any]:
    """The report as JSON-ready numbers."""

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    changed = [p for p in pairs if p.rules]
    return {
        "requests": len(pairs),
        "rewritten": len(changed),
        "exact_agreement": mean([1.0 if p.exact else 0.0 for p in pairs]),
        "exact_agreement_rewritten": mean([1.0 if p.exact else 0.0 for p in changed]),
        "mean_similarity": mean([p.similarity for p in pairs]),
        "prompt_tokens": {
            "original": sum(p.original.prompt_tokens or 0 for p in pairs),
            "canonical": sum(p.canonical.prompt_tokens or 0 for p in pairs),
        },
        "mean_ttft_ms": {
            "original": mean([p.original.ttft_ms for p in pairs if p.original.ttft_ms]),
            "canonical": mean([p.canonical.ttft_ms for p in pairs if p.canonical.ttft_ms]),
        },
        "differing": [
            {"index": i, "rules": list(p.rules), "similarity": round(p.similarity, 3)}
            for i, p in enumerate(pairs)
            if not p.exact
        ],
    }


def add_quality_parser(subparsers: Any) -> None:
    """Register ``quality`` on the ``prefixgate`` command."""
    parser = subparsers.add_parser(
        "quality",
        help="replay requests in original and canonical form and compare the answers",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="JSONL of requests or records")
    parser.add_argument("--backend", required=True, help="backend (or proxy) base URL")
    parser.add_argument("--sample", type=int, default=50, help="requests to replay (default 50)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--max-tokens", type=int, default=64, help="answer length cap")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"


def run_quality(args: argparse.Namespace) -> int:
    bodies = list(read_requests(args.paths))
    if not bodies:
        print("prefixgate quality: no chat requests found in the input")
        return 1
    if len(bodies) > args.sample:
        bodies = random.Random(args.seed).sample(bodies, args.sample)
    try:
        pairs = asyncio.run(replay(bodies, args.backend.rstrip("/"), max_tokens=args.max_tokens))
    except (aiohttp.ClientError, RuntimeError) as exc:
        print(f"prefixgate quality: {exc}")
        return 1
    report = summarize(pairs)
    if args.json:
        print(orjson.dumps(report, option=orjson.OPT_INDENT_2).decode())
        return 0
    print(f"requests replayed        {report['requests']} ({report['rewritten']} rewritten)")
    print(f"exact agreement          {report['exact_agreement']:.1%}")
    if report["exact_agreement_rewritten"] is not None:
        print(f"  of rewritten requests  {report['exact_agreement_rewritten']:.1%}")
    print(f"mean similarity          {report['mean_similarity']:.3f}")
    pt, tt = report["prompt_tokens"], report["mean_ttft_ms"]
    print(f"prompt tokens            original {pt['original']}, canonical {pt['canonical']}")
    print(
        f"mean TTFT                original {_ms(tt['original'])}, canonical {_ms(tt['canonical'])}"
    )
    for d in report["differing"][:10]:
        print(f"  differs: request {d['index']} rules={d['rules']} similarity={d['similarity']}")
    return 0
