"""prefixgate's own errors, and how they leave the proxy.

Every failure that is the proxy's own (not a status the backend sent) leaves in the OpenAI error
shape ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status; on the
Anthropic Messages route in Anthropic's, ``{"type": "error", "error": {"type", "message"}}``.
Upstream statuses and bodies pass through untouched and never become one of these.

    ProxyError                      base; carries status, type, code
    ├── BadRequest                  400 invalid_request_error (malformed JSON, non-object body…)
    ├── Unauthorized                401 invalid_request_error (missing or wrong API key / token)
    ├── RequestTimeout              408 invalid_request_error (the client stopped sending its body)
    ├── PayloadTooLarge             413 invalid_request_error
    ├── UnsupportedMediaType        415 invalid_request_error
    └── UpstreamError               5xx, the backend could not be used
        ├── BackendUnavailable      502 backend_unavailable (refused, reset, DNS, no replica)
        │   └── BackendBadAnswer    502 an answer that is not readable HTTP (the replica is up)
        └── BackendTimeout          504 backend_timeout (connect or idle read timed out)

Low-level exceptions (aiohttp, asyncio) are translated at the boundary, in ``relay.py``, with
``raise ... from exc`` so the cause survives in logs.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


class ProxyError(Exception):
    """A failure of the proxy itself, rendered as an OpenAI-shaped error response."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)

    def to_response(self, *, request_id: str | None = None) -> web.Response:
        return error_response(
            self.status,
            self.message,
            type_=self.type,
            param=self.param,
            code=self.code,
            request_id=request_id,
        )


class BadRequest(ProxyError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ProxyError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"

    def to_response(self, *, request_id: str | None = None) -> web.Response:
        resp = super().to_response(request_id=request_id)
        resp.headers["WWW-Authenticate"] = 'Bearer realm="prefixgate"'
        return resp


class NotFound(ProxyError):
    status = 404
    type = "invalid_request_error"
    code = "unknown_route"


class RequestTimeout(ProxyError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(ProxyError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(ProxyError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class UpstreamError(ProxyError):
    status = 502
    type = "backend_error"


class BackendUnavailable(UpstreamError):
    status = 502
    type = "backend_unavailable"
    code = "backend_unreachable"


class BackendBadAnswer(BackendUnavailable):
    """502: the backend answered, but not in HTTP the proxy can read (it is up: not ejected)."""

    code = "backend_bad_answer"


class BackendTimeout(UpstreamError):
    status = 504
    type = "backend_timeout"
    code = "backend_timeout"


def error_body(
    message: str, *, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    *,
    type_: str,
    param: str | None = None,
    code: str | None = None,
    request_id: str | None = None,
) -> web.Response:
    """An OpenAI-shaped JSON error response with ``status``."""
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.Response(
        status=status,
        body=orjson.dumps(error_body(message, type_=type_, param=param, code=code)),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(exc: ProxyError) -> bytes:
    """A mid-stream error as an SSE event, the way OpenAI-compatible servers send one."""
    return b"data: " + orjson.dumps(exc.body()) + b"\n\n"


# The Anthropic Messages API's error types by status (its own error shape, below).
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """The Anthropic error envelope: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ANTHROPIC_ERROR_TYPES.get(status)
    if kind is None:
        kind = "invalid_request_error" if status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(exc: ProxyError, *, request_id: str | None = None) -> web.Response:
    """``exc`` as the Anthropic Messages API reports an error, with the same status."""
    headers = {"X-Request-Id": request_id, "Request-Id": request_id} if request_id else None
    return web.Response(
        status=exc.status,
        body=orjson.dumps(anthropic_error_body(exc.status, exc.message)),
        content_type="application/json",
        headers=headers,
    )


def anthropic_sse_error_event(exc: ProxyError) -> bytes:
    """A mid-stream error as an Anthropic stream sends one (``event: error``)."""
    data = orjson.dumps(anthropic_error_body(exc.status, exc.message))
    return b"event: error\ndata: " + data + b"\n\n"
