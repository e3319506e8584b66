"""``read_body``: a body already buffered whole is taken at once, within the same limit."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from aiohttp import streams
from aiohttp.test_utils import make_mocked_request

from proxy.errors import PayloadTooLarge
from proxy.validation import read_body


def _request(pieces: list[bytes], *, eof: bool, length: int | None = None) -> object:
    """A request whose body reader holds ``pieces`` (and its end, with ``eof``)."""
    protocol = mock.Mock(_reading_paused=False)
    reader = streams.StreamReader(protocol, 2**16, loop=asyncio.get_running_loop())
    for piece in pieces:
        reader.feed_data(piece)
    if eof:
        reader.feed_eof()
    headers = {"Content-Type": "application/json"}
    if length is not None:
        headers["Content-Length"] = str(length)
    else:
        headers["Transfer-Encoding"] = "chunked"
    return make_mocked_request("POST", "/v1/chat/completions", headers=headers, payload=reader)


async def test_buffered_body_is_read_whole() -> None:
    """Every piece that arrived with the head, joined in order; no wait."""
    pieces = [b'{"messages": ', b'[{"role": "user", ', b'"content": "hi"}]}']
    request = _request(pieces, eof=True)
    assert await read_body(request, 1024, idle_s=0.01) == b"".join(pieces)  # type: ignore[arg-type]


async def test_buffered_body_over_the_limit_is_413() -> None:
    """A chunked body (no length announced) over the limit, all of it buffered: 413."""
    request = _request([b"x" * 600, b"y" * 600], eof=True)
    with pytest.raises(PayloadTooLarge):
        await read_body(request, 1000)  # type: ignore[arg-type]


async def test_body_still_arriving_is_read_as_it_comes() -> None:
    """A body whose end has not arrived is read piece by piece, as before."""
    request = _request([b'{"messages": []'], eof=False)

    async def finish() -> None:
        await asyncio.sleep(0.01)
        request.content.feed_data(b"}")  # type: ignore[attr-defined]
        request.content.feed_eof()  # type: ignore[attr-defined]

    task = asyncio.create_task(finish())
    assert await read_body(request, 1024, idle_s=1.0) == b'{"messages": []}'  # type: ignore[arg-type]
    await task


async def test_empty_body() -> None:
    """No body at all: empty bytes (``parse_object`` then refuses it)."""
    request = _request([], eof=True, length=0)
    assert await read_body(request, 1024) == b""  # type: ignore[arg-type]
