"""The least an aiohttp reverse proxy can do: a benchmark reference, not a product.

One aiohttp server that forwards every request to one upstream through one pooled
``ClientSession`` and streams the answer back chunk by chunk, as it arrives. It reads nothing,
records nothing and routes nothing, so its overhead is the floor for any proxy built on aiohttp
in one process (prefixgate included): what is left between it and prefixgate is prefixgate's own
work, and what is left between it and nginx is Python and aiohttp.

Run: ``python bench/bare_relay.py --upstream URL --port N``.
"""

from __future__ import annotations

import argparse
import sys

import aiohttp
from aiohttp import web

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "upgrade"}
)
SESSION = web.AppKey("session", aiohttp.ClientSession)


def build(upstream: str) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)

    async def session_ctx(app: web.Application):  # type: ignore[no-untyped-def]
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
            app[SESSION] = session
            yield

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with app[SESSION].request(
            request.method, upstream + request.path_qs, data=body, headers=headers
        ) as upstream_resp:
            resp = web.StreamResponse(
                status=upstream_resp.status,
                headers={
                    k: v for k, v in upstream_resp.headers.items() if k.lower() not in HOP_BY_HOP
                },
            )
            await resp.prepare(request)
            async for chunk in upstream_resp.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", relay)
    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    web.run_app(
        build(args.upstream.rstrip("/")),
        host="127.0.0.1",
        port=args.port,
        access_log=None,
        print=None,
        backlog=2048,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
