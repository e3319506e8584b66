"""proxy/server.py: aiohttp's own error answers (framing, escaped exceptions) in the OpenAI shape.

The app here has no middleware, so an exception in a handler reaches aiohttp's
``handle_error`` (the proxy's ``request_context`` middleware answers those itself).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
import structlog.testing
from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    BadStatusLine,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
)

from proxy.server import MESSAGE_LIMIT, JsonErrorRequestHandler, error_for, make_runner


async def boom(request: web.Request) -> web.StreamResponse:
    raise RuntimeError("secret detail")


async def timeout(request: web.Request) -> web.StreamResponse:
    raise TimeoutError


async def half_sent(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    await resp.write(b"partial")
    raise RuntimeError("after the head")


async def ok(request: web.Request) -> web.StreamResponse:
    return web.json_response({"ok": True})


@pytest.fixture
async def port() -> AsyncIterator[int]:
    app = web.Application()
    app.router.add_get("/boom", boom)
    app.router.add_get("/timeout", timeout)
    app.router.add_get("/half", half_sent)
    app.router.add_get("/ok", ok)
    runner = make_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def raw(port: int, request: bytes) -> bytes:
    """Send ``request``; everything the server sends until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        async with asyncio.timeout(5):
            return await reader.read()  # to EOF: only returns if the server closes
    finally:
        writer.close()


def split(response: bytes) -> tuple[int, str, dict[str, object]]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers["content-type"], orjson.loads(body)


def assert_shape(body: dict[str, object], type_: str, code: str | None) -> dict[str, object]:
    assert set(body) == {"error"}
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_ and error["code"] == code and error["param"] is None
    assert isinstance(error["message"], str) and error["message"]
    return error


async def test_framing_error_is_json_and_closes(port: int) -> None:
    request = b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Key: topsecret\x01value\r\n\r\n"
    status, content_type, body = split(await raw(port, request))  # returns: the server closed
    assert status == 400 and content_type == "application/json"
    error = assert_shape(body, "invalid_request_error", "bad_http_request")
    assert "topsecret" not in str(error["message"]) and "X-Key" not in str(error["message"])


async def test_refused_request_is_logged_without_its_bytes(
    port: int, caplog: pytest.LogCaptureFixture
) -> None:
    """One ``bad_http_request`` line with the reason; nothing of the offending line, in our log
    or aiohttp's (which would quote up to 100 bytes of it)."""
    secret = "Bearer sk-" + "s" * 40
    request = f"GET /ok HTTP/1.1\r\nHost: x\r\nAuthorization: {secret}{'a' * 9000}\r\n\r\n"
    with structlog.testing.capture_logs() as events, caplog.at_level(logging.DEBUG):
        status, _, _ = split(await raw(port, request.encode()))
    assert status == 400
    (event,) = [e for e in events if e["event"] == "bad_http_request"]
    assert event["error"] == "LineTooLong" and "8190" in event["reason"]
    assert "sk-sss" not in repr(events)
    assert "sk-sss" not in caplog.text


async def test_exception_in_handler_is_json_500(
    port: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="aiohttp.server"):
        status, content_type, body = split(
            await raw(port, b"GET /boom HTTP/1.1\r\nHost: x\r\nAccept: text/html\r\n\r\n")
        )
    assert status == 500 and content_type == "application/json"
    error = assert_shape(body, "server_error", None)
    assert "secret" not in str(error["message"])
    # Logged as aiohttp logs it, with the exception.
    assert any(r.exc_info and "secret detail" in str(r.exc_info[1]) for r in caplog.records)


async def test_timeout_in_handler_is_json_504(port: int) -> None:
    status, content_type, body = split(await raw(port, b"GET /timeout HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status == 504 and content_type == "application/json"
    assert_shape(body, "server_error", "timeout")


async def test_no_error_body_after_the_response_started(port: int) -> None:
    """Once part of a response is out, the connection is broken, not answered again."""
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/half") as resp:
        assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()


async def test_served_normally(port: int) -> None:
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/ok") as resp:
        assert resp.status == 200 and await resp.json() == {"ok": True}


async def test_runner_options() -> None:
    runner = make_runner(web.Application())
    await runner.setup()
    try:
        assert runner.server is not None and runner.server.handler_cancellation
        handler = runner.server()
        assert isinstance(handler, JsonErrorRequestHandler)
        assert handler.access_logger is None
    finally:
        await runner.cleanup()


def message_of(resp: web.Response) -> str:
    assert resp.body is not None and isinstance(resp.body, bytes)
    message: str = orjson.loads(resp.body)["error"]["message"]
    return message


def test_messages_do_not_quote_the_request() -> None:
    key = "sk-" + "k" * 300
    too_long = LineTooLong(f"Authorization: Bearer {key}"[:100] + "...", 8190)
    resp = error_for(400, too_long, too_long.message)
    assert resp.status == 400 and resp.keep_alive is False
    assert message_of(resp).endswith("a request line or header field is longer than 8190 bytes")
    assert "sk-" not in message_of(resp)

    # llhttp's form: description, then the offending line and a caret.
    exc = BadHttpMessage(f"Invalid header value char:\n\n  b'X-Key: {key}\\x01'\n  ^")
    assert message_of(error_for(400, exc, exc.message)).endswith("Invalid header value char")

    # Any other message: on one line, truncated.
    exc = BadHttpMessage("Invalid HTTP header: " + "x" * 5000)
    message = message_of(error_for(400, exc, None))
    assert "\n" not in message and len(message) < MESSAGE_LIMIT + 50

    # Messages that quote the request with nothing to cut at: described by their kind.
    for exc, described in (
        (InvalidURLError(f"http://[bad/?api_key={key}"), "not a valid URL"),
        (InvalidHeader(f"X-Key: {key}".encode()), "a header field is not valid"),
        (BadStatusLine(f"GET /?key={key} HTTP/9"), "the request line is not valid"),
        (BadStatusLine(f"GET /?key={key}\x01 HTTP/9"), "the request line is not valid"),
        (BadHttpMethod(f"{key} / HTTP/1.1"), "the request method is not valid"),
        (BadHttpMessage(f"Unforeseen: b'{key}'"), "malformed HTTP request"),
    ):
        message = message_of(error_for(400, exc, exc.message))
        assert message.endswith(described) and "sk-" not in message, message

    exc = BadHttpMessage("Pause on PRI/Upgrade:\n\n  b''\n  ^")
    assert "HTTP/2" in message_of(error_for(400, exc, exc.message))
    assert message_of(error_for(400, None, None)).endswith("malformed HTTP request")


def test_collector_tuned_once_started() -> None:
    """The process's server sets start-up's objects aside and raises the collector's thresholds;
    what is collected is unchanged: a cycle made afterwards is still freed."""
    import gc
    import weakref

    from proxy.server import GC_YOUNG_OBJECTS, tune_collector

    before = gc.get_threshold()
    try:
        tune_collector()
        assert gc.get_threshold() == (GC_YOUNG_OBJECTS, 20, 20)
        assert gc.get_freeze_count() > 0

        class Node:
            other: object = None

        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
