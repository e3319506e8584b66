"""Pass-through: every path that is not inference, forwarded untouched through aiohttp's client.

The request goes as the client sent it (hop-by-hop headers aside) and the answer comes back
chunk by chunk as it arrives; nothing is read, recorded or rewritten. Bodiless answers keep
their ``Content-Length`` and ``Content-Encoding``. The session and its connector are
``proxy.upstream``'s; the inference path has its own connections (``proxy.wire``).
``passthrough`` is the route's handler (methods and a second replica), ``relay_passthrough``
the forwarding.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping

import aiohttp
from aiohttp import web

from proxy.config import Timeouts
from proxy.errors import BackendBadAnswer, BackendUnavailable, NotFound
from proxy.fleet import Replica
from proxy.headers import downstream_response_headers
from proxy.relay import BackendConnectTimeout, outgoing_request, upstream_failure
from proxy.state import REQUEST_ID, STATE
from proxy.stream_relay import write_to_client
from proxy.validation import read_body

IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


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
    headers, url = outgoing_request(request, url, request_id, backend_api_key, extra_headers)

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
        raise upstream_failure(exc, url) from exc


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
            await write_to_client(request, resp, None, timeouts.client)
            return resp
        try:
            async for chunk in upstream.content.iter_any():
                if not await write_to_client(request, resp, chunk, timeouts.client):
                    upstream.close()
                    return resp
        except (TimeoutError, aiohttp.ClientError):
            upstream.close()  # the status is sent; ending the body early is all that is left
        await write_to_client(request, resp, None, timeouts.client)
        return resp


async def passthrough(request: web.Request) -> web.StreamResponse:
    """Every other path: forwarded to the first healthy backend untouched.

    When that backend cannot be reached, an idempotent request (GET, HEAD, OPTIONS) is sent
    once to the next healthy one. ``--passthrough read-only`` forwards only those methods,
    ``off`` nothing (404): pass-through requests get no record, no canonicalization and no
    tenant cache partition, so an operator isolating tenants can close them.
    """
    state = request.app[STATE]
    mode = state.settings.passthrough
    if mode == "off" or (mode == "read-only" and request.method not in IDEMPOTENT_METHODS):
        raise NotFound(
            f"{request.method} {request.path} is not forwarded by this proxy "
            f"(--passthrough {mode}); it serves chat, completions, /completion, "
            "responses and messages"
        )
    limit, idle_s = state.settings.max_body_bytes, state.settings.timeouts.client
    body = await read_body(request, limit, idle_s=idle_s) if request.can_read_body else None
    order = state.fleet.passthrough_order()

    async def forward(replica: Replica) -> web.StreamResponse:
        return await relay_passthrough(
            request,
            state.session,
            url=replica.url + request.path,
            body=body,
            request_id=request[REQUEST_ID],
            timeouts=state.settings.timeouts,
            backend_api_key=state.settings.backend_api_key,
        )

    try:
        return await forward(order[0])
    except BackendBadAnswer:
        raise  # it answered: an odd answer on a pass-through path never ejects a replica
    except (BackendUnavailable, BackendConnectTimeout) as exc:
        state.fleet.report_failure(order[0], exc.message)
        second = next((r for r in order[1:] if r.healthy), None)
        if second is None or request.method not in IDEMPOTENT_METHODS:
            raise
        return await forward(second)
