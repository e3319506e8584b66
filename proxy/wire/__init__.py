"""The inference path's connections to its backends: HTTP/1.1 on asyncio protocols.

An inference answer is relayed a read at a time. Through a client library that is a parser
feeding a stream object, a task woken per read to take the bytes out of it, and a writer
coroutine per write: most of what relaying a token event costs. Here the connection's own
``data_received`` decodes the body framing and hands each read's payload to the relay
synchronously (``Answering.deliver``), which inspects and writes it to the client there and
then; the relay's coroutine wakes only when the answer ends, fails, or the client falls behind.
Everything else the proxy sends upstream (pass-through paths, the backends' metrics and slots)
keeps using the aiohttp session (``proxy.upstream``).

What it implements of RFC 9112, as a client to the backends it is configured with:

- Requests: ``METHOD target HTTP/1.1``, the headers given (``Host`` and ``Content-Length``
  computed; credentials in the backend's URL sent as Basic ``Authorization`` unless the request
  has its own), a short body in the same write as the head, a long one (``JOIN_BELOW``) in
  writes of its own after it, as it is (``Body``: bytes, or parts never joined into a copy).
  ``Accept-Encoding: identity`` is asked for, since the relay reads the answer; an encoded
  answer is relayed as it came, its ``Content-Encoding`` kept.
- Answers: the status line and header fields (obsolete line folding joined with a space;
  ``1xx`` interim answers skipped), then the body by its framing: none (``204``, ``304``, an
  answer to ``HEAD``), ``Transfer-Encoding`` ending in ``chunked`` (extensions ignored,
  trailers read and dropped), ``Content-Length``, or until the connection closes. A head that
  cannot be read (over 64 KiB, no status line, a field line without a colon, control
  characters or a bare CR or LF, conflicting lengths, a bad chunk size) is ``WireBadAnswer``.
- Connections are kept alive and reused, newest first, unless the answer says ``Connection:
  close``, is HTTP/1.0 without ``keep-alive``, ended by the connection closing, or announced a
  body it cannot have (a ``204`` or ``304`` with a length or chunks); one idle
  longer than ``keepalive_s`` is closed. A connection that cannot be made, or is closed before
  any byte of an answer, is tried once more on a new one: a kept-alive connection the backend
  had closed while it was idle (servers close idle ones) looks just like that.
- Time limits: ``connect`` for the TCP (and TLS) connection; ``idle`` between reads once the
  request is sent; ``head_s`` for the whole head, connecting included, however steadily the
  backend dribbles it (one timer per answer does both). A read that stalls past either is
  ``WireTimeout``.

Flow control: ``Answering.pause`` stops reading from the backend (the client is not taking
bytes as fast as the backend sends them) and ``resume`` starts again; the idle timer does not
run while paused.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from proxy.wire.answering import Answering
from proxy.wire.errors import (
    WireBadAnswer,
    WireClosed,
    WireConnectError,
    WireConnectTimeout,
    WireError,
    WireTimeout,
)
from proxy.wire.http1 import JOIN_BELOW, Body, Head, request_bytes
from proxy.wire.pool import BackendConnection, BackendPool

__all__ = [
    "JOIN_BELOW",
    "Answering",
    "BackendConnection",
    "BackendPool",
    "Body",
    "Head",
    "WireBadAnswer",
    "WireClosed",
    "WireConnectError",
    "WireConnectTimeout",
    "WireError",
    "WireTimeout",
    "request_bytes",
    "send",
]


async def send(
    pool: BackendPool,
    method: str,
    url: str,
    *,
    headers: Iterable[tuple[str, str]],
    body: Body | None,
    connect_s: float | None,
    idle_s: float | None,
    head_s: float | None = None,
) -> tuple[Answering, Head]:
    """Send a request and wait for its answer's head (``WireError``, ``TimeoutError``).

    A connection that fails, or is closed before any byte of an answer arrived, is tried once
    more on a new connection: a kept-alive one the backend had closed while it was idle looks
    just like that. A timeout is not retried. ``head_s`` bounds the whole wait for the head,
    connecting included (``WireConnectTimeout`` or ``WireTimeout`` after it), however steadily
    the backend dribbles it.
    """
    key, target, host, auth = pool.origin(url)
    writes = request_bytes(method, target, host, headers, body, auth)
    head_request = method == "HEAD"
    head_by = pool.loop.time() + head_s if head_s else math.inf
    tries = 2
    while True:
        tries -= 1
        left = head_by - pool.loop.time()
        if left <= 0:
            raise WireTimeout("the backend's answer head did not come in time")
        limit = min(connect_s or math.inf, left)  # connecting, within the head's deadline
        try:
            connect_limit = None if limit == math.inf else limit
            conn = await (
                pool.connect(key, connect_limit)
                if tries
                else pool.new_connection(key, connect_limit)
            )
        except WireConnectError:
            if not tries:
                raise
            continue
        answering = Answering(conn, idle_s=idle_s, head_request=head_request, head_by=head_by)
        conn.answering = answering
        try:
            transport = conn.transport
            if transport is None or conn.closed:
                raise WireClosed("the backend closed the connection", before_answer=True)
            for data in writes:
                transport.write(data)
            return answering, await answering.head()
        except WireClosed as exc:
            answering.abort()
            if not (tries and exc.before_answer):
                raise
        except BaseException:
            answering.abort()
            raise
