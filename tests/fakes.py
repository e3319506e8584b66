"""Fake inference servers for the in-process suite: real aiohttp apps speaking real wire formats.

``LlamaFake`` answers like llama.cpp's ``llama-server`` and ``VllmFake`` like vLLM's OpenAI server
(see /work/shared/BACKENDS.md): the same endpoints, the same JSON shapes, the same SSE framing,
the same quirks (llama.cpp's ``timings`` riding on the last event, its ``:`` pings, no ``[DONE]``
after a mid-stream error or on native ``/completion``; vLLM's role chunk, its usage chunk only
with ``include_usage``, ``prompt_tokens_details`` only when enabled).

Behaviour is steered by ``Knobs`` (what to emit, how fast, where to fail or stall). Each fake
records what it received (``last_body``, ``last_headers``, ``last_query``) and whether the proxy
closed an unfinished response (``closed``, set when the handler is cancelled or its writes fail).

Prompt caching is modelled per fake: tokens are whitespace-separated words, and a prompt's cached
tokens are its longest common prefix with any prompt seen before (llama.cpp keeps at least one
token to evaluate, so its count is capped at ``prompt_tokens - 1``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.records import RequestRecord

MODEL = "fake-model"
DONE = b"data: [DONE]\n\n"
PING = b":\n\n"


class RecordLog(list[RequestRecord]):
    """The records a proxy wrote, in order (its ``RecordWriter`` sink appends here)."""

    def __init__(self) -> None:
        super().__init__()
        self._grew = asyncio.Event()

    def append(self, record: RequestRecord) -> None:
        super().append(record)
        self._grew.set()

    async def wait(self, n: int = 1, limit_s: float = 2.0) -> RequestRecord:
        """Wait until at least ``n`` records exist (they are written after the response ends)."""
        async with asyncio.timeout(limit_s):
            while len(self) < n:
                self._grew.clear()
                await self._grew.wait()
        return self[n - 1]


ProxyClient = TestClient[web.Request, web.Application]
MakeProxy = Callable[..., Awaitable[tuple[ProxyClient, RecordLog, web.Application]]]


@dataclass
class Knobs:
    """How a fake behaves on its next inference requests."""

    tokens: list[str] = field(default_factory=lambda: ["Hello", " there", ",", " friend", "!"])
    reasoning: list[str] = field(default_factory=list)  # emitted before ``tokens``
    token_delay_s: float = 0.0
    header_delay_s: float = 0.0  # before the status line is sent
    ping_first: bool = False  # an SSE comment before the first token
    fail_after: int | None = None  # a mid-stream error event after N token events
    stall_after: int | None = None  # stop sending (but keep the connection) after N token events
    reject_status: int | None = None  # answer the first result with this HTTP error
    prefill_ms_per_token: float = 0.5
    decode_ms_per_token: float = 10.0


def sse(obj: Any) -> bytes:
    """One SSE event the way both servers frame it."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prompt_words(body: Mapping[str, Any]) -> list[str]:
    """The prompt as whitespace-separated "tokens": messages' text, or the prompt string."""
    parts: list[str] = []
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, Mapping):
                continue
            parts.append(str(m.get("role", "")))
            content = m.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        parts.append(prompt)
    elif isinstance(prompt, list):
        parts.extend(str(p) for p in prompt)
    return " ".join(parts).split()


class FakeBackend:
    """What both fakes share: knobs, request capture, the prompt cache, the closing watch."""

    def __init__(self, knobs: Knobs | None = None) -> None:
        self.knobs = knobs or Knobs()
        self.requests: list[dict[str, Any]] = []
        self.last_body: dict[str, Any] | None = None
        self.last_headers: Mapping[str, str] = {}
        self.last_query: Mapping[str, str] = {}
        self.closed = asyncio.Event()  # an unfinished response was abandoned by the client
        self.finished = asyncio.Event()  # a streamed response ran to its end
        self._seen: list[list[str]] = []
        self.url = ""  # set by the fixture once the server listens
        self._created = int(time.time())

    def forget(self) -> None:
        """Empty the prompt cache (so a direct request sees what the proxied one saw)."""
        self._seen.clear()

    # -- to be provided by each server ---------------------------------------------------------

    def app(self) -> web.Application:
        raise NotImplementedError

    # -- shared plumbing -------------------------------------------------------------------------

    async def _capture(self, request: web.Request) -> dict[str, Any] | web.Response:
        raw = await request.read()
        self.last_headers = request.headers.copy()  # case-insensitive, like HTTP
        self.last_query = dict(request.query)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return self.error_response(400, "failed to parse request body as JSON")
        if not isinstance(body, dict):
            return self.error_response(400, "request body must be an object")
        self.last_body = body
        self.requests.append(body)
        return body

    def cache_lookup(self, body: Mapping[str, Any]) -> tuple[int, int]:
        """(prompt_tokens, cached_tokens) for ``body``; remembers the prompt."""
        words = prompt_words(body)
        cached = max((common_prefix(words, s) for s in self._seen), default=0)
        self._seen.append(words)
        return len(words), cached

    def error_response(self, status: int, message: str) -> web.Response:
        raise NotImplementedError

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``; a client leaving meanwhile cancels the handler (``closed`` set)."""
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.closed.set()
            raise

    async def _stall(self) -> None:
        """Send nothing more, keeping the connection, until the client closes it."""
        try:
            await asyncio.Event().wait()
        finally:
            self.closed.set()

    async def _open_stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200, headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        return resp

    def timings(self, prompt_n: int, cache_n: int, predicted_n: int) -> dict[str, Any]:
        k = self.knobs
        prompt_ms = round(max(prompt_n, 1) * k.prefill_ms_per_token, 3)
        predicted_ms = round(max(predicted_n - 1, 0) * k.decode_ms_per_token, 3)
        per_token = predicted_ms / (predicted_n - 1) if predicted_n > 1 else 0.0
        return {
            "cache_n": cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": round(prompt_ms / max(prompt_n, 1), 6),
            "prompt_per_second": round(1000.0 * max(prompt_n, 1) / prompt_ms, 6),
            "predicted_n": predicted_n,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": per_token,
            "predicted_per_second": 1000.0 / per_token if per_token else 0.0,
        }

    async def _run_stream(
        self,
        request: web.Request,
        events: list[bytes],
        *,
        token_events: int,
        lead: list[bytes],
        error_event: bytes,
        error_tail: bytes,
    ) -> web.StreamResponse:
        """Send ``lead`` then ``events`` (the first ``token_events`` paced by the knobs)."""
        k = self.knobs
        if k.header_delay_s:
            await self._pause(k.header_delay_s)
        resp = await self._open_stream(request)
        try:
            if k.ping_first:
                await resp.write(PING)
            for event in lead:
                await resp.write(event)
            for i, event in enumerate(events):
                if i < token_events:
                    if k.fail_after is not None and i == k.fail_after:
                        await resp.write(error_event + error_tail)
                        await resp.write_eof()
                        self.finished.set()
                        return resp
                    if k.stall_after is not None and i == k.stall_after:
                        await self._stall()
                    if k.token_delay_s and i > 0:
                        await self._pause(k.token_delay_s)
                await resp.write(event)
            await resp.write_eof()
            self.finished.set()
        except (asyncio.CancelledError, ConnectionResetError):
            self.closed.set()
            raise
        return resp


FakeBackendT = TypeVar("FakeBackendT", bound=FakeBackend)


def _chunk_meta(object_: str, created: int, rid: str) -> dict[str, Any]:
    return {"id": rid, "object": object_, "created": created, "model": MODEL}


class LlamaFake(FakeBackend):
    """llama.cpp ``llama-server``: ``/props``, ``timings``, native ``/completion``, ``:`` pings."""

    n_ctx = 4096
    total_slots = 4
    fingerprint = "b6000-abcdef12"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/props", self.props)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/completion", self.native)
        return app

    def error_response(self, status: int, message: str) -> web.Response:
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = {"error": {"code": status, "message": message, "type": kind}}
        return web.json_response(body, status=status)

    async def health(self, request: web.Request) -> web.Response:
        self.last_query = dict(request.query)
        return web.json_response({"status": "ok"})

    async def props(self, request: web.Request) -> web.Response:
        self.last_query = dict(request.query)
        return web.json_response(
            {
                "default_generation_settings": {
                    "n_ctx": self.n_ctx,
                    "params": {"temperature": 0.8},
                },
                "total_slots": self.total_slots,
                "model_alias": MODEL,
                "model_path": f"/models/{MODEL}.gguf",
                "build_info": self.fingerprint,
                "endpoint_slots": True,
                "is_sleeping": False,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        self.last_query = dict(request.query)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": MODEL,
                        "object": "model",
                        "created": self._created,
                        "owned_by": "llamacpp",
                        "meta": {"n_ctx_train": 8192},
                    }
                ],
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        got = await self._capture(request)
        if isinstance(got, web.Response):
            return got
        content = got.get("content")
        if not isinstance(content, str):
            return self.error_response(400, '"content" must be provided')
        return web.json_response({"tokens": [len(w) for w in content.split()]})

    def _usage(self, prompt: int, cached: int, completion: int) -> dict[str, Any]:
        return {
            "completion_tokens": completion,
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _counts(self, body: Mapping[str, Any]) -> tuple[int, int]:
        prompt, cached = self.cache_lookup(body)
        return prompt, min(cached, max(prompt - 1, 0))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._oai(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._oai(request, chat=False)

    async def _oai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._capture(request)
        if isinstance(body, web.Response):
            return body
        k = self.knobs
        if k.reject_status is not None:
            return self.error_response(k.reject_status, "the request exceeds the context size")
        prompt, cached = self._counts(body)
        n_out = len(k.reasoning) + len(k.tokens)
        usage = self._usage(prompt, cached, n_out)
        timings = self.timings(prompt - cached, cached, n_out)
        rid = "chatcmpl-fake" if chat else "cmpl-fake"
        if body.get("stream") is not True:
            if k.header_delay_s:
                await self._pause(k.header_delay_s)
            text = "".join(k.tokens)
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if k.reasoning:
                    message["reasoning_content"] = "".join(k.reasoning)
                choice: dict[str, Any] = {"finish_reason": "stop", "index": 0, "message": message}
            else:
                choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": "stop"}
            return web.json_response(
                {
                    "choices": [choice],
                    "created": self._created,
                    "model": MODEL,
                    "system_fingerprint": self.fingerprint,
                    "object": "chat.completion" if chat else "text_completion",
                    "usage": usage,
                    "id": rid,
                    "timings": timings,
                }
            )
        opts = body.get("stream_options")
        include_usage = isinstance(opts, Mapping) and opts.get("include_usage") is True
        obj = "chat.completion.chunk" if chat else "text_completion"
        meta = {**_chunk_meta(obj, self._created, rid), "system_fingerprint": self.fingerprint}

        def piece(delta: dict[str, Any] | None, text: str | None, finish: str | None) -> bytes:
            if chat:
                choice = {"finish_reason": finish, "index": 0, "delta": delta or {}}
            else:
                choice = {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
            return sse({"choices": [choice], **meta})

        events = [piece({"reasoning_content": t}, t, None) for t in k.reasoning]
        events += [piece({"content": t}, t, None) for t in k.tokens]
        n_tokens = len(events)
        lead = [piece({"role": "assistant", "content": None}, None, None)] if chat else []
        if chat:
            finish = {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}], **meta}
            if include_usage:
                events.append(sse(finish))
                events.append(sse({"choices": [], **meta, "usage": usage, "timings": timings}))
            else:
                events.append(sse({**finish, "timings": timings}))
        else:
            # /v1/completions: the final event is the whole object, usage and timings included.
            done = {
                "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}],
                **meta,
                "usage": usage,
                "timings": timings,
            }
            events.append(sse(done))
        events.append(DONE)
        error = sse(
            {"error": {"code": 500, "message": "the slot failed to decode", "type": "server_error"}}
        )
        return await self._run_stream(
            request, events, token_events=n_tokens, lead=lead, error_event=error, error_tail=b""
        )

    async def native(self, request: web.Request) -> web.StreamResponse:
        body = await self._capture(request)
        if isinstance(body, web.Response):
            return body
        k = self.knobs
        if k.reject_status is not None:
            return self.error_response(k.reject_status, "the request exceeds the context size")
        prompt, cached = self._counts(body)
        n_out = len(k.tokens)
        final: dict[str, Any] = {
            "index": 0,
            "content": "".join(k.tokens),
            "tokens": [],
            "id_slot": 0,
            "stop": True,
            "model": MODEL,
            "tokens_predicted": n_out,
            "tokens_evaluated": prompt,
            "generation_settings": {"n_predict": -1},
            "prompt": body.get("prompt"),
            "has_new_line": False,
            "truncated": False,
            "stop_type": "eos",
            "stopping_word": "",
            "tokens_cached": prompt + n_out,
            "timings": self.timings(prompt - cached, cached, n_out),
        }
        if body.get("stream") is not True:
            return web.json_response(final)
        events = [
            sse(
                {
                    "index": 0,
                    "content": t,
                    "tokens": [i],
                    "stop": False,
                    "id_slot": 0,
                    "tokens_predicted": i + 1,
                    "tokens_evaluated": prompt,
                }
            )
            for i, t in enumerate(k.tokens)
        ]
        events.append(sse({**final, "content": ""}))
        error = sse(
            {"error": {"code": 500, "message": "the slot failed to decode", "type": "server_error"}}
        )
        return await self._run_stream(
            request, events, token_events=n_out, lead=[], error_event=error, error_tail=b""
        )


class VllmFake(FakeBackend):
    """vLLM's OpenAI server: ``/version``, role chunk first, usage only with ``include_usage``."""

    max_model_len = 8192

    def __init__(self, knobs: Knobs | None = None, *, prompt_tokens_details: bool = False) -> None:
        super().__init__(knobs)
        self.prompt_tokens_details = prompt_tokens_details

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        return app

    def error_response(self, status: int, message: str) -> web.Response:
        kind = "BadRequestError" if status < 500 else "InternalServerError"
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return web.json_response(body, status=status)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.11.0"})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": MODEL,
                        "object": "model",
                        "created": self._created,
                        "owned_by": "vllm",
                        "root": MODEL,
                        "parent": None,
                        "max_model_len": self.max_model_len,
                        "permission": [],
                    }
                ],
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        got = await self._capture(request)
        if isinstance(got, web.Response):
            return got
        words = prompt_words(got)
        return web.json_response(
            {
                "count": len(words),
                "max_model_len": self.max_model_len,
                "tokens": [len(w) for w in words],
                "token_strs": None,
            }
        )

    def _usage(self, prompt: int, cached: int, completion: int) -> dict[str, Any]:
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
        }
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._oai(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._oai(request, chat=False)

    async def _oai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._capture(request)
        if isinstance(body, web.Response):
            return body
        k = self.knobs
        if k.reject_status is not None:
            return self.error_response(
                k.reject_status,
                f"This model's maximum context length is {self.max_model_len} tokens.",
            )
        prompt, cached = self.cache_lookup(body)
        # vLLM caches whole blocks of 16 tokens.
        cached = (cached // 16) * 16
        n_out = len(k.reasoning) + len(k.tokens)
        usage = self._usage(prompt, cached, n_out)
        rid = "chatcmpl-fake" if chat else "cmpl-fake"
        if body.get("stream") is not True:
            if k.header_delay_s:
                await self._pause(k.header_delay_s)
            text = "".join(k.tokens)
            if chat:
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": text,
                    "tool_calls": [],
                    "reasoning_content": None,
                }
                if k.reasoning:
                    message["reasoning_content"] = "".join(k.reasoning)
                choice: dict[str, Any] = {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            full_usage = {**usage, "prompt_tokens_details": usage.get("prompt_tokens_details")}
            return web.json_response(
                {
                    **_chunk_meta(
                        "chat.completion" if chat else "text_completion", self._created, rid
                    ),
                    "choices": [choice],
                    "usage": full_usage,
                }
            )
        opts = body.get("stream_options")
        include_usage = isinstance(opts, Mapping) and opts.get("include_usage") is True
        meta = _chunk_meta(
            "chat.completion.chunk" if chat else "text_completion", self._created, rid
        )

        def piece(delta: dict[str, Any], text: str, finish: str | None) -> bytes:
            if chat:
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": finish,
                }
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = None
            return sse({**meta, "choices": [choice]})

        events = [piece({"reasoning_content": t}, t, None) for t in k.reasoning]
        events += [piece({"content": t}, t, None) for t in k.tokens]
        n_tokens = len(events)
        lead = [piece({"role": "assistant", "content": ""}, "", None)] if chat else []
        events.append(piece({"content": ""}, "", "stop"))
        if include_usage:
            events.append(sse({**meta, "choices": [], "usage": usage}))
        events.append(DONE)
        error = sse(
            {
                "error": {
                    "message": "engine core died",
                    "type": "InternalServerError",
                    "param": None,
                    "code": 500,
                }
            }
        )
        return await self._run_stream(
            request,
            events,
            token_events=n_tokens,
            lead=lead,
            error_event=error,
            error_tail=DONE,
        )


def sse_events(raw: bytes) -> list[bytes]:
    """A complete SSE body cut into its events (each with its blank line)."""
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def sse_payloads(raw: bytes) -> list[Any]:
    """The JSON ``data:`` payloads of a complete SSE body (``[DONE]`` and pings left out)."""
    return [
        orjson.loads(e[6:])
        for e in sse_events(raw)
        if e.startswith(b"data: ") and not e.startswith(b"data: [DONE]")
    ]


async def serve(fake: FakeBackendT, aiohttp_server: Any) -> FakeBackendT:
    """Start ``fake`` with pytest-aiohttp's ``aiohttp_server`` on a free port; set its ``url``."""
    server = await aiohttp_server(fake.app())
    fake.url = str(server.make_url("")).rstrip("/")
    return fake
