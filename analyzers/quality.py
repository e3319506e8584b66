"""``prefixgate quality``: show whether canonicalization changes answers beyond the backend's noise.

Replays a sample of chat requests against a backend at temperature 0, three times each: as the
application sent it with the backend's cache off for it (``cache_prompt: false``, cold), the
same again with the cache on (warm, and a repeat), and as the canonicalizer rewrites it. The
canonicalizer runs over every request in log order first, so learned forms (the first form
seen of a tool list, of a system prompt) are the ones the proxy would have learned. Answers are
compared by exact agreement and a similarity score (``difflib`` ratio over the answer text),
with each form's prompt tokens, cached tokens and time to first token. Requests come from a
prefixgate log written with ``--log-prompts`` (records carrying ``body``) or from a JSONL file of
OpenAI request bodies.

Reading it: the *noise floor* is how often the backend disagrees with itself on the very same
request (cold against warm). A rewritten request whose original answer the backend reproduced
and whose canonical answer differs is a change the rewrite made (``attributable``); one whose
original answers already differ says nothing. The verdict says which it is.
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
from proxy.canonical import Canonicalizer, CanonicalResult
from proxy.canonical.forms import FormMemory

CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Answer:
    """One replayed request's answer and its timings."""

    text: str
    prompt_tokens: int | None
    cached_tokens: int | None
    ttft_ms: float | None


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


@dataclass(frozen=True, slots=True)
class Pair:
    """The answers to one request: original cold, original warm (the repeat), canonical."""

    original: Answer
    canonical: Answer
    rules: tuple[str, ...]
    repeat: Answer | None = None

    @property
    def exact(self) -> bool:
        """The canonical answer equals the original one."""
        return self.original.text == self.canonical.text

    @property
    def similarity(self) -> float:
        return _similarity(self.original.text, self.canonical.text)

    @property
    def reproducible(self) -> bool | None:
        """The backend gave the original request the same answer twice (None: not repeated)."""
        return None if self.repeat is None else self.repeat.text == self.original.text

    @property
    def attributable(self) -> bool:
        """The rewrite changed the answer: rewritten, the original reproducible, and the
        canonical answer matching neither original answer."""
        return (
            bool(self.rules)
            and self.reproducible is True
            and not self.exact
            and (self.repeat is None or self.repeat.text != self.canonical.text)
        )


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
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    max_tokens: int,
    *,
    cold: bool = False,
) -> Answer:
    """Send one request (streamed, temperature 0) and collect its answer and timings;
    ``cold`` asks the backend not to reuse its cache for it (``cache_prompt: false``)."""
    req = dict(body)
    req.update(
        temperature=0, stream=True, max_tokens=max_tokens, stream_options={"include_usage": True}
    )
    req.pop("n", None)
    if cold:
        req["cache_prompt"] = False
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


def canonical_forms(
    bodies: Sequence[dict[str, Any]], canonicalizer: Canonicalizer | None = None
) -> list[CanonicalResult]:
    """Each request as the proxy would forward it, canonicalized in the given (log) order with
    learned forms, as the proxy learns them."""
    canon = canonicalizer or Canonicalizer(forms=FormMemory())
    return [canon.apply(CHAT, body) for body in bodies]


async def replay(
    bodies: Sequence[dict[str, Any]],
    backend: str,
    *,
    max_tokens: int = 64,
    noise: bool = True,
    canonical: Sequence[CanonicalResult] | None = None,
) -> list[Pair]:
    """Ask ``backend`` every request: original cold, original warm (when ``noise``), then
    canonical; one at a time, so timings stay comparable. ``canonical``: the requests'
    canonical forms when the caller computed them over a longer log (else computed here)."""
    results = list(canonical) if canonical is not None else canonical_forms(bodies)
    pairs: list[Pair] = []
    # A fresh connection per request: llama-server may close idle keep-alive connections.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        for body, result in zip(bodies, results, strict=True):
            original = await ask(session, backend, body, max_tokens, cold=noise)
            repeat = await ask(session, backend, body, max_tokens) if noise else None
            if result.body is body:  # nothing rewritten: the canonical request is the original
                answer = repeat or await ask(session, backend, body, max_tokens)
            else:
                answer = await ask(session, backend, result.body, max_tokens)
            pairs.append(
                Pair(original=original, canonical=answer, rules=result.fired, repeat=repeat)
            )
    return pairs


def _rate(values: Sequence[bool]) -> float | None:
    return sum(values) / len(values) if values else None


def verdict(pairs: Sequence[Pair]) -> str:
    """One line: did the rewrite change answers beyond what the backend does by itself?"""
    changed = [p for p in pairs if p.rules]
    if not changed:
        return "nothing rewritten: every request reached the backend as the application sent it"
    repeated = [p for p in changed if p.reproducible is not None]
    if not repeated:
        return "no noise floor measured (--no-noise): agreement alone cannot tell"
    blamed = [p for p in repeated if p.attributable]
    steady = [p for p in repeated if p.reproducible]
    if blamed:
        return (
            f"the rewrite changed answers: {len(blamed)} of {len(steady)} rewritten requests "
            "the backend answers reproducibly got another answer"
        )
    if not steady:
        return "inconclusive: the backend did not reproduce any rewritten request's answer"
    return (
        f"within the backend's noise: the {len(steady)} rewritten requests it answers "
        "reproducibly kept their answers"
    )


def summarize(pairs: Sequence[Pair]) -> dict[str, Any]:
    """The report as JSON-ready numbers."""

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    changed = [p for p in pairs if p.rules]
    repeated = [p for p in pairs if p.repeat is not None]
    return {
        "requests": len(pairs),
        "rewritten": len(changed),
        "exact_agreement": mean([1.0 if p.exact else 0.0 for p in pairs]),
        "exact_agreement_rewritten": mean([1.0 if p.exact else 0.0 for p in changed]),
        "mean_similarity": mean([p.similarity for p in pairs]),
        "noise": {
            "repeated": len(repeated),
            "cold_vs_warm_agreement": _rate([bool(p.reproducible) for p in repeated]),
            "cold_vs_warm_similarity": mean(
                [_similarity(p.original.text, p.repeat.text) for p in repeated if p.repeat]
            ),
        },
        "attributable": sum(1 for p in pairs if p.attributable),
        "verdict": verdict(pairs),
        "prompt_tokens": {
            "original": sum(p.original.prompt_tokens or 0 for p in pairs),
            "canonical": sum(p.canonical.prompt_tokens or 0 for p in pairs),
        },
        "mean_ttft_ms": {
            "original": mean([p.original.ttft_ms for p in pairs if p.original.ttft_ms]),
            "original_warm": mean(
                [p.repeat.ttft_ms for p in pairs if p.repeat and p.repeat.ttft_ms]
            ),
            "canonical": mean([p.canonical.ttft_ms for p in pairs if p.canonical.ttft_ms]),
        },
        "differing": [
            {
                "index": i,
                "rules": list(p.rules),
                "similarity": round(p.similarity, 3),
                "reproducible": p.reproducible,
            }
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
    parser.add_argument(
        "--no-noise",
        dest="noise",
        action="store_false",
        help="skip the noise floor (the cold and warm repeats of each original request); for "
        "a backend that rejects cache_prompt",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} ms"


def run_quality(args: argparse.Namespace) -> int:
    bodies = list(read_requests(args.paths))
    if not bodies:
        print("prefixgate quality: no chat requests found in the input")
        return 1
    results = canonical_forms(bodies)  # over the whole log, in order: forms as learned
    if len(bodies) > args.sample:
        picked = sorted(random.Random(args.seed).sample(range(len(bodies)), args.sample))
        bodies, results = [bodies[i] for i in picked], [results[i] for i in picked]
    try:
        pairs = asyncio.run(
            replay(
                bodies,
                args.backend.rstrip("/"),
                max_tokens=args.max_tokens,
                noise=args.noise,
                canonical=results,
            )
        )
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
    noise = report["noise"]
    if noise["repeated"]:
        print(
            f"noise floor              cold vs warm agreement {noise['cold_vs_warm_agreement']:.1%}"
            f", similarity {noise['cold_vs_warm_similarity']:.3f}"
        )
    print(f"verdict                  {report['verdict']}")
    pt, tt = report["prompt_tokens"], report["mean_ttft_ms"]
    print(f"prompt tokens            original {pt['original']}, canonical {pt['canonical']}")
    warm = f" (cold; warm {_ms(tt['original_warm'])})" if tt["original_warm"] is not None else ""
    print(
        f"mean TTFT                original {_ms(tt['original'])}{warm}, "
        f"canonical {_ms(tt['canonical'])}"
    )
    for d in report["differing"][:10]:
        print(
            f"  differs: request {d['index']} rules={d['rules']} "
            f"similarity={d['similarity']} reproducible={d['reproducible']}"
        )
    return 0
