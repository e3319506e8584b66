"""Hostile input: the corpus in tests/data/fuzz, and sizes and depths generated at the limits.

Every case gets the status its manifest names. A refusal by the proxy is a 4xx in the OpenAI
error shape naming the field when one is at fault, and the backend never sees the request; an
accepted body reaches the backend unchanged. Nothing gets a 5xx, and the proxy process
serves normally after all of it. Requests whose HTTP framing itself is broken are refused by
the HTTP layer before any routing, in the same shape (a 400 with code ``bad_http_request``),
and the connection is closed: see requests.toml and proxy/server.py.
"""

from __future__ import annotations

import asyncio
import io
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.reliability.conftest import BODY_LIMIT, Stack
from tests.reliability.outcome import COMPLETE, call, classify, is_proxy_error_body

FUZZ = Path(__file__).resolve().parents[1] / "data" / "fuzz"
BODY_CASES: list[dict[str, Any]] = tomllib.loads((FUZZ / "bodies.toml").read_text())["case"]
REQUEST_CASES: list[dict[str, Any]] = tomllib.loads((FUZZ / "requests.toml").read_text())["case"]
CHAT = "/v1/chat/completions"


def case_id(case: dict[str, Any]) -> str:
    return Path(case["file"]).stem


async def post(
    http: aiohttp.ClientSession,
    url: str,
    body: bytes,
    content_type: str | None = "application/json",
    headers: dict[str, str] | None = None,
) -> tuple[int, str, bytes]:
    hdrs = dict(headers or {})
    if content_type:
        hdrs["Content-Type"] = content_type
    skip = () if content_type else ("Content-Type",)
    data = io.BytesIO(body) if len(body) > 65536 else body  # aiohttp warns on large raw bytes
    async with http.post(url, data=data, headers=hdrs, skip_auto_headers=skip) as resp:
        return resp.status, resp.content_type, await resp.read()


# Fields the proxy itself may add on the way: the usage request on streams, llama.cpp's slot.
PROXY_ADDED = frozenset({"stream_options", "id_slot"})


def same_request(forwarded: bytes, sent: bytes) -> bool:
    """The backend got what the client sent: the same bytes, or the same JSON plus only the
    fields the proxy adds (when it had to re-serialize the body)."""
    if forwarded == sent:
        return True
    got, want = orjson.loads(forwarded), orjson.loads(sent)
    added = set(got) - set(want)
    return added <= PROXY_ADDED and {k: v for k, v in got.items() if k not in added} == want


def assert_refusal(status: int, payload: bytes, case: dict[str, Any]) -> None:
    """A refusal by the proxy: the OpenAI shape, naming the field, with the expected words."""
    body = orjson.loads(payload)
    assert is_proxy_error_body(body), payload
    error = body["error"]
    assert error["type"] == "invalid_request_error"
    if "param" in case:
        assert error["param"] == case["param"], error
        assert f"'{case['param']}'" in error["message"], error
    if "message" in case:
        assert case["message"] in error["message"], error


@pytest.mark.parametrize("case", BODY_CASES, ids=case_id)
async def test_body_corpus(stack: Stack, http: aiohttp.ClientSession, case: dict[str, Any]) -> None:
    """Each hostile body gets its status; refusals never reach the backend, and what is
    accepted reaches it unchanged."""
    body = (FUZZ / case["file"]).read_bytes()
    route = case.get("route", CHAT)
    before = stack.backend.stats()["requests"]
    status, content_type, payload = await post(
        http, stack.proxy.url + route, body, case.get("content_type", "application/json")
    )
    assert status == case["status"], (status, payload[:300])
    forwarded = stack.backend.stats()["requests"] - before
    if status == 200:
        assert classify(status, content_type, payload).kind == COMPLETE, payload[:300]
        assert forwarded == 1
        assert same_request(stack.backend.last_body(), body)
    else:
        assert_refusal(status, payload, case)
        assert forwarded == 0


def read_response(raw: bytes) -> tuple[int, dict[str, str], bytes] | None:
    """(status, headers, body) of the first complete final HTTP response in ``raw``, else None.

    Interim ``1xx`` responses (``100 Continue``) are skipped.
    """
    end = raw.find(b"\r\n\r\n")
    if end < 0:
        return None
    if raw.startswith(b"HTTP/1.1 1"):
        return read_response(raw[end + 4 :])
    lines = raw[:end].decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    rest = raw[end + 4 :]
    if "content-length" in headers:
        n = int(headers["content-length"])
        return (status, headers, rest[:n]) if len(rest) >= n else None
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body, pos = b"", 0
        while (eol := rest.find(b"\r\n", pos)) >= 0:
            size = int(rest[pos:eol], 16)
            if size == 0:
                return status, headers, body
            if len(rest) < eol + 2 + size + 2:
                return None
            body += rest[eol + 2 : eol + 2 + size]
            pos = eol + 2 + size + 2
        return None
    return None


async def exchange(
    port: int, request: bytes, *, wait_close: bool, timeout_s: float = 5.0
) -> tuple[Any, bool]:
    """Send raw bytes; the parsed response, and (``wait_close``) whether the server then
    closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    raw = b""
    try:
        writer.write(request)
        async with asyncio.timeout(timeout_s):
            while (parsed := read_response(raw)) is None:
                chunk = await reader.read(65536)
                if not chunk:
                    return read_response(raw), True
                raw += chunk
            if not wait_close:
                return parsed, False
            try:
                async with asyncio.timeout(2):
                    closed = await reader.read(1) == b""
            except TimeoutError:
                closed = False
            return parsed, closed
    finally:
        writer.close()


@pytest.mark.parametrize("case", REQUEST_CASES, ids=case_id)
async def test_request_corpus(stack: Stack, case: dict[str, Any]) -> None:
    """Broken HTTP framing, oversized heads and bodies, hostile headers: each gets its status
    and never a 5xx; a refusal is in the OpenAI shape, and a framing error closes the connection
    with a short message that does not quote the request."""
    raw = (FUZZ / case["file"]).read_bytes()
    closes = case.get("closes", False)
    parsed, closed = await exchange(stack.proxy.port, raw, wait_close=closes)
    assert parsed is not None, "no response"
    status, headers, body = parsed
    assert status == case["status"], (status, body[:300])
    if case["shape"] == "openai":
        assert headers.get("content-type", "").startswith("application/json"), headers
        error = orjson.loads(body)
        assert is_proxy_error_body(error), body
        assert error["error"]["type"] == "invalid_request_error", error
        if "code" in case:
            assert error["error"]["code"] == case["code"], error
        if "message" in case:
            assert case["message"] in error["error"]["message"], error
    else:
        assert classify(status, headers.get("content-type", ""), body).kind == COMPLETE
        rid = headers.get("x-request-id", "")
        assert rid and "/" not in rid and "<" not in rid and len(rid) <= 128
    if closes:
        assert closed, "the HTTP layer keeps a connection it could not parse"
        assert len(body) < 400, body  # a description, not an echo of the request
        assert b"\\x" not in body and b"b'" not in body, body
    stack.assert_alive()


def chat_of_size(total: int) -> bytes:
    """A chat body of exactly ``total`` bytes (a long user message)."""
    empty = orjson.dumps({"messages": [{"role": "user", "content": ""}]})
    return orjson.dumps({"messages": [{"role": "user", "content": "x" * (total - len(empty))}]})


async def test_sizes_at_the_limit(stack: Stack, http: aiohttp.ClientSession) -> None:
    """A string or an array that fills the body limit exactly is served; one byte over is a
    413, whether the length is announced or the body is chunked."""
    url = stack.proxy.url + CHAT
    at_limit = chat_of_size(BODY_LIMIT)
    assert len(at_limit) == BODY_LIMIT
    status, _, payload = await post(http, url, at_limit)
    assert status == 200, payload[:200]

    many = [{"role": "user", "content": "a"}] * 30_000
    array_body = orjson.dumps({"messages": many})
    assert len(array_body) < BODY_LIMIT
    status, _, payload = await post(http, url, array_body)
    assert status == 200, payload[:200]

    tokens = orjson.dumps({"prompt": list(range(150_000))})
    assert len(tokens) < BODY_LIMIT
    status, _, payload = await post(http, stack.proxy.url + "/v1/completions", tokens)
    assert status == 200, payload[:200]

    over = chat_of_size(BODY_LIMIT + 1)
    before = stack.backend.stats()["requests"]
    status, _, payload = await post(http, url, over)
    assert status == 413 and is_proxy_error_body(orjson.loads(payload))

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(over), 65536):
            yield over[i : i + 65536]

    async with http.post(url, data=chunked(), headers={"Content-Type": "application/json"}) as r:
        assert r.status == 413 and is_proxy_error_body(orjson.loads(await r.read()))
    assert stack.backend.stats()["requests"] == before


def nested(depth: int) -> bytes:
    """A streamed chat body whose deepest container sits ``depth`` levels down (body = 1), in
    a member of a text part that OpenAI does not define (content parts must be objects)."""
    inner = depth - 5  # body {} → messages [] → message {} → content [] → part {} → extra
    extra = b"[" * inner + b"]" * inner
    part = b'{"type": "text", "text": "hi", "extra": ' + extra + b"}"
    return b'{"stream": true, "messages": [{"role": "user", "content": [' + part + b"]}]}"


async def test_nesting_limit(stack: Stack, http: aiohttp.ClientSession) -> None:
    """128 levels are served (and survive being re-serialized for the stream), 129 are refused
    with a message saying so; JSON nested past the parser's own limit is refused as invalid."""
    url = stack.proxy.url + CHAT
    status, content_type, payload = await post(http, url, nested(128))
    assert status == 200 and classify(status, content_type, payload).kind == COMPLETE
    for depth, words in [(129, "nested more than 128"), (1000, "nested more than 128")]:
        status, _, payload = await post(http, url, nested(depth))
        assert status == 400, (depth, payload[:200])
        assert words in orjson.loads(payload)["error"]["message"]
    status, _, payload = await post(http, url, nested(5000))
    assert status == 400 and "not valid JSON" in orjson.loads(payload)["error"]["message"]


async def test_backend_judges_what_the_proxy_does_not_read(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """A field only the backend reads (here a negative max_tokens) goes through untouched, and
    the backend's own 4xx comes back unchanged."""
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1})
    headers = {"X-Fault": "status=400"}
    status, _, payload = await post(http, stack.proxy.url + CHAT, body, headers=headers)
    assert status == 400
    assert orjson.loads(payload) == {
        "error": {
            "code": 400,
            "message": "the request exceeds the context size",
            "type": "invalid_request_error",
        }
    }
    assert same_request(stack.backend.last_body(), body)


async def test_proxy_serves_after_the_corpus(stack: Stack, http: aiohttp.ClientSession) -> None:
    """After every hostile input above, ordinary requests are served."""
    body = {"messages": [{"role": "user", "content": "ok?"}]}
    outcome = await call(http, stack.proxy.url + CHAT, body)
    assert outcome.kind == COMPLETE
    stack.assert_alive()
