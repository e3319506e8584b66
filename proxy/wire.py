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
  has its own), the body in one write. ``Accept-Encoding: identity`` is asked for, since the
  relay reads the answer; an encoded answer is relayed as it came, its ``Content-Encoding`` kept.
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

import asyncio
import base64
import math
import re
import ssl
from collections.abc import Callable, Iterable
from typing import Final
from urllib.parse import unquote, urlsplit

from multidict import CIMultiDict, CIMultiDictProxy

MAX_HEAD_BYTES: Final = 64 * 1024
MAX_CHUNK_LINE: Final = 4096
BODILESS_STATUSES: Final = frozenset({204, 304})
_HEX_DIGITS: Final = b"0123456789abcdefABCDEF"
# Anything but a visible character, a space or a tab in a field, or a CR or LF that is not a
# line end: what a lenient reader would let through to the client's answer.
_BAD_HEAD_BYTES: Final = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


# Framing of the body being read.
_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _LENGTH, _UNTIL_CLOSE, _DONE = range(8)


class WireError(Exception):
    """The exchange with the backend failed."""


class WireConnectError(WireError):
    """No connection to the backend could be made (refused, unresolvable, TLS)."""


class WireClosed(WireError):
    """The backend closed (or reset) the connection before the answer ended."""

    def __init__(self, message: str, *, before_answer: bool) -> None:
        super().__init__(message)
        self.before_answer = before_answer  # nothing of an answer had arrived


class WireBadAnswer(WireError):
    """The backend's bytes are not an HTTP/1.1 answer this client reads."""


class WireTimeout(TimeoutError):
    """No byte came from the backend for the idle limit."""


class WireConnectTimeout(TimeoutError):
    """Connecting to the backend took longer than the connect limit."""


class Head:
    """An answer's status line and header fields."""

    __slots__ = ("content_type", "headers", "reason", "status", "version")

    def __init__(self, version: str, status: int, reason: str, headers: CIMultiDict[str]):
        self.version = version
        self.status = status
        self.reason = reason
        self.headers = CIMultiDictProxy(headers)
        raw = headers.get("Content-Type")
        # As aiohttp reads it: the media type, lower case, no parameters.
        self.content_type = (
            raw.partition(";")[0].strip().lower() if raw else "application/octet-stream"
        )


def _parse_head(raw: bytes) -> Head:
    """A head's bytes (up to, not including, the blank line) as a ``Head``."""
    if _BAD_HEAD_BYTES.search(raw) is not None:
        raise WireBadAnswer("control characters or a bare line end in the answer's head")
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code, _, reason = rest.partition(" ")
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or not _digits(code):
        raise WireBadAnswer(f"not an HTTP/1.1 status line: {lines[0][:40]!r}")
    headers: CIMultiDict[str] = CIMultiDict()
    last: str | None = None
    for line in lines[1:]:
        if line[:1] in (" ", "\t"):  # obsolete line folding: part of the field above
            if last is None:
                raise WireBadAnswer("a folded line before any header field")
            values = headers.getall(last)
            headers.popall(last)
            for v in values[:-1]:
                headers.add(last, v)
            headers.add(last, f"{values[-1]} {line.strip()}")
            continue
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            raise WireBadAnswer(f"a header line that is not a field: {line[:40]!r}")
        headers.add(name, value.strip(" \t"))
        last = name
    return Head(version, int(code), reason, headers)


class BackendConnection(asyncio.Protocol):
    """One keep-alive connection to a backend; one exchange at a time."""

    def __init__(self, pool: BackendPool, origin: str) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.closed_here = False  # closed by this side (an answer cut short, not ended)
        self.answering: Answering | None = None
        self.idle_since = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        answering = self.answering
        if answering is None:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        answering.received(data)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self.pool.lost(self)
        answering = self.answering
        if answering is not None:
            answering.lost(exc)

    def close(self) -> None:
        """Close the connection (not reused); reading stops at once."""
        self.closed = self.closed_here = True
        if self.transport is not None:
            self.transport.close()


class Answering:
    """A request sent on a connection and its answer as it arrives.

    ``head()`` waits for the status line and headers. Then either ``read()`` collects the whole
    body, or ``deliver(sink)`` hands each read's payload to ``sink`` as it arrives and ``wait()``
    returns when the body has ended (or raises why it did not). ``release()`` gives the
    connection back to the pool (only a complete answer's) or closes it.
    """

    def __init__(
        self,
        conn: BackendConnection,
        *,
        idle_s: float | None,
        head_request: bool,
        head_by: float = math.inf,
    ):
        self.conn = conn
        self.loop = conn.loop
        self.idle_s = idle_s
        self.head_by = head_by  # (loop time) the head must have come by then
        self.head_request = head_request
        self.state = _HEAD
        self.buf = b""
        self.need = 0  # bytes left in the current chunk or of the Content-Length body
        self.keep_alive = True
        self.got_bytes = False
        self.paused = False
        self._head: Head | None = None
        self._failure: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._parts: list[bytes] = []
        self._sink: Callable[[bytes], None] | None = None
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._arm()

    # -- the caller's side --------------------------------------------------------------

    async def head(self) -> Head:
        while self._head is None:
            await self._wait()
        return self._head

    async def read(self) -> bytes:
        """The whole body (after ``head``)."""
        while self.state != _DONE:
            await self._wait()
        return b"".join(self._parts)

    def deliver(self, sink: Callable[[bytes], None]) -> None:
        """From now on each read's payload goes to ``sink`` (what was read already, at once)."""
        self._sink = sink
        if self._parts:
            parts, self._parts = self._parts, []
            sink(b"".join(parts))

    async def wait(self) -> bool:
        """Wait for the body to end (True) or a wake-up (False: ``wake``); raise a failure."""
        if self.state == _DONE:
            return True
        await self._wait()
        return self.state == _DONE

    def wake(self) -> None:
        """End the caller's ``wait`` early (the sink needs the caller: backpressure, an error)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def pause(self) -> None:
        if self.paused or self.conn.transport is None:
            return
        self.paused = True
        self.conn.transport.pause_reading()
        self._disarm()

    def resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        if self.conn.transport is not None:
            self.conn.transport.resume_reading()
            self._arm()

    @property
    def complete(self) -> bool:
        return self.state == _DONE

    def release(self) -> None:
        """The exchange is over: the connection goes back to the pool, or is closed."""
        self._disarm()
        conn = self.conn
        if conn.answering is self:
            conn.answering = None
        if (
            self.state == _DONE
            and self.keep_alive
            and self._failure is None
            and not self.paused
            and not conn.closed
        ):
            conn.pool.put(conn)
        else:
            conn.close()

    def abort(self) -> None:
        """Give the answer up: the connection is closed at once (the backend sees it); a
        ``wait`` then raises."""
        self._disarm()
        self.keep_alive = False
        if self.conn.answering is self:
            self.conn.answering = None
        self.conn.close()
        if self.state != _DONE and self._failure is None:
            self._failure = WireError("the answer was given up")
        self.wake()

    async def _wait(self) -> None:
        if self._failure is not None:
            raise self._failure
        waiter = self._waiter = self.loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        if self._failure is not None:
            raise self._failure

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._disarm()
        self.keep_alive = False
        self.conn.close()
        self.wake()

    # -- the idle timer: one handle, re-armed lazily (as ``proxy.upstream`` does) ---------

    def _next_deadline(self, now: float) -> float:
        """The idle limit from ``now``, and the head's own deadline until the head has come."""
        deadline = now + self.idle_s if self.idle_s else math.inf
        return min(deadline, self.head_by) if self._head is None else deadline

    def _arm(self) -> None:
        deadline = self._next_deadline(self.loop.time())
        self._deadline = deadline
        if deadline == math.inf:
            self._disarm()
            return
        timer = self._timer
        if timer is None or timer.when() > deadline:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(deadline, self._due)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        if self.state == _DONE or self.paused:
            return
        now = self.loop.time()
        if self._deadline > now:
            if self._deadline != math.inf:
                self._timer = self.loop.call_at(self._deadline, self._due)
            return
        if self._head is None and now >= self.head_by:
            self._fail(WireTimeout("the backend's answer head did not come in time"))
            return
        what = "the answer's head" if self._head is None else "the rest of the answer"
        self._fail(WireTimeout(f"the backend sent nothing for {self.idle_s:g} s ({what})"))

    # -- the connection's side -------------------------------------------------------------

    def lost(self, exc: Exception | None) -> None:
        if self.state == _DONE or self._failure is not None:
            return
        if self.state == _UNTIL_CLOSE and exc is None and not self.conn.closed_here:
            self.state = _DONE  # a body that ends with the connection, ended
            self._disarm()
            self.wake()
            return
        why = f": {exc.__class__.__name__}" if exc is not None else ""
        self._fail(
            WireClosed(f"the backend closed the connection{why}", before_answer=not self.got_bytes)
        )

    def received(self, data: bytes) -> None:
        if self._failure is not None or self.state == _DONE:
            self.conn.close()  # bytes past the end of the answer: not reusable
            return
        self.got_bytes = True
        if self._timer is not None:
            self._deadline = self._next_deadline(self.loop.time())
        try:
            if self.state == _HEAD:
                data = self._read_head(data)
                if self._head is None:
                    return
                self.wake()
                if self.state == _DONE:
                    if data:
                        self.keep_alive = False  # bytes after a bodiless answer
                    self._disarm()
                    return
                if not data:
                    return
            payload = self._decode(data)
        except WireBadAnswer as exc:
            self._fail(exc)
            return
        if payload:
            sink = self._sink
            if sink is not None:
                sink(payload)
            else:
                self._parts.append(payload)
        if self.state == _DONE:
            self._disarm()
            self.wake()

    def _read_head(self, data: bytes) -> bytes:
        """Take the head out of the bytes read so far; what follows it is returned."""
        buf = self.buf + data if self.buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise WireBadAnswer("the answer's head is over 64 KiB")
                self.buf = buf
                return b""
            head = _parse_head(buf[:end])
            buf = buf[end + 4 :]
            if 100 <= head.status < 200:  # an interim answer: the real one follows
                if head.status == 101:
                    raise WireBadAnswer("the backend switched protocols")
                continue
            break
        self.buf = b""
        self._head = head
        if self.head_by != math.inf:
            self._deadline = self._next_deadline(self.loop.time())
            if self._deadline == math.inf:
                self._disarm()
        self._frame(head)
        return buf

    def _frame(self, head: Head) -> None:
        headers = head.headers
        connection = headers.get("Connection", "").lower()
        if head.version == "HTTP/1.0":
            self.keep_alive = "keep-alive" in connection
        elif "close" in connection:
            self.keep_alive = False
        if self.head_request or head.status in BODILESS_STATUSES:
            self.state = _DONE
            if head.status in BODILESS_STATUSES and (
                "Transfer-Encoding" in headers or headers.get("Content-Length", "0").strip() != "0"
            ):
                # A body announced where none can be (llama-server's ``/cors-proxy`` sends
                # ``0\r\n\r\n`` after a 204): whatever follows is not the next answer.
                self.keep_alive = False
            return
        codings = ",".join(headers.getall("Transfer-Encoding", ())).lower()
        if codings:
            if codings.rsplit(",", 1)[-1].strip() == "chunked":
                self.state = _CHUNK_SIZE
            else:
                self.state = _UNTIL_CLOSE
                self.keep_alive = False
            return
        lengths = {v.strip() for v in ",".join(headers.getall("Content-Length", ())).split(",")}
        lengths.discard("")
        if lengths:
            if len(lengths) != 1 or not _digits(length := lengths.pop()):
                raise WireBadAnswer("the answer's Content-Length cannot be read")
            self.need = int(length)
            self.state = _LENGTH if self.need else _DONE
            return
        self.state = _UNTIL_CLOSE
        self.keep_alive = False

    def _decode(self, data: bytes) -> bytes:
        """The payload in ``data`` (the framing taken off); moves the framing state on."""
        state = self.state
        if state == _LENGTH:
            if len(data) < self.need:
                self.need -= len(data)
                return data
            payload, rest = data[: self.need], data[self.need :]
            self.need = 0
            self.state = _DONE
            if rest:
                self.keep_alive = False  # more than the length said
            return payload
        if state == _UNTIL_CLOSE:
            return data
        if state == _DONE:
            if data:
                self.keep_alive = False
            return b""
        return self._dechunk(data)

    def _dechunk(self, data: bytes) -> bytes:
        if self.state == _CHUNK_SIZE and not self.buf:
            # The usual read of a streamed answer: one whole chunk (one token event).
            nl = data.find(b"\r\n")
            if 0 < nl <= 16:
                text = data[:nl]
                if not text.strip(_HEX_DIGITS):
                    size = int(text, 16)
                    if size and len(data) == nl + size + 4 and data.endswith(b"\r\n"):
                        return data[nl + 2 : -2]
        buf = self.buf + data if self.buf else data
        self.buf = b""
        pos, end = 0, len(buf)
        out: list[bytes] = []
        state = self.state
        while pos < end:
            if state == _CHUNK_DATA:
                take = min(self.need, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self.need -= take
                if self.need:
                    break
                state = _CHUNK_END
            elif state == _CHUNK_SIZE:
                nl = _line_end(buf, pos, MAX_CHUNK_LINE, "a chunk size line")
                if nl < 0:
                    break
                text = buf[pos:nl].split(b";", 1)[0].strip(b" \t")
                if not text or text.strip(_HEX_DIGITS) or len(text) > 16:
                    raise WireBadAnswer(f"a bad chunk size: {text[:20]!r}")
                size = int(text, 16)
                pos = nl + 2
                if size == 0:
                    state = _TRAILER
                else:
                    self.need = size
                    state = _CHUNK_DATA
            elif state == _CHUNK_END:
                if end - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise WireBadAnswer("a chunk not followed by CRLF")
                pos += 2
                state = _CHUNK_SIZE
            elif state == _TRAILER:
                nl = _line_end(buf, pos, MAX_HEAD_BYTES, "a trailer line")
                if nl < 0:
                    break
                if nl == pos:  # the blank line: the answer is complete
                    pos += 2
                    state = _DONE
                    if pos < end:
                        self.keep_alive = False
                    pos = end
                    break
                pos = nl + 2
            else:  # _DONE
                break
        self.state = state
        if pos < end:
            self.buf = buf[pos:]
        if not out:
            return b""
        return out[0] if len(out) == 1 else b"".join(out)


def _line_end(buf: bytes, pos: int, limit: int, what: str) -> int:
    """Where the line starting at ``pos`` ends (its CR), or -1 while it may still come whole;
    a line already longer than ``limit`` is a bad answer."""
    nl = buf.find(b"\r\n", pos)
    if nl < 0 and len(buf) - pos > limit:
        raise WireBadAnswer(f"{what} over {limit} bytes")
    return nl


class BackendPool:
    """Keep-alive connections to the backends, by origin; no limit on their number."""

    def __init__(self, *, keepalive_s: float = 30.0) -> None:
        self.keepalive_s = keepalive_s
        self._idle: dict[str, list[BackendConnection]] = {}
        self._all: set[BackendConnection] = set()
        self._origins: dict[str, tuple[str, int, bool, bytes, bytes | None]] = {}
        self._tls: ssl.SSLContext | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    def origin(self, url: str) -> tuple[str, str, bytes, bytes | None]:
        """``url``'s origin key, its request target (path and query), its ``Host`` line and the
        ``Authorization`` line its credentials make (``http://user:password@host``), if any."""
        scheme, sep, rest = url.partition("://")
        if not sep:
            raise WireConnectError(f"not an absolute URL: {url[:80]!r}")
        authority, slash, path = rest.partition("/")
        key = f"{scheme.lower()}://{authority}"
        known = self._origins.get(key)
        if known is None:
            parts = urlsplit(key)
            tls = parts.scheme == "https"
            try:
                port = parts.port or (443 if tls else 80)
            except ValueError as exc:
                raise WireConnectError(f"bad port in {key!r}") from exc
            if not parts.hostname or parts.scheme not in ("http", "https"):
                raise WireConnectError(f"not an http(s) origin: {key!r}")
            host = parts.hostname
            shown = f"[{host}]" if ":" in host else host
            host_header = shown if port == (443 if tls else 80) else f"{shown}:{port}"
            auth = None
            if parts.username is not None:
                pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
                token = base64.b64encode(pair.encode("utf-8")).decode("ascii")
                auth = f"Authorization: Basic {token}\r\n".encode("ascii")
            host_line = f"Host: {host_header}\r\n".encode("latin-1")
            known = (host, port, tls, host_line, auth)
            self._origins[key] = known
        return key, "/" + path if slash else "/", known[3], known[4]

    async def connect(self, key: str, connect_s: float | None) -> BackendConnection:
        """An idle connection to ``key`` (newest first), or a new one."""
        idle = self._idle.get(key)
        if idle:
            oldest = self.loop.time() - self.keepalive_s
            while idle:
                conn = idle.pop()
                if conn.idle_since < oldest:  # this one and all below it have expired
                    conn.close()
                    for stale in idle:
                        stale.close()
                    idle.clear()
                    break
                if not conn.closed:
                    return conn
        return await self.new_connection(key, connect_s)

    async def new_connection(self, key: str, connect_s: float | None) -> BackendConnection:
        if self._closed:
            raise WireConnectError("the proxy is shutting down")
        host, port, tls, _, _ = self._origins[key]
        context: ssl.SSLContext | None = None
        if tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            context = self._tls
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await self.loop.create_connection(
                    lambda: BackendConnection(self, key),
                    host,
                    port,
                    ssl=context,
                    server_hostname=host if tls else None,
                )
        except TimeoutError as exc:
            raise WireConnectTimeout("connecting timed out") from exc
        except (OSError, ssl.SSLError) as exc:
            raise WireConnectError(f"cannot connect: {exc.__class__.__name__}") from exc
        self._all.add(conn)
        return conn

    def put(self, conn: BackendConnection) -> None:
        """``conn`` is idle again, ready for another request to its origin."""
        if self._closed or conn.closed:
            conn.close()
            return
        conn.idle_since = self.loop.time()
        self._idle.setdefault(conn.origin, []).append(conn)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self.keepalive_s, self._close_expired)

    def _close_expired(self) -> None:
        """Close the connections idle for ``keepalive_s``; again later while any are idle."""
        self._sweep = None
        oldest = self.loop.time() - self.keepalive_s
        waiting = False
        for idle in self._idle.values():
            expired = [c for c in idle if c.idle_since <= oldest]
            for conn in expired:
                idle.remove(conn)
                conn.close()
            waiting = waiting or bool(idle)
        if waiting and not self._closed:
            self._sweep = self.loop.call_later(self.keepalive_s / 2, self._close_expired)

    def lost(self, conn: BackendConnection) -> None:
        """``conn`` has closed: it is forgotten."""
        self._all.discard(conn)
        idle = self._idle.get(conn.origin)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        """Close every connection (at shutdown)."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        await asyncio.sleep(0)


def _request_bytes(
    method: str,
    target: str,
    host: bytes,
    headers: Iterable[tuple[str, str]],
    body: bytes | None,
    auth: bytes | None = None,
) -> bytes:
    parts = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), host]
    for name, value in headers:
        if auth is not None and name.lower() == "authorization":
            auth = None  # the request's own credentials win over the URL's
        parts.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
    if auth is not None:
        parts.append(auth)
    parts.append(b"Accept-Encoding: identity\r\n")
    if body is not None or method in ("POST", "PUT", "PATCH"):
        parts.append(b"Content-Length: %d\r\n" % len(body or b""))
    parts.append(b"\r\n")
    if body:
        parts.append(body)
    return b"".join(parts)


async def send(
    pool: BackendPool,
    method: str,
    url: str,
    *,
    headers: Iterable[tuple[str, str]],
    body: bytes | None,
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
    data = _request_bytes(method, target, host, headers, body, auth)
    head_request = method == "HEAD"
    head_by = pool.loop.time() + head_s if head_s else math.inf
    tries = 2
    while True:
        tries -= 1
        if pool.loop.time() >= head_by:
            raise WireTimeout("the backend's answer head did not come in time")
        connect_by = pool.loop.time() + connect_s if connect_s else math.inf
        limit: float | None = min(connect_by, head_by) - pool.loop.time()
        if limit == math.inf:
            limit = None
        try:
            conn = await (pool.connect(key, limit) if tries else pool.new_connection(key, limit))
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
            transport.write(data)
            return answering, await answering.head()
        except WireClosed as exc:
            answering.abort()
            if not (tries and exc.before_answer):
                raise
        except BaseException:
            answering.abort()
            raise
