"""A proxy on a real port in front of a fake llama-server, for the examples/ tests.

The examples are real clients (the OpenAI SDK, curl, urllib), so the proxy must listen on a TCP
port: ``aiohttp_server`` serves the fake and the proxy on free loopback ports.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from example_runner import LiveProxy, StartProxy
from fakes import Knobs, LlamaFake, serve

from proxy.app import admin_app, build_app
from proxy.config import resolve


@pytest.fixture
def start_proxy(aiohttp_server: Any) -> StartProxy:
    """Factory: a fresh fake (steered by ``knobs``) and a proxy in front of it, with ``Settings``
    overrides."""

    async def start(knobs: Knobs | None = None, **overrides: Any) -> LiveProxy:
        fake = await serve(LlamaFake(knobs), aiohttp_server)
        settings = dataclasses.replace(resolve({"backend": [fake.url]}, environ={}), **overrides)
        app = build_app(settings)
        server = await aiohttp_server(app)
        admin = await aiohttp_server(admin_app(app))
        root = str(server.make_url("")).rstrip("/")
        admin_url = str(admin.make_url("")).rstrip("/")
        return LiveProxy(base_url=root + "/v1", root_url=root, fake=fake, admin_url=admin_url)

    return start


@pytest.fixture
async def live_proxy(start_proxy: StartProxy) -> LiveProxy:
    """A proxy listening on a free port in front of a fresh fake llama-server."""
    return await start_proxy()
