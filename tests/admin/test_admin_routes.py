"""The admin routes are the proxy's own: served from the package, never passed through."""

from __future__ import annotations

from fakes import LlamaFake, MakeProxy


async def test_dashboard_assets(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """The page, its script and stylesheet come from the package; nothing else is served."""
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.get("/dashboard") as resp:
        page = await resp.text()
        assert resp.content_type == "text/html"
        assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
    assert 'src="dashboard/dashboard.js"' in page and "http" not in page.replace("http-equiv", "")
    async with client.get("/dashboard/dashboard.js") as resp:
        assert resp.status == 200 and resp.content_type == "text/javascript"
        assert "fetch(" in await resp.text()
    async with client.get("/dashboard/dashboard.css") as resp:
        assert resp.status == 200 and resp.content_type == "text/css"
    async with client.get("/dashboard/secrets.txt") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "invalid_request_error"
    async with client.get("/dashboard/", allow_redirects=False) as resp:
        assert resp.status == 302 and resp.headers["Location"] == "../dashboard"


async def test_admin_paths_are_not_forwarded(llama_fake: LlamaFake, make_proxy: MakeProxy) -> None:
    """The backend never sees /stats or /metrics; other GET paths still pass through."""
    llama_fake.serve_metrics = True  # the backend has a /metrics of its own
    client, _, _ = await make_proxy(llama_fake.url)
    async with client.get("/metrics") as resp:
        text = await resp.text()
    assert "prefixgate_requests_total" in text or "prefixgate_store_degraded" in text
    assert "llamacpp:" not in text
    async with client.get("/v1/models") as resp:
        assert resp.status == 200  # passthrough is untouched
