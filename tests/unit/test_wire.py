"""The inference path's HTTP/1.1 client (``proxy.wire``) against scripted raw servers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy import wire
from proxy.wire import Answering, BackendPool, Head
from proxy.wire.answering import _copy

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One request off the connection: its head and its body (by Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head, await reader.readexactly(length)


@asynccontextmanager
async def server(script: Script) -> AsyncIterator[tuple[str, list[int]]]:
    """A server on a free port running ``script`` per connection; yields its URL and a list
    that counts the connections it accepted."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await script(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        srv.close()


def answering_each(*answers: bytes, keep_open: bool = True) -> Script:
    """A script that reads a request and writes the next of ``answers``, for each request."""

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await read_request(reader)
            writer.write(answer)
            await writer.drain()
        if keep_open:
            await reader.read()

    return script


async def exchange(
    pool: BackendPool, url: str, *, body: bytes = b"{}", idle_s: float | None = 5.0
) -> tuple[Answering, Head]:
    return await wire.send(
        pool,
        "POST",
        url + "/v1/chat/completions",
        headers=[("Content-Type", "application/json")],
        body=body,
        connect_s=5.0,
        idle_s=idle_s,
    )


def chunked(*parts: bytes, trailer: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts) + b"0\r\n" + trailer + b"\r\n"


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


async def test_a_streamed_answer_is_delivered_read_by_read_and_the_connection_is_reused() -> None:
    events = [b'data: {"n": %d}\n\n' % i for i in range(3)]
    answer = SSE_HEAD + chunked(*events)
    async with server(answering_each(answer, answer)) as (url, accepted):
        pool = BackendPool()
        for _ in range(2):
            answering, head = await exchange(pool, url)
            assert (head.status, head.content_type) == (200, "text/event-stream")
            got: list[bytes] = []
            answering.deliver(got.append)
            while not await answering.wait():
                pass
            answering.release()
            assert b"".join(got) == b"".join(events)
        assert len(accepted) == 1
        await pool.close()


async def test_the_request_carries_host_length_identity_and_the_headers_given() -> None:
    seen: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, body = await read_request(reader)
        seen.extend([head, body])
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async with server(script) as (url, _):
        pool = BackendPool()
        answering, _ = await exchange(pool, url, body=b'{"a": 1}')
        assert await answering.read() == b"ok"
        answering.release()
        await pool.close()
    request_head, body = seen
    lines = request_head.decode().split("\r\n")
    assert lines[0] == "POST /v1/chat/completions HTTP/1.1"
    port = url.rsplit(":", 1)[1]
    assert f"Host: 127.0.0.1:{port}" in lines
    assert "Content-Type: application/json" in lines
    assert "Accept-Encoding: identity" in lines
    assert "Content-Length: 8" in lines
    assert body == b'{"a": 1}'


@pytest.mark.parametrize("size", [10, wire.JOIN_BELOW - 100, wire.JOIN_BELOW, 600_000])
async def test_a_body_in_parts_arrives_whole_with_its_length(size: int) -> None:
    """A client body with the proxy's fields appended as a second part (``wire.Body``): the
    backend reads one body, the parts in order, under one ``Content-Length``, short or long."""
    seen: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.extend(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    raw = b'{"messages": "' + b"x" * size + b'"}'
    body = (memoryview(raw)[:-1], b',"id_slot":1}')
    async with server(script) as (url, _):
        pool = BackendPool()
        answering, _ = await wire.send(
            pool,
            "POST",
            url + "/v1/chat/completions",
            headers=[],
            body=body,
            connect_s=5.0,
            idle_s=5.0,
        )
        assert await answering.read() == b"ok"
        answering.release()
        await pool.close()
    head, received = seen
    assert received == raw[:-1] + b',"id_slot":1}'
    assert f"Content-Length: {len(received)}".encode() in head


def test_a_long_body_is_written_after_the_head_as_it_is() -> None:
    """Short: head and body in one write. Long: the head, then each part itself (the client's
    bytes not copied); empty parts are not written."""
    short = wire.request_bytes("POST", "/x", b"Host: h\r\n", [], (b"{", memoryview(b"}")))
    assert short == [
        b"POST /x HTTP/1.1\r\nHost: h\r\nAccept-Encoding: identity\r\nContent-Length: 2\r\n\r\n{}"
    ]
    raw = b"{" + b" " * wire.JOIN_BELOW + b"}"
    view = memoryview(raw)[:-1]
    writes = wire.request_bytes("POST", "/x", b"Host: h\r\n", [], (view, b"", b"}"))
    assert len(writes) == 3 and writes[1] is view and writes[2] == b"}"
    assert bytes(writes[0]).endswith(b"Content-Length: %d\r\n\r\n" % len(raw))
    whole = wire.request_bytes("POST", "/x", b"Host: h\r\n", [], raw)
    assert len(whole) == 2 and whole[1] is raw
    mutable = bytearray(raw)  # a buffer of any kind is one part, its length its bytes
    assert wire.request_bytes("POST", "/x", b"Host: h\r\n", [], mutable)[1] is mutable
    wide = memoryview(bytes(80_000)).cast("Q")  # 10,000 items of 8 bytes
    head = wire.request_bytes("POST", "/x", b"Host: h\r\n", [], wide)[0]
    assert b"Content-Length: 80000\r\n" in bytes(head)


@pytest.mark.parametrize(
    "failure",
    [
        wire.WireError("e"),
        wire.WireClosed("closed", before_answer=True),
        wire.WireBadAnswer("bad"),
        wire.WireTimeout("slow"),
        wire.WireTimeout(110, "timed out"),
        wire.WireConnectTimeout("connect"),
    ],
    ids=repr,
)
def test_a_failure_is_raised_as_a_copy_without_its_traceback(failure: BaseException) -> None:
    """What ``Answering`` raises is the failure it keeps, copied: same type, message and
    attributes, and no traceback on the kept one (the raise's frames hold the answer)."""
    try:
        raise failure
    except BaseException as exc:  # the kept one had been raised once: its traceback dropped
        kept = exc.with_traceback(None)
    clone = _copy(kept)
    assert type(clone) is type(kept) and clone is not kept
    assert (clone.args, str(clone), clone.__dict__) == (kept.args, str(kept), kept.__dict__)
    if isinstance(kept, OSError):
        assert (clone.errno, clone.strerror) == (kept.errno, kept.strerror)
    assert kept.__traceback__ is None and clone.__traceback__ is None


@pytest.mark.parametrize(
    ("answer", "payload", "reusable"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", b"", True),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b"", True),
        (b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", b"", False),
        (
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
            b"ok",
            True,
        ),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", b"ok", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok", False),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked(b"ab", b"c", trailer=b"X-T: 1\r\n"),
            b"abc",
            True,
        ),
    ],
)
async def test_body_framings(answer: bytes, payload: bytes, reusable: bool) -> None:
    async with server(answering_each(answer, answer)) as (url, accepted):
        pool = BackendPool()
        for _ in range(2):
            answering, _ = await exchange(pool, url)
            assert await answering.read() == payload
            answering.release()
        assert len(accepted) == (1 if reusable else 2)
        await pool.close()


async def test_a_body_that_ends_with_the_connection() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil close"

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()

    async with server(script) as (url, _):
        pool = BackendPool()
        answering, head = await exchange(pool, url)
        assert head.content_type == "text/plain"
        assert await answering.read() == b"until close"
        answering.release()
        await pool.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTP/1.1 200 OK\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nokXX0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: a\nb\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (70 * 1024),
    ],
)
async def test_unreadable_answers_are_bad_answers(answer: bytes) -> None:
    async with server(answering_each(answer)) as (url, _):
        pool = BackendPool()
        with pytest.raises(wire.WireBadAnswer):
            answering, _ = await exchange(pool, url)
            try:
                await answering.read()
            finally:
                answering.release()
        await pool.close()


async def test_a_kept_alive_connection_the_backend_closed_is_replaced() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    # Each connection answers one request, then closes (as a backend closing idle ones).
    async with server(answering_each(answer, keep_open=False)) as (url, accepted):
        pool = BackendPool()
        for _ in range(3):
            answering, _ = await exchange(pool, url)
            assert await answering.read() == b"ok"
            answering.release()
            await asyncio.sleep(0.05)  # the close arrives while the connection is idle
        assert len(accepted) == 3
        await pool.close()


async def test_a_connection_dropped_before_the_answer_is_sent_once_more() -> None:
    drops = [2]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if drops[0]:
            drops[0] -= 1
            return  # closed without a byte
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await reader.read()

    async with server(script) as (url, accepted):
        pool = BackendPool()
        with pytest.raises(wire.WireClosed) as failed:
            await exchange(pool, url)
        assert failed.value.before_answer
        assert len(accepted) == 2  # the first try and the one more
        answering, _ = await exchange(pool, url)
        assert await answering.read() == b"ok"
        answering.release()
        await pool.close()


async def test_refused_connections_fail_to_connect() -> None:
    async with server(answering_each()) as (url, _):
        pass  # closed: nothing listens there now
    pool = BackendPool()
    with pytest.raises(wire.WireConnectError):
        await exchange(pool, url)
    await pool.close()


async def test_a_backend_silent_for_the_idle_limit_times_out_and_not_while_paused() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + b"5\r\nfirst\r\n")
        await writer.drain()
        await reader.read()

    async with server(script) as (url, _):
        pool = BackendPool()
        answering, _ = await exchange(pool, url, idle_s=0.2)
        got: list[bytes] = []
        answering.deliver(got.append)
        answering.pause()
        await asyncio.sleep(0.4)  # paused: the client is behind, not the backend
        assert not answering.complete
        answering.resume()
        with pytest.raises(wire.WireTimeout):
            while not await answering.wait():
                pass
        assert got == [b"first"]
        answering.release()
        await pool.close()


async def test_the_backend_closing_mid_body_is_reported() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD + b"5\r\nfirst\r\n")
        await writer.drain()

    async with server(script) as (url, _):
        pool = BackendPool()
        answering, _ = await exchange(pool, url)
        with pytest.raises(wire.WireClosed) as failed:
            await answering.read()
        assert not failed.value.before_answer
        answering.release()
        await pool.close()


async def test_idle_connections_are_closed_after_the_keepalive() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    closed = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        await reader.read()  # until the client closes
        closed.set()

    async with server(script) as (url, _):
        pool = BackendPool(keepalive_s=0.1)
        answering, _ = await exchange(pool, url)
        await answering.read()
        answering.release()
        await asyncio.wait_for(closed.wait(), 2)
        await pool.close()


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=1, max_value=400), max_size=8),
    extension=st.sampled_from([b"", b";ext=1"]),
    size_form=st.sampled_from([b"%x", b"%X", b"00%x"]),
    per_read=st.integers(min_value=0, max_value=3),
    trailer=st.booleans(),
    extra=st.sampled_from([b"", b"HTTP/1.1 200 OK\r\n"]),
)
def test_chunked_bodies_decode_the_same_however_the_reads_are_cut(
    parts: list[bytes],
    cuts: list[int],
    extension: bytes,
    size_form: bytes,
    per_read: int,
    trailer: bool,
    extra: bytes,
) -> None:
    """Whatever the reads: cut anywhere, one whole chunk each (a streaming backend's token
    events), or several (the same under load, the last chunk included), and then cut once
    more inside; size lines in either case, with leading zeros, with or without extensions;
    with or without trailers; bytes after the body, read with its end or after it, make the
    connection one not to reuse."""
    frames = [size_form % len(p) + extension + b"\r\n" + p + b"\r\n" for p in parts]
    frames.append(b"0\r\nX-Trailer: t\r\n\r\n" if trailer else b"0\r\n\r\n")
    raw = SSE_HEAD + b"".join(frames) + extra
    if per_read:  # whole chunks, ``per_read`` of them a read, and one cut of ``cuts`` besides
        whole, pos = cuts[:1], len(SSE_HEAD)
        for i, frame in enumerate(frames):
            if i % per_read == 0:
                whole.append(pos)
            pos += len(frame)
        cuts = whole

    class Conn:  # what Answering touches of its connection, without a socket
        loop = asyncio.new_event_loop()
        transport = None
        closed = False

        def close(self) -> None:
            self.closed = True

    conn = Conn()
    try:
        answering = Answering(conn, idle_s=None, head_request=False)  # type: ignore[arg-type]
        got: list[bytes] = []
        answering.deliver(got.append)
        pos = 0
        for cut in sorted(set(cuts)):
            if cut < len(raw):
                answering.received(raw[pos:cut])
                pos = cut
        answering.received(raw[pos:])
        assert answering.complete
        # Bytes after the body, in its last read or in a read of their own: not reused.
        assert (answering.keep_alive and not conn.closed) == (not extra)
        assert b"".join(got) == b"".join(parts)
    finally:
        conn.loop.close()


@pytest.mark.parametrize("own", [False, True])
async def test_credentials_in_the_backend_url_are_sent_unless_the_request_has_its_own(
    own: bool,
) -> None:
    seen: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head, _ = await read_request(reader)
        seen.append(head)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async with server(script) as (url, _):
        pool = BackendPool()
        headers = [("Authorization", "Bearer mine")] if own else []
        answering, _ = await wire.send(
            pool,
            "POST",
            url.replace("http://", "http://us%40er:p%3Ass@") + "/x",
            headers=headers,
            body=b"{}",
            connect_s=5.0,
            idle_s=5.0,
        )
        await answering.read()
        answering.release()
        await pool.close()
    lines = seen[0].decode().split("\r\n")
    auth = [line for line in lines if line.lower().startswith("authorization:")]
    # base64 of "us@er:p:ss"
    assert auth == (
        ["Authorization: Bearer mine"] if own else ["Authorization: Basic dXNAZXI6cDpzcw=="]
    )
    assert not any(
        "us%40er" in line or "us@er" in line for line in lines if line.startswith("Host")
    )


async def test_a_body_ending_with_the_connection_is_cut_short_when_this_side_closes() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npart")
        await writer.drain()
        await reader.read()

    async with server(script) as (url, _):
        pool = BackendPool()
        answering, _ = await exchange(pool, url)
        await asyncio.sleep(0.05)
        await pool.close()  # shutting down while the answer is being read
        with pytest.raises(wire.WireError):
            await answering.read()
        answering.release()


async def test_a_given_up_answer_fails_its_wait() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(SSE_HEAD)
        await writer.drain()
        await reader.read()

    async with server(script) as (url, _):
        pool = BackendPool()
        answering, _ = await exchange(pool, url)
        answering.abort()
        with pytest.raises(wire.WireError):
            await asyncio.wait_for(answering.wait(), 2)
        await pool.close()
