"""Forwarding to a backend and relaying its answer: bytes out as they arrive, observed on the way.

The relay never rebuilds a response. Streamed events reach the client as the backend sends them
(whole SSE events, written one upstream chunk at a time, with backpressure from ``write()``); the
relay only looks at each event to timestamp the first token, the first visible token and the last
token, and to read usage. When the proxy asked for usage the client did not, the usage-only event
is removed (and llama.cpp's ``timings``, which ride on that event, are moved back onto the
finishing event where the client would have found them).

Upstream failures are translated here, at the boundary: before the first byte reached the client
they become ``BackendUnavailable`` (502) or ``BackendTimeout`` (504); after it, an SSE error event
ends the stream, since the status line is already gone.

Retrying on another replica. When the caller says another replica could take the request
(``retry=True``), a failure that happened before anything reached the client is raised as
``NotStarted`` instead: a connection-level failure (refused, reset, connect timeout, the
connection lost while a non-streamed answer was being read) or a 502/503 status line. The caller
routes again and relays from the other replica. Nothing is ever retried once the client has
received a byte, and a read timeout is not retried (the backend may still be working on it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from proxy.backends import EventKind
from proxy.backends.apis import MESSAGES, RESPONSES
from proxy.backends.base import COMPLETIONS, NATIVE_COMPLETION
from proxy.config import Timeouts
from proxy.errors import (
    BackendBadAnswer,
    BackendTimeout,
    BackendUnavailable,
    ProxyError,
    anthropic_sse_error_event,
    sse_error_event,
)
from proxy.exchange import Exchange
from proxy.headers import downstream_response_headers, is_event_stream, upstream_request_headers
from proxy.records import monotonic
from proxy.sse import EventSplitter, event_data

CLIENT_CLOSED = 499  # nginx's convention: the client went away before the response ended
RETRY_STATUSES = frozenset({502, 503})  # the replica could not take it; another one may


class BackendConnectTimeout(BackendTimeout):
    """504: connecting to the backend timed out (nothing was sent; the replica is suspect)."""


@dataclass(frozen=True, slots=True)
class Answer:
    """A complete, non-streamed upstream answer, read into memory and not yet sent."""

    status: int
    headers: Mapping[str, str]
    payload: bytes
    content_type: str


class NotStarted(Exception):
    """The replica did not serve the request and nothing has reached the client.

    Either ``failure`` (a connection-level failure: the replica is suspect) or ``answer`` (it
    answered 502/503) is set; it is what the client gets when no other replica can be tried.
    """

    def __init__(
        self, reason: str, *, failure: ProxyError | None = None, answer: Answer | None = None
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.failure = failure
        self.answer = answer

    @property
    def connection_failed(self) -> bool:
        """Whether the replica is suspect (an unreadable answer is not a connection failure)."""
        return self.failure is not None and not isinstance(self.failure, BackendBadAnswer)


def is_bodiless(method: str, status: int) -> bool:
    """Whether an answer has no body by definition: to a ``HEAD``, or ``1xx``, ``204``, ``304``."""
    return method == "HEAD" or status < 200 or status in (204, 304)


def upstream_timeout(timeouts: Timeouts) -> aiohttp.ClientTimeout:
    """Connect and between-bytes limits; never a total limit (streams may run for minutes)."""
    return aiohttp.ClientTimeout(
        total=None,
        connect=timeouts.connect,
        sock_connect=timeouts.connect,
        sock_read=timeouts.idle,
    )


async def open_upstream(
    session: aiohttp.ClientSession,
    request: web.Request,
    *,
    url: str,
    body: bytes | None,
    request_id: str,
    timeouts: Timeouts,
    backend_api_key: str | None,
    extra_headers: Mapping[str, str] | None = None,
) -> aiohttp.ClientResponse:
    """Send the request upstream and wait for the status line, translating failures.

    ``extra_headers`` replace the client's of the same names (the trace context).
    """
    headers = upstream_request_headers(
        request.headers, request_id=request_id, backend_api_key=backend_api_key
    )
    if extra_headers:
        headers.update(extra_headers)
    query = request.rel_url.raw_query_string
    if query:  # as the client encoded it: decoding would turn %26 into a separator upstream
        url = f"{url}?{query}"

    async def send() -> aiohttp.ClientResponse:
        # A deadline on the whole response head: a backend dribbling its status line and
        # headers a byte at a time never trips the between-bytes (idle) timeout.
        async with asyncio.timeout(timeouts.connect + timeouts.idle):
            return await session.request(
                request.method,
                url,
                data=body,
                headers=headers,
                timeout=upstream_timeout(timeouts),
                allow_redirects=False,
            )

    try:
        try:
            return await send()
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            # A pooled keep-alive connection the backend had already closed (llama-server
            # closes idle ones): nothing was answered, so one retry on a new connection is safe.
            return await send()
    except aiohttp.ConnectionTimeoutError as exc:
        raise BackendConnectTimeout(f"backend connect timed out: {url}") from exc
    except TimeoutError as exc:
        raise BackendTimeout(f"backend did not answer in time: {url}") from exc
    except aiohttp.ClientResponseError as exc:
        # It answered, in bytes the parser refuses: one odd answer, not a replica that is down.
        raise BackendBadAnswer(f"backend answered unreadable HTTP: {exc.message[:80]}") from exc
    except aiohttp.ClientError as exc:
        raise BackendUnavailable(f"backend unreachable: {exc.__class__.__name__}") from exc


async def relay_inference(
    request: web.Request,
    session: aiohttp.ClientSession,
    ex: Exchange,
    *,
    timeouts: Timeouts,
    backend_api_key: str | None,
    retry: bool = False,
) -> web.StreamResponse:
    """Forward one inference request and relay the answer, observing it into ``ex.obs``.

    With ``retry``, a failure before anything reached the client raises ``NotStarted``.
    """
    ex.obs.t_forward = monotonic()
    if ex.forwarded is not None:
        ex.forwarded.set()
    try:
        upstream = await open_upstream(
            session,
            request,
            url=ex.backend_url + ex.upstream_path,
            body=ex.upstream_body,
            request_id=ex.request_id,
            timeouts=timeouts,
            backend_api_key=backend_api_key,
            extra_headers=ex.upstream_headers,
        )
    except (BackendUnavailable, BackendConnectTimeout) as exc:
        if retry:
            raise NotStarted(exc.message, failure=exc) from exc
        raise
    ex.obs.t_headers = monotonic()
    async with upstream:
        ex.status = upstream.status
        if ex.stream and upstream.status == 200 and is_event_stream(upstream.content_type):
            return await _relay_stream(request, upstream, ex)
        try:
            answer = await _read_answer(upstream)
        except BackendUnavailable as exc:
            if retry:
                raise NotStarted(exc.message, failure=exc) from exc
            raise
    if retry and answer.status in RETRY_STATUSES:
        raise NotStarted(f"backend answered {answer.status}", answer=answer)
    return await send_answer(request, ex, answer)


async def _read_answer(upstream: aiohttp.ClientResponse) -> Answer:
    try:
        payload = await upstream.read()
    except TimeoutError as exc:
        raise BackendTimeout("backend stopped sending before the response was complete") from exc
    except aiohttp.ClientError as exc:
        raise BackendUnavailable(f"backend failed mid-response: {exc.__class__.__name__}") from exc
    return Answer(
        status=upstream.status,
        headers=downstream_response_headers(upstream.headers),
        payload=payload,
        content_type=upstream.content_type or "",
    )


async def send_answer(request: web.Request, ex: Exchange, answer: Answer) -> web.StreamResponse:
    """Relay a complete answer to the client, reading usage and timings out of it."""
    now = monotonic()
    ex.status = answer.status
    if answer.status == 200 and "json" in answer.content_type:
        t0 = monotonic()
        try:
            obj = orjson.loads(answer.payload)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, Mapping):
            ex.dialect.read_response(ex.route, obj, ex.obs)
            if ex.on_first_token is not None:
                ex.on_first_token(obj)
        ex.obs.inspect_s += monotonic() - t0
    elif answer.status >= 400:
        ex.error = "upstream_error"
    resp = web.Response(status=answer.status, body=answer.payload, headers=answer.headers)
    resp.headers["X-Request-Id"] = ex.request_id
    resp.headers.update(ex.response_headers)
    await resp.prepare(request)
    await resp.write_eof()
    ex.obs.t_end = now
    return resp


# Byte patterns of a plain token event, one whose only news is that a token arrived. A pattern
# with quotes can only occur in the raw JSON as a key (inside a string its quotes are escaped).
_CHAT_TOKENS: tuple[bytes, ...] = (
    b'"content":"',
    b'"reasoning_content":"',
    b'"reasoning":"',
    b'"tool_calls":[',
)
_TEXT_TOKENS: tuple[bytes, ...] = (b'"text":"',)
_NATIVE_TOKENS: tuple[bytes, ...] = (b'"content":"',)
_NEWS = (b'"usage"', b'"timings"', b'"error"')
"""Keys that make an event worth parsing: usage, timings or an error to read."""


# The Responses and Messages APIs: an ``event:`` line, then the data line of a visible token.
_API_TOKENS: dict[str, tuple[bytes, bytes, bytes]] = {
    RESPONSES: (b"event: response.output_text.delta\ndata: {", b'"delta":"', b""),
    MESSAGES: (b"event: content_block_delta\ndata: {", b'"text":"', b'"type":"text_delta"'),
}


def _plain_api_event(event: bytes, head: bytes, pattern: bytes, marker: bytes) -> bool:
    if not event.startswith(head) or event.find(b"\n", len(head)) < len(event) - 2:
        return False  # not exactly the event line and one data line ending in "\n\n"
    if marker and marker not in event:
        return False
    for key in _NEWS:
        if key in event:
            return False
    at = event.find(pattern)
    return at >= 0 and event[at + len(pattern) : at + len(pattern) + 1] != b'"'


def plain_token_event(event: bytes, route: str) -> bool:
    """True when ``event`` is certainly one ``data:`` line carrying a token and nothing else.

    Such events are most of a stream and need no parsing once the first visible token has been
    timed: every other event (a finish reason, usage, timings, an error, several data lines,
    anything unexpected) answers False and is parsed as before. On the Responses and Messages
    routes, the event is a text delta: its ``event:`` line and one data line.
    """
    api = _API_TOKENS.get(route)
    if api is not None:
        return _plain_api_event(event, *api)
    if not event.startswith(b"data: {") or event.find(b"\n") < len(event) - 2:
        return False  # not one data line ending in a blank line ("\n\n")
    if route == NATIVE_COMPLETION:
        if b'"stop":false' not in event:
            return False
        patterns = _NATIVE_TOKENS
    else:
        if b'"finish_reason":null' not in event:
            return False
        patterns = _TEXT_TOKENS if route == COMPLETIONS else _CHAT_TOKENS
    for key in _NEWS:
        if key in event:
            return False
    return _carries_token(event, patterns)


def _carries_token(event: bytes, patterns: tuple[bytes, ...]) -> bool:
    """Whether a token key of ``patterns`` in ``event`` has a non-empty value."""
    for pattern in patterns:
        at = event.find(pattern)
        if at >= 0 and event[at + len(pattern) : at + len(pattern) + 1] not in (b'"', b"]"):
            return True
    return False


def plain_token_run(chunk: bytes, route: str) -> int:
    """How many events ``chunk`` holds when it is whole events, each of which
    ``plain_token_event`` would pass; else 0.

    Under load one upstream read often carries several token events. A chunk without ``\r``
    that ends in a blank line splits into exactly the events the ``EventSplitter`` would cut
    (``\n\n`` is then the only separator), so the events are checked in place, and the keys no
    plain event may hold are searched once over the whole chunk (none of them contains a line
    break, so none can span two events).
    """
    if b"\r" in chunk or not chunk.endswith(b"\n\n"):
        return 0
    for key in _NEWS:
        if key in chunk:
            return 0
    parts = chunk.split(b"\n\n")
    parts.pop()  # what follows the last separator: nothing
    api = _API_TOKENS.get(route)
    if api is not None:
        for part in parts:
            if not _plain_api_event(part + b"\n\n", *api):
                return 0
        return len(parts)
    if chunk.count(b"\n") != 2 * len(parts):
        return 0  # an event of more than one line (each ends in two line breaks)
    if route == NATIVE_COMPLETION:
        marker, patterns = b'"stop":false', _NATIVE_TOKENS
    else:
        marker = b'"finish_reason":null'
        patterns = _TEXT_TOKENS if route == COMPLETIONS else _CHAT_TOKENS
    for part in parts:
        if not part.startswith(b"data: {") or marker not in part:
            return 0
        if not _carries_token(part, patterns):
            return 0
    return len(parts)


class StreamInspector:
    """Looks at each SSE event on its way through; decides only whether it is forwarded.

    Events are parsed until the first visible token has been timed; after that, a plain token
    event (``plain_token_event``) is only counted, and everything else is still parsed.
    """

    __slots__ = ("_held", "ex")

    def __init__(self, ex: Exchange) -> None:
        self.ex = ex
        self._held: tuple[bytes, dict[str, Any]] | None = None

    def process(self, event: bytes, now: float, out: list[bytes]) -> None:
        """Observe ``event`` and append what should reach the client to ``out``."""
        ex, obs = self.ex, self.ex.obs
        if obs.t_first_visible is not None and plain_token_event(event, ex.route):
            self._count_token(now)
            self._release(out)
            out.append(event)
            return
        data = event_data(event)
        obj: Any = None
        if data is not None and data != b"[DONE]":
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = None
        if not isinstance(obj, dict):
            self._release(out)
            out.append(event)
            return
        kind = ex.dialect.classify_event(ex.route, obj, obs)
        if kind is EventKind.TOKEN or kind is EventKind.VISIBLE:
            if obs.t_first_token is None:
                obs.t_first_token = now
                if ex.on_first_token is not None:
                    ex.on_first_token(obj)
            if kind is EventKind.VISIBLE and obs.t_first_visible is None:
                obs.t_first_visible = now
            obs.t_last_token = now
            obs.token_events += 1
        elif kind is EventKind.ERROR:
            ex.error = "upstream_stream_error"
        if ex.strip_usage:
            if kind is EventKind.USAGE_ONLY:
                self._release(out, carry=ex.dialect.carried_on_strip(obj))
                return
            if _finishes(obj):
                self._release(out)
                self._held = (event, obj)
                return
        self._release(out)
        out.append(event)

    def plain_chunk(self, chunk: bytes, now: float) -> bool:
        """Whether ``chunk`` (a whole upstream read) is one plain token event, or several
        (``plain_token_run``); counted if so.

        The relay then forwards it as it is, without splitting it into events first.
        """
        obs = self.ex.obs
        if self._held is not None or obs.t_first_visible is None:
            return False
        if b"\r" not in chunk and plain_token_event(chunk, self.ex.route):
            # One event, unless a "\r\r" inside is a separator the splitter would cut at.
            events = 1
        else:
            events = plain_token_run(chunk, self.ex.route)
            if not events:
                return False
        obs.t_last_token = now
        obs.token_events += events
        return True

    def _count_token(self, now: float) -> None:
        """A plain token event passed: it is the latest token, and one more."""
        self.ex.obs.t_last_token = now
        self.ex.obs.token_events += 1

    def _release(self, out: list[bytes], carry: Mapping[str, Any] | None = None) -> None:
        if self._held is None:
            return
        event, obj = self._held
        self._held = None
        if carry:
            obj.update(carry)
            event = b"data: " + orjson.dumps(obj) + b"\n\n"
        out.append(event)

    def finish(self, out: list[bytes]) -> None:
        self._release(out)


def _finishes(obj: Mapping[str, Any]) -> bool:
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return False
    return any(isinstance(c, Mapping) and c.get("finish_reason") for c in choices)


async def _relay_stream(
    request: web.Request, upstream: aiohttp.ClientResponse, ex: Exchange
) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=upstream.status, headers=downstream_response_headers(upstream.headers)
    )
    resp.headers["X-Request-Id"] = ex.request_id
    resp.headers.update(ex.response_headers)
    resp.headers["X-Accel-Buffering"] = "no"
    resp.headers.setdefault("Cache-Control", "no-cache")
    await resp.prepare(request)
    splitter = EventSplitter()
    inspector = StreamInspector(ex)
    obs = ex.obs
    failure: ProxyError | None = None
    body_started = False
    try:
        async for chunk in upstream.content.iter_any():
            now = monotonic()
            if not splitter.pending and inspector.plain_chunk(chunk, now):
                data = chunk  # the usual read once the answer is under way: one token event
            else:
                out: list[bytes] = []
                for event in splitter.feed(chunk):
                    inspector.process(event, now, out)
                data = b"".join(out)
            obs.inspect_s += monotonic() - now
            if data:
                if not await _write(request, resp, data, ex.send_timeout_s):
                    _client_gone(ex, upstream)
                    return resp
                body_started = True
    except TimeoutError:
        failure = BackendTimeout("backend stopped sending mid-stream")
        ex.error = "backend_timeout"
    except aiohttp.ClientPayloadError:
        failure = BackendUnavailable("backend closed the stream early")
        ex.error = "backend_disconnected"
    except aiohttp.ClientError:
        failure = BackendUnavailable("backend connection failed mid-stream")
        ex.error = "backend_disconnected"
    except asyncio.CancelledError:
        _client_gone(ex, upstream)
        raise
    tail: list[bytes] = []
    inspector.finish(tail)
    rest = splitter.flush()
    if rest:
        tail.append(rest)
    if failure is not None:
        anthropic = ex.route == MESSAGES
        tail.append(anthropic_sse_error_event(failure) if anthropic else sse_error_event(failure))
        upstream.close()
    limit = ex.send_timeout_s
    if tail:
        if not await _write(request, resp, b"".join(tail), limit):
            _client_gone(ex, upstream)
            return resp
        body_started = True
    if not await _write(request, resp, None, limit, body_started=body_started):
        _client_gone(ex, upstream)
        return resp
    obs.t_end = monotonic()
    return resp


async def _write(
    request: web.Request,
    resp: web.StreamResponse,
    data: bytes | None,
    limit_s: float | None,
    *,
    body_started: bool = False,
) -> bool:
    """Write to the client (``None``: end the body; ``body_started``: some of it was written,
    so the head has gone out with it); False when the client has gone away.

    A client that stays connected but stops reading would hold its backend request (a slot)
    forever: backpressure stops the relay, not the backend's work. When a write is not
    accepted within ``limit_s`` the client's connection is aborted and the write counts as
    the client gone, so the caller closes the upstream request.
    """
    transport = request.transport
    size = _LAST_CHUNK if data is None else len(data)
    if (
        (data is not None or body_started)
        and transport is not None
        and transport.get_write_buffer_size() + size <= transport.get_write_buffer_limits()[0]
    ):
        # Below the low-water mark the transport is not paused and this write cannot pause it,
        # so it cannot wait (the common case): no deadline to set. Nor can the end of a body
        # already under way (its head is out): it is the last chunk's 5 bytes (the answer is
        # never compressed).
        try:
            if data is None:
                await resp.write_eof()
            else:
                await resp.write(data)
        except ConnectionResetError:
            return False
        return True
    try:
        async with asyncio.timeout(limit_s):
            if data is None:
                await resp.write_eof()
            else:
                await resp.write(data)
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one too
        return False
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        return False
    return True


_LAST_CHUNK = len(b"0\r\n\r\n")
"""What ending a chunked body writes."""


def _client_gone(ex: Exchange, upstream: aiohttp.ClientResponse) -> None:
    """The client disconnected: close the upstream connection so the backend frees its slot."""
    ex.status = CLIENT_CLOSED
    ex.error = "client_disconnected"
    ex.obs.t_end = monotonic()
    upstream.close()


async def relay_passthrough(
    request: web.Request,
    session: aiohttp.ClientSession,
    *,
    url: str,
    body: bytes | None,
    request_id: str,
    timeouts: Timeouts,
    backend_api_key: str | None,
) -> web.StreamResponse:
    """Any other path: forwarded as is, the answer streamed back chunk by chunk."""
    upstream = await open_upstream(
        session,
        request,
        url=url,
        body=body,
        request_id=request_id,
        timeouts=timeouts,
        backend_api_key=backend_api_key,
    )
    async with upstream:
        bodiless = is_bodiless(request.method, upstream.status)
        resp = web.StreamResponse(
            status=upstream.status,
            headers=downstream_response_headers(upstream.headers, bodiless=bodiless),
        )
        resp.headers["X-Request-Id"] = request_id
        await resp.prepare(request)
        if bodiless:  # the head is the whole answer (aiohttp writes no body for these either)
            await _write(request, resp, None, timeouts.client)
            return resp
        try:
            async for chunk in upstream.content.iter_any():
                if not await _write(request, resp, chunk, timeouts.client):
                    upstream.close()
                    return resp
        except (TimeoutError, aiohttp.ClientError):
            upstream.close()  # the status is sent; ending the body early is all that is left
        await _write(request, resp, None, timeouts.client)
        return resp
