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

Tool calling (``LlamaFake`` only) is opt-in: with ``Knobs.tool_calls`` set, a chat request that
offers those functions (``tools``) and has no tool result after its newest user message is
answered with the calls instead of text (``finish_reason: "tool_calls"``); the request that
brings the results back gets the text answer. So every user turn of an agent loop is one tool
round, then an answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.app import admin_app
from proxy.config import BackendSpec, HealthChecks
from proxy.record_writer import RecordWriter
from proxy.records import RequestRecord
from proxy.routing import RoutingConfig
from tests.fake_apis import (
    anthropic_to_chat,
    api_event,
    messages_answer,
    messages_stream,
    responses_answer,
    responses_stream,
    responses_to_chat,
    responses_usage,
)
from tests.record_check import as_logged, violations

MODEL = "fake-model"
DONE = b"data: [DONE]\n\n"
PING = b":\n\n"


class RecordLog(list[RequestRecord]):
    """The records a proxy wrote, in order (its ``RecordWriter`` sink appends here).

    Each one is checked against the published record schema on the way in; ``schema_problems``
    lists the violations (the ``make_proxy`` fixture fails the test when there are any).
    """

    def __init__(self) -> None:
        super().__init__()
        self._grew = asyncio.Event()
        self.schema_problems: list[str] = []
        self.writer: RecordWriter[Any] | None = None
        """The writer whose sink this is: reading the log first writes what it holds (records
        wait a moment to go out together, ``RecordWriter.submit``), as ``/metrics`` and
        ``/stats`` do, so every request that has ended is in it."""

    @classmethod
    def of(cls, writer: RecordWriter[Any]) -> RecordLog:
        """The log of every record ``writer`` writes (its sink)."""
        log = cls()
        writer.add_sink(log.append)
        log.writer = writer
        return log

    def _current(self) -> None:
        if self.writer is not None:
            self.writer.flush_ended()

    def __len__(self) -> int:
        self._current()
        return super().__len__()

    def __iter__(self) -> Iterator[RequestRecord]:
        self._current()
        return super().__iter__()

    def __getitem__(self, index: Any) -> Any:
        self._current()
        return super().__getitem__(index)

    def __reversed__(self) -> Iterator[RequestRecord]:
        self._current()
        return super().__reversed__()

    def __contains__(self, item: object) -> bool:
        self._current()
        return super().__contains__(item)

    def __eq__(self, other: object) -> bool:
        self._current()
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # (a list's)

    def append(self, record: RequestRecord) -> None:
        problems = violations(as_logged(record))
        self.schema_problems += [f"record {record.request_id}: {p}" for p in problems]
        super().append(record)
        self._grew.set()

    async def wait(self, n: int = 1, limit_s: float = 2.0) -> RequestRecord:
        """Wait until at least ``n`` records exist (they are written a moment after the
        response ends), as the writer writes them: waiting does not write them sooner."""
        async with asyncio.timeout(limit_s):
            while super().__len__() < n:  # (written by the writer's own timer, not by reading)
                self._grew.clear()
                await self._grew.wait()
        return self[n - 1]


class ProxyClient(TestClient[web.Request, web.Application]):
    """A test client of the proxy's traffic listener; ``admin`` is one of its admin listener.

    The traffic application starts first (its start-up opens the state the admin routes read)
    and stops last.
    """

    def __init__(self, app: web.Application) -> None:
        super().__init__(TestServer(app))
        self.admin: TestClient[web.Request, web.Application] = TestClient(
            TestServer(admin_app(app))
        )

    async def start_server(self) -> None:
        await super().start_server()
        await self.admin.start_server()

    async def close(self) -> None:
        await self.admin.close()
        await super().close()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MakeProxy = Callable[..., Awaitable[tuple[ProxyClient, RecordLog, web.Application]]]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the fake model makes: a function's name and its arguments as JSON text."""

    name: str
    arguments: str = "{}"


@dataclass
class Knobs:
    """How a fake behaves on its next inference requests."""

    tokens: list[str] = field(default_factory=lambda: ["Hello", " there", ",", " friend", "!"])
    reasoning: list[str] = field(default_factory=list)  # emitted before ``tokens``
    token_delay_s: float = 0.0
    header_delay_s: float = 0.0  # before the status line is sent
    ping_first: bool = False  # an SSE comment before the first token
    head_only: bool = False  # a stream's head, then nothing (until the client closes)
    head_with_first: bool = False  # a stream's head in the same write as its first event
    fail_after: int | None = None  # a mid-stream error event after N token events
    stall_after: int | None = None  # stop sending (but keep the connection) after N token events
    reject_status: int | None = None  # answer the first result with this HTTP error
    drop_connections: int = 0  # close the next N inference connections without answering
    drop_after: int | None = None  # close the connection mid-stream after N token events
    prefill_ms_per_token: float = 0.5
    decode_ms_per_token: float = 10.0
    # LlamaFake: the calls made, in place of text, when a chat request is due one (module doc).
    tool_calls: list[ToolCall] = field(default_factory=list)


def sse(obj: Any) -> bytes:
    """One SSE event the way both servers frame it."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def due_tool_calls(body: Mapping[str, Any], calls: Sequence[ToolCall]) -> list[ToolCall]:
    """Those of ``calls`` a chat request gets: the ones whose function it offers in ``tools``,
    unless ``tool_choice`` is ``"none"`` or a tool result already follows the newest user message.
    """
    tools = body.get("tools")
    messages = body.get("messages")
    if not calls or not isinstance(tools, list) or not isinstance(messages, list):
        return []
    if body.get("tool_choice") == "none":
        return []
    for m in reversed(messages):
        role = m.get("role") if isinstance(m, Mapping) else None
        if role == "tool":
            return []
        if role == "user":
            break
    offered = {
        t["function"].get("name")
        for t in tools
        if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)
    }
    return [c for c in calls if c.name in offered]


def argument_pieces(arguments: str, size: int = 8) -> list[str]:
    """A call's arguments as the stream sends them: ``""`` with the name, then ``size`` chars."""
    return ["", *(arguments[i : i + size] for i in range(0, len(arguments), size))]


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
        self.last_raw: bytes | None = None
        self.last_headers: Mapping[str, str] = {}
        self.last_query: Mapping[str, str] = {}
        self.closed = asyncio.Event()  # an unfinished response was abandoned by the client
        self.finished = asyncio.Event()  # a streamed response ran to its end
        self.received = asyncio.Event()  # a request was captured (tests clear it to wait again)
        self._seen: list[list[str]] = []
        self.url = ""  # set by the fixture once the server listens
        self._created = int(time.time())
        # Health and load as the server reports them (``/health``, ``/slots``, ``/metrics``).
        self.health_status = 200
        self.health_checks = 0
        self.load_running = 0
        self.load_waiting = 0
        self.serve_slots = False  # llama.cpp: /slots (on in a real server unless --no-slots)
        self.serve_metrics = False  # /metrics (llama.cpp needs --metrics; vLLM always has it)

    async def wait_requests(self, n: int, limit_s: float = 5.0) -> None:
        """Wait until at least ``n`` requests have been received."""
        async with asyncio.timeout(limit_s):
            while len(self.requests) < n:
                self.received.clear()
                await self.received.wait()

    def forget(self) -> None:
        """Empty the prompt cache (so a direct request sees what the proxied one saw)."""
        self._seen.clear()

    def app(self) -> web.Application:
        """The server: the endpoints both servers have, then its own (``_own_routes``)."""
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)
        self._own_routes(app.router)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._oai(request, chat=True)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._api(request, anthropic=False)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._api(request, anthropic=True)

    async def _api(self, request: web.Request, *, anthropic: bool) -> web.StreamResponse:
        """``/v1/responses`` or ``/v1/messages`` (``anthropic``), streamed or not."""
        body = await self._accept(request)
        if isinstance(body, web.Response):
            return body
        k = self.knobs
        chat = anthropic_to_chat(body) if anthropic else responses_to_chat(body)
        prompt, cached = self._api_counts(chat)
        n_out = len(k.reasoning) + len(k.tokens)
        thinking, text = "".join(k.reasoning), "".join(k.tokens)
        stream = body.get("stream") is True
        if anthropic:
            start, final, whole = self._messages_usage(prompt, cached, n_out)
            if not stream:
                return web.json_response(messages_answer(MODEL, thinking, text, whole))
            lead, writes, tail = messages_stream(
                MODEL, k.reasoning, k.tokens, start, final, start_alone=self.messages_start_alone
            )
        else:
            usage = responses_usage(prompt, self._responses_cached(cached), n_out)
            if not stream:
                return web.json_response(
                    responses_answer(MODEL, thinking, text, usage, self._created)
                )
            timings = self._api_timings(prompt - cached, cached, n_out)
            lead: list[bytes] = []
            writes, tail = responses_stream(
                MODEL, k.reasoning, k.tokens, usage, self._created, timings=timings
            )
        if anthropic:
            tail += self._messages_stream_end()
        return await self._run_stream(
            request,
            writes + tail,
            token_events=len(writes),
            lead=lead,
            error_event=self._api_error_event(anthropic),
            error_tail=b"",
        )

    def _api_counts(self, chat: Mapping[str, Any]) -> tuple[int, int]:
        """(prompt, cached) tokens of a Responses or Messages request, as chat messages."""
        raise NotImplementedError

    def _responses_cached(self, cached: int) -> int | None:
        """``input_tokens_details.cached_tokens``, or None when the server omits it."""
        return cached

    def _messages_usage(
        self, prompt: int, cached: int, output: int
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        """Anthropic usage: on ``message_start``, on ``message_delta``, on a whole answer."""
        raise NotImplementedError

    def _api_timings(self, prompt_n: int, cache_n: int, predicted_n: int) -> dict[str, Any] | None:
        """``timings`` on ``response.completed`` (llama.cpp only)."""
        return None

    def _messages_stream_end(self) -> list[bytes]:
        """What follows ``message_stop`` (vLLM: ``[DONE]``; llama-server: nothing)."""
        return []

    # vLLM sends ``message_start`` on its first chunk, before any token; llama-server with it.
    messages_start_alone = False

    def _api_error_event(self, anthropic: bool) -> bytes:
        """The mid-stream error event of a Responses or Messages stream."""
        raise NotImplementedError

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._oai(request, chat=False)

    # -- to be provided by each server ---------------------------------------------------------

    def _own_routes(self, router: web.UrlDispatcher) -> None:
        raise NotImplementedError

    async def health(self, request: web.Request) -> web.Response:
        raise NotImplementedError

    async def models(self, request: web.Request) -> web.Response:
        raise NotImplementedError

    async def tokenize(self, request: web.Request) -> web.Response:
        raise NotImplementedError

    async def metrics(self, request: web.Request) -> web.Response:
        raise NotImplementedError

    async def _oai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        """``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
        raise NotImplementedError

    def reject_message(self) -> str:
        """The error message of a request answered with ``Knobs.reject_status``."""
        raise NotImplementedError

    # -- shared plumbing -------------------------------------------------------------------------

    async def _capture(self, request: web.Request) -> dict[str, Any] | web.Response:
        raw = await request.read()
        self.last_raw = raw
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
        self.received.set()
        if self.knobs.drop_connections > 0:
            self.knobs.drop_connections -= 1
            if request.transport is not None:
                request.transport.close()  # the proxy sees the connection reset, no status line
            return web.Response(status=500)
        return body

    async def _accept(self, request: web.Request) -> dict[str, Any] | web.Response:
        """An inference request's body, captured; or the answer when it is not to be served."""
        body = await self._capture(request)
        if isinstance(body, web.Response):
            return body
        if self.knobs.reject_status is not None:
            return self.error_response(self.knobs.reject_status, self.reject_message())
        return body

    async def _peek(self, request: web.Request) -> dict[str, Any] | None:
        """The body of an inference request the handler will serve (not an error), uncaptured."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return None
        if not isinstance(body, dict) or self.knobs.reject_status is not None:
            return None
        return body

    def _token_events(
        self, piece: Callable[[dict[str, Any], str, str | None], bytes]
    ) -> list[bytes]:
        """The reasoning then content token events, each one ``piece(delta, text, None)``."""
        k = self.knobs
        events = [piece({"reasoning_content": t}, t, None) for t in k.reasoning]
        return events + [piece({"content": t}, t, None) for t in k.tokens]

    def _model_list(self, owned_by: str, **fields: Any) -> web.Response:
        """``GET /v1/models``: the one model, with this server's own ``fields`` after the common."""
        model = {"id": MODEL, "object": "model", "created": self._created, "owned_by": owned_by}
        return web.json_response({"object": "list", "data": [{**model, **fields}]})

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
        kind = _HeadWithFirstWrite if self.knobs.head_with_first else web.StreamResponse
        resp = kind(
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

    def _stream_events(self, events: list[bytes]) -> list[bytes]:
        """``events`` as this server sends them (a subclass may rewrite them)."""
        return events

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
        events = self._stream_events(events)
        k = self.knobs
        if k.header_delay_s:
            await self._pause(k.header_delay_s)
        resp = await self._open_stream(request)
        try:
            if k.head_only:
                await self._stall()
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
                    if k.drop_after is not None and i == k.drop_after:
                        if request.transport is not None:
                            request.transport.close()
                        self.closed.set()
                        return resp
                    if k.token_delay_s and i > 0:
                        await self._pause(k.token_delay_s)
                await resp.write(event)
            await resp.write_eof()
            self.finished.set()
        except (asyncio.CancelledError, ConnectionResetError):
            self.closed.set()
            raise
        return resp


class _HeadWithFirstWrite(web.StreamResponse):
    """A stream whose head aiohttp sends with the first body write (as the overhead
    benchmark's fake backend does; llama-server sends its head alone, before the prefill)."""

    _send_headers_immediately = False


FakeBackendT = TypeVar("FakeBackendT", bound=FakeBackend)


# llama-server's mid-stream error event.
_DECODE_FAILED = sse(
    {"error": {"code": 500, "message": "the slot failed to decode", "type": "server_error"}}
)


def wants_usage(body: Mapping[str, Any]) -> bool:
    """Whether a streamed request asked for the usage chunk (``stream_options.include_usage``)."""
    opts = body.get("stream_options")
    return isinstance(opts, Mapping) and opts.get("include_usage") is True


def _chunk_meta(object_: str, created: int, rid: str) -> dict[str, Any]:
    return {"id": rid, "object": object_, "created": created, "model": MODEL}


class LlamaFake(FakeBackend):
    """llama.cpp ``llama-server``: ``/props``, ``timings``, native ``/completion``, ``:`` pings."""

    n_ctx = 4096
    total_slots = 4
    fingerprint = "b6000-abcdef12"

    def _own_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/props", self.props)
        router.add_post("/completion", self.native)
        router.add_get("/slots", self.slots)
        router.add_post("/responses", self.responses)  # llama-server's alias of /v1/responses

    def reject_message(self) -> str:
        return "the request exceeds the context size"

    def error_response(self, status: int, message: str) -> web.Response:
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = {"error": {"code": status, "message": message, "type": kind}}
        return web.json_response(body, status=status)

    async def health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.health_status != 200:
            body = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
            return web.json_response(body, status=self.health_status)
        self.last_query = dict(request.query)
        return web.json_response({"status": "ok"})

    async def slots(self, request: web.Request) -> web.Response:
        if not self.serve_slots:
            return self._not_supported("This server does not support slots endpoint.")
        return web.json_response(
            [
                {
                    "id": i,
                    "n_ctx": self.n_ctx,
                    "speculative": False,
                    "is_processing": i < self.load_running,
                }
                for i in range(self.total_slots)
            ]
        )

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.serve_metrics:
            return self._not_supported(
                "This server does not support metrics endpoint. Start it with `--metrics`"
            )
        gauges = [
            ("prompt_tokens_total", "counter", 6886),
            ("prompt_tokens_seconds", "gauge", 2.37151),
            ("requests_processing", "gauge", self.load_running),
            ("requests_deferred", "gauge", self.load_waiting),
            ("n_busy_slots_per_decode", "gauge", 1),
        ]
        lines: list[str] = []
        for name, kind, value in gauges:
            lines += [
                f"# HELP llamacpp:{name} {name}.",
                f"# TYPE llamacpp:{name} {kind}",
                f"llamacpp:{name} {value}",
            ]
        return web.Response(
            text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8"
        )

    def _not_supported(self, message: str) -> web.Response:
        body = {"error": {"code": 501, "message": message, "type": "not_supported_error"}}
        return web.json_response(body, status=501)

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
        return self._model_list("llamacpp", meta={"n_ctx_train": 8192})

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

    def _api_counts(self, chat: Mapping[str, Any]) -> tuple[int, int]:
        return self._counts(chat)

    def _messages_usage(
        self, prompt: int, cached: int, output: int
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        # llama-server: input_tokens is the prompt not read from cache; the delta has output only.
        whole = {"cache_read_input_tokens": cached, "input_tokens": prompt - cached}
        return (
            {**whole, "output_tokens": 0},
            {"output_tokens": output},
            {
                **whole,
                "output_tokens": output,
            },
        )

    def _api_timings(self, prompt_n: int, cache_n: int, predicted_n: int) -> dict[str, Any] | None:
        return self.timings(prompt_n, cache_n, predicted_n)

    def _api_error_event(self, anthropic: bool) -> bytes:
        if anthropic:  # format_anthropic_sse({"event": "error", "data": <the error object>})
            error = {"code": 500, "message": "the slot failed to decode", "type": "server_error"}
            return api_event("error", error)
        return _DECODE_FAILED  # format_oai_sse({"error": ...}): no event line

    async def _oai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._accept(request)
        if isinstance(body, web.Response):
            return body
        k = self.knobs
        prompt, cached = self._counts(body)
        calls = due_tool_calls(body, k.tool_calls) if chat else []
        ids = [f"call_{len(self.requests)}_{i}" for i in range(len(calls))]
        n_out = len(k.reasoning) + len(k.tokens)
        if calls:
            n_out = len(k.reasoning) + sum(len(argument_pieces(c.arguments)) for c in calls)
        stop = "tool_calls" if calls else "stop"
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
                if calls:  # llama-server: content null beside the calls
                    message["content"] = None
                    message["tool_calls"] = [
                        {
                            "type": "function",
                            "function": {"name": c.name, "arguments": c.arguments},
                            "id": id_,
                        }
                        for c, id_ in zip(calls, ids, strict=True)
                    ]
                choice: dict[str, Any] = {"finish_reason": stop, "index": 0, "message": message}
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
        include_usage = wants_usage(body)
        obj = "chat.completion.chunk" if chat else "text_completion"
        meta = {**_chunk_meta(obj, self._created, rid), "system_fingerprint": self.fingerprint}

        def piece(delta: dict[str, Any] | None, text: str | None, finish: str | None) -> bytes:
            if chat:
                choice = {"finish_reason": finish, "index": 0, "delta": delta or {}}
            else:
                choice = {"text": text or "", "index": 0, "logprobs": None, "finish_reason": finish}
            return sse({"choices": [choice], **meta})

        events = self._token_events(piece)
        if calls:
            events = events[: len(k.reasoning)] + self._tool_call_events(piece, calls, ids)
        n_tokens = len(events)
        lead = [piece({"role": "assistant", "content": None}, None, None)] if chat else []
        if chat:
            finish = {"choices": [{"finish_reason": stop, "index": 0, "delta": {}}], **meta}
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
        return await self._run_stream(
            request,
            events,
            token_events=n_tokens,
            lead=lead,
            error_event=_DECODE_FAILED,
            error_tail=b"",
        )

    @staticmethod
    def _tool_call_events(
        piece: Callable[[dict[str, Any] | None, str | None, str | None], bytes],
        calls: Sequence[ToolCall],
        ids: Sequence[str],
    ) -> list[bytes]:
        """Tool-call deltas as llama-server streams them: per call, index, id, type and name with
        the arguments parsed so far, then the rest of the arguments (``index`` and ``function``)."""
        events: list[bytes] = []
        for index, (call, id_) in enumerate(zip(calls, ids, strict=True)):
            first, *rest = argument_pieces(call.arguments)
            head = {"name": call.name, "arguments": first}
            opening = {"index": index, "id": id_, "type": "function", "function": head}
            events.append(piece({"tool_calls": [opening]}, None, None))
            for part in rest:
                more = {"index": index, "function": {"arguments": part}}
                events.append(piece({"tool_calls": [more]}, None, None))
        return events

    async def native(self, request: web.Request) -> web.StreamResponse:
        body = await self._accept(request)
        if isinstance(body, web.Response):
            return body
        k = self.knobs
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
        return await self._run_stream(
            request, events, token_events=n_out, lead=[], error_event=_DECODE_FAILED, error_tail=b""
        )


class VllmFake(FakeBackend):
    """vLLM's OpenAI server: ``/version``, role chunk first, usage only with ``include_usage``."""

    max_model_len = 8192

    def __init__(self, knobs: Knobs | None = None, *, prompt_tokens_details: bool = False) -> None:
        super().__init__(knobs)
        self.prompt_tokens_details = prompt_tokens_details

    def _own_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/version", self.version)

    def reject_message(self) -> str:
        return f"This model's maximum context length is {self.max_model_len} tokens."

    def error_response(self, status: int, message: str) -> web.Response:
        kind = "BadRequestError" if status < 500 else "InternalServerError"
        body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
        return web.json_response(body, status=status)

    async def health(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        return web.Response(status=self.health_status)

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus text as vLLM's V1 engine writes it (labels per model and engine)."""
        if not self.serve_metrics:
            return web.Response(status=404, text="Not Found")
        label = f'engine="0",model_name="{MODEL}"'
        text = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{label}}} {float(self.load_running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{label}}} {float(self.load_waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{{{label}}} 0.25\n"
            "# HELP vllm:time_to_first_token_seconds Histogram of time to first token.\n"
            "# TYPE vllm:time_to_first_token_seconds histogram\n"
            f'vllm:time_to_first_token_seconds_bucket{{{label},le="0.001"}} 0.0\n'
            f'vllm:time_to_first_token_seconds_bucket{{{label},le="+Inf"}} 3.0\n'
            f"vllm:time_to_first_token_seconds_count{{{label}}} 3.0\n"
            f"vllm:time_to_first_token_seconds_sum{{{label}}} 0.42\n"
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.11.0"})

    async def models(self, request: web.Request) -> web.Response:
        return self._model_list(
            "vllm", root=MODEL, parent=None, max_model_len=self.max_model_len, permission=[]
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

    def _api_counts(self, chat: Mapping[str, Any]) -> tuple[int, int]:
        prompt, cached = self.cache_lookup(chat)
        return prompt, (cached // 16) * 16

    def _responses_cached(self, cached: int) -> int | None:
        return cached if self.prompt_tokens_details else None

    def _messages_stream_end(self) -> list[bytes]:
        return [DONE]  # vLLM's Messages stream is its chat stream converted: [DONE] stays

    messages_start_alone = True

    def _messages_usage(
        self, prompt: int, cached: int, output: int
    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        # The whole prompt in input_tokens, and no cache fields.
        return (
            {"input_tokens": prompt, "output_tokens": 0},
            {"input_tokens": prompt, "output_tokens": output},
            {"input_tokens": prompt, "output_tokens": output},
        )

    def _api_error_event(self, anthropic: bool) -> bytes:
        if anthropic:
            error = {"type": "error", "error": {"type": "api_error", "message": "engine died"}}
            return api_event("error", error)
        error = {"type": "error", "code": "server_error", "message": "engine died", "param": None}
        return api_event("error", error)

    async def _oai(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._accept(request)
        if isinstance(body, web.Response):
            return body
        k = self.knobs
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
        include_usage = wants_usage(body)
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

        events = self._token_events(piece)
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


class _ComputeShare:
    """A backend's compute, shared between concurrent prefills: two at once take twice as long.

    Work is done in small chunks under a FIFO lock, so concurrent prefills interleave.
    """

    CHUNK = 16

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    async def prefill(self, tokens: int, ms_per_token: float) -> None:
        left = tokens
        while left > 0:
            n = min(left, self.CHUNK)
            async with self._lock:
                await asyncio.sleep(n * ms_per_token / 1000.0)
            left -= n


# What the slot-aware fakes computed for the request being answered (read by the base handlers).
_SLOT_COUNTS: ContextVar[tuple[int, int] | None] = ContextVar("fake_slot_counts", default=None)
_SERVING_SLOT: ContextVar[int | None] = ContextVar("fake_serving_slot", default=None)
_APC_COUNTS: ContextVar[tuple[int, int] | None] = ContextVar("fake_apc_counts", default=None)


class SlotLlamaFake(LlamaFake):
    """llama-server with one prompt cache per slot, as the real one schedules them.

    A request's cached tokens are its common prefix with *its slot's* last prompt (not with any
    prompt seen, as in ``LlamaFake``). ``id_slot`` pins a request to a slot and a busy pinned slot
    defers it until free; an unpinned request takes the idle slot whose prompt is most similar
    (more than 10 % shared), else the least recently used one, and waits when none is idle.
    Prefill takes ``prefill_ms_per_token`` per uncached word, shared between concurrent prefills;
    answers are paced by ``token_delay_s`` (non-streamed answers too). ``GET /slots`` is served
    (``is_processing``, ``id_task``), and with ``slot_save`` ``POST /slots/{id}?action=save`` and
    ``?action=restore`` copy a slot through a named file (a save waits while its slot is busy).
    ``prompt_processed`` counts the prompt words prefilled. Native answers carry ``id_slot``
    (streamed: on the final event; the events before it say -1, as llama-server b11434 does).
    """

    def __init__(
        self, knobs: Knobs | None = None, *, slots: int = 4, slot_save: bool = False
    ) -> None:
        super().__init__(knobs)
        self.total_slots = slots
        self.serve_slots = True
        self.slot_save = slot_save
        self.slot_words: list[list[str]] = [[] for _ in range(slots)]
        self.slot_busy = [False] * slots
        self.slot_task: list[int | None] = [None] * slots
        self.slot_used = [0] * slots
        self.assigned: list[int] = []  # the slot of every request, in arrival order of service
        self.prompt_processed = 0
        self.saves = 0
        self.restores = 0
        self._files: dict[str, list[str]] = {}
        self._freed = asyncio.Condition()
        self._compute = _ComputeShare()
        self._tick = 0

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_post("/slots/{id}", self.slot_action)
        return app

    # -- slot choice -----------------------------------------------------------------------------

    def _pick(self, words: list[str], pinned: int | None) -> int | None:
        if pinned is not None:
            return None if self.slot_busy[pinned] else pinned
        idle = [i for i in range(self.total_slots) if not self.slot_busy[i]]
        if not idle:
            return None
        similar = [
            (common_prefix(words, self.slot_words[i]) / max(len(words), 1), i)
            for i in idle
            if self.slot_words[i]
        ]
        best = max(similar, default=(0.0, -1))
        if best[0] > 0.1:
            return best[1]
        return min(idle, key=lambda i: self.slot_used[i])

    async def _acquire(self, words: list[str], pinned: int | None) -> int:
        async with self._freed:
            while (slot := self._pick(words, pinned)) is None:
                await self._freed.wait()
            self.slot_busy[slot] = True
            self._tick += 1
            self.slot_task[slot] = self._tick
            self.slot_used[slot] = self._tick
            self.assigned.append(slot)
            return slot

    async def _release(self, slot: int) -> None:
        async with self._freed:
            self.slot_busy[slot] = False
            self._freed.notify_all()

    @asynccontextmanager
    async def _idle(self, slot: int) -> AsyncIterator[None]:
        """Hold the slots' lock once ``slot`` is idle (a save or restore waits for its request)."""
        async with self._freed:
            await self._freed.wait_for(lambda: not self.slot_busy[slot])
            yield

    async def _on_slot(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        body = await self._peek(request)
        if body is None:
            return await handler(request)
        if request.path in ("/v1/responses", "/responses"):
            words = prompt_words(responses_to_chat(body))
        elif request.path == "/v1/messages":
            words = prompt_words(anthropic_to_chat(body))
            body.pop("id_slot", None)  # the Messages route drops every field it does not map
        else:
            words = prompt_words(body)
        pinned = body.get("id_slot")
        pinned = pinned % self.total_slots if isinstance(pinned, int) and pinned >= 0 else None
        slot = await self._acquire(words, pinned)
        try:
            cached = min(common_prefix(words, self.slot_words[slot]), max(len(words) - 1, 0))
            self.slot_words[slot] = words[:cached]
            await self._compute.prefill(len(words) - cached, self.knobs.prefill_ms_per_token)
            self.prompt_processed += len(words) - cached
            self.slot_words[slot] = words
            _SLOT_COUNTS.set((len(words), cached))
            if body.get("stream") is not True and self.knobs.token_delay_s:
                await self._pause(self.knobs.token_delay_s * max(len(self.knobs.tokens) - 1, 0))
            return await self._with_slot(request, handler, slot, stream=body.get("stream") is True)
        finally:
            await self._release(slot)

    async def _with_slot(
        self,
        request: web.Request,
        handler: Handler,
        slot: int,
        *,
        stream: bool,
    ) -> web.StreamResponse:
        token = _SERVING_SLOT.set(slot)
        try:
            resp = await handler(request)
        finally:
            _SERVING_SLOT.reset(token)
        if not stream and isinstance(resp, web.Response) and resp.body is not None:
            obj = orjson.loads(bytes(resp.body))  # type: ignore[arg-type]  # bytes payload
            if isinstance(obj, dict) and "id_slot" in obj:
                obj["id_slot"] = slot
                return web.json_response(obj)
        return resp

    def _counts(self, body: Mapping[str, Any]) -> tuple[int, int]:
        counts = _SLOT_COUNTS.get()
        return counts if counts is not None else super()._counts(body)

    def _stream_events(self, events: list[bytes]) -> list[bytes]:
        slot = _SERVING_SLOT.get()
        if slot is None:
            return events
        # Native streams name the slot on the final event, -1 before it.
        return [
            e.replace(b'"id_slot":0,', b'"id_slot":%d,' % (slot if b'"stop":true' in e else -1))
            for e in events
        ]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._on_slot(request, super().chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._on_slot(request, super().completions)

    async def native(self, request: web.Request) -> web.StreamResponse:
        return await self._on_slot(request, super().native)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._on_slot(request, super().responses)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._on_slot(request, super().messages)

    # -- /slots ----------------------------------------------------------------------------------

    async def slots(self, request: web.Request) -> web.Response:
        if not self.serve_slots:
            return self._not_supported("This server does not support slots endpoint.")
        out: list[dict[str, Any]] = []
        for i in range(self.total_slots):
            entry: dict[str, Any] = {
                "id": i,
                "n_ctx": self.n_ctx,
                "speculative": False,
                "is_processing": self.slot_busy[i],
            }
            if self.slot_task[i] is not None:
                entry["id_task"] = self.slot_task[i]
                entry["n_prompt_tokens"] = len(self.slot_words[i])
            out.append(entry)
        return web.json_response(out)

    async def slot_action(self, request: web.Request) -> web.Response:
        if not self.slot_save:
            return self._not_supported(
                "This server does not support slots action. Start it with `--slot-save-path`"
            )
        slot = int(request.match_info["id"]) % self.total_slots
        body = orjson.loads(await request.read())
        filename = str(body.get("filename", ""))
        action = request.query.get("action")
        if action == "save":
            async with self._idle(slot):
                self._files[filename] = list(self.slot_words[slot])
            self.saves += 1
            n = len(self._files[filename])
            return web.json_response(
                {"id_slot": slot, "filename": filename, "n_saved": n, "n_written": 64 * n}
            )
        if action == "restore":
            if filename not in self._files:
                return self.error_response(400, "failed to restore slot")
            async with self._idle(slot):
                self.slot_words[slot] = list(self._files[filename])
            self.restores += 1
            n = len(self.slot_words[slot])
            return web.json_response(
                {"id_slot": slot, "filename": filename, "n_restored": n, "n_read": 64 * n}
            )
        return self.error_response(400, "Invalid action")


class ApcVllmFake(VllmFake):
    """vLLM with automatic prefix caching, as its cost works out.

    The prompt is cut into full blocks of 16 words; a block is computed by every request that
    does not find it cached when its prefill starts, and becomes cached when that prefill ends.
    So requests that arrive together with the same new prefix both compute every block of it,
    and a request that arrives after the first one's prefill computes only what it adds.
    Prefill takes ``prefill_ms_per_token`` per computed word, shared between concurrent
    prefills; ``computed_tokens`` counts the words prefilled. Cached tokens are reported
    (``prompt_tokens_details``) unless told otherwise.
    """

    BLOCK = 16

    def __init__(self, knobs: Knobs | None = None, *, prompt_tokens_details: bool = True) -> None:
        super().__init__(knobs, prompt_tokens_details=prompt_tokens_details)
        self.cached_blocks: set[int] = set()
        self.computed_tokens = 0
        self._compute = _ComputeShare()

    def _block_keys(self, words: list[str]) -> list[int]:
        keys: list[int] = []
        h = 0
        for i in range(len(words) // self.BLOCK):
            h = hash((h, tuple(words[i * self.BLOCK : (i + 1) * self.BLOCK])))
            keys.append(h)
        return keys

    async def _apc(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        body = await self._peek(request)
        if body is None:
            return await handler(request)
        words = prompt_words(body)
        keys = self._block_keys(words)
        hit = 0
        while hit < len(keys) and keys[hit] in self.cached_blocks:
            hit += 1
        cached = min(hit * self.BLOCK, max(len(words) - 1, 0) // self.BLOCK * self.BLOCK)
        computed = len(words) - cached
        await self._compute.prefill(computed, self.knobs.prefill_ms_per_token)
        self.computed_tokens += computed
        self.cached_blocks.update(keys)
        _APC_COUNTS.set((len(words), cached))
        return await handler(request)

    def cache_lookup(self, body: Mapping[str, Any]) -> tuple[int, int]:
        counts = _APC_COUNTS.get()
        return counts if counts is not None else super().cache_lookup(body)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._apc(request, super().chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._apc(request, super().completions)


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


def backend_specs(*fakes: FakeBackend, weights: Sequence[float] = ()) -> tuple[BackendSpec, ...]:
    """``Settings.backends`` for a proxy in front of several fakes, optionally weighted."""
    given = list(weights) or [1.0] * len(fakes)
    return tuple(BackendSpec(url=f.url, weight=w) for f, w in zip(fakes, given, strict=True))


async def fleet_proxy(
    make_proxy: MakeProxy,
    *fakes: FakeBackend,
    policy: str = "prefix-affinity",
    weights: Sequence[float] = (),
    **overrides: Any,
) -> tuple[ProxyClient, RecordLog, web.Application]:
    """The proxy in front of several fakes with ``policy``.

    The background health monitor is parked (an hour between rounds); tests run a round with
    ``app[STATE].fleet.check_all()`` when they want one.
    """
    overrides.setdefault("health", HealthChecks(interval_s=3600.0))
    return await make_proxy(
        fakes[0].url,
        backends=backend_specs(*fakes, weights=weights),
        routing=RoutingConfig(policy=policy),
        **overrides,
    )


async def serve(fake: FakeBackendT, aiohttp_server: Any) -> FakeBackendT:
    """Start ``fake`` with pytest-aiohttp's ``aiohttp_server`` on a free port; set its ``url``."""
    server = await aiohttp_server(fake.app())
    fake.url = str(server.make_url("")).rstrip("/")
    return fake
