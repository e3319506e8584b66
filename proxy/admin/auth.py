"""Bearer-token guard for the admin routes (``/stats``, ``/dashboard``, ``/metrics``).

Without ``--admin-token`` the admin routes are open, like the rest of the proxy. With it, every
admin request must carry the token, compared in constant time (``hmac.compare_digest``) so the
time to answer says nothing about how much of a guess was right. Two carriers are accepted:

* ``Authorization: Bearer <token>`` — what Prometheus (``authorization.credentials``), curl and
  scripts send;
* ``Authorization: Basic <base64(user:token)>`` (any user name) — what a browser sends after its
  own login prompt, so the dashboard can be opened in a browser and its ``fetch`` calls to
  ``/stats`` carry the same credentials without the token ever appearing in a URL.

A missing or wrong token gets 401 in the OpenAI error shape with both challenges.
"""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web

from proxy.errors import ProxyError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REALM = "prefixgate"


class AdminUnauthorized(ProxyError):
    """401: an admin route was called without the configured admin token."""

    status = 401
    type = "invalid_request_error"
    code = "invalid_admin_token"

    def to_response(self, *, request_id: str | None = None) -> web.Response:
        resp = super().to_response(request_id=request_id)
        resp.headers.add(hdrs.WWW_AUTHENTICATE, f'Bearer realm="{REALM}"')
        resp.headers.add(hdrs.WWW_AUTHENTICATE, f'Basic realm="{REALM}", charset="UTF-8"')
        return resp


def presented_token(authorization: str) -> str | None:
    """The token an ``Authorization`` header carries (Bearer, or Basic's password), else None."""
    scheme, _, value = authorization.strip().partition(" ")
    value = value.strip()
    if scheme.lower() == "bearer" and value:
        return value
    if scheme.lower() == "basic" and value:
        try:
            decoded = base64.b64decode(value, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, sep, password = decoded.partition(":")
        return password if sep else None
    return None


def token_matches(expected: str, authorization: str) -> bool:
    """Whether ``authorization`` carries ``expected``, compared in constant time."""
    given = presented_token(authorization)
    if given is None:
        # Still compare, so a request without a token costs the same as one with a wrong token.
        hmac.compare_digest(expected.encode(), b"")
        return False
    return hmac.compare_digest(expected.encode(), given.encode())


def require_admin(token: str | None, handler: Handler) -> Handler:
    """``handler``, guarded by ``token`` (returned unchanged when no token is configured)."""
    if not token:
        return handler

    async def guarded(request: web.Request) -> web.StreamResponse:
        if not token_matches(token, request.headers.get(hdrs.AUTHORIZATION, "")):
            raise AdminUnauthorized("this route needs the admin token: Authorization: Bearer …")
        return await handler(request)

    return guarded
