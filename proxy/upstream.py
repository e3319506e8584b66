"""The connection pool to the backends: aiohttp's, reading bodiless answers as bodiless.

A response that cannot have a body (``204 No Content``, ``304 Not Modified``, the answer to a
``HEAD``) ends with its head (RFC 9112 §6.3). Some servers still send one after it: llama-server's
``/cors-proxy`` answers ``204`` with ``Transfer-Encoding: chunked`` and a ``0\\r\\n\\r\\n`` body.
aiohttp's client parser, rightly, reads those bytes as the start of the next response on the
connection; when they arrive with the head (one read), the parse error fails the 204 itself
("Bad status line '0'"), and the client would get a 502 for an answer the backend did give.

``BodilessAwareHandler`` is aiohttp's ``ResponseHandler`` (one per connection) with one change,
made before its parser sees the bytes: when the first read of a response holds a complete head
whose status (or request method) rules out a body, and the head nevertheless announces one
(``Transfer-Encoding`` or a non-zero ``Content-Length``), the response is that head alone. What
followed it is dropped, and so is anything the connection sends until it closes: it is never
reused (``force_close``), so those bytes cannot be read as another request's answer. A head that
announces nothing is left to aiohttp, which handles it already; so is a head that spans several
reads (the quirk's bytes then reach the parser after the response was delivered, and the
connection, which aiohttp then closes, was not reused).

How it is wired, and what it leans on (aiohttp >= 3.13, < 4):

- ``ResponseHandler.set_response_params`` (public) is called once per request, before it is
  sent, with ``skip_payload=True`` for ``HEAD``: it marks where the next response head starts.
- ``ResponseHandler.data_received`` (asyncio's ``Protocol`` method) is overridden, and calls
  aiohttp's own with the bytes that are the response.
- ``UpstreamConnector`` is a ``TCPConnector`` whose protocol factory builds the subclass: the
  factory is the connector's ``_factory`` attribute.
  ``tests/unit/test_upstream.py`` fails at once if a future aiohttp stops calling it.

The between-bytes timeout (``sock_read``, the proxy's idle limit) is re-armed lazily. aiohttp
cancels its timer and schedules a new one on every read from the backend: a streamed answer's
every token event costs a timer handle, a push onto the event loop's heap and a cancelled
entry there. ``BodilessAwareHandler`` keeps the same deadline (``sock_read`` seconds after the
latest read) as a number instead: each read moves the deadline, and the one timer, when it
comes due early, re-arms itself for the deadline as it stands. The timeout fires when it did,
at most a loop turn later. This overrides ``ResponseHandler._reschedule_timeout`` (called on
each read, on ``start_timeout`` and on ``resume_reading``) and reads ``_read_timeout`` and
``_read_timeout_handle``, which aiohttp's ``_drop_timeout`` cancels and clears as before; the
tests there fail if aiohttp stops calling it or renames them.
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Any, cast

import aiohttp
from aiohttp.client_proto import ResponseHandler

BODILESS_STATUSES = frozenset({204, 304})
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})[ \r]")
_ANNOUNCES_BODY = re.compile(
    rb"\r\n(?:transfer-encoding[ \t]*:|content-length[ \t]*:[ \t]*0*[1-9])", re.IGNORECASE
)


def bodiless_head_end(data: bytes, *, head_request: bool) -> int | None:
    """Where the response ends when ``data`` starts with a bodiless head that announces a body.

    Returns the offset just past the head's blank line, or None when ``data`` is anything else
    (an incomplete head, a status with a body, a ``1xx`` interim answer, a head announcing no
    body), which aiohttp's parser reads as it always does.
    """
    match = _STATUS_LINE.match(data)
    if match is None:
        return None
    status = int(match.group(1))
    if status < 200 or (status not in BODILESS_STATUSES and not head_request):
        return None
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return None
    if _ANNOUNCES_BODY.search(data, 0, end + 2) is None:
        return None
    return end + 4


class BodilessAwareHandler(ResponseHandler):
    """aiohttp's per-connection protocol; a bodiless answer that announces a body ends at its
    head (module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._head_next = False
        self._head_request = False
        self._discarding = False
        self._read_deadline = 0.0

    def _reschedule_timeout(self) -> None:
        """Data arrived (or reading starts again): the idle deadline moves ``sock_read`` seconds
        on; the timer already armed stays, and re-arms itself when it comes due early."""
        timeout = self._read_timeout
        handle = self._read_timeout_handle
        if not timeout:
            if handle is not None:
                handle.cancel()
                self._read_timeout_handle = None
            return
        deadline = self._loop.time() + timeout
        self._read_deadline = deadline
        if handle is None or handle.when() > deadline:  # none armed, or armed for later
            if handle is not None:
                handle.cancel()
            self._read_timeout_handle = self._loop.call_at(deadline, self._read_timer_due)

    def _read_timer_due(self) -> None:
        deadline = self._read_deadline
        if deadline > self._loop.time():  # data came since it was armed: wait for the rest
            self._read_timeout_handle = self._loop.call_at(deadline, self._read_timer_due)
            return
        self._read_timeout_handle = None
        self._on_read_timeout()

    def set_response_params(self, **kwargs: Any) -> None:
        super().set_response_params(**kwargs)
        self._head_next = True
        self._head_request = bool(kwargs.get("skip_payload", False))

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self._head_next and data:
            self._head_next = False
            end = bodiless_head_end(data, head_request=self._head_request)
            if end is not None:
                self.force_close()
                self._discarding = True
                data = data[:end]
        super().data_received(data)


class UpstreamConnector(aiohttp.TCPConnector):
    """``TCPConnector`` whose connections are ``BodilessAwareHandler`` s."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # partial is invariant in mypy's eyes; a subclass's partial builds ResponseHandlers too.
        self._factory = cast(
            "functools.partial[ResponseHandler]",
            functools.partial(BodilessAwareHandler, loop=self._loop),
        )


def upstream_session(**connector: Any) -> aiohttp.ClientSession:
    """The one session the proxy talks to its backends with (no total timeout of its own)."""
    return aiohttp.ClientSession(
        connector=UpstreamConnector(**connector), timeout=aiohttp.ClientTimeout()
    )
