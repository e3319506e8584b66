"""The HTTP server under the app: aiohttp's, with its own refusals in the OpenAI error shape.

aiohttp answers some requests before the application (and so its middlewares) ever sees them:
a request whose framing its parser refuses (a header line over 8 KiB, too many header fields,
``Content-Length`` with chunked, a bad chunk size, a control character in a header, a bad
method or HTTP version, bytes that are not HTTP at all) gets a ``400``, an exception escaping
a handler a ``500``, an ``asyncio.TimeoutError`` escaping one a ``504``. All three come from
``RequestHandler.handle_error``, which writes them as ``text/plain``. Here they leave as the
proxy's other errors do, ``{"error": {"message", "type", "param", "code"}}``, with aiohttp's
status, and still close the connection.

How the server gets there, chosen to depend on as little of aiohttp's inside as possible
(aiohttp >= 3.13, < 4):

- ``JsonErrorRequestHandler`` subclasses ``RequestHandler`` (one per connection) and overrides
  ``handle_error`` only. For a server error (500, 504) it calls aiohttp's own
  ``handle_error`` first, for what it does besides the body: logging the traceback and raising
  ``ConnectionError`` when part of a response was already sent (the connection is then broken,
  not answered). For a request the parser refused it does the latter itself and logs one
  ``bad_http_request`` line without the request's bytes (aiohttp's own log line quotes up to
  100 bytes of the offending line, which may be a credential).
- Nothing in aiohttp lets a caller choose that class: ``web.Server.__call__``, the protocol
  factory the event loop calls for each connection, constructs ``RequestHandler`` by name.
  ``JsonErrorServer.__call__`` lets aiohttp build the handler as it always does (its arguments,
  its fallback) and re-classes the result. ``RequestHandler`` has ``__slots__``, so attributes
  cannot be patched on an instance, but a subclass that adds no slots has the same layout and
  Python allows the ``__class__`` assignment. Constructing the subclass ourselves would instead
  copy that constructor call and read the server's private ``_loop`` and ``_kwargs``.
- ``web.run_app`` builds its own ``AppRunner``, so ``run_app`` here replaces it:
  ``JsonErrorAppRunner.setup()`` (public) re-classes the ``web.Server`` that aiohttp made for the
  app, before any site listens, rather than overriding ``AppRunner._make_server`` or calling the
  private ``Application._make_handler``. The rest is ``web.run_app``'s defaults, spelled out.

Should a future aiohttp change the handler's layout, the assignment raises ``TypeError`` on the
first connection; ``tests/unit/test_server.py`` and ``tests/reliability/test_bad_input.py``
fail at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from proxy.errors import error_response
from proxy.heap import HeapTrimmer
from proxy.log import get_logger

# web.run_app's defaults, which `prefixgate serve` has always run with.
KEEPALIVE_TIMEOUT_S = 75.0  # an idle keep-alive connection, or an unfinished request head
SHUTDOWN_TIMEOUT_S = 60.0  # on SIGTERM, how long requests in flight may take to finish
BACKLOG = 2048  # aiohttp's 128 overflows in a burst of connections: 1-3 s SYN retries

_log = get_logger()

GC_YOUNG_OBJECTS = 10_000
"""Python's cyclic collector runs its youngest generation once this many more container objects
were allocated than freed (CPython's default is 700), and each older one every 20 runs of the
one below (default 10; the generational collector of CPython 3.11-3.13). A request allocates
thousands of short-lived dicts, lists and dataclasses, nearly all freed by reference counting;
at the default the collector ran every few requests and promoted what was alive at that moment
into generations it walks again and again. With this threshold it takes 5-8 % less CPU per
request at 64 streams (``bench/README.md``, fourth round); a young collection walks at most
this many objects (well under a millisecond)."""

MESSAGE_LIMIT = 200  # characters of aiohttp's own description kept in the error message
BAD_HTTP_CODE = "bad_http_request"


# What was wrong, by the kind of error, for messages that carry the request's own bytes
# (subclasses before their bases; anything else is a "malformed HTTP request").
_BY_KIND: tuple[tuple[type[HttpProcessingError], str], ...] = (
    (InvalidURLError, "the request target is not a valid URL"),
    (InvalidHeader, "a header field is not valid"),
    (BadHttpMethod, "the request method is not valid"),
    (BadStatusLine, "the request line is not valid"),
)


def _describe(exc: BaseException | None, message: str | None) -> str:
    """What was wrong with the request, in aiohttp's words, without quoting the request.

    The request's bytes can hold credentials and run to 8 KiB; neither the answer nor the log
    line carries them. llhttp's messages end with the offending bytes after a blank line
    (``Invalid header value char:\n\n  b'X-Api-Key: ...'\n  ^``): the description before it
    is kept. aiohttp's own messages quote what they refuse (``Bad status line 'GET ...'``) or,
    for a URL or a header, are that text: those are described by their kind. A message with
    nothing quoted is aiohttp's own words (``Received HTTPS traffic on an HTTP port``). At most
    ``MESSAGE_LIMIT`` characters.
    """
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else "the limit"
        return f"a request line or header field is longer than {limit} bytes"
    if not message and isinstance(exc, HttpProcessingError):
        message = exc.message
    message = message or ""
    if "\n\n" in message:
        text = " ".join(message.split("\n\n", 1)[0].split()).rstrip(":")
    elif isinstance(exc, InvalidURLError | InvalidHeader) or "'" in message or '"' in message:
        text = next((d for kind, d in _BY_KIND if isinstance(exc, kind)), "")
    else:
        text = " ".join(message.split())
    if text.startswith("Pause on PRI"):  # llhttp's words for the HTTP/2 connection preface
        return "HTTP/2 without an upgrade is not supported: send HTTP/1.1"
    if len(text) > MESSAGE_LIMIT:
        text = text[: MESSAGE_LIMIT - 1] + "…"
    return text or "malformed HTTP request"


def error_for(status: int, exc: BaseException | None, message: str | None) -> web.Response:
    """The OpenAI-shaped response for what ``RequestHandler.handle_error`` is asked to answer."""
    if status < 500:
        text = f"could not parse the HTTP request: {_describe(exc, message)}"
        resp = error_response(status, text, type_="invalid_request_error", code=BAD_HTTP_CODE)
    elif status == 504:
        text = "the proxy timed out handling the request"
        resp = error_response(status, text, type_="server_error", code="timeout")
    else:
        resp = error_response(status, "internal proxy error", type_="server_error")
    resp.force_close()
    return resp


class JsonErrorRequestHandler(RequestHandler):
    """aiohttp's per-connection protocol, whose own error answers are OpenAI-shaped JSON."""

    __slots__ = ()  # the same layout as RequestHandler: JsonErrorServer re-classes into this

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            # aiohttp's: logs the traceback, and raises ConnectionError if the response
            # already started.
            super().handle_error(request, status, exc, message)
            return error_for(status, exc, message)
        # A request the parser refused: aiohttp would log it with a traceback quoting the
        # offending line (up to 100 bytes of it: an Authorization header, say). One line
        # without the request's bytes is enough.
        if request.writer.output_size > 0:
            raise ConnectionError(
                "Response is sent already, cannot send another response with the error message"
            )
        _log.warning(
            "bad_http_request",
            status=status,
            error=type(exc).__name__ if exc is not None else None,
            reason=_describe(exc, message),
            remote=request.remote,
        )
        return error_for(status, exc, message)


class JsonErrorServer(web.Server):
    """``web.Server`` whose connections are served by ``JsonErrorRequestHandler``."""

    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = JsonErrorRequestHandler
        return handler


class JsonErrorAppRunner(web.AppRunner):
    """``web.AppRunner`` whose server is a ``JsonErrorServer``."""

    __slots__ = ()

    async def setup(self) -> None:
        await super().setup()
        assert self.server is not None
        self.server.__class__ = JsonErrorServer


def make_runner(app: web.Application, **kwargs: Any) -> JsonErrorAppRunner:
    """The runner ``prefixgate serve`` uses: clients that leave cancel their handler (and so
    their upstream request), no access log (every request has its record), run_app's timeouts.
    """
    options: dict[str, Any] = {
        "handler_cancellation": True,
        "access_log": None,
        "keepalive_timeout": KEEPALIVE_TIMEOUT_S,
        "shutdown_timeout": SHUTDOWN_TIMEOUT_S,
    }
    return JsonErrorAppRunner(app, **(options | kwargs))


def _hosts(host: str | Sequence[str]) -> list[str]:
    return [host] if isinstance(host, str) else list(host)


async def serve_app(
    app: web.Application,
    *,
    host: str | Sequence[str],
    port: int,
    admin: web.Application | None = None,
    admin_host: str | Sequence[str] | None = None,
    admin_port: int = 0,
    backlog: int = BACKLOG,
    tune_process: bool = False,
) -> None:
    """Serve ``app`` on every address in ``host`` (and ``admin`` on its own) until a signal.

    ``tune_process`` (the process's own server, ``run_app``): once the apps have started, what
    they built is set aside from the cyclic collector's walks (``gc.freeze``), its thresholds
    are raised (``GC_YOUNG_OBJECTS``), and the C heap's free pages are given back on a timer
    (``proxy.heap``); an embedded server leaves the process as it found it.

    ``app`` starts first and stops last: the admin application reads its state. The first
    SIGTERM or SIGINT stops listening, lets requests in flight finish (up to
    ``SHUTDOWN_TIMEOUT_S``) and runs the apps' shutdown and cleanup hooks. A second one cuts
    the wait short: the connections still open are aborted (their handlers are cancelled, and
    with them their upstream requests), and the cleanup hooks still run, so the store, the
    backend connections and the record writer are closed as on a normal stop. A third one gives
    up on the cleanup as well. A signal that arrives while the app is still starting lets the
    startup finish, then cleans up without listening.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    main = asyncio.current_task()
    runners = [make_runner(app)]
    if admin is not None:
        runners.append(make_runner(admin))
    received = 0
    heap = HeapTrimmer() if tune_process else None

    def on_signal() -> None:
        nonlocal received
        received += 1
        if received == 2:
            for runner in runners:
                abort_connections(runner)
        elif received > 2 and main is not None:
            main.cancel()
        stop.set()

    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        with contextlib.suppress(NotImplementedError):  # no add_signal_handler on Windows
            loop.add_signal_handler(sig, on_signal)
    started: list[JsonErrorAppRunner] = []
    try:
        for runner in runners:
            if stop.is_set():
                break
            await runner.setup()
            started.append(runner)
        if heap is not None:  # tune_process: the collector and the heap, once start-up is done
            tune_collector()
            heap.start()
        if not stop.is_set():
            listeners = [(runners[0], _hosts(host), port)]
            if admin is not None:
                listeners.append((runners[1], _hosts(admin_host or host), admin_port))
            for runner, hosts, at in listeners:
                for address in hosts:
                    await web.TCPSite(runner, address, at, backlog=backlog).start()
            _log.info(
                "listening",
                traffic=_urls(runners[0]),
                admin=_urls(runners[1]) if admin is not None else [],
            )
            await stop.wait()
    finally:
        if heap is not None:
            heap.stop()
        try:
            for runner in reversed(started):
                await runner.cleanup()
        finally:
            for sig in signals:
                with contextlib.suppress(NotImplementedError):
                    loop.remove_signal_handler(sig)


def _urls(runner: web.BaseRunner) -> list[str]:
    """``http://host:port`` of each socket ``runner`` listens on (the port a 0 was given)."""
    out = []
    for address in runner.addresses:
        host, port = address[0], address[1]
        out.append(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
    return out


def abort_connections(runner: web.BaseRunner) -> None:
    """Abort every client connection: their handlers are cancelled (``handler_cancellation``),
    so the server's wait for them ends at once."""
    server = runner.server
    if server is None:
        return
    for connection in list(server.connections):
        transport = connection.transport
        if transport is not None:
            transport.abort()


def run_app(
    app: web.Application,
    *,
    host: str | Sequence[str],
    port: int,
    admin: web.Application | None = None,
    admin_host: str | Sequence[str] | None = None,
    admin_port: int = 0,
    backlog: int = BACKLOG,
) -> None:
    """``web.run_app`` for the proxy: ``serve_app`` on a new event loop, returning when it ends.

    Returns normally after a signal, even when a third one abandoned the cleanup.
    """
    with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt):
        asyncio.run(
            serve_app(
                app,
                host=host,
                port=port,
                admin=admin,
                admin_host=admin_host,
                admin_port=admin_port,
                backlog=backlog,
                tune_process=True,
            )
        )


def tune_collector() -> None:
    """What start-up built stays (``gc.freeze``: never walked again); the young generation is
    collected every ``GC_YOUNG_OBJECTS`` objects, each older one every 20 of the one below."""
    gc.collect()  # start-up's own garbage first: what is frozen is never collected
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, 20, 20)
