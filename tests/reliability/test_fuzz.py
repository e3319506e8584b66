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


class Shapes:
    """OpenAI's structural rules for tools, tool_choice, response_format, content parts,
    tool_calls and stream_options, restated: every field that breaks one, collected."""

    def __init__(self) -> None:
        self.bad: set[str] = set()

    def get(
        self,
        obj: Any,
        name: str,
        kind: type | tuple[type, ...],
        where: str,
        required: bool = False,
    ) -> Any:
        """``obj[name]`` if it is a ``kind``; a missing required or mistyped one is bad."""
        param = f"{where}.{name}" if where else name
        value = obj.get(name) if isinstance(obj, dict) else None
        if value is None:
            if required:
                self.bad.add(param)
            return None
        if not isinstance(value, kind):
            self.bad.add(param)
            return None
        return value

    def obj(self, value: Any, where: str) -> dict[str, Any] | None:
        if isinstance(value, dict):
            return value
        self.bad.add(where)
        return None

    def named(self, obj: dict[str, Any], key: str, where: str, also: tuple[str, ...]) -> None:
        inner = self.get(obj, key, dict, where, required=True)
        if inner is not None:
            self.get(inner, "name", str, f"{where}.{key}", required=True)
            for extra in also:
                self.get(inner, extra, str, f"{where}.{key}", required=extra == "input")

    def tools(self, tools: list[Any]) -> None:
        for i, raw in enumerate(tools):
            where = f"tools[{i}]"
            if (tool := self.obj(raw, where)) is None:
                continue
            kind = self.get(tool, "type", str, where, required=True)
            if kind not in (None, "function", "custom"):
                self.bad.add(f"{where}.type")
            if kind == "custom":
                self.named(tool, "custom", where, ("description",))
            if kind == "function":
                fn = self.get(tool, "function", dict, where, required=True)
                if fn is not None:
                    at = f"{where}.function"
                    self.get(fn, "name", str, at, required=True)
                    self.get(fn, "description", str, at)
                    self.get(fn, "parameters", dict, at)
                    self.get(fn, "strict", bool, at)

    def tool_choice(self, choice: Any) -> None:
        if isinstance(choice, str):
            return
        if (obj := self.obj(choice, "tool_choice")) is None:
            return
        kind = self.get(obj, "type", str, "tool_choice", required=True)
        if kind in ("function", "custom"):
            self.named(obj, kind, "tool_choice", ())
        if kind == "allowed_tools":
            allowed = self.get(obj, "allowed_tools", dict, "tool_choice", required=True)
            if allowed is not None:
                self.get(allowed, "mode", str, "tool_choice.allowed_tools", required=True)
                self.get(allowed, "tools", list, "tool_choice.allowed_tools", required=True)

    def response_format(self, fmt: Any) -> None:
        if (obj := self.obj(fmt, "response_format")) is None:
            return
        if self.get(obj, "type", str, "response_format", required=True) == "json_schema":
            schema = self.get(obj, "json_schema", dict, "response_format", required=True)
            if schema is not None:
                at = "response_format.json_schema"
                self.get(schema, "name", str, at, required=True)
                self.get(schema, "description", str, at)
                self.get(schema, "schema", dict, at)
                self.get(schema, "strict", bool, at)

    def message(self, m: dict[str, Any], where: str) -> None:
        content = m.get("content")
        for j, raw in enumerate(content if isinstance(content, list) else ()):
            at = f"{where}.content[{j}]"
            if (part := self.obj(raw, at)) is None:
                continue
            kind = self.get(part, "type", str, at, required=True)
            if kind in ("text", "refusal"):
                self.get(part, kind, str, at, required=True)
            if kind in ("input_audio", "file"):
                self.get(part, kind, dict, at, required=True)
            if kind == "image_url":
                image = self.get(part, "image_url", (dict, str), at, required=True)
                if isinstance(image, dict):
                    self.get(image, "url", str, f"{at}.image_url", required=True)
        calls = m.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            self.bad.add(f"{where}.tool_calls")
        for k, raw in enumerate(calls if isinstance(calls, list) else ()):
            at = f"{where}.tool_calls[{k}]"
            if (call := self.obj(raw, at)) is None:
                continue
            self.get(call, "id", str, at, required=True)
            kind = self.get(call, "type", str, at, required=True)
            if kind not in (None, "function", "custom"):
                self.bad.add(f"{at}.type")
            if kind == "custom":
                self.named(call, "custom", at, ("input",))
            if kind == "function":
                fn = self.get(call, "function", dict, at, required=True)
                if fn is not None:
                    self.get(fn, "name", str, f"{at}.function", required=True)
                    self.get(fn, "arguments", str, f"{at}.function", required=True)
        self.get(m, "name", str, where)
        self.get(m, "tool_call_id", str, where, required=m.get("role") == "tool")


def type_errors(route: str, body: dict[str, Any]) -> set[str]:
    """The fields the proxy must refuse in ``body`` (its rules, restated independently)."""
    bad = set()
    top = (("model", str), ("stream", bool), ("stream_options", dict), ("prompt_cache_key", str))
    for name, kind in top:
        if body.get(name) is not None and not isinstance(body[name], kind):
            bad.add(name)
    shapes = Shapes()
    if isinstance(body.get("stream_options"), dict):
        shapes.get(body["stream_options"], "include_usage", bool, "stream_options")
        shapes.get(body["stream_options"], "include_obfuscation", bool, "stream_options")
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
                shapes.message(m, f"messages[{i}]")
        if body.get("tools") is not None and not isinstance(body["tools"], list):
            bad.add("tools")
        if isinstance(body.get("tools"), list):
            shapes.tools(body["tools"])
        if body.get("tool_choice") is not None:
            shapes.tool_choice(body["tool_choice"])
        if body.get("response_format") is not None:
            shapes.response_format(body["response_format"])
    else:
        prompt = body.get("prompt")
        allowed: tuple[type, ...] = (str, list, dict) if route == "/completion" else (str, list)
        if prompt is not None and not isinstance(prompt, allowed):
            bad.add("prompt")
    return bad | shapes.bad


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
