"""What a client got back: a complete answer, a well-formed error, or neither.

Every request through the proxy must end in one of two ways: a **complete** answer (a JSON
completion, or a stream that reached ``[DONE]`` / llama.cpp's ``"stop": true``) or a well-formed
**error** (an OpenAI-shaped error body with a 4xx/5xx status, or an SSE error event ending a
stream that had already started). Anything else is **lost**: no response at all, a connection
cut without an error, a truncated stream, a body that is neither. The fault tests and the soak
assert that nothing is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

COMPLETE = "complete"
ERROR = "error"
LOST = "lost"

PROXY_ERROR_KEYS = frozenset({"message", "type", "param", "code"})


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request ended, as its client saw it."""

    kind: str  # COMPLETE, ERROR or LOST
    status: int  # HTTP status; 0 when no response arrived
    error: str | None = None  # the error ``type`` (or the client-side failure) when not complete
    detail: str = ""
    body: bytes = b""
    elapsed_s: float = 0.0

    @property
    def label(self) -> str:
        """``complete``, ``error:<status>:<type>`` or ``lost:<why>``, for counting by kind."""
        if self.kind == COMPLETE:
            return COMPLETE
        if self.kind == ERROR:
            return f"error:{self.status}:{self.error}"
        return f"lost:{self.error}"


def is_error_body(obj: Any) -> bool:
    """An OpenAI-style error envelope (the proxy's own, or one a backend sent)."""
    if not isinstance(obj, Mapping) or "error" not in obj:
        return False
    err = obj["error"]
    return isinstance(err, Mapping) and isinstance(err.get("message"), str)


def is_proxy_error_body(obj: Any) -> bool:
    """Exactly the proxy's own shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return (
        is_error_body(obj)
        and set(obj) == {"error"}
        and set(obj["error"]) == PROXY_ERROR_KEYS
        and isinstance(obj["error"]["type"], str)
    )


def sse_payloads(body: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, in order (comments and other fields skipped)."""
    out: list[bytes] = []
    for event in body.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n\n"):
        data = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))
    return out


def _load(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def classify(status: int, content_type: str, body: bytes, *, elapsed_s: float = 0.0) -> Outcome:
    """Judge a response that arrived in full (status, Content-Type, the whole body)."""

    def out(kind: str, error: str | None = None, detail: str = "") -> Outcome:
        return Outcome(kind, status, error, detail, body, elapsed_s)

    if status >= 400:
        obj = _load(body)
        if is_error_body(obj):
            return out(ERROR, str(obj["error"].get("type")), obj["error"]["message"])
        return out(LOST, "malformed_error_body", body[:200].decode("utf-8", "replace"))
    if status != 200:
        return out(LOST, f"status_{status}")
    if "text/event-stream" in content_type:
        payloads = sse_payloads(body)
        for data in payloads:
            obj = _load(data)
            if is_error_body(obj):
                return out(ERROR, str(obj["error"].get("type")), obj["error"]["message"])
        last = payloads[-1] if payloads else b""
        final = _load(last) if last and last != b"[DONE]" else None
        if last == b"[DONE]" or (isinstance(final, dict) and final.get("stop") is True):
            return out(COMPLETE)
        return out(LOST, "truncated_stream", "stream ended without [DONE] or an error event")
    obj = _load(body)
    if isinstance(obj, dict) and ("choices" in obj or "content" in obj):
        return out(COMPLETE)
    return out(LOST, "malformed_answer", body[:200].decode("utf-8", "replace"))


async def call(
    session: aiohttp.ClientSession,
    url: str,
    body: Any,
    *,
    headers: Mapping[str, str] | None = None,
    timeout_s: float = 10.0,
) -> Outcome:
    """POST ``body`` (JSON, or raw bytes) and judge the answer; never raises."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    try:
        async with asyncio.timeout(timeout_s), session.post(url, data=data, headers=hdrs) as resp:
            payload = await resp.read()
            return classify(resp.status, resp.content_type, payload, elapsed_s=loop.time() - t0)
    except TimeoutError:
        return Outcome(LOST, 0, "client_timeout", f"no answer in {timeout_s} s", b"", timeout_s)
    except aiohttp.ClientError as exc:
        return Outcome(LOST, 0, type(exc).__name__, str(exc), b"", loop.time() - t0)
