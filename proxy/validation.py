"""A client's request body: read within limits, parsed, and checked before anything else.

``read_body`` bounds the size (413) and the silence between pieces (408); ``parse_object``
accepts one JSON object (400/415, and no deeper than ``MAX_JSON_DEPTH``); ``validate_inference``
checks the fields the proxy itself routes, fingerprints, canonicalizes and relays by, with
OpenAI's error wording. Everything else in the body is the backend's to judge.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from proxy.api_validation import validate_api
from proxy.backends import API_ROUTES, CHAT, NATIVE_COMPLETION
from proxy.errors import BadRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType
from proxy.hosted import PROMPT_CACHE_KEY
from proxy.shapes import (
    check_message,
    check_response_format,
    check_stream_options,
    check_tool_choice,
    check_tools,
    json_type,
)
from proxy.shapes import invalid_type as _invalid_type
from proxy.shapes import missing as _missing


async def read_body(request: web.Request, limit: int, *, idle_s: float | None = None) -> bytes:
    """The request body, bounded by ``limit`` (413 above it).

    ``idle_s`` bounds the silence between two pieces of the body (nginx's
    ``client_body_timeout``): a client that stops sending, or a chunked body that never ends,
    gets a 408 instead of holding the request open for ever. A slow but steady upload is fine.
    """
    if request.content_length is not None and request.content_length > limit:
        raise PayloadTooLarge(f"request body is {request.content_length} bytes; limit {limit}")
    chunks: list[bytes] = []
    size = 0
    content = request.content
    loop = asyncio.get_running_loop()
    try:
        if content.is_eof():
            # The whole body came with the head (the common case): it is in the buffer, and
            # taking it needs no wait and no deadline.
            body = content.read_nowait(-1)
            if len(body) > limit:
                raise _too_large(limit)
            return body
        # One deadline, moved on by every piece. The pieces are the reads as they arrived
        # (``readchunk``; ``readany`` would join what is buffered first), joined once at the end.
        async with asyncio.timeout(idle_s) as silence:
            while True:
                chunk, boundary = await content.readchunk()
                if not chunk:
                    # The end of one piece of a chunked body: more may follow. An empty body's
                    # reader says the same forever, and is at its end.
                    if boundary and not content.at_eof():
                        continue
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                if idle_s is not None:
                    silence.reschedule(loop.time() + idle_s)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)  # one copy at most
    except TimeoutError as exc:
        raise RequestTimeout(f"no part of the request body arrived for {idle_s:g} s") from exc
    except (web.RequestPayloadError, HttpProcessingError) as exc:  # bad chunking or encoding
        cause = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else exc
        detail = cause.message if isinstance(cause, HttpProcessingError) else str(cause)
        raise BadRequest(f"request body could not be decoded: {detail.strip()}") from exc


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")


# Deeper bodies are refused: the proxy must be able to serialize what it forwards, and the JSON
# encoder stops at 255 levels. No OpenAI-style request comes near (tool schemas nest a dozen).
MAX_JSON_DEPTH = 128


def parse_object(body: bytes, content_type: str) -> dict[str, Any]:
    """Parse a JSON object body; anything else is the client's error (400/415)."""
    if content_type.startswith("multipart/"):
        raise UnsupportedMediaType(f"expected application/json, got {content_type}")
    if not body:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise BadRequest(f"request body must be a JSON object, not {json_type(obj)}")
    if _nested_deeper(obj, MAX_JSON_DEPTH):
        raise BadRequest(f"request body is nested more than {MAX_JSON_DEPTH} levels deep")
    return obj


def _nested_deeper(obj: dict[str, Any], limit: int) -> bool:
    """Whether containers in ``obj`` nest more than ``limit`` levels (the body itself is 1)."""
    # A walk over the containers only: its cost follows the number of JSON values, not the
    # bytes (counting brackets first costs more than the walk on a text-heavy body).
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        for child in node.values() if type(node) is dict else node:
            if type(child) is dict or type(child) is list:
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


# Top-level fields the proxy itself reads or rewrites, with the types it accepts (null counts as
# absent, as in OpenAI's API).
_TOP_LEVEL = (
    ("model", str, "a string"),
    ("stream", bool, "a boolean"),
    ("stream_options", dict, "an object"),
    (PROMPT_CACHE_KEY, str, "a string"),
)


def validate_inference(route: str, body: dict[str, Any]) -> None:
    """Reject, with a 400 naming the field, what the proxy must understand and cannot, and
    the malformed structures OpenAI's API rejects.

    The first are the fields it routes, fingerprints, canonicalizes and relays by: ``model``,
    ``stream``, ``stream_options``, ``prompt_cache_key``, the chat ``messages`` (an array of
    objects with a string ``role`` and string, array or null ``content``) and ``tools``, the
    completion ``prompt``. The second are the shapes of ``tools``, ``tool_choice``,
    ``response_format``, ``stream_options``, content parts and ``tool_calls``
    (``proxy.shapes``), which a backend may otherwise answer with a 500. Every other field and
    value (``max_tokens``, ``stop``, ``temperature``, a tool's name…) is the backend's to judge:
    it answers its own 4xx, relayed unchanged.
    """
    if route in API_ROUTES:  # Responses and Anthropic Messages: their own fields and wording
        validate_api(route, body)
        return
    for name, kind, expected in _TOP_LEVEL:
        value = body.get(name)
        if value is not None and not isinstance(value, kind):
            raise _invalid_type(name, expected, value)
    opts = body.get("stream_options")
    if opts is not None:
        check_stream_options(opts)
    if route == CHAT:
        _validate_chat(body)
        return
    prompt = body.get("prompt")
    if prompt is None or isinstance(prompt, str | list):
        return
    if route == NATIVE_COMPLETION and isinstance(prompt, dict):
        return  # llama.cpp's multimodal prompt object
    raise _invalid_type("prompt", "a string or an array", prompt)


def _validate_chat(body: dict[str, Any]) -> None:
    messages = body.get("messages")
    if messages is None:
        raise _missing("messages")
    if not isinstance(messages, list):
        raise _invalid_type("messages", "an array", messages)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _invalid_type(f"messages[{i}]", "an object", message)
        role = message.get("role")
        if role is None:
            raise _missing(f"messages[{i}].role")
        if not isinstance(role, str):
            raise _invalid_type(f"messages[{i}].role", "a string", role)
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _invalid_type(f"messages[{i}].content", "a string, an array or null", content)
        bare = len(message) == 2 and "content" in message and type(content) is not list
        if not bare or role == "tool":  # a bare {role, content: "..."} has nothing more
            check_message(message, i)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _invalid_type("tools", "an array", tools)
        check_tools(tools)
    choice = body.get("tool_choice")
    if choice is not None:
        check_tool_choice(choice)
    fmt = body.get("response_format")
    if fmt is not None:
        check_response_format(fmt)
