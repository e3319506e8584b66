"""The benchmarks' load generator: streamed OpenAI requests, timed per token, summarized.

Two ways to offer load:

* **closed loop** (``--concurrency N``): N workers, each sending its next request as soon as the
  previous one ends; measures the most a target sustains at that concurrency;
* **open loop** (``--rate R``): Poisson arrivals at R requests/s whatever the target does, so
  queueing shows up in latency instead of being hidden by a slower send rate.

Every request is streamed (SSE) and timed on the client: **TTFT** (send to the first event that
carries a token: ``delta.content``, ``reasoning_content``, tool calls, ``text``), **TPOT**
(``(t_last - t_first) / (tokens - 1)``, one token per event as llama.cpp and vLLM send them) and
**end-to-end**. Usage, when the server sends it, gives prompt and cached tokens. A summary has
p50 / p90 / p99 of each, the achieved request rate and **goodput**: completed requests per second
that met the SLO (TTFT and TPOT limits).

Run: ``python bench/loadgen.py --url http://127.0.0.1:8000 --concurrency 64 --duration 10``
(``--rate 50`` for open loop, ``--prompt-bytes``, ``--max-tokens``, ``--json OUT``). The
benchmark harnesses import it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

from analyzers.quantile import percentile

CHAT_PATH = "/v1/chat/completions"
BodyFactory = Callable[[int], bytes]


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency limits a request must meet to count toward goodput (None: no limit)."""

    ttft_ms: float | None = 1000.0
    tpot_ms: float | None = 100.0

    def met(self, r: Result) -> bool:
        if not r.ok or r.ttft_ms is None:
            return False
        if self.ttft_ms is not None and r.ttft_ms > self.ttft_ms:
            return False
        return not (self.tpot_ms is not None and r.tpot_ms is not None and r.tpot_ms > self.tpot_ms)


@dataclass(slots=True)
class Result:
    """One request as the client saw it. Times in ms; ``start_s`` from the run's start."""

    start_s: float
    ok: bool = False
    status: int = 0
    error: str | None = None
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float = 0.0
    tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    lag_ms: float = 0.0  # open loop: how late the request left against its scheduled arrival
    text: str = ""

    @property
    def end_s(self) -> float:
        return self.start_s + self.e2e_ms / 1000.0


@dataclass(frozen=True, slots=True)
class Window:
    """The measured part of a run, in seconds from its start: latencies are those of requests
    that started in it, throughput counts requests that completed in it.

    ``run_s`` is the whole run, drain included: when fewer than ``MIN_IN_WINDOW`` requests
    completed inside the window (a target slower than the window is long), throughput is all
    completed requests over the whole run instead, and latencies are those of every request.
    """

    start_s: float
    end_s: float
    run_s: float | None = None

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass(slots=True)
class _Stream:
    """Incremental SSE reading for one response."""

    t0: float
    keep_text: bool
    buf: bytes = b""
    t_first: float | None = None
    t_last: float | None = None
    tokens: int = 0
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None
    t_finish: float | None = None
    finish_reason: str | None = None
    parts: list[str] = field(default_factory=list)

    def feed(self, data: bytes, now: float) -> None:
        buf = self.buf + data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self.buf = buf.split(b"\n\n")
        for event in events:
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]" or not payload:
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                self._object(obj, now)

    def _object(self, obj: dict[str, Any], now: float) -> None:
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]
        if "error" in obj and "choices" not in obj:
            self.error = "stream_error"
            return
        reason = _finish_reason(obj)
        if reason is not None and self.t_finish is None:
            self.t_finish, self.finish_reason = now, reason
        text = _token_text(obj)
        if text is None:
            return
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self.tokens += 1
        if self.keep_text:
            self.parts.append(text)


def _finish_reason(obj: dict[str, Any]) -> str | None:
    if obj.get("stop") is True:  # llama.cpp's native /completion
        return str(obj.get("stop_type") or "stop")
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if isinstance(choice, dict) and choice.get("finish_reason"):
            return str(choice["finish_reason"])
    return None


def _token_text(obj: dict[str, Any]) -> str | None:
    """The token an event carries (possibly ``""`` for a tool-call delta); None if none."""
    content = obj.get("content")  # llama.cpp's native /completion
    if isinstance(content, str) and content and "choices" not in obj:
        return content
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return None
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        text = choice.get("text")
        if isinstance(text, str) and text:
            return text
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        for key in ("content", "reasoning_content", "reasoning"):
            value = delta.get(key)
            if isinstance(value, str) and value:
                return value if key == "content" else ""
        if delta.get("tool_calls"):
            return ""
    return None


async def send(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    *,
    start_s: float = 0.0,
    keep_text: bool = False,
    headers: dict[str, str] | None = None,
) -> Result:
    """POST one streamed request and time it. Never raises on a failed request."""
    t0 = time.perf_counter()
    result = Result(start_s=start_s)
    stream = _Stream(t0=t0, keep_text=keep_text)
    hdrs = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
    if headers:
        hdrs.update(headers)
    try:
        resp = await _post(session, url, body, hdrs)
        async with resp:
            result.status = resp.status
            if resp.status != 200:
                await resp.read()
                result.error = f"http_{resp.status}"
            else:
                async for data in resp.content.iter_any():
                    stream.feed(data, time.perf_counter())
    except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
        result.error = type(exc).__name__
    t_end = time.perf_counter()
    result.e2e_ms = (t_end - t0) * 1000.0
    result.tokens = stream.tokens
    # An answer with no token at all (the model stopped at once) has its first output, the
    # finishing event, as its first "token".
    t_first = stream.t_first if stream.t_first is not None else stream.t_finish
    if t_first is not None:
        result.ttft_ms = (t_first - t0) * 1000.0
        if stream.tokens >= 2 and stream.t_last is not None:
            result.tpot_ms = (stream.t_last - t_first) * 1000.0 / (stream.tokens - 1)
    _read_usage(result, stream)
    result.error = result.error or stream.error
    result.ok = result.error is None and result.status == 200 and t_first is not None
    if result.ok is False and result.error is None:
        result.error = "no_output"
    result.text = "".join(stream.parts)
    return result


async def _post(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> aiohttp.ClientResponse:
    """POST, retrying once when a pooled keep-alive connection turns out to be closed.

    llama-server closes idle keep-alive connections; nothing was answered on such a
    connection, so a retry on a new one is safe (HTTP clients such as the OpenAI SDK retry too).
    The request's times still start at the first attempt.
    """
    try:
        return await session.post(url, data=body, headers=headers)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        return await session.post(url, data=body, headers=headers)


def _read_usage(result: Result, stream: _Stream) -> None:
    usage = stream.usage or {}
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    timings = stream.timings or {}
    if cached is None and isinstance(timings.get("cache_n"), int):
        cached = timings["cache_n"]
        if prompt is None and isinstance(timings.get("prompt_n"), int):
            prompt = timings["prompt_n"] + cached
    result.prompt_tokens = prompt if isinstance(prompt, int) else None
    result.cached_tokens = cached if isinstance(cached, int) else None


def new_session(connections: int = 0) -> aiohttp.ClientSession:
    """A client session with keep-alive connections and no total timeout (streams run long)."""
    connector = aiohttp.TCPConnector(limit=connections, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=120)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def closed_loop(
    url: str,
    bodies: BodyFactory,
    *,
    concurrency: int,
    duration_s: float | None = None,
    requests: int | None = None,
    warmup_s: float = 0.0,
    id_prefix: str | None = None,
) -> tuple[list[Result], Window]:
    """``concurrency`` workers back to back until ``duration_s`` or ``requests`` in total.

    With ``id_prefix``, request *i* carries ``X-Request-Id: <id_prefix>-<i>``. Returns every
    result and the measured window: ``[warmup_s, warmup_s + duration_s]`` for a timed run (so
    neither the ramp-up nor the drain of the last requests counts), the whole run otherwise.
    """
    if duration_s is None and requests is None:
        raise ValueError("closed_loop needs duration_s or requests")
    results: list[Result] = []
    counter = 0
    async with new_session(concurrency) as session:
        t_start = time.perf_counter()
        deadline = t_start + warmup_s + duration_s if duration_s is not None else math.inf

        async def worker() -> None:
            nonlocal counter
            while time.perf_counter() < deadline:
                if requests is not None and counter >= requests:
                    return
                i = counter
                counter += 1
                start = time.perf_counter() - t_start
                r = await send(session, url, bodies(i), start_s=start, headers=_rid(id_prefix, i))
                results.append(r)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t_start
    if duration_s is not None:
        return results, Window(warmup_s, warmup_s + duration_s, run_s=wall)
    return results, Window(0.0, wall)


async def open_loop(
    url: str,
    bodies: BodyFactory,
    *,
    rate: float,
    duration_s: float,
    seed: int = 0,
    id_prefix: str | None = None,
) -> tuple[list[Result], Window]:
    """Poisson arrivals at ``rate`` per second for ``duration_s``; waits for all to finish."""
    rng = random.Random(seed)
    arrivals: list[float] = []
    t = rng.expovariate(rate)
    while t < duration_s:
        arrivals.append(t)
        t += rng.expovariate(rate)
    results: list[Result] = []
    async with new_session(0) as session:
        t_start = time.perf_counter()

        async def one(i: int, at: float) -> None:
            delay = at - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            lag = (time.perf_counter() - t_start - at) * 1000.0
            r = await send(session, url, bodies(i), start_s=at, headers=_rid(id_prefix, i))
            r.lag_ms = lag
            results.append(r)

        await asyncio.gather(*(one(i, at) for i, at in enumerate(arrivals)))
        wall = max(time.perf_counter() - t_start, duration_s)
    return results, Window(0.0, wall)


def _rid(prefix: str | None, i: int) -> dict[str, str] | None:
    return {"X-Request-Id": f"{prefix}-{i}"} if prefix else None


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {
        "p50": _round(percentile(ordered, 0.5)),
        "p90": _round(percentile(ordered, 0.9)),
        "p99": _round(percentile(ordered, 0.99)),
        "mean": _round(sum(values) / len(values)) if values else None,
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


MIN_IN_WINDOW = 20


def summarize(results: Sequence[Result], window: Window, slo: Slo) -> dict[str, Any]:
    """Latency distributions, throughput, goodput and cache share of a run."""
    wall_s = window.seconds
    done = [r for r in results if r.ok and window.start_s <= r.end_s <= window.end_s + 1e-9]
    basis = "window"
    if len(done) < MIN_IN_WINDOW and window.run_s:
        done = [r for r in results if r.ok]
        wall_s, basis = window.run_s, "whole run"
    goodput = sum(1 for r in done if slo.met(r))
    if basis == "window":
        results = [r for r in results if r.start_s >= window.start_s]
    ok = [r for r in results if r.ok]
    met = [r for r in ok if slo.met(r)]
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached = [r.cached_tokens or 0 for r in ok if r.prompt_tokens is not None]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown"] = errors.get(r.error or "unknown", 0) + 1
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": errors,
        "wall_s": round(wall_s, 3),
        "rps": round(len(done) / wall_s, 2) if wall_s > 0 else None,
        "rps_basis": basis,
        "goodput_rps": round(goodput / wall_s, 2) if wall_s > 0 else None,
        "slo_met_share": round(len(met) / len(results), 4) if results else None,
        "slo": asdict(slo),
        "ttft_ms": _dist([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": _dist([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "e2e_ms": _dist([r.e2e_ms for r in ok]),
        "tokens_per_request": round(sum(r.tokens for r in ok) / len(ok), 2) if ok else None,
        "prompt_tokens": sum(prompt),
        "cached_tokens": sum(cached),
        "cached_share": round(sum(cached) / sum(prompt), 4) if sum(prompt) else None,
        "lag_ms_p99": _round(percentile(sorted(r.lag_ms for r in results), 0.99)),
    }


def chat_body(
    prompt_bytes: int,
    *,
    max_tokens: int = 16,
    model: str = "bench-model",
    salt: str = "",
    include_usage: bool = False,
) -> bytes:
    """A streamed chat request whose user message is about ``prompt_bytes`` long."""
    unit = "The quick brown fox jumps over the lazy dog. "
    text = (salt + " " + unit * (prompt_bytes // len(unit) + 1))[:prompt_bytes]
    body: dict[str, Any] = {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": text},
        ],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return orjson.dumps(body)


def fixed_bodies(body: bytes) -> BodyFactory:
    return lambda _i: body


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="base URL of the target")
    parser.add_argument("--path", default=CHAT_PATH)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop with N streams")
    mode.add_argument("--rate", type=float, help="open loop, Poisson arrivals per second")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds")
    parser.add_argument("--requests", type=int, help="closed loop: stop after N requests")
    parser.add_argument("--warmup", type=float, default=0.0, help="seconds not counted")
    parser.add_argument("--prompt-bytes", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="bench-model")
    parser.add_argument("--include-usage", action="store_true", help="ask for the usage event")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=100.0)
    parser.add_argument("--json", help="write the summary here")
    args = parser.parse_args(argv)
    url = args.url.rstrip("/") + args.path
    body = chat_body(
        args.prompt_bytes,
        max_tokens=args.max_tokens,
        model=args.model,
        include_usage=args.include_usage,
    )
    if args.concurrency:
        results, window = asyncio.run(
            closed_loop(
                url,
                fixed_bodies(body),
                concurrency=args.concurrency,
                duration_s=None if args.requests else args.duration,
                requests=args.requests,
                warmup_s=args.warmup,
            )
        )
    else:
        results, window = asyncio.run(
            open_loop(url, fixed_bodies(body), rate=args.rate, duration_s=args.duration)
        )
    summary = summarize(results, window, Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    out = orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode()
    if args.json:
        with open(args.json, "w") as f:
            f.write(out + "\n")
    print(out)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
