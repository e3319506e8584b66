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
import functools
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict

from proxy import wire
from proxy.backends.apis import MESSAGES
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
from proxy.log import get_logger
from proxy.records import monotonic
from proxy.sse import EventSplitter
from proxy.stream_inspect import StreamInspector
from proxy.wire import Answering, BackendPool, Head

log = get_logger()

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


@functools.lru_cache(maxsize=8)
def upstream_timeout(timeouts: Timeouts) -> aiohttp.ClientTimeout:
    """Connect and between-bytes limits; never a total limit (streams may run for minutes).

    One (immutable) object per setting, not one per request."""
    return aiohttp.ClientTimeout(
        total=None,
        connect=timeouts.connect,
        sock_connect=timeouts.connect,
        sock_read=timeouts.idle,
    )


def _upstream_failure(exc: BaseException, url: str) -> ProxyError:
    """A failure to get an answer's head from either client (aiohttp's, ``proxy.wire``), as
    the client is told of it."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError | wire.WireConnectTimeout):
        return BackendConnectTimeout(f"backend connect timed out: {url}")
    if isinstance(exc, TimeoutError):
        return BackendTimeout(f"backend did not answer in time: {url}")
    # It answered, in bytes that cannot be read: one odd answer, not a replica that is down.
    if isinstance(exc, aiohttp.ClientResponseError):
        return BackendBadAnswer(f"backend answered unreadable HTTP: {exc.message[:80]}")
    if isinstance(exc, wire.WireBadAnswer):
        return BackendBadAnswer(f"backend answered unreadable HTTP: {str(exc)[:80]}")
    why = str(exc) if isinstance(exc, wire.WireError) else exc.__class__.__name__
    return BackendUnavailable(f"backend unreachable: {why}")


def _outgoing(
    request: web.Request,
    url: str,
    request_id: str,
    backend_api_key: str | None,
    extra_headers: Mapping[str, str] | None,
) -> tuple[CIMultiDict[str], str]:
    """The headers and the URL a request goes upstream with (``extra_headers`` replace the
    client's of the same names: the trace context)."""
    headers = upstream_request_headers(
        request.headers, request_id=request_id, backend_api_key=backend_api_key
    )
    if extra_headers:
        headers.update(extra_headers)
    query = request.rel_url.raw_query_string
    if query:  # as the client encoded it: decoding would turn %26 into a separator upstream
        url = f"{url}?{query}"
    return headers, url


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
    headers, url = _outgoing(request, url, request_id, backend_api_key, extra_headers)

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
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise _upstream_failure(exc, url) from exc


async def open_answer(
    pool: BackendPool,
    request: web.Request,
    *,
    url: str,
    body: bytes | None,
    request_id: str,
    timeouts: Timeouts,
    backend_api_key: str | None,
    extra_headers: Mapping[str, str] | None = None,
) -> tuple[Answering, Head]:
    """Send an inference request upstream (``proxy.wire``) and wait for its answer's head,
    translating failures as ``open_upstream`` does."""
    headers, url = _outgoing(request, url, request_id, backend_api_key, extra_headers)
    try:
        # A deadline on the whole response head (``head_s``): a backend dribbling its status
        # line and headers a byte at a time never trips the between-bytes (idle) timeout.
        return await wire.send(
            pool,
            request.method,
            url,
            headers=headers.items(),
            body=body,
            connect_s=timeouts.connect,
            idle_s=timeouts.idle,
            head_s=timeouts.connect + timeouts.idle,
        )
    except (TimeoutError, wire.WireError) as exc:
        raise _upstream_failure(exc, url) from exc


async def relay_inference(
    request: web.Request,
    pool: BackendPool,
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
        answering, head = await open_answer(
            pool,
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
    try:
        ex.status = head.status
        if ex.stream and head.status == 200 and is_event_stream(head.content_type):
            return await _relay_stream(request, answering, head, ex)
        try:
            answer = await _read_answer(answering, head)
        except BackendUnavailable as exc:
            if retry:
                raise NotStarted(exc.message, failure=exc) from exc
            raise
    finally:
        answering.release()
    if retry and answer.status in RETRY_STATUSES:
        raise NotStarted(f"backend answered {answer.status}", answer=answer)
    return await send_answer(request, ex, answer)


async def _read_answer(answering: Answering, head: Head) -> Answer:
    try:
        payload = await answering.read()
    except TimeoutError as exc:
        raise BackendTimeout("backend stopped sending before the response was complete") from exc
    except wire.WireError as exc:
        raise BackendUnavailable(f"backend failed mid-response: {exc}") from exc
    return Answer(
        status=head.status,
        headers=downstream_response_headers(head.headers, decoded=False),
        payload=payload,
        content_type=head.content_type,
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


async def _relay_stream(
    request: web.Request, answering: Answering, head: Head, ex: Exchange
) -> web.StreamResponse:
    resp = web.StreamResponse(
        status=head.status, headers=downstream_response_headers(head.headers, decoded=False)
    )
    resp.headers["X-Request-Id"] = ex.request_id
    resp.headers.update(ex.response_headers)
    resp.headers["X-Accel-Buffering"] = "no"
    resp.headers.setdefault("Cache-Control", "no-cache")
    writer = await resp.prepare(request)
    transport = request.transport
    if writer is None or transport is None or transport.is_closing():
        _client_gone(ex, answering)
        return resp
    relay = _StreamRelay(answering, ex, transport, chunked=getattr(writer, "chunked", True))
    failure: ProxyError | None = None
    limit = ex.send_timeout_s
    try:
        answering.deliver(relay.feed)  # (what came with the head is fed at once, here)
        while True:  # what the reads left for the coroutine, before every wait
            if relay.error is not None:
                break
            if relay.gone:
                _client_gone(ex, answering)
                return resp
            if answering.paused:  # the client is behind: wait for it to take what it has
                if not await _drained(request, writer, limit):
                    _client_gone(ex, answering)
                    return resp
                answering.resume()
                continue
            try:
                if await answering.wait():
                    break
            except (wire.WireError, TimeoutError):
                if relay.error is None and not relay.gone:
                    raise  # the backend's failure; else the read's own, seen at the top
        if relay.error is not None:
            # A failure of the proxy's own inside a read (a bug): the stream ends with an
            # error event, as for a backend failure, rather than mid-event.
            log.error("relay_failed", exc_info=relay.error)
            failure = ProxyError("internal proxy error while relaying the answer")
            ex.error = "server_error"
    except TimeoutError:
        failure = BackendTimeout("backend stopped sending mid-stream")
        ex.error = "backend_timeout"
    except wire.WireError:
        failure = BackendUnavailable("backend closed the stream early")
        ex.error = "backend_disconnected"
    except asyncio.CancelledError:
        _client_gone(ex, answering)
        raise
    splitter, inspector = relay.splitter, relay.inspector
    tail = relay.last  # the read that ended the answer, held to go out with the end
    inspector.finish(tail)
    rest = splitter.flush()
    if rest:
        tail.append(rest)
    if failure is not None:
        anthropic = ex.route == MESSAGES
        tail.append(anthropic_sse_error_event(failure) if anthropic else sse_error_event(failure))
        answering.abort()
    # The rest and the end of the body in one write.
    end = b"".join(tail)
    if not await _write(request, resp, end, limit, body_started=relay.body_started, eof=True):
        _client_gone(ex, answering)
        return resp
    ex.obs.t_end = monotonic()
    return resp


class _StreamRelay:
    """A streamed answer's reads, as the connection hands them over (``Answering.deliver``):
    each is inspected and written to the client at once, inside the read's own callback. What
    needs the relay's coroutine (the client fell behind, went away, an error) wakes it."""

    __slots__ = (
        "answering",
        "body_started",
        "chunked",
        "error",
        "ex",
        "gone",
        "high",
        "inspector",
        "last",
        "obs",
        "splitter",
        "transport",
    )

    def __init__(
        self, answering: Answering, ex: Exchange, transport: asyncio.Transport, *, chunked: bool
    ) -> None:
        self.answering = answering
        self.ex = ex
        self.obs = ex.obs
        self.transport = transport
        self.chunked = chunked
        self.splitter = EventSplitter()
        self.inspector = StreamInspector(ex)
        self.high = transport.get_write_buffer_limits()[1]
        self.body_started = False
        self.gone = False
        self.error: BaseException | None = None
        self.last: list[bytes] = []
        """What the read that ended the answer leaves to send: it goes out with the end of the
        body, in one write (the relay's coroutine is woken by that read at once)."""

    def feed(self, chunk: bytes) -> None:
        if self.gone or self.error is not None:
            return
        try:
            self._feed(chunk)
        except Exception as exc:  # handed to the relay's coroutine, which raises it
            self.error = exc
            self.answering.abort()
            self.answering.wake()

    def _feed(self, chunk: bytes) -> None:
        splitter, inspector, obs = self.splitter, self.inspector, self.obs
        now = monotonic()
        forwarded_events = 0
        if not splitter.pending and inspector.plain_chunk(chunk, now):
            data = chunk  # the usual read once the answer is under way: one token event
        elif obs.t_first_visible is None and not splitter.pending:
            # Token events before the first visible one is timed: forwarded as they are
            # whatever they hold, so they go out first and are read after.
            forwarded_events = inspector.unchanged(chunk)
            data = chunk if forwarded_events else _inspect(splitter, inspector, chunk, now)
        else:
            data = _inspect(splitter, inspector, chunk, now)
        obs.inspect_s += monotonic() - now
        if data and self.answering.complete:
            self.last.append(data)
        elif data:
            transport = self.transport
            if transport.is_closing():
                self.gone = True
                self.answering.abort()
                self.answering.wake()
                return
            transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
            self.body_started = True
            if transport.get_write_buffer_size() > self.high:
                self.answering.pause()
                self.answering.wake()
        if forwarded_events:
            t0 = monotonic()
            inspector.read_unchanged(chunk, forwarded_events, now)
            obs.inspect_s += monotonic() - t0


async def _drained(
    request: web.Request, writer: AbstractStreamWriter, limit_s: float | None
) -> bool:
    """Wait for the client to take what it has been sent, at most ``limit_s``; False (its
    connection aborted) when it does not, or has gone."""
    try:
        async with asyncio.timeout(limit_s):
            await writer.drain()
    except ConnectionError:  # reset, or lost ("Connection lost" fails aiohttp's drain)
        return False
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        return False
    transport = request.transport
    return transport is not None and not transport.is_closing()


def _inspect(
    splitter: EventSplitter, inspector: StreamInspector, chunk: bytes, now: float
) -> bytes:
    """What of ``chunk`` reaches the client, its events observed (``StreamInspector.process``)."""
    out: list[bytes] = []
    inspector.process_all(list(splitter.feed(chunk)), now, out)
    return b"".join(out)


async def _write(
    request: web.Request,
    resp: web.StreamResponse,
    data: bytes | None,
    limit_s: float | None,
    *,
    body_started: bool = False,
    eof: bool = False,
) -> bool:
    """Write to the client (``None``: end the body; ``eof``: ``data`` and the end of the body
    in one write; ``body_started``: some of it was written, so the head has gone out with
    it); False when the client has gone away.

    A client that stays connected but stops reading would hold its backend request (a slot)
    forever: backpressure stops the relay, not the backend's work. When a write is not
    accepted within ``limit_s`` the client's connection is aborted and the write counts as
    the client gone, so the caller closes the upstream request.
    """
    if data is None:
        data, eof = b"", True
    transport = request.transport
    size = len(data) + (_LAST_CHUNK if eof else 0)
    if (
        (data or body_started)
        and transport is not None
        and transport.get_write_buffer_size() + size <= transport.get_write_buffer_limits()[0]
    ):
        # Below the low-water mark the transport is not paused and this write cannot pause it,
        # so it cannot wait (the common case): no deadline to set. Nor can the end of a body
        # already under way (its head is out): it is the last chunk's 5 bytes (the answer is
        # never compressed).
        try:
            await (resp.write_eof(data) if eof else resp.write(data))
        except ConnectionResetError:
            return False
        return True
    try:
        async with asyncio.timeout(limit_s):
            await (resp.write_eof(data) if eof else resp.write(data))
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one too
        return False
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        return False
    return True


_LAST_CHUNK = len(b"0\r\n\r\n")
"""What ending a chunked body writes."""


def _client_gone(ex: Exchange, answering: Answering) -> None:
    """The client disconnected: close the upstream connection so the backend frees its slot."""
    ex.status = CLIENT_CLOSED
    ex.error = "client_disconnected"
    ex.obs.t_end = monotonic()
    answering.abort()


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
