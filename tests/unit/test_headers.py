"""Header hygiene between client, proxy and backend."""

from __future__ import annotations

from multidict import CIMultiDict

from proxy.headers import downstream_response_headers, is_event_stream, upstream_request_headers


def test_upstream_drops_hop_by_hop_and_recomputed() -> None:
    """Hop-by-hop, Connection-named, Host, Content-Length and Accept-Encoding never go upstream."""
    incoming = CIMultiDict(
        {
            "Host": "proxy:8000",
            "Content-Length": "12",
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "1",
            "Keep-Alive": "timeout=5",
            "Transfer-Encoding": "chunked",
            "Accept-Encoding": "gzip",
            "Content-Type": "application/json",
            "X-Custom": "kept",
        }
    )
    out = upstream_request_headers(incoming, request_id="rid-1")
    assert dict(out) == {
        "Content-Type": "application/json",
        "X-Custom": "kept",
        "X-Request-Id": "rid-1",
    }


def test_upstream_request_id_replaces_clients() -> None:
    """The proxy's request id wins over whatever the client sent."""
    out = upstream_request_headers({"x-request-id": "bad id"}, request_id="good")
    assert out.getall("X-Request-Id") == ["good"]


def test_backend_key_replaces_client_authorization() -> None:
    """With a backend key, the client's Authorization is replaced; without, it is kept."""
    incoming = {"Authorization": "Bearer client-key"}
    assert upstream_request_headers(incoming, request_id="r")["Authorization"] == (
        "Bearer client-key"
    )
    out = upstream_request_headers(incoming, request_id="r", backend_api_key="server-key")
    assert out.getall("Authorization") == ["Bearer server-key"]


def test_upstream_drop_list() -> None:
    """Extra headers named in ``drop`` are removed, case-insensitively."""
    out = upstream_request_headers({"X-Admin": "1", "X-Ok": "2"}, request_id="r", drop=["x-admin"])
    assert "X-Admin" not in out and out["X-Ok"] == "2"


def test_downstream_drops_length_encoding_and_hops() -> None:
    """Content-Length, Content-Encoding and hop-by-hop headers are not relayed; others are."""
    upstream = CIMultiDict(
        [
            ("Content-Type", "text/event-stream"),
            ("Content-Length", "10"),
            ("Content-Encoding", "gzip"),
            ("Connection", "close"),
            ("Set-Cookie", "a=1"),
            ("Set-Cookie", "b=2"),
            ("Server", "llama.cpp"),
        ]
    )
    out = downstream_response_headers(upstream)
    assert out.getall("Set-Cookie") == ["a=1", "b=2"]
    assert set(out) == {"Content-Type", "Set-Cookie", "Server"}


def test_is_event_stream() -> None:
    """Only text/event-stream (any case, any parameters) counts as a stream."""
    assert is_event_stream("text/event-stream; charset=utf-8")
    assert is_event_stream("Text/Event-Stream")
    assert not is_event_stream("application/json")
    assert not is_event_stream(None)
    assert not is_event_stream("")
