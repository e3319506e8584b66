"""Client API keys, tenants, per-tenant cache partitions and redaction of logged prompts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from fakes import LlamaFake, MakeProxy, ProxyClient, VllmFake, serve
from structlog.testing import LogCapture

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


class SeeingFake(LlamaFake):
    """A llama-server fake that notes every request it receives, whatever the path."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, str | None]] = []

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def note(request: web.Request, handler: Any) -> web.StreamResponse:
            self.seen.append((request.method, request.path, request.headers.get("Authorization")))
            return await handler(request)  # type: ignore[no-any-return]

        app.middlewares.append(note)
        return app


@pytest.fixture
async def seeing_fake(aiohttp_server: Any) -> SeeingFake:
    return await serve(SeeingFake(), aiohttp_server)


async def send_raw(
    client: ProxyClient, method: str, target: str, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """Send a request line as written (an HTTP client would normalize the path first)."""
    body = orjson.dumps(chat("hi")) if method == "POST" else b""
    head = {"Host": "proxy", "Content-Type": "application/json", "Connection": "close"}
    head |= {"Content-Length": str(len(body)), **(headers or {})}
    lines = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    assert client.server.host and client.server.port
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    try:
        writer.write(f"{method} {target} HTTP/1.1\r\n{lines}\r\n".encode() + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    payload = rest.partition(b"\r\n\r\n")[2]
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:
        parsed = payload
    return int(status_line.split()[1]), parsed


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
    async with client.admin.get("/healthz") as resp:
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


# -- paths the router and the upstream URL could read differently ----------------------------

# Each would reach the backend (with the proxy's own backend key, or past validation, the
# tenant's cache_salt and the record) if the proxy routed and forwarded it as written.
AMBIGUOUS = [
    ("POST", "/healthz/../v1/chat/completions"),
    ("POST", "/healthz/%2e%2e/v1/chat/completions"),
    ("GET", "/healthz/%2E%2E/v1/models"),
    ("GET", "/healthz/.%2e/v1/models"),
    ("GET", "/readyz/../v1/models"),
    ("GET", "/stats/../v1/models"),
    ("GET", "/metrics/../v1/models"),
    ("GET", "/dashboard/../v1/models"),
    ("GET", "/dashboard/%2e%2e/%2e%2e/v1/models"),
    ("GET", "/v1/models/.."),
    ("POST", "/v1/chat/./completions"),
    ("POST", "/v1/chat/%2e/completions"),
    ("POST", "/v1/x/../chat/completions"),
    ("POST", "/v1%2fchat%2fcompletions"),
    ("POST", "/v1%2Fchat/completions"),
    ("POST", "/v1%5cchat/completions"),
    ("POST", "/v1\\chat/completions"),
    ("POST", "//v1/chat/completions"),
    ("POST", "/v1//chat/completions"),
    ("POST", "/v1/chat/completions;x=1"),
    ("GET", "/healthz/..;/v1/models"),
    ("GET", "/v1/%252e%252e/models"),
    ("GET", "/v1/models%3Flimit=1"),
    ("GET", "/v1/models%23x"),
    ("GET", "/v1/mod%20els"),
    ("GET", "/v1/%00models"),
    ("GET", "/v1/mod%C3%A9ls"),
]


@pytest.mark.parametrize("admin_token", [None, "adm-token"])
async def test_ambiguous_paths_are_refused(
    seeing_fake: SeeingFake, make_proxy: MakeProxy, admin_token: str | None
) -> None:
    client, records, _ = await make_proxy(
        seeing_fake.url,
        api_keys=("sk-good",),
        backend_api_key="sk-backend",
        admin_token=admin_token,
    )
    seeing_fake.seen.clear()  # health checks at start-up
    for method, target in AMBIGUOUS:
        for headers in ({}, bearer("sk-good")):
            status, body = await send_raw(client, method, target, headers)
            assert status == 400, (method, target, headers, body)
            assert body["error"]["code"] == "invalid_path"
            assert body["error"]["type"] == "invalid_request_error"
    assert [s for s in seeing_fake.seen if s[1] != "/health"] == []
    assert len(records) == 0


async def test_ambiguous_paths_are_refused_without_keys(
    seeing_fake: SeeingFake, make_proxy: MakeProxy
) -> None:
    """No keys: the path check still keeps validation, records and the catch-all apart."""
    client, records, _ = await make_proxy(seeing_fake.url)
    seeing_fake.seen.clear()
    for method, target in AMBIGUOUS:
        status, body = await send_raw(client, method, target)
        assert status == 400 and body["error"]["code"] == "invalid_path", target
    assert [s for s in seeing_fake.seen if s[1] != "/health"] == []
    status, _ = await send_raw(client, "POST", "/v1/chat/completions")
    assert status == 200
    assert (await records.wait(1)).route == "/v1/chat/completions"


@pytest.mark.parametrize("admin_token", [None, "adm-token"])
async def test_only_the_routes_served_are_open(
    seeing_fake: SeeingFake, make_proxy: MakeProxy, admin_token: str | None
) -> None:
    """Exempt is the route the router matched, never a path prefix or another method."""
    client, _, _ = await make_proxy(seeing_fake.url, api_keys=("sk-good",), admin_token=admin_token)
    seeing_fake.seen.clear()
    for method, target in [
        ("POST", "/healthz"),
        ("PUT", "/readyz"),
        ("POST", "/stats"),
        ("DELETE", "/dashboard"),
        ("GET", "/healthz/x"),
        ("GET", "/healthzz"),
        ("GET", "/stats/v1/models"),
        ("GET", "/metrics/x"),
        ("GET", "/dashboard/x/y"),
        ("GET", "/dashboardx"),
    ]:
        status, body = await send_raw(client, method, target)
        assert status == 401, (method, target, body)
        assert body["error"]["code"] == "invalid_api_key"
    assert [s for s in seeing_fake.seen if s[1] != "/health"] == []


async def test_normal_paths_still_work(seeing_fake: SeeingFake, make_proxy: MakeProxy) -> None:
    client, records, _ = await make_proxy(
        seeing_fake.url, api_keys=("sk-good",), backend_api_key="sk-backend"
    )
    seeing_fake.seen.clear()
    key = bearer("sk-good")
    async with client.post("/v1/chat/completions", json=chat("hi"), headers=key) as resp:
        assert resp.status == 200
    assert (await records.wait(1)).tenant == default_tenant_name("sk-good")
    async with client.get("/v1/models", params={"q": "../../x"}, headers=key) as resp:
        assert resp.status == 200  # dots in the query are not the path's business
    for target in ("/v1/models/", "/v1/model-1.5:free@x/~a_b!$&'()*+,=", "/v1/..a/b...c"):
        status, _ = await send_raw(client, "GET", target, key)
        assert status == 404  # passed through: the fake has no such route
    assert ("GET", "/v1/models/", "Bearer sk-backend") in seeing_fake.seen
    assert ("GET", "/v1/..a/b...c", "Bearer sk-backend") in seeing_fake.seen
    for path in ("/healthz", "/readyz", "/stats", "/metrics", "/dashboard", "/dashboard/app.js"):
        async with client.admin.get(path, allow_redirects=False) as resp:  # no client key needed
            assert resp.status in (200, 404), path
    async with client.admin.get("/dashboard/", allow_redirects=False) as resp:
        assert resp.status == 302


def _warnings(cap: LogCapture) -> list[dict[str, Any]]:
    return [e for e in cap.entries if e["event"] == "admin_routes_unauthenticated"]


def test_open_admin_routes_are_warned_about(tmp_path: Path, log_capture: LogCapture) -> None:
    import dataclasses

    from proxy.app import build_app
    from proxy.config import resolve

    settings = resolve({"backend": ["http://127.0.0.1:9"]}, environ={})
    build_app(settings)  # no keys: every route is as open as the others
    build_app(dataclasses.replace(settings, api_keys=("k",), admin_token="t"))
    assert _warnings(log_capture) == []
    build_app(dataclasses.replace(settings, api_keys=("k",)))
    (entry,) = _warnings(log_capture)
    assert entry["log_level"] == "warning"
    assert "--admin-token" in entry["message"] and "/stats" in entry["message"]


def test_open_routes_are_the_routes_served() -> None:
    """Every route but inference and the catch-all is open; nothing else is."""
    from proxy.app import OPEN_ROUTES, build_app
    from proxy.config import resolve
    from proxy.handlers import INFERENCE_PATHS

    app = build_app(resolve({"backend": ["http://127.0.0.1:9"]}, environ={}))
    served = {r.canonical for r in app.router.resources()}
    assert served - set(INFERENCE_PATHS) - {"/{tail}"} == set(OPEN_ROUTES)


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
