"""Generated hostile requests against the proxy process (hypothesis, bounded examples).

Each example is a real HTTP request to the session's proxy. The oracle restates the input
rules independently of the proxy's code: a body with a wrong-typed field the proxy must read is
a 400 naming such a field; any other JSON object is forwarded and answered; bytes that are not
a JSON object are a 400. Never a 5xx, never a response that is neither an answer nor an
OpenAI-shaped error.
"""

from __future__ import annotations

import http.client
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import Stack
from tests.reliability.outcome import COMPLETE, classify, is_proxy_error_body
from tests.reliability.strategies import any_json, request_body

ROUTES = ("/v1/chat/completions", "/v1/completions", "/completion")
OVER_HTTP = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def send(stack: Stack, path: str, body: bytes) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.proxy.port, timeout=10)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read()
    finally:
        conn.close()


def type_errors(route: str, body: dict[str, Any]) -> set[str]:
    """The fields the proxy must refuse in ``body`` (its rules, restated independently)."""
    bad = set()
    for name, kind in (("model", str), ("stream", bool), ("stream_options", dict)):
        if body.get(name) is not None and not isinstance(body[name], kind):
            bad.add(name)
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list):
            bad.add("messages")
        else:
            for i, m in enumerate(messages):
                if not isinstance(m, dict):
                    bad.add(f"messages[{i}]")
                    continue
                if not isinstance(m.get("role"), str):
                    bad.add(f"messages[{i}].role")
                content = m.get("content")
                if content is not None and not isinstance(content, str | list):
                    bad.add(f"messages[{i}].content")
        if body.get("tools") is not None and not isinstance(body["tools"], list):
            bad.add("tools")
    else:
        prompt = body.get("prompt")
        allowed: tuple[type, ...] = (str, list, dict) if route == "/completion" else (str, list)
        if prompt is not None and not isinstance(prompt, allowed):
            bad.add("prompt")
    return bad


def judge(status: int, content_type: str, payload: bytes) -> dict[str, Any] | None:
    """Never a 5xx; a 200 is a complete answer; anything else is the proxy's own error."""
    assert status < 500, (status, payload[:300])
    if status == 200:
        assert classify(status, content_type, payload).kind == COMPLETE, payload[:300]
        return None
    error = orjson.loads(payload)
    assert is_proxy_error_body(error), payload[:300]
    return dict(error["error"])


@OVER_HTTP
@given(request_body, st.sampled_from(ROUTES))
def test_wrong_types_anywhere(stack: Stack, body: dict[str, Any], route: str) -> None:
    """Request-shaped bodies with wrong types anywhere: refused exactly when a field the proxy
    reads is wrong (the 400 names one of them), otherwise answered."""
    status, content_type, payload = send(stack, route, orjson.dumps(body))
    error = judge(status, content_type, payload)
    bad = type_errors(route, body)
    if bad:
        assert status == 400 and error is not None, (bad, payload[:200])
        assert error["param"] in bad, (error, bad)
    else:
        assert status == 200, (body, payload[:300])


@OVER_HTTP
@given(any_json, st.sampled_from(ROUTES))
def test_any_json_value(stack: Stack, value: Any, route: str) -> None:
    """Any JSON value at all as the body: answered or refused with a 400, never more."""
    status, content_type, payload = send(stack, route, orjson.dumps(value))
    error = judge(status, content_type, payload)
    if not isinstance(value, dict):
        assert status == 400 and error is not None and "JSON object" in error["message"]


@OVER_HTTP
@given(st.binary(max_size=200), st.sampled_from(ROUTES))
def test_arbitrary_bytes(stack: Stack, raw: bytes, route: str) -> None:
    """Arbitrary bytes as the body: a 400 unless they happen to be a valid request."""
    judge(*send(stack, route, raw))


HOSTILE_BYTES = [b"NaN", b"\\ud800", b"\xff", b"{", b"[", b'"', b",", b"\x00", b"1e999", b"}"]


@OVER_HTTP
@given(request_body, st.sampled_from(ROUTES), st.data())
def test_mutated_requests(stack: Stack, body: dict[str, Any], route: str, data: Any) -> None:
    """A valid-looking request truncated, with a byte replaced or a hostile token spliced in:
    a 400 or an answer, never more."""
    raw = orjson.dumps(body)
    cut = data.draw(st.integers(0, len(raw)))
    how = data.draw(st.sampled_from(["truncate", "replace", "insert"]))
    if how == "truncate":
        raw = raw[:cut]
    elif how == "replace":
        raw = raw[:cut] + bytes([data.draw(st.integers(0, 255))]) + raw[cut + 1 :]
    else:
        raw = raw[:cut] + data.draw(st.sampled_from(HOSTILE_BYTES)) + raw[cut:]
    judge(*send(stack, route, raw))
