"""The upstream connection pool: a bodiless answer that announces a body ends at its head."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from proxy.upstream import bodiless_head_end, upstream_session

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
