"""A streamed answer relayed read by read, and the proxy's writes to its clients.

Each read of the backend's answer reaches ``_StreamRelay.feed`` inside the connection's own
callback (``proxy.wire``'s ``Answering.deliver``): its events are looked at (``StreamInspector``:
token times, usage, the usage-only event the client did not ask for removed) and written to the
client's transport there and then, framed as a chunk (the first write carries the response's
head when the backend's first events came with its own: one segment, as from the backend).
``relay_stream``'s coroutine wakes only when the answer ends or fails, when the client falls
behind (reading from the backend pauses until the client's socket drains, within the client
send deadline) or has gone (the backend's connection is closed so it frees its slot). A backend
failure after the head ends the stream with an SSE error event.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from proxy import wire
from proxy.backends.apis import MESSAGES
from proxy.errors import (
    BackendTimeout,
    BackendUnavailable,
    ProxyError,
    anthropic_sse_error_event,
    sse_error_event,
)
from proxy.exchange import Exchange
from proxy.headers import downstream_response_headers
from proxy.log import get_logger
from proxy.records import monotonic
from proxy.sse import EventSplitter
from proxy.stream_inspect import StreamInspector
from proxy.wire import Answering, Head

log = get_logger()

READ_AFTER_WRITE_S = 0.001
"""How long after a read up to the first token (``_StreamRelay``) is written to the client it is
read: its events parsed, the token timed at the read's own time, the first-token hook called.
Not at once: a client on the same cores is woken by the write and would wait for that work
before it reads the token (at one stream, a tenth of a millisecond of its time to first token)."""

CLIENT_CLOSED = 499  # nginx's convention: the client went away before the response ended


async def relay_stream(
    request: web.Request, answering: Answering, head: Head, ex: Exchange
) -> web.StreamResponse:
    resp = _HeldHeadResponse(
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
    relay.head = _take_head(writer)
    failure: ProxyError | None = None
    limit = ex.send_timeout_s
    try:
        # What came with the head is fed at once, here: its first write carries the head.
        answering.deliver(relay.feed)
        relay.send_head()  # (nothing came with it: the head goes alone, as it did from the backend)
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
        relay.read_unread()  # (a failure of its own ends the stream as one inside a read)
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
    finally:
        relay.send_head()  # (however the relay ends, the head is out before anything else)
        relay.read_unread(report=True)  # however the relay ends, nothing is left unread
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
    end, started = b"".join(tail), relay.body_started
    if not await write_to_client(request, resp, end, limit, body_started=started, eof=True):
        _client_gone(ex, answering)
        return resp
    ex.obs.t_end = monotonic()
    return resp


class _HeldHeadResponse(web.StreamResponse):
    """A streamed response whose head ``prepare`` serializes but does not send: it goes out
    with the first bytes of the body (``_take_head``), in one write, as it came from the
    backend, so the client reads the head and the first event together."""

    _send_headers_immediately = False


def _take_head(writer: AbstractStreamWriter) -> bytes | None:
    """The head ``prepare`` left unsent (``_HeldHeadResponse``), taken over from the writer;
    None when it has gone out already (or this aiohttp keeps it elsewhere, and sends it)."""
    held = getattr(writer, "_headers_buf", None)
    if not held or getattr(writer, "_headers_written", True) is not False:
        send = getattr(writer, "send_headers", None)
        if send is not None:
            send()  # (a no-op once sent)
        return None
    writer._headers_buf = None  # type: ignore[attr-defined]
    writer._headers_written = True  # type: ignore[attr-defined]
    # Counted as sent (it goes out within this step, or as the relay ends): a failure from
    # here on closes the connection rather than answering a 500 after it.
    writer.output_size += len(held)
    return bytes(held)


class _StreamRelay:
    """A streamed answer's reads, as the connection hands them over (``Answering.deliver``):
    each is inspected and written to the client at once, inside the read's own callback. What
    needs the relay's coroutine (the client fell behind, went away, an error) wakes it.

    Up to the first visible token, a read the inspector would forward as it came
    (``StreamInspector.forwardable``) is written first and read after it: at once, or, the one
    that carries the first token, ``READ_AFTER_WRITE_S`` later, before the next read, or when
    the answer ends, whichever comes first (``read_unread``)."""

    __slots__ = (
        "answering",
        "body_started",
        "chunked",
        "error",
        "ex",
        "gone",
        "head",
        "high",
        "inspector",
        "last",
        "obs",
        "splitter",
        "timer",
        "transport",
        "unread",
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
        self.head: bytes | None = None
        """The response's head, until it goes out with the first write (``send_head``)."""
        self.gone = False
        self.error: BaseException | None = None
        self.unread: tuple[bytes, float] | None = None
        """A read written but not read yet, and its time (``READ_AFTER_WRITE_S``)."""
        self.timer: asyncio.TimerHandle | None = None
        self.last: list[bytes] = []
        """What the read that ended the answer leaves to send: it goes out with the end of the
        body, in one write (the relay's coroutine is woken by that read at once)."""

    def feed(self, chunk: bytes) -> None:
        if self.gone or self.error is not None:
            return
        try:
            if self.unread is not None:  # read in the order they came
                self._read_unread()
            self._feed(chunk)
        except Exception as exc:  # handed to the relay's coroutine, which raises it
            self.error = exc
            self.answering.abort()
            self.answering.wake()

    def _feed(self, chunk: bytes) -> None:
        splitter, inspector, obs = self.splitter, self.inspector, self.obs
        now = monotonic()
        if not splitter.pending and inspector.plain_chunk(chunk, now):
            data = chunk  # the usual read once the answer is under way: one token event
        elif obs.t_first_visible is None and not splitter.pending and inspector.forwardable(chunk):
            data = chunk  # goes out as it came, read after (the class docstring)
            self.unread = (chunk, now)
        else:
            data = _inspect(splitter, inspector, chunk, now)
        obs.inspect_s += monotonic() - now
        if data and self.answering.complete:
            self.last.append(data)
        elif data:
            transport = self.transport
            if transport.is_closing():  # (a read left unread is read as the relay ends)
                self.gone = True
                self.answering.abort()
                self.answering.wake()
                return
            framed = b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data
            if self.head is not None:
                framed, self.head = self.head + framed, None
            transport.write(framed)
            self.body_started = True
            if transport.get_write_buffer_size() > self.high:
                self.answering.pause()
                self.answering.wake()
            if self.unread is not None and obs.t_first_token is None:
                loop = asyncio.get_running_loop()
                self.timer = loop.call_later(READ_AFTER_WRITE_S, self.read_unread)
                return
        if self.unread is not None:
            self._read_unread()

    def send_head(self) -> None:
        """Write the head if no write has carried it yet (a closing transport drops it)."""
        head, self.head = self.head, None
        if head is not None and not self.transport.is_closing():
            self.transport.write(head)

    def read_unread(self, *, report: bool = False) -> None:
        """Read the read left unread, if any (``READ_AFTER_WRITE_S``); a failure is handed to
        the relay's coroutine, as one inside a read is (``report``: and logged here, where the
        coroutine is past looking)."""
        if self.unread is None:
            return
        try:
            self._read_unread()
        except Exception as exc:
            if report:
                log.error("relay_failed", exc_info=exc)
            self.error = exc
            self.answering.abort()
            self.answering.wake()

    def _read_unread(self) -> None:
        unread, self.unread = self.unread, None
        assert unread is not None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        chunk, now = unread
        t0 = monotonic()
        # (``forwardable``: the splitter cuts it exactly, as it came, and keeps nothing)
        self.inspector.read_forwarded(list(self.splitter.feed(chunk)), now)
        self.obs.inspect_s += monotonic() - t0


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


async def write_to_client(
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
