"""Forwarding to a backend and relaying its answer: bytes out as they arrive, observed on the way.

The relay never rebuilds a response. Streamed events reach the client as the backend sends them
(written to the client from the read callback of the backend's connection, ``proxy.wire``,
with backpressure pausing those reads while the client is behind); the relay only looks at each
event to timestamp the first token, the first visible token and the last token, and to read
usage. When the proxy asked for usage the client did not, the usage-only event
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

from collections.abc import Mapping

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy import wire
from proxy.config import Timeouts
from proxy.errors import (
    BackendBadAnswer,
    BackendTimeout,
    BackendUnavailable,
    ProxyError,
)
from proxy.exchange import Exchange
from proxy.headers import downstream_response_headers, is_event_stream, upstream_request_headers
from proxy.records import monotonic
from proxy.stream_relay import relay_stream
from proxy.values import value
from proxy.wire import Answering, BackendPool, Head

RETRY_STATUSES = frozenset({502, 503})  # the replica could not take it; another one may


class BackendConnectTimeout(BackendTimeout):
    """504: connecting to the backend timed out (nothing was sent; the replica is suspect)."""


@value
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


def upstream_failure(exc: BaseException, url: str) -> ProxyError:
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


def outgoing_request(
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


async def open_answer(
    pool: BackendPool,
    request: web.Request,
    *,
    url: str,
    body: wire.Body | None,
    request_id: str,
    timeouts: Timeouts,
    backend_api_key: str | None,
    extra_headers: Mapping[str, str] | None = None,
) -> tuple[Answering, Head]:
    """Send an inference request upstream (``proxy.wire``) and wait for its answer's head,
    translating failures as the pass-through's ``open_upstream`` does."""
    headers, url = outgoing_request(request, url, request_id, backend_api_key, extra_headers)
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
        raise upstream_failure(exc, url) from exc


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
            return await relay_stream(request, answering, head, ex)
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
