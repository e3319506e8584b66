"""The request-path check: what it refuses, and that every path it lets through is read the
same way by the router and by the HTTP client that builds the upstream URL."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from yarl import URL

from proxy.auth import path_problem

BASE = "http://127.0.0.1:8080"


def decoded(raw: str) -> str:
    """The path as aiohttp decodes a request target (``request.path``)."""
    return URL.build(path=raw, encoded=True).path


def problem(raw: str) -> str | None:
    return path_problem(raw, decoded(raw))


@pytest.mark.parametrize(
    "raw",
    [
        "/healthz/../v1/chat/completions",
        "/healthz/%2e%2e/v1/models",
        "/healthz/%2E./v1/models",
        "/v1/chat/./completions",
        "/v1/chat/%2e/completions",
        "/v1/models/..",
        "/v1/models/.",
        "/v1%2fchat/completions",
        "/v1%2Fchat/completions",
        "/v1%5cchat",
        "/v1\\chat",
        "//v1/chat/completions",
        "/v1//chat/completions",
        "/v1/chat/completions;a=b",
        "/x/..;/v1/models",
        "/v1/%252e%252e/models",
        "/v1/models%3Fa=b",
        "/v1/models%23f",
        "/v1/a%20b",
        "/v1/%00",
        "/v1/%c3%a9",
        "/v1/é",
        "v1/models",
        "",
    ],
)
def test_refused(raw: str) -> None:
    assert problem(raw) is not None


@pytest.mark.parametrize(
    "raw",
    [
        "/",
        "/v1/chat/completions",
        "/v1/models/",
        "/dashboard/",
        "/dashboard/dashboard.js",
        "/v1/models/org:model-1.5@rev~2",
        "/v1/..a/b../...",
        "/v1/%41BC",  # an encoded letter decodes to the same path the client sends
        "/v1/file%2ejson",
        "/slots/0",
        "/v1/x!$&'()*+,=",
    ],
)
def test_accepted(raw: str) -> None:
    assert problem(raw) is None


TOKENS = st.sampled_from(
    [
        "/", "//", ".", "..", "%2e", "%2E", "%2f", "%2F", "%5c", "\\", "%25", "%3f", "%23",
        ";", "a", "Z", "9", "-", "_", "~", "+", "%41", "%20", " ", "é", "%c3%a9", ":", "@",
        "!", "=", "%00", "%", "..;",
    ]
)  # fmt: skip


@settings(max_examples=1500, deadline=None)
@given(st.lists(TOKENS, max_size=12))
def test_accepted_paths_are_never_rewritten(tokens: list[str]) -> None:
    """Router (``path_safe``), ``request.path`` and the upstream URL agree on every path let
    through: the client neither normalizes it nor splits a query or fragment off it."""
    raw = "/" + "".join(tokens)
    try:
        url = URL.build(path=raw, encoded=True)
    except ValueError:
        return  # aiohttp would not parse it either
    path = url.path
    if path_problem(url.raw_path, path) is not None:
        return
    assert url.path_safe == path  # what the router matches
    upstream = URL(BASE + path)  # what the pass-through route sends
    assert upstream.path == path
    assert upstream.raw_query_string == "" and upstream.raw_fragment == ""
    segments = path.split("/")[1:]
    assert "." not in segments and ".." not in segments
    assert "" not in segments[:-1]
