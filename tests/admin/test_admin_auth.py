"""The admin token: open without one; with one, /stats, /dashboard and /metrics need it."""

from __future__ import annotations

import base64

import pytest
from fakes import LlamaFake, MakeProxy

from proxy.admin.auth import presented_token, token_matches

TOKEN = "s3cret-admin-token"
ADMIN = ["/stats", "/metrics", "/dashboard", "/dashboard/dashboard.js"]


@pytest.mark.parametrize("path", ADMIN)
async def test_open_without_a_token(
    llama_fake: LlamaFake, make_proxy: MakeProxy, path: str
) -> None:
    """With no admin token configured, the admin routes answer anyone."""
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.admin.get(path) as resp:
        assert resp.status == 200


@pytest.mark.parametrize("path", ADMIN)
@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong", "Bearer " + TOKEN[:-1], "Bearer", "Basic !!!", TOKEN, "Token " + TOKEN],
)
async def test_missing_or_wrong_token_is_401(
    llama_fake: LlamaFake, make_proxy: MakeProxy, path: str, authorization: str | None
) -> None:
    """Without the right token: 401 in the OpenAI error shape, with Bearer and Basic challenges."""
    client, _, _ = await make_proxy(llama_fake.url, admin_token=TOKEN)
    headers = {"Authorization": authorization} if authorization is not None else {}
    async with client.admin.get(path, headers=headers) as resp:
        assert resp.status == 401
        body = await resp.json()
        challenges = resp.headers.getall("WWW-Authenticate")
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_admin_token"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert any(c.startswith("Bearer") for c in challenges)
    assert any(c.startswith("Basic") for c in challenges)


@pytest.mark.parametrize("path", ADMIN)
async def test_bearer_and_basic_tokens_are_accepted(
    llama_fake: LlamaFake, make_proxy: MakeProxy, path: str
) -> None:
    """The token as a Bearer credential (scripts, Prometheus) or a Basic password (browsers)."""
    client, _, _ = await make_proxy(llama_fake.url, admin_token=TOKEN)
    basic = base64.b64encode(f"admin:{TOKEN}".encode()).decode()
    for authorization in ("Bearer " + TOKEN, "bearer  " + TOKEN, "Basic " + basic):
        async with client.admin.get(path, headers={"Authorization": authorization}) as resp:
            assert resp.status == 200, authorization


async def test_token_does_not_guard_inference(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """The admin token guards only the admin routes, not the traffic."""
    client, _, _ = await make_proxy(llama_fake.url, admin_token=TOKEN)
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    async with client.post("/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
    async with client.admin.get("/healthz") as resp:
        assert resp.status == 200


def test_presented_token_parsing() -> None:
    """Bearer gives its credential, Basic its password; anything else gives nothing."""
    basic = base64.b64encode(b"user:pa:ss").decode()
    assert presented_token("Bearer abc") == "abc"
    assert presented_token("Basic " + basic) == "pa:ss"
    assert presented_token("Basic " + base64.b64encode(b"nocolon").decode()) is None
    assert presented_token("Basic %%%") is None
    assert presented_token("") is None
    assert token_matches("abc", "Bearer abc") and not token_matches("abc", "Bearer abcd")
    assert not token_matches("abc", "")
