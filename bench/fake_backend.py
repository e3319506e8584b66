"""A load target for the overhead benchmark: a tiny, fast, fake llama.cpp-style OpenAI server.

This is not a model and not a test fake: it exists only to be cheap, so that what a benchmark
measures in front of it is the reverse proxy in the middle, not the backend. It is a raw asyncio
``Protocol`` (no framework, one timer callback per token) that speaks just enough HTTP/1.1
(keep-alive, ``Content-Length`` request bodies, chunked responses) and just enough of
``llama-server``'s wire format for a proxy to treat it as one:

* ``POST /v1/chat/completions`` (and ``/chat/completions``, ``/v1/completions``): streamed, it
  sends ``--tokens`` content events (or the body's ``max_tokens``, whichever is smaller), the
  first after ``--ttft-ms`` and the rest ``--itl-ms`` apart, then the finishing event, the
  usage-only event when ``stream_options.include_usage`` is set (llama.cpp's ``timings`` ride on
  the last event either way), then ``[DONE]``; not streamed, one JSON body after the same time;
* ``GET /props`` (so a proxy detects the llama.cpp dialect; it reports ``--slots`` slots of
  8,192 tokens, though it serves any number of requests at once), ``/health``, ``/v1/models``.

Usage reports ``prompt_tokens`` as the body size / 4 and zero cached tokens.

Run: ``python bench/fake_backend.py --port 9000 [--tokens 16] [--itl-ms 2] [--ttft-ms 0]``;
it prints ``ready <port>`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

import orjson

MODEL = "bench-model"
TOKEN = " lorem"
MAX_HEAD = 64 * 1024


@dataclass(frozen=True, slots=True)
class Shape:
    """How every answer looks and how fast it comes."""

    tokens: int = 16
    itl_s: float = 0.002
    ttft_s: float = 0.0
    slots: int = 8


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chat_chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


TOKEN_EVENT = chunk(sse(_chat_chunk({"content": TOKEN}, None)))
DONE_EVENT = chunk(b"data: [DONE]\n\n")
LAST_CHUNK = b"0\r\n\r\n"
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def _usage(prompt_tokens: int, completion: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def _timings(prompt_tokens: int, completion: int, shape: Shape) -> dict[str, Any]:
    return {
        "cache_n": 0,
        "prompt_n": prompt_tokens,
        "prompt_ms": shape.ttft_s * 1000.0,
        "predicted_n": completion,
        "predicted_ms": shape.itl_s * 1000.0 * max(completion - 1, 0),
        "predicted_per_token_ms": shape.itl_s * 1000.0,
    }


def json_response(status: int, obj: Any, keep_alive: bool) -> bytes:
    body = orjson.dumps(obj)
    conn = b"keep-alive" if keep_alive else b"close"
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Connection: %s\r\n\r\n%s"
        % (status, b"OK" if status == 200 else b"Error", len(body), conn, body)
    )


class FakeServer(asyncio.Protocol):
    """One client connection. Requests on it are answered one at a time, in order."""

    def __init__(self, shape: Shape) -> None:
        self.shape = shape
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False
        self.keep_alive = True
        self.loop = asyncio.get_running_loop()
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.timer is not None:
            self.timer.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._next_request()

    # -- requests ----------------------------------------------------------------------------

    def _next_request(self) -> None:
        if self.busy or self.transport is None:
            return
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEAD:
                self._reply(json_response(431, {"error": "headers too large"}, False))
            return
        lines = bytes(self.buf[:end]).split(b"\r\n")
        method, path = lines[0].split(b" ")[:2]
        length = 0
        self.keep_alive = True
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            key = name.strip().lower()
            if key == b"content-length":
                length = int(value)
            elif key == b"connection" and value.strip().lower() == b"close":
                self.keep_alive = False
            elif key == b"transfer-encoding":
                self._reply(json_response(411, {"error": "send Content-Length"}, False))
                return
        if len(self.buf) < end + 4 + length:
            return
        body = bytes(self.buf[end + 4 : end + 4 + length])
        del self.buf[: end + 4 + length]
        self.busy = True
        self._dispatch(method, path.split(b"?")[0], body)

    def _dispatch(self, method: bytes, path: bytes, body: bytes) -> None:
        if method == b"GET":
            if path == b"/props":
                obj: Any = {
                    "total_slots": self.shape.slots,
                    "default_generation_settings": {"n_ctx": 8192},
                    "model_alias": MODEL,
                }
            elif path == b"/v1/models":
                obj = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
            elif path == b"/health":
                obj = {"status": "ok"}
            else:
                self._reply(json_response(404, {"error": "not found"}, self.keep_alive))
                return
            self._reply(json_response(200, obj, self.keep_alive))
            return
        if method != b"POST" or not path.endswith(b"completions"):
            self._reply(json_response(404, {"error": "not found"}, self.keep_alive))
            return
        try:
            req = orjson.loads(body)
        except orjson.JSONDecodeError:
            self._reply(json_response(400, {"error": "bad json"}, self.keep_alive))
            return
        n = self.shape.tokens
        max_tokens = req.get("max_tokens") or req.get("max_completion_tokens")
        if isinstance(max_tokens, int) and max_tokens > 0:
            n = min(n, max_tokens)
        prompt_tokens = max(1, len(body) // 4)
        if req.get("stream") is True:
            opts = req.get("stream_options") or {}
            Stream(self, n, prompt_tokens, bool(opts.get("include_usage"))).start()
        else:
            delay = self.shape.ttft_s + self.shape.itl_s * max(n - 1, 0)
            obj = {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": MODEL,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": TOKEN * n},
                        "finish_reason": "length",
                    }
                ],
                "usage": _usage(prompt_tokens, n),
                "timings": _timings(prompt_tokens, n, self.shape),
            }
            data = json_response(200, obj, self.keep_alive)
            self.timer = self.loop.call_later(delay, self._reply, data)

    def write(self, data: bytes) -> bool:
        """Write to the client; False when it has gone away."""
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(data)
        return True

    def _reply(self, data: bytes) -> None:
        """Send a complete response and move on to the next request on this connection."""
        self.timer = None
        if not self.write(data):
            return
        self.done()

    def done(self) -> None:
        self.busy = False
        if not self.keep_alive:
            if self.transport is not None:
                self.transport.close()
            return
        if self.buf:
            self._next_request()


class Stream:
    """One streamed answer, driven by timer callbacks (no coroutine per request)."""

    __slots__ = ("conn", "include_usage", "n", "prompt_tokens", "sent")

    def __init__(self, conn: FakeServer, n: int, prompt_tokens: int, include_usage: bool) -> None:
        self.conn = conn
        self.n = n
        self.prompt_tokens = prompt_tokens
        self.include_usage = include_usage
        self.sent = 0

    def start(self) -> None:
        if not self.conn.write(STREAM_HEAD):
            return
        self.conn.timer = self.conn.loop.call_later(self.conn.shape.ttft_s, self.step)

    def step(self) -> None:
        conn = self.conn
        conn.timer = None
        if not conn.write(TOKEN_EVENT):
            return
        self.sent += 1
        if self.sent < self.n:
            conn.timer = conn.loop.call_later(conn.shape.itl_s, self.step)
            return
        usage = _usage(self.prompt_tokens, self.n)
        timings = _timings(self.prompt_tokens, self.n, conn.shape)
        finish = _chat_chunk({}, "length")
        tail = []
        if self.include_usage:
            tail.append(chunk(sse(finish)))
            last = {**_chat_chunk({}, None), "choices": [], "usage": usage, "timings": timings}
            tail.append(chunk(sse(last)))
        else:
            tail.append(chunk(sse({**finish, "timings": timings})))
        tail.append(DONE_EVENT)
        tail.append(LAST_CHUNK)
        if conn.write(b"".join(tail)):
            conn.done()


async def serve(port: int, shape: Shape, host: str = "127.0.0.1") -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FakeServer(shape), host, port, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=16, help="content events per answer")
    parser.add_argument("--itl-ms", type=float, default=2.0, help="delay between tokens")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="delay before the first token")
    parser.add_argument(
        "--slots", type=int, default=8, help="slots /props reports (it serves any number)"
    )
    args = parser.parse_args(argv)
    shape = Shape(
        tokens=args.tokens,
        itl_s=args.itl_ms / 1000.0,
        ttft_s=args.ttft_ms / 1000.0,
        slots=args.slots,
    )
    asyncio.run(serve(args.port, shape, args.host))
    return 0


if __name__ == "__main__":
    sys.exit(main())
