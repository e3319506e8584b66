"""Header hygiene between client, proxy and backend, as small pure functions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from aiohttp import hdrs
from multidict import CIMultiDict, CIMultiDictProxy

# RFC 9110 §7.6.1 hop-by-hop headers, plus ones the proxy must recompute itself.
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        hdrs.CONNECTION,
        hdrs.KEEP_ALIVE,
        hdrs.PROXY_AUTHENTICATE,
        hdrs.PROXY_AUTHORIZATION,
        hdrs.TE,
        hdrs.TRAILER,
        hdrs.TRANSFER_ENCODING,
        hdrs.UPGRADE,
        "Proxy-Connection",
    )
)
_RECOMPUTED = frozenset(h.lower() for h in (hdrs.CONTENT_LENGTH, hdrs.HOST))
# Never sent upstream as the client sent them (the relay inspects SSE bytes: identity asked).
_UPSTREAM_SKIP = HOP_BY_HOP | _RECOMPUTED | {hdrs.ACCEPT_ENCODING.lower()}
# aiohttp's client transparently decompresses, so the encoding header must not be relayed.
_RESPONSE_DROP = HOP_BY_HOP | {hdrs.CONTENT_LENGTH.lower(), hdrs.CONTENT_ENCODING.lower()}
_REFRAMED_DROP = HOP_BY_HOP | {hdrs.CONTENT_LENGTH.lower()}


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    value = headers.get(hdrs.CONNECTION, "")
    return {t.strip().lower() for t in value.split(",") if t.strip()}


def upstream_request_headers(
    incoming: CIMultiDictProxy[str] | Mapping[str, str],
    *,
    request_id: str,
    backend_api_key: str | None = None,
    drop: Iterable[str] = (),
) -> CIMultiDict[str]:
    """Headers to send upstream: the client's, minus hop-by-hop ones, plus the request id.

    When the proxy holds the backend's key, the client's Authorization (the key it used for the
    proxy) is replaced so the backend key never leaves the server side.
    """
    extra = {d.lower() for d in drop}
    if hdrs.CONNECTION in incoming:
        extra |= _connection_tokens(incoming)
    skip = _UPSTREAM_SKIP | extra if extra else _UPSTREAM_SKIP
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in incoming.items():
        if key.lower() not in skip:
            out.add(key, value)
    out["X-Request-Id"] = request_id
    if backend_api_key is not None:
        out[hdrs.AUTHORIZATION] = f"Bearer {backend_api_key}"
    return out


def downstream_response_headers(
    upstream: Mapping[str, str], *, bodiless: bool = False, decoded: bool = True
) -> CIMultiDict[str]:
    """Headers to relay to the client from the backend's response.

    ``bodiless``: the answer has no body (``HEAD``, ``204``, ``304``), so nothing was decoded
    and ``Content-Length`` and ``Content-Encoding`` describe the resource: they stay as sent.
    ``decoded=False``: the body is relayed as it came (``proxy.wire``), so an encoding the
    backend applied stays named; only the framing (``Content-Length``) is the proxy's.
    """
    drop = HOP_BY_HOP if bodiless else _RESPONSE_DROP if decoded else _REFRAMED_DROP
    skip = drop | _connection_tokens(upstream)
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in upstream.items():
        if key.lower() not in skip:
            out.add(key, value)
    return out


def is_event_stream(content_type: str | None) -> bool:
    return bool(content_type) and "text/event-stream" in (content_type or "").lower()
