"""The upstream connection pool: a bodiless answer that announces a body ends at its head."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from proxy.upstream import BodilessAwareHandler, bodiless_head_end, upstream_session

HEAD_204 = b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n\r\n"


def test_bodiless_head_end() -> None:
    """Only a complete bodiless head (204, 304, a HEAD's answer) announcing a body is cut."""
    assert bodiless_head_end(HEAD_204 + b"0\r\n\r\n", head_request=False) == len(HEAD_204)
    sized = b"HTTP/1.1 304 Not Modified\r\nContent-Length: 12\r\n\r\n"
    assert bodiless_head_end(sized, head_request=False) == len(sized)
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"
    assert bodiless_head_end(head, head_request=True) == len(head)
    assert bodiless_head_end(head + b"hello", head_request=False) is None  # a body is due
    assert bodiless_head_end(b"HTTP/1.1 204 No Content\r\n\r\n", head_request=False) is None
    zero = b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"
    assert bodiless_head_end(zero, head_request=False) is None
    assert bodiless_head_end(HEAD_204[:20], head_request=False) is None  # incomplete head
    interim = b"HTTP/1.1 100 Continue\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert bodiless_head_end(interim, head_request=False) is None
    assert bodiless_head_end(b"0\r\n\r\n", head_request=False) is None


async def test_the_pool_reads_what_plain_aiohttp_refuses() -> None:
    """The quirk in one read fails aiohttp's own pool; the proxy's reads it as a 204.

    If a future aiohttp stops building connections from the connector's factory (the one private
    name ``proxy.upstream`` uses), the second half fails.
    """

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(HEAD_204 + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    async with server:
        async with aiohttp.ClientSession() as plain:
            with pytest.raises(aiohttp.ClientResponseError):
                async with plain.get(url) as resp:
                    await resp.read()
        async with upstream_session() as session, session.get(url) as resp:
            assert resp.status == 204 and await resp.read() == b""


def dribbler(
    pieces: int, every_s: float, stall: asyncio.Event | None = None
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    """A server answering with a chunked body: ``pieces`` chunks ``every_s`` apart, then (with
    ``stall``) silence until the event is set, then the end."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(pieces):
                writer.write(b"1\r\nx\r\n")
                await writer.drain()
                await asyncio.sleep(every_s)
            if stall is not None:
                await stall.wait()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    return answer


async def test_the_idle_timeout_moves_with_each_read() -> None:
    """A stream whose reads come faster than ``sock_read`` never times out, however long it
    runs (the one timer re-arms itself for the moved deadline); silence longer than it does, at
    ``sock_read`` after the latest read."""
    due: list[float] = []
    saved = BodilessAwareHandler._read_timer_due

    def spy(self: BodilessAwareHandler) -> None:
        due.append(asyncio.get_running_loop().time())
        saved(self)

    BodilessAwareHandler._read_timer_due = spy  # type: ignore[method-assign]
    try:
        timeout = aiohttp.ClientTimeout(sock_read=0.2)
        server = await asyncio.start_server(dribbler(12, 0.05), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        async with server, upstream_session() as session, session.get(url, timeout=timeout) as r:
            assert await r.read() == b"x" * 12  # 0.6 s in all: three timeouts' worth
        assert due, "aiohttp no longer calls ResponseHandler._reschedule_timeout"
        stall = asyncio.Event()
        server = await asyncio.start_server(dribbler(3, 0.02, stall), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        loop = asyncio.get_running_loop()
        async with server, upstream_session() as session, session.get(url, timeout=timeout) as r:
            chunks, last = 0, loop.time()
            with pytest.raises(aiohttp.SocketTimeoutError):
                async for _ in r.content.iter_any():
                    chunks, last = chunks + 1, loop.time()
            waited = loop.time() - last
            stall.set()
            await asyncio.sleep(0.05)  # the server's handler ends and closes its side
        assert chunks >= 1
        assert 0.18 <= waited < 0.5
    finally:
        BodilessAwareHandler._read_timer_due = saved  # type: ignore[method-assign]
