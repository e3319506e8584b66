"""Bodiless answers (204, 304, HEAD) pass through as the backend sent them, odd ones included.

The backend here is a raw socket, so it can send what an aiohttp fake would refuse to: a
``204`` with ``Transfer-Encoding: chunked`` and a ``0\\r\\n\\r\\n`` body, as llama-server's
``/cors-proxy`` does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from fakes import MakeProxy
from structlog.testing import LogCapture

CORS_204 = (
    b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\n"
    b"Access-Control-Allow-Origin: *\r\n\r\n0\r\n\r\n"
)
ANSWERS = {
    b"GET /cors-proxy": CORS_204,
    b"GET /plain-204": b"HTTP/1.1 204 No Content\r\nX-Kind: plain\r\n\r\n",
    b"GET /cached": (b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\nContent-Length: 10\r\n\r\n'),
    b"HEAD /file": (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 1234\r\n\r\n"),
    b"GET /garbage": b"NOT-HTTP nonsense\r\n\r\n",
    b"HEAD /chunked-file": (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n"
    ),
}
OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"data":[]}'


class RawBackend:
    """A keep-alive HTTP/1.1 server on a raw socket that answers each request with fixed bytes."""

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line = head.split(b"\r\n", 1)[0]
                self.requests.append(line)
                key = b" ".join(line.split(b" ")[:2])
                writer.write(ANSWERS.get(key, OK))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def raw_backend() -> AsyncIterator[RawBackend]:
    backend = RawBackend()
    server = await asyncio.start_server(backend.handle, "127.0.0.1", 0)
    backend.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield backend


def _ejections(cap: LogCapture) -> list[dict[str, object]]:
    return [e for e in cap.entries if e["event"] == "backend_ejected"]


async def test_chunked_204_is_relayed_and_ejects_nothing(
    raw_backend: RawBackend, make_proxy: MakeProxy, log_capture: LogCapture
) -> None:
    """llama-server's 204 with a chunked ``0`` body reaches the client as a 204, every time."""
    client, _, _ = await make_proxy(raw_backend.url, dialect="openai")
    for _ in range(3):  # on the same pooled connection and on new ones
        async with client.get("/cors-proxy") as resp:
            assert resp.status == 204
            assert await resp.read() == b""
            assert resp.headers["Access-Control-Allow-Origin"] == "*"
            assert "Transfer-Encoding" not in resp.headers
        async with client.get("/v1/models") as resp:
            assert resp.status == 200
    assert _ejections(log_capture) == []
    async with client.admin.get("/readyz") as resp:
        assert resp.status == 200


async def test_bodiless_answers_keep_their_headers(
    raw_backend: RawBackend, make_proxy: MakeProxy
) -> None:
    """A plain 204, a 304 and HEAD answers keep their status and headers, Content-Length too."""
    client, _, _ = await make_proxy(raw_backend.url, dialect="openai")
    async with client.get("/plain-204") as resp:
        assert resp.status == 204 and resp.headers["X-Kind"] == "plain"
        assert await resp.read() == b""
    async with client.get("/cached") as resp:
        assert resp.status == 304 and resp.headers["ETag"] == '"v1"'
        assert await resp.read() == b""
    async with client.head("/file") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Length"] == "1234"
        assert resp.headers["Content-Type"].startswith("text/plain")
    async with client.head("/chunked-file") as resp:
        assert resp.status == 200
    async with client.get("/v1/models") as resp:
        assert resp.status == 200


async def test_unreadable_answer_is_a_502_that_ejects_nothing(
    raw_backend: RawBackend, make_proxy: MakeProxy, log_capture: LogCapture
) -> None:
    """Bytes that are not HTTP get the client a 502 ``backend_bad_answer``; the replica stays."""
    client, _, _ = await make_proxy(raw_backend.url, dialect="openai")
    for _ in range(3):
        async with client.get("/garbage") as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["code"] == "backend_bad_answer"
    assert _ejections(log_capture) == []
    async with client.admin.get("/readyz") as resp:
        assert resp.status == 200
