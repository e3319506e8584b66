"""One HTTP/1.1 exchange as bytes: the request written, the answer read as its bytes arrive.

Pure: no sockets, no clock. ``AnswerReader`` is fed the reads of one answer and gives back the
payload each carries, with the framing (RFC 9112 §6: none, chunked, ``Content-Length``, until
the connection closes) taken off; ``Head`` is the status line and header fields it read first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy

from proxy.wire.errors import WireBadAnswer

MAX_HEAD_BYTES: Final = 64 * 1024
MAX_CHUNK_LINE: Final = 4096
BODILESS_STATUSES: Final = frozenset({204, 304})
_HEX_DIGITS: Final = b"0123456789abcdefABCDEF"
# Anything but a visible character, a space or a tab in a field, or a CR or LF that is not a
# line end: what a lenient reader would let through to the client's answer.
_BAD_HEAD_BYTES: Final = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]|\r(?!\n)|(?<!\r)\n")

# Where the reader is in the answer.
_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _LENGTH, _UNTIL_CLOSE, _DONE = range(8)


def _digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


class Head:
    """An answer's status line and header fields."""

    __slots__ = ("content_type", "headers", "status", "version")

    def __init__(self, version: str, status: int, headers: CIMultiDict[str]):
        self.version = version
        self.status = status
        self.headers = CIMultiDictProxy(headers)
        raw = headers.get("Content-Type")
        # As aiohttp reads it: the media type, lower case, no parameters.
        self.content_type = (
            raw.partition(";")[0].strip().lower() if raw else "application/octet-stream"
        )


def parse_head(raw: bytes) -> Head:
    """A head's bytes (up to, not including, the blank line) as a ``Head``."""
    if _BAD_HEAD_BYTES.search(raw) is not None:
        raise WireBadAnswer("control characters or a bare line end in the answer's head")
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest.partition(" ")[0]
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
    return Head(version, int(code), headers)


class AnswerReader:
    """One answer as its reads arrive: its head, then its body's payload (``feed``)."""

    __slots__ = ("buf", "head", "head_request", "keep_alive", "need", "state")

    def __init__(self, *, head_request: bool = False) -> None:
        self.head_request = head_request  # the answer to a HEAD: no body, whatever it says
        self.head: Head | None = None
        self.state = _HEAD
        self.buf = b""  # an unfinished line (or head) carried to the next read
        self.need = 0  # bytes left in the current chunk or of the Content-Length body
        self.keep_alive = True  # whether the connection may carry another exchange after it

    @property
    def done(self) -> bool:
        return self.state == _DONE

    def feed(self, data: bytes) -> bytes:
        """The payload in ``data``, the next read of the answer (``b""`` while the head is not
        complete); ``WireBadAnswer`` when the bytes are not an answer."""
        if self.head is None:
            data = self._read_head(data)
            if self.head is None or not data:
                return b""
        return self._decode(data)

    def ended_by_close(self) -> bool:
        """The connection closed: whether that ends the answer (a body read until it closes)."""
        if self.state != _UNTIL_CLOSE:
            return False
        self.state = _DONE
        return True

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
            head = parse_head(buf[:end])
            buf = buf[end + 4 :]
            if 100 <= head.status < 200:  # an interim answer: the real one follows
                if head.status == 101:
                    raise WireBadAnswer("the backend switched protocols")
                continue
            break
        self.buf = b""
        self.head = head
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
            out, pos, complete = _whole_chunks(data)
            if complete:
                self.state = _DONE
            if complete or pos == len(data):
                return out[0] if len(out) == 1 else b"".join(out)
            buf = data  # the rest from ``pos``, as the general reader takes it
        else:
            buf = self.buf + data if self.buf else data
            pos, out = 0, []
        self.buf = b""
        end = len(buf)
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


def _whole_chunks(data: bytes) -> tuple[list[bytes], int, bool]:
    """The leading whole chunks of ``data`` with bare hex size lines (a backend's reads under
    load: several token events each), read at a chunk's start: their payloads, where they
    end, and whether the last chunk (with no trailer) ended the body there. The general
    reader takes what is left from that position: the same bytes, in fewer steps."""
    out: list[bytes] = []
    pos, end, find = 0, len(data), data.find
    while pos < end:
        nl = find(b"\r\n", pos, pos + 18)
        if nl <= pos:
            break
        text = data[pos:nl]
        if text.strip(_HEX_DIGITS):
            break
        size = int(text, 16)
        start = nl + 2
        if not size:  # the last chunk: the body ends here, unless trailers or more follow
            if end - start == 2 and data[start:] == b"\r\n":
                return out, end, True
            break
        stop = start + size
        if data[stop : stop + 2] != b"\r\n":
            break
        out.append(data[start:stop])
        pos = stop + 2
    return out, pos, False


def _line_end(buf: bytes, pos: int, limit: int, what: str) -> int:
    """Where the line starting at ``pos`` ends (its CR), or -1 while it may still come whole;
    a line already longer than ``limit`` is a bad answer."""
    nl = buf.find(b"\r\n", pos)
    if nl < 0 and len(buf) - pos > limit:
        raise WireBadAnswer(f"{what} over {limit} bytes")
    return nl


Body = bytes | bytearray | memoryview | tuple[bytes | bytearray | memoryview, ...]
"""A request body: bytes, or parts sent one after another (a large client body with the proxy's
fields appended: never joined into a copy of it)."""

JOIN_BELOW: Final = 64 * 1024
"""A body shorter than this goes in the same write as the head (one write, one segment); a
longer one is written after it as it is, without a copy that joins it to the head (at 512 KB
each copy is a fresh allocation's page faults, a quarter of a millisecond)."""


def request_bytes(
    method: str,
    target: str,
    host: bytes,
    headers: Iterable[tuple[str, str]],
    body: Body | None,
    auth: bytes | None = None,
) -> list[bytes | bytearray | memoryview]:
    """A request's writes: its line, ``Host``, the headers given (credentials from the URL,
    ``auth``, unless they include their own), identity encoding asked for, the length; the body
    in the same write when it is short (``JOIN_BELOW``), else in writes of its own after it."""
    parts: list[bytes | bytearray | memoryview] = [
        f"{method} {target} HTTP/1.1\r\n".encode("latin-1"),
        host,
    ]
    for name, value in headers:
        if auth is not None and name.lower() == "authorization":
            auth = None  # the request's own credentials win over the URL's
        parts.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
    if auth is not None:
        parts.append(auth)
    parts.append(b"Accept-Encoding: identity\r\n")
    sized = [(p, memoryview(p).nbytes) for p in _pieces(body)]
    pieces = [p for p, n in sized if n]
    length = sum(n for _, n in sized)
    if body is not None or method in ("POST", "PUT", "PATCH"):
        parts.append(b"Content-Length: %d\r\n" % length)
    parts.append(b"\r\n")
    if length < JOIN_BELOW:
        return [b"".join((*parts, *pieces))]
    return [b"".join(parts), *pieces]


def _pieces(body: Body | None) -> tuple[bytes | bytearray | memoryview, ...]:
    if body is None:
        return ()
    return (body,) if isinstance(body, bytes | bytearray | memoryview) else body
