"""A fake inference server in a process of its own, with faults chosen request by request.

    python -m tests.reliability.fake_backend --port 8123 [--dialect llamacpp|vllm]

It serves the fakes of ``tests/fakes.py`` (real wire formats) so a test or the soak can kill it
with a signal, restart it on the same port, and steer single requests into a fault with an
``X-Fault`` request header (the proxy forwards it like any other header). The header holds
comma-separated ``name=value`` items:

    tokens=N          N content tokens (default 5)
    token-delay=S     S seconds between tokens
    hold=S            S seconds before the status line
    stall-after=N     N tokens, then nothing more while the connection stays open
    fail-after=N      N tokens, then the backend's own error event
    reset-after=N     N tokens, then the connection is reset (a crash, as the proxy sees it)
    dribble-head=S    a response head sent one byte every S seconds that never ends
    dribble-body=S    the whole streamed answer, one byte every S seconds (it does end)
    flood=BYTES       a stream of BYTES of token events, as fast as the reader takes them
    status=CODE       answer with this HTTP error status

``GET /_fault/last`` answers the body of the last inference request, byte for byte;
``GET /_fault/stats`` what the process has seen: requests, finished (answered to the
end), closed (abandoned by the client before the end), active, peak_active (most at once)
and flood_bytes (bytes of ``flood`` streams actually handed to the socket).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.fakes import Knobs, LlamaFake, VllmFake, sse

FAULT_HEADER = "X-Fault"
INFERENCE = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/completion": "native",
}
SEEN_PROMPTS = 256  # the fake's prompt cache compares against every prompt seen: keep it short


def parse_fault(value: str) -> dict[str, float]:
    """``"stall-after=2, token-delay=0.1"`` → ``{"stall-after": 2.0, "token-delay": 0.1}``."""
    out: dict[str, float] = {}
    for item in value.split(","):
        name, _, raw = item.strip().partition("=")
        if name:
            out[name] = float(raw) if raw else 1.0
    return out


def knobs_for(fault: dict[str, float]) -> Knobs:
    """The fake's knobs for one request's ``X-Fault``."""
    knobs = Knobs()
    if "tokens" in fault:
        knobs.tokens = [f" t{i}" for i in range(int(fault["tokens"]))]
    knobs.token_delay_s = fault.get("token-delay", 0.0)
    knobs.header_delay_s = fault.get("hold", 0.0)
    if "stall-after" in fault:
        knobs.stall_after = int(fault["stall-after"])
    if "fail-after" in fault:
        knobs.fail_after = int(fault["fail-after"])
    if "status" in fault:
        knobs.reject_status = int(fault["status"])
    return knobs


@dataclass
class Stats:
    requests: int = 0
    finished: int = 0
    closed: int = 0
    active: int = 0
    peak_active: int = 0
    flood_bytes: int = 0
    paths: dict[str, int] = field(default_factory=dict)


class FaultyBackend:
    """Wraps a fake: each inference request runs on a fresh fake built from its ``X-Fault``."""

    def __init__(self, dialect: str) -> None:
        self.dialect = dialect
        self.base = self._make(Knobs())
        self.stats = Stats()
        self.last_body = b""

    def _make(self, knobs: Knobs) -> LlamaFake | VllmFake:
        if self.dialect == "vllm":
            return VllmFake(knobs, prompt_tokens_details=True)
        return LlamaFake(knobs)

    def app(self) -> web.Application:
        base = self.base
        app = web.Application(client_max_size=256 * 1024 * 1024)  # llama-server has no 1 MiB cap
        app.router.add_get("/health", base.health)
        app.router.add_get("/v1/models", base.models)
        app.router.add_post("/tokenize", base.tokenize)
        if isinstance(base, LlamaFake):
            app.router.add_get("/props", base.props)
        else:
            app.router.add_get("/version", base.version)
        for path, name in INFERENCE.items():
            if hasattr(base, name):
                app.router.add_post(path, self._wrap(name))
        app.router.add_get("/_fault/stats", self.get_stats)
        app.router.add_get("/_fault/last", self.get_last)
        return app

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(vars(self.stats))

    async def get_last(self, request: web.Request) -> web.Response:
        """The body of the last inference request, byte for byte."""
        return web.Response(body=self.last_body, content_type="application/octet-stream")

    def _wrap(self, name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            stats = self.stats
            stats.requests += 1
            stats.active += 1
            stats.peak_active = max(stats.peak_active, stats.active)
            stats.paths[request.path] = stats.paths.get(request.path, 0) + 1
            self.last_body = await request.read()  # cached by aiohttp: the fake reads it again
            fault = parse_fault(request.headers.get(FAULT_HEADER, ""))
            fake = self._make(knobs_for(fault))
            fake._seen = self.base._seen  # one prompt cache for the process
            ended = False
            try:
                if "dribble-head" in fault:
                    await dribble_head(request, fault["dribble-head"])
                if "flood" in fault:
                    resp = await self.flood(request, int(fault["flood"]))
                elif "dribble-body" in fault or "reset-after" in fault:
                    resp = await self.raw_stream(request, name, fault)
                else:
                    resp = await getattr(fake, name)(request)
                ended = True
                return resp
            finally:
                stats.active -= 1
                if ended and not fake.closed.is_set():
                    stats.finished += 1
                else:
                    stats.closed += 1
                del self.base._seen[:-SEEN_PROMPTS]

        return handle

    async def raw_stream(
        self, request: web.Request, name: str, fault: dict[str, float]
    ) -> web.StreamResponse:
        """A streamed answer written one byte at a time, or cut off by a connection reset."""
        await request.read()
        events = synthetic_stream(name, int(fault.get("tokens", 5)))
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if "reset-after" in fault:
            for event in events[: int(fault["reset-after"]) + 1]:
                await resp.write(event)
            await asyncio.sleep(0.05)  # let the events leave before the reset
            reset_connection(request)
            raise asyncio.CancelledError
        delay = fault["dribble-body"]
        data = b"".join(events)
        for i in range(len(data)):
            await resp.write(data[i : i + 1])
            await asyncio.sleep(delay)
        await resp.write_eof()
        return resp

    async def flood(self, request: web.Request, total: int) -> web.StreamResponse:
        """A long stream of token events, written with the socket's backpressure."""
        await request.read()
        event = sse(
            {
                "id": "chatcmpl-flood",
                "object": "chat.completion.chunk",
                "model": "fake-model",
                "choices": [{"index": 0, "delta": {"content": "x" * 200}, "finish_reason": None}],
            }
        )
        chunk = event * max(1, 65536 // len(event))
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        sent = 0
        while sent < total:
            await resp.write(chunk)
            sent += len(chunk)
            self.stats.flood_bytes += len(chunk)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def synthetic_stream(name: str, tokens: int) -> list[bytes]:
    """A complete OpenAI-style stream (chat or text completion) of ``tokens`` tokens."""
    chat = name == "chat"
    meta = {"id": "cmpl-raw", "created": 0, "model": "fake-model"}
    meta["object"] = "chat.completion.chunk" if chat else "text_completion"

    def piece(text: str, finish: str | None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {"content": text} if text else {}
        else:
            choice["text"] = text
        return sse({**meta, "choices": [choice]})

    events = [piece(f" t{i}", None) for i in range(tokens)]
    events.append(piece("", "stop"))
    events.append(b"data: [DONE]\n\n")
    return events


async def dribble_head(request: web.Request, every_s: float) -> None:
    """Send a response head one byte at a time, never finishing it, until the peer leaves."""
    transport = request.transport
    assert transport is not None
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nX-Padding: "
    i = 0
    while not transport.is_closing():
        transport.write(head[i : i + 1] if i < len(head) else b"a")
        i += 1
        await asyncio.sleep(every_s)
    raise asyncio.CancelledError


def reset_connection(request: web.Request) -> None:
    """Abort the connection with a TCP reset, the way a crashed server's socket ends."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dialect", choices=["llamacpp", "vllm"], default="llamacpp")
    args = parser.parse_args(argv)
    backend = FaultyBackend(args.dialect)
    web.run_app(
        backend.app(),
        host="127.0.0.1",
        port=args.port,
        handler_cancellation=True,  # a client that leaves cancels the handler, as in real servers
        backlog=4096,
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
