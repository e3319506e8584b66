"""Client API keys, tenants, per-tenant cache partitions and redaction of logged prompts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fakes import LlamaFake, MakeProxy, VllmFake

from proxy.auth import ApiKeys, KeysFileError, default_tenant_name, load_keys, parse_keys_file
from proxy.backends.vllm import tenant_cache_salt
from proxy.config import ConfigError
from proxy.redact import Redactor
from proxy.state import STATE

SYSTEM = " ".join(f"rule{i}" for i in range(80))


def chat(question: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        **extra,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- keys ------------------------------------------------------------------------------------


def test_keys_file_names_tenants_and_rejects_bad_lines(tmp_path: Path) -> None:
    keys = parse_keys_file("# comment\n\nsk-alpha team-a\nsk-beta\n")
    assert keys == {"sk-alpha": "team-a", "sk-beta": default_tenant_name("sk-beta")}
    assert default_tenant_name("sk-beta").startswith("key-")
    assert "sk-beta" not in default_tenant_name("sk-beta")
    with pytest.raises(KeysFileError, match=":1:"):
        parse_keys_file("a b c")
    with pytest.raises(KeysFileError, match="tenant must be"):
        parse_keys_file("key team/a")
    with pytest.raises(KeysFileError, match="cannot read"):
        load_keys(keys_file=str(tmp_path / "missing"))


def test_tenant_for_checks_every_key() -> None:
    keys = load_keys(["k1"], None)
    assert keys.tenant_for("Bearer k1") == default_tenant_name("k1")
    assert keys.tenant_for("bearer   k1 ") == default_tenant_name("k1")
    assert keys.tenant_for("Bearer k2") is None
    assert keys.tenant_for("Basic k1") is None
    assert keys.tenant_for(None) is None
    assert not ApiKeys(by_digest={}).enabled


async def test_requests_need_a_valid_key(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    client, records, _ = await make_proxy(llama_fake.url, api_keys=("sk-good",))
    for headers in ({}, bearer("sk-bad"), {"Authorization": "sk-good"}):
        async with client.post("/v1/chat/completions", json=chat("hi"), headers=headers) as resp:
            assert resp.status == 401
            err = (await resp.json())["error"]
            assert err["code"] == "invalid_api_key"
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        async with client.get("/v1/models", headers=headers) as resp:
            assert resp.status == 401
    assert llama_fake.last_body is None  # nothing reached the backend
    async with client.post("/v1/chat/completions", json=chat("hi"), headers=bearer("sk-good")) as r:
        assert r.status == 200
    # The client's key is the proxy's, never forwarded to the backend.
    assert "Authorization" not in llama_fake.last_headers
    async with client.get("/healthz") as resp:
        assert resp.status == 200
    record = await records.wait(1)
    assert record.tenant == default_tenant_name("sk-good")


async def test_backend_key_replaces_client_key(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    client, _, _ = await make_proxy(
        llama_fake.url, api_keys=("sk-client",), backend_api_key="sk-backend"
    )
    async with client.post("/v1/chat/completions", json=chat("hi"), headers=bearer("sk-client")):
        pass
    assert llama_fake.last_headers["Authorization"] == "Bearer sk-backend"


# -- tenants ---------------------------------------------------------------------------------


async def test_tenants_have_separate_indexes_and_stats(
    llama_fake: LlamaFake, make_proxy: MakeProxy, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("sk-a team-a\nsk-b team-b\n")
    client, records, app = await make_proxy(llama_fake.url, api_keys_file=str(keys_file))
    for key in ("sk-a", "sk-a", "sk-b"):
        async with client.post("/v1/chat/completions", json=chat("q"), headers=bearer(key)) as r:
            assert r.status == 200
    await records.wait(3)
    a1, a2, b1 = records[0], records[1], records[2]
    assert (a1.tenant, a2.tenant, b1.tenant) == ("team-a", "team-a", "team-b")
    # team-a's second request is predicted from team-a's index; team-b shares nothing with it.
    assert a2.predicted_cached_tokens and a2.predicted_cached_tokens > 0
    assert b1.predicted_cached_tokens == 0
    assert a1.prefix_anchor != b1.prefix_anchor  # the tenant seeds the fingerprint chain
    state = app[STATE]
    await state.writer.drain()
    now = time.time()
    a = await state.store.query_stats(since_s=now - 300, until_s=now + 60, namespace="team-a")
    b = await state.store.query_stats(since_s=now - 300, until_s=now + 60, namespace="team-b")
    assert (a.requests, b.requests) == (2, 1)


async def test_tenant_header_refines_but_cannot_escape_the_key(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    client, records, _ = await make_proxy(
        llama_fake.url, api_keys=("sk-a",), tenant_header="X-Tenant"
    )
    headers = {**bearer("sk-a"), "X-Tenant": "alice"}
    async with client.post("/v1/chat/completions", json=chat("q"), headers=headers) as r:
        assert r.status == 200
    assert (await records.wait(1)).tenant == f"{default_tenant_name('sk-a')}/alice"
    headers["X-Tenant"] = "../team-b"
    async with client.post("/v1/chat/completions", json=chat("q"), headers=headers) as r:
        assert r.status == 400
        assert (await r.json())["error"]["param"] == "X-Tenant"


async def test_tenant_header_alone_names_the_tenant(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    client, records, _ = await make_proxy(llama_fake.url, tenant_header="X-Tenant")
    async with client.post("/v1/chat/completions", json=chat("q"), headers={"X-Tenant": "t1"}):
        pass
    async with client.post("/v1/chat/completions", json=chat("q")):
        pass
    await records.wait(2)
    assert [r.tenant for r in records] == ["t1", "default"]


async def test_vllm_cache_salt_per_tenant(vllm_fake: VllmFake, make_proxy: MakeProxy) -> None:
    client, _, _ = await make_proxy(vllm_fake.url, api_keys=("sk-a", "sk-b"))
    salts = []
    for key, extra in (("sk-a", {}), ("sk-b", {}), ("sk-a", {"cache_salt": "sk-b-salt"})):
        body = chat("q", **extra)
        async with client.post("/v1/chat/completions", json=body, headers=bearer(key)) as r:
            assert r.status == 200
        salts.append(vllm_fake.last_body["cache_salt"])
    tenant_a = default_tenant_name("sk-a")
    assert salts[0] == tenant_cache_salt(tenant_a)
    assert len(set(salts)) == 3  # per tenant, and a client salt only subdivides its own
    for salt in salts:
        assert len(salt) == 64 and "/" not in salt  # within vLLM's cache_salt validator


async def test_llama_body_untouched_by_tenancy(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    client, _, _ = await make_proxy(llama_fake.url, api_keys=("sk-a",))
    async with client.post("/v1/chat/completions", json=chat("q"), headers=bearer("sk-a")):
        pass
    assert "cache_salt" not in llama_fake.last_body


def test_bad_keys_file_is_a_config_error(tmp_path: Path) -> None:
    import dataclasses

    from proxy.app import build_app
    from proxy.config import resolve

    bad = tmp_path / "keys"
    bad.write_text("a b c\n")
    settings = dataclasses.replace(
        resolve({"backend": ["http://127.0.0.1:9"]}, environ={}), api_keys_file=str(bad)
    )
    with pytest.raises(ConfigError):
        build_app(settings)
    with pytest.raises(ConfigError, match="redact"):
        build_app(dataclasses.replace(settings, api_keys_file=None, redact_patterns=("(",)))


# -- privacy ---------------------------------------------------------------------------------


def test_redactor_defaults() -> None:
    r = Redactor.build()
    text = (
        "mail bob.smith@example.com, key sk-proj-abcdefghijklmnop1234, "
        "aws AKIAABCDEFGHIJKLMNOP, Authorization: Bearer abcdefghijklmnopqrstuvwx"
    )
    out = r.text(text)
    for secret in (
        "bob.smith@example.com",
        "sk-proj-abcdef",
        "AKIAABCD",
        "abcdefghijklmnopqrstuvwx",
    ):
        assert secret not in out
    assert "[REDACTED:email]" in out and "[REDACTED:api_key]" in out
    assert r.value({"a": ["x@y.io", 3, None]}) == {"a": ["[REDACTED:email]", 3, None]}
    assert Redactor.build(defaults=False).text("x@y.io") == "x@y.io"
    assert Redactor.build([r"ticket-\d+"], defaults=False).text("ticket-42") == "[REDACTED:custom]"


async def test_logged_prompts_are_redacted(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    client, records, _ = await make_proxy(llama_fake.url, log_prompts=True)
    async with client.post("/v1/chat/completions", json=chat("mail me at eve@corp.example")):
        pass
    record = await records.wait(1)
    logged = str(record.as_dict()["body"])
    assert "eve@corp.example" not in logged and "[REDACTED:email]" in logged


async def test_prompts_not_logged_by_default(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    client, records, _ = await make_proxy(llama_fake.url)
    async with client.post("/v1/chat/completions", json=chat("secret question")):
        pass
    record = await records.wait(1)
    assert "secret question" not in str(record.as_dict())
    assert "rule0" not in str(record.as_dict())
