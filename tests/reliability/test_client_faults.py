"""Client faults: stops reading, disconnects, sends its body slowly or never ends it; and a
thousand connections at once.

The proxy runs as its own process, so its memory is measured from the outside (RSS) and the
fake backend process reports what it saw (requests, connections closed, bytes it managed to
send).
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import aiohttp
import orjson

from tests.reliability.conftest import CLIENT_S, Procs, Stack
from tests.reliability.outcome import COMPLETE, call, is_proxy_error_body
from tests.reliability.processes import eventually, raise_nofile

CHAT = "/v1/chat/completions"
MiB = 1024 * 1024


def chat(text: str = "tell me a story", *, stream: bool = False) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "stream": stream}


def http_request(path: str, body: bytes, *, headers: dict[str, str] | None = None) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
    for name, value in (headers or {}).items():
        head += f"{name}: {value}\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def open_raw(port: int, *, rcvbuf: int | None = None) -> tuple[asyncio.StreamReader, Any]:
    """A plain TCP connection to the proxy (optionally with a small receive buffer)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    return await asyncio.open_connection(sock=sock, limit=16 * 1024)


async def test_client_that_stops_reading_keeps_proxy_memory_bounded(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """A client that stops reading a fast, endless stream holds the proxy's memory flat:
    backpressure reaches the backend, which can hand over only a few socket buffers' worth;
    other clients are served meanwhile, and leaving frees the upstream connection."""
    proxy, backend = stack.proxy, stack.backend
    before = backend.stats()
    rss0 = proxy.rss()
    reader, writer = await open_raw(proxy.port, rcvbuf=16 * 1024)
    flood = {"X-Fault": f"flood={4096 * MiB}"}
    writer.write(http_request(CHAT, orjson.dumps(chat(stream=True)), headers=flood))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    # From here on the client reads nothing more.
    peak = rss0
    for _ in range(8):
        await asyncio.sleep(0.25)
        peak = max(peak, proxy.rss())
    sent = backend.stats()["flood_bytes"] - before["flood_bytes"]
    ok = await call(http, proxy.url + CHAT, chat("meanwhile"), timeout_s=2)
    assert ok.kind == COMPLETE, ok
    assert sent < 64 * MiB, f"the backend pushed {sent / MiB:.0f} MiB past a stalled client"
    assert peak - rss0 < 32 * MiB, f"proxy RSS grew {(peak - rss0) / MiB:.1f} MiB"

    writer.close()

    async def upstream_closed() -> bool:
        now = backend.stats()
        return bool(now["closed"] > before["closed"] and now["active"] == 0)

    assert await eventually(upstream_closed, within_s=3)
    stack.assert_alive()


async def test_client_disconnects_mid_stream_frees_the_backend(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """A client that leaves mid-stream, or before the status line, has its upstream request
    closed within a second; the record says 499."""
    proxy, backend = stack.proxy, stack.backend
    before = backend.stats()
    slow = {"X-Fault": "tokens=100,token-delay=0.05", "X-Request-Id": "leaves-mid-stream"}
    reader, writer = await open_raw(proxy.port)
    writer.write(http_request(CHAT, orjson.dumps(chat(stream=True)), headers=slow))
    got = b""
    while b'"content":" t1"' not in got:
        got += await asyncio.wait_for(reader.read(4096), 5)
    writer.transport.abort()
    left_at = time.monotonic()

    held = {"X-Fault": "hold=10", "X-Request-Id": "leaves-before-head"}
    _, writer2 = await open_raw(proxy.port)
    writer2.write(http_request(CHAT, orjson.dumps(chat()), headers=held))
    await asyncio.sleep(0.3)
    writer2.close()

    async def both_closed() -> bool:
        return bool(backend.stats()["closed"] >= before["closed"] + 2)

    assert await eventually(both_closed, within_s=2)
    assert time.monotonic() - left_at < 2.0

    async def recorded() -> bool:
        ids = {r["request_id"]: r for r in proxy.records()}
        return "leaves-mid-stream" in ids and "leaves-before-head" in ids

    assert await eventually(recorded, within_s=2)
    records = {r["request_id"]: r for r in proxy.records()}
    for rid in ("leaves-mid-stream", "leaves-before-head"):
        assert (records[rid]["status"], records[rid]["error"]) == (499, "client_disconnected")
    ok = await call(http, proxy.url + CHAT, chat(), timeout_s=2)
    assert ok.kind == COMPLETE


async def test_client_disconnects_while_sending_its_body(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """A client that leaves halfway through its body never reaches the backend."""
    before = stack.backend.stats()["requests"]
    body = orjson.dumps(chat("x" * 5000))
    request = http_request(CHAT, body)
    _, writer = await open_raw(stack.proxy.port)
    writer.write(request[: len(request) // 2])
    await writer.drain()
    await asyncio.sleep(0.2)
    writer.transport.abort()
    await asyncio.sleep(0.3)
    ok = await call(http, stack.proxy.url + CHAT, chat(), timeout_s=2)
    assert ok.kind == COMPLETE
    assert stack.backend.stats()["requests"] == before + 1  # only the request that followed


async def test_body_that_never_ends_is_408(stack: Stack, http: aiohttp.ClientSession) -> None:
    """A chunked body that stops coming, or a body shorter than its Content-Length, gets a 408
    in the OpenAI shape after the client timeout; a slow but steady upload is served."""
    port = stack.proxy.port
    cases = [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'8\r\n{"messag\r\n',
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nContent-Length: 500\r\n\r\n"
        b'{"messages": [',
    ]

    async def stuck(raw: bytes) -> tuple[bytes, float]:
        reader, writer = await open_raw(port)
        t0 = time.monotonic()
        writer.write(raw)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), CLIENT_S + 3)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = await asyncio.wait_for(reader.readexactly(length), 2)
        writer.close()
        return head + body, time.monotonic() - t0

    for raw, elapsed in await asyncio.gather(*(stuck(c) for c in cases)):
        assert raw.startswith(b"HTTP/1.1 408"), raw
        body = orjson.loads(raw.split(b"\r\n\r\n", 1)[1])
        assert is_proxy_error_body(body) and body["error"]["code"] == "request_timeout"
        assert CLIENT_S <= elapsed < CLIENT_S + 1.5

    # Steady: three pieces 0.6 client timeouts apart, longer than one client timeout in all.
    body = orjson.dumps(chat("slow but steady"))
    step = len(body) // 3 + 1
    pieces = [body[i : i + step] for i in range(0, len(body), step)]

    async def trickle() -> Any:
        for piece in pieces:
            yield piece
            await asyncio.sleep(CLIENT_S * 0.6)

    async with http.post(stack.proxy.url + CHAT, data=trickle()) as resp:
        assert resp.status == 200, await resp.read()
    stack.assert_alive()


async def test_a_body_that_came_with_its_head_is_read_whole(stack: Stack) -> None:
    """A chunked body whose pieces all arrive with the head (one write) is read as one and
    served (the buffered path's limit: ``tests/unit/test_read_body.py``)."""
    body = orjson.dumps(chat("in one write, several pieces"))
    pieces = [body[i : i + 7] for i in range(0, len(body), 7)]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: chunked\r\n"
    head += b"Content-Type: application/json\r\n\r\n"

    reader, writer = await open_raw(stack.proxy.port)
    writer.write(head + chunked)
    answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), "pieces not joined"
    stack.assert_alive()


async def test_a_thousand_concurrent_connections(procs: Procs) -> None:
    """1,000 requests at once (half streamed), each held open by the backend for a second,
    all complete; the backend saw them concurrently and the proxy serves on afterwards."""
    n = 1000
    raise_nofile(4 * n + 256)  # the test's client, and the child processes inherit it
    backend = procs.backend()
    proxy = procs.proxy([backend.url], idle_timeout=30.0, connect_timeout=10.0)
    hold = {"X-Fault": "hold=1.0,tokens=3"}
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        t0 = time.monotonic()
        outcomes = await asyncio.gather(
            *(
                call(
                    http,
                    proxy.url + CHAT,
                    chat(f"q{i}", stream=i % 2 == 0),
                    headers=hold,
                    timeout_s=60,
                )
                for i in range(n)
            )
        )
        elapsed = time.monotonic() - t0
        labels: dict[str, int] = {}
        for o in outcomes:
            labels[o.label] = labels.get(o.label, 0) + 1
        assert labels == {COMPLETE: n}, labels
        stats = backend.stats()
        assert stats["peak_active"] >= 0.9 * n, stats
        assert elapsed < 45, elapsed
        ok = await call(http, proxy.url + CHAT, chat(), timeout_s=5)
        assert ok.kind == COMPLETE
    assert proxy.alive


async def test_client_that_stops_reading_loses_its_backend_request(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """A client that stays connected but stops reading is cut off after the client timeout,
    and its upstream request closed with it, so it cannot hold a backend slot forever."""
    proxy, backend = stack.proxy, stack.backend
    before = backend.stats()
    reader, writer = await open_raw(proxy.port, rcvbuf=16 * 1024)
    flood = {"X-Fault": f"flood={4096 * MiB}", "X-Request-Id": "stops-reading"}
    writer.write(http_request(CHAT, orjson.dumps(chat(stream=True)), headers=flood))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    stalled_at = time.monotonic()

    async def upstream_closed() -> bool:
        now = backend.stats()
        return bool(now["closed"] > before["closed"] and now["active"] == 0)

    assert await eventually(upstream_closed, within_s=CLIENT_S + 4)
    assert time.monotonic() - stalled_at < CLIENT_S + 4

    async def recorded() -> bool:
        return any(r["request_id"] == "stops-reading" for r in proxy.records())

    assert await eventually(recorded, within_s=2)
    record = next(r for r in proxy.records() if r["request_id"] == "stops-reading")
    assert record["status"] == 499
    writer.close()
    ok = await call(http, proxy.url + CHAT, chat(), timeout_s=2)
    assert ok.kind == COMPLETE
    stack.assert_alive()
