"""Properties of the request path's pure parts over hostile input, straight on the functions.

Whatever bytes arrive, parsing answers a dict or the client's error (``BadRequest`` /
``UnsupportedMediaType``), never anything else. Whatever JSON object passes validation, the
rest of the path (canonicalize, fingerprint, let the dialect prepare it, serialize it for the
backend) never raises. The canonicalizer and the fingerprint never raise on any JSON object at
all, valid request or not, lone surrogates and huge integers included; the nesting limit is
exact; the SSE splitter gives the same events however the bytes are cut, in linear time; and
no canonicalizer rule backtracks on long hostile text.
"""

from __future__ import annotations

import re
import time
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.backends import CHAT, COMPLETIONS, NATIVE_COMPLETION, Dialect, dialect_named
from proxy.canonical import Canonicalizer, config_from_mapping
from proxy.errors import BadRequest, UnsupportedMediaType
from proxy.fingerprint import fingerprint
from proxy.sse import EventSplitter
from proxy.validation import MAX_JSON_DEPTH, parse_object, validate_inference
from tests.reliability.strategies import request_body, wild_json

ROUTES = (CHAT, COMPLETIONS, NATIVE_COMPLETION)
PROPERTIES = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
CANONICALIZER = Canonicalizer(
    config_from_mapping({"patterns": [{"name": "ticket", "regex": r"TICKET-\d+"}]})
)
DIALECTS: list[Dialect] = [dialect_named(n) for n in ("llamacpp", "vllm", "openai")]


def forwardable(route: str, body: dict[str, Any]) -> bytes:
    """What the proxy does with an accepted body, short of the network; returns the bytes."""
    result = CANONICALIZER.apply(route, body)
    fingerprint(route, result.body, block_bytes=16)
    out = b""
    for dialect in DIALECTS:
        sent = dict(result.body)
        dialect.prepare(route, sent, stream=sent.get("stream") is True)
        dialect.partition_cache(sent, "tenant-a")
        out = orjson.dumps(sent)
    return out


@PROPERTIES
@given(st.binary(max_size=400), st.sampled_from(["application/json", "text/plain", ""]))
def test_parse_answers_a_dict_or_the_clients_error(raw: bytes, content_type: str) -> None:
    """Arbitrary bytes parse to a dict or raise the client's error, nothing else."""
    try:
        body = parse_object(raw, content_type)
    except (BadRequest, UnsupportedMediaType):
        return
    assert isinstance(body, dict)


@PROPERTIES
@given(request_body, st.sampled_from(ROUTES))
def test_whatever_passes_validation_can_be_forwarded(body: dict[str, Any], route: str) -> None:
    """A body that validation accepts goes through canonicalization, fingerprinting, every
    dialect's preparation and serialization without an exception; one it refuses is refused
    with a 400 naming a field."""
    raw = orjson.dumps(body)
    parsed = parse_object(raw, "application/json")
    try:
        validate_inference(route, parsed)
    except BadRequest as exc:
        assert exc.status == 400 and exc.param
        assert exc.param.split("[")[0].split(".")[0] in body or exc.param == "messages"
        return
    assert orjson.loads(forwardable(route, parsed)) is not None


@PROPERTIES
@given(st.dictionaries(st.text(max_size=10), wild_json, max_size=6), st.sampled_from(ROUTES))
def test_canonicalizer_and_fingerprint_never_raise(body: dict[str, Any], route: str) -> None:
    """Any JSON object at all, lone surrogates and big integers included: the canonicalizer
    and the fingerprint answer, deterministically."""
    first = CANONICALIZER.apply(route, body)
    again = CANONICALIZER.apply(route, body)
    assert first.fired == again.fired
    assert fingerprint(route, first.body) == fingerprint(route, again.body)


@PROPERTIES
@given(request_body, st.sampled_from(ROUTES))
def test_canonicalizer_and_fingerprint_on_request_shapes(body: dict[str, Any], route: str) -> None:
    """Request-shaped bodies with wrong types anywhere: no rule fails (none is skipped for an
    error), and canonicalizing twice changes nothing more."""
    errors_before = dict(CANONICALIZER.error_counters)
    first = CANONICALIZER.apply(route, body)
    assert dict(CANONICALIZER.error_counters) == errors_before
    second = CANONICALIZER.apply(route, first.body)
    assert orjson.dumps(second.body) == orjson.dumps(first.body)
    fingerprint(route, first.body)


def nest(depth: int, where: str) -> bytes:
    """A body whose deepest container is ``depth`` levels down (the body itself is level 1):
    objects and arrays alternating in an extra field, or arrays in a message's content."""
    if where == "field":
        opens = [b'{"a": ' if i % 2 else b"[" for i in range(depth - 1)]
        closes = [b"}" if i % 2 else b"]" for i in range(depth - 1)]
        inner = b"".join(opens) + b"1" * (opens[-1] != b"[") + b"".join(reversed(closes))
        return b'{"metadata": ' + inner + b"}"
    inner_depth = depth - 3
    content = b"[" * inner_depth + b"]" * inner_depth
    return b'{"messages": [{"role": "user", "content": ' + content + b"}]}"


@settings(max_examples=60, deadline=None)
@given(st.integers(4, 400), st.sampled_from(["field", "content"]))
def test_nesting_limit_is_exact(depth: int, where: str) -> None:
    """Bodies up to the limit parse and can be forwarded; one level more is refused."""
    raw = nest(depth, where)
    real = _depth(orjson.loads(raw))
    try:
        body = parse_object(raw, "application/json")
    except BadRequest as exc:
        assert real > MAX_JSON_DEPTH, (real, exc.message)
        assert "nested more than" in exc.message
        return
    assert real <= MAX_JSON_DEPTH
    forwardable(CHAT, {**body, "stream": True})


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


_REFERENCE = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def reference_split(data: bytes) -> tuple[list[bytes], bytes]:
    """The events of ``data`` fed in one piece, the plain way."""
    events, pos = [], 0
    for m in _REFERENCE.finditer(data):
        events.append(data[pos : m.end()])
        pos = m.end()
    return events, data[pos:]


SSE_PIECES = st.sampled_from([b"a", b"data: x", b"\n", b"\r", b"\r\n", b":"])


@settings(max_examples=300, deadline=None)
@given(st.lists(SSE_PIECES, max_size=60), st.data())
def test_sse_splitter_ignores_chunking(parts: list[bytes], data: st.DataObject) -> None:
    """However a byte stream is cut, the splitter yields the events of the uncut stream."""
    stream = b"".join(parts)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(stream)), max_size=12))))
    splitter = EventSplitter()
    events: list[bytes] = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        events.extend(splitter.feed(stream[a:b]))
    rest = splitter.flush()
    assert b"".join(events) + rest == stream  # nothing lost, nothing added, in order
    if not _ambiguous(stream, cuts):
        assert (events, rest) == reference_split(stream)


def _ambiguous(stream: bytes, cuts: list[int]) -> bool:
    """A cut between ``\\r`` and ``\\n`` can end an event early (``\\r\\r`` then ``\\n``) in
    any incremental SSE reader; such cuts are left out of the comparison."""
    return any(0 < c < len(stream) and stream[c - 1 : c + 1] == b"\r\n" for c in cuts)


def test_sse_splitter_is_linear_in_a_long_event() -> None:
    """A 16 MiB event arriving in 64 KiB chunks is split in well under a second per 16 MiB
    (quadratic rescanning took about 20 s)."""
    event = b"data: " + b"x" * (16 * 1024 * 1024) + b"\n\n"
    splitter = EventSplitter()
    start = time.perf_counter()
    got = [e for i in range(0, len(event), 65536) for e in splitter.feed(event[i : i + 65536])]
    elapsed = time.perf_counter() - start
    assert got == [event]
    assert elapsed < 2.0, f"{elapsed:.2f} s"


HOSTILE_TEXT = {
    "digits": "1" * 200_000,
    "dates": "2026-11-30 " * 20_000,
    "almost_dates": "2026-11-3" * 20_000,
    "weekdays": "Monday, November " * 10_000,
    "times": "22:41:" * 30_000,
    "hex": "deadbeef" * 25_000,
    "uuid_prefixes": "550e8400-e29b-41d4-" * 10_000,
    "placeholders": "[[date_" * 25_000,
    "tickets": "TICKET-" * 25_000,
    "whitespace": " \t" * 100_000 + "\r\n" * 50_000,
}


@pytest.mark.parametrize("kind", sorted(HOSTILE_TEXT))
def test_canonicalizer_has_no_catastrophic_backtracking(kind: str) -> None:
    """200 KB of text built to make a regex backtrack, in a system prompt and a tool
    description, canonicalizes in well under a second."""
    hostile = HOSTILE_TEXT[kind]
    body = {
        "messages": [
            {"role": "system", "content": hostile},
            {"role": "user", "content": "hi"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "description": hostile}}],
    }
    start = time.perf_counter()
    result = CANONICALIZER.apply(CHAT, body)
    fingerprint(CHAT, result.body)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{kind}: {elapsed:.2f} s"
