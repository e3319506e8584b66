"""The admin routes are the proxy's own: served from the package, never passed through."""

from __future__ import annotations

from fakes import LlamaFake, MakeProxy


async def test_dashboard_assets(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """The page, its script and stylesheet come from the package; nothing else is served."""
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.admin.get("/dashboard") as resp:
        page = await resp.text()
        assert resp.content_type == "text/html"
        assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
    assert 'src="dashboard/dashboard.js"' in page and "http" not in page.replace("http-equiv", "")
    async with client.admin.get("/dashboard/dashboard.js") as resp:
        assert resp.status == 200 and resp.content_type == "text/javascript"
        assert "fetch(" in await resp.text()
    async with client.admin.get("/dashboard/dashboard.css") as resp:
        assert resp.status == 200 and resp.content_type == "text/css"
    async with client.admin.get("/dashboard/secrets.txt") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    async with client.admin.get("/dashboard/", allow_redirects=False) as resp:
        assert resp.status == 302 and resp.headers["Location"] == "../dashboard"


async def test_admin_paths_are_not_forwarded(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """The backend never sees /stats or /metrics; other GET paths still pass through."""
    llama_fake.serve_metrics = True  # the backend has a /metrics of its own
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.admin.get("/metrics") as resp:
        text = await resp.text()
    assert "prefixgate_requests_total" in text or "prefixgate_store_degraded" in text
    assert "llamacpp:" not in text
    async with client.get("/v1/models") as resp:
        assert resp.status == 200  # passthrough is untouched


async def test_traffic_port_passes_every_admin_path_through(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """On the traffic port /metrics, /stats, /dashboard, /healthz and /readyz are the backend's."""
    llama_fake.serve_metrics = True
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.get("/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    assert "llamacpp:" in text and "prefixgate_" not in text
    for path in ("/stats", "/dashboard", "/healthz", "/readyz"):
        async with client.get(path) as resp:
            assert resp.status == 404, path  # the fake's own answer: it has no such route
            assert "prefixgate" not in await resp.text()


async def test_backend_metrics_501_passes_through(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """A backend without --metrics answers /metrics 501 and the client gets that 501."""
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.get("/metrics") as resp:
        assert resp.status == 501
        assert (await resp.json())["error"]["type"] == "not_supported_error"
