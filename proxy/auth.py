"""Client authentication and tenants.

With API keys configured (``--api-key`` repeated, or ``--api-keys-file``), every request outside
the health and admin routes must carry ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``,
as the Anthropic SDK sends it); anything else is a 401 in the OpenAI error shape (Anthropic's on
its Messages route). The presented key is hashed with SHA-256 and its digest compared with
every configured key's digest by ``hmac.compare_digest`` (no early exit), so the time taken does
not depend on how much of a key an attacker guessed right. The client's key is never forwarded
(neither header): the backend sees the proxy's own ``--backend-api-key`` or no Authorization.

A **tenant** is derived from the key (its name in the keys file, else ``key-`` and the first 12
hex digits of its digest) and, when ``--tenant-header`` is set, refined by that header: behind one
key, ``X-Tenant: team-a`` makes the tenant ``<key tenant>/team-a``, so a header can subdivide a
key's tenant but never reach another key's. With no keys the header alone names the tenant
(for deployments where a trusted gateway in front sets it); with neither, everyone is the
``default`` tenant. Each tenant has its own prefix index and statistics (the store namespace),
and on vLLM its own partition of the backend's prefix cache (``cache_salt``, see
``proxy.backends.vllm.tenant_cache_salt``).

Paths. Which routes are exempt is decided by the route the router actually matched (its
template: ``/healthz``, ``/dashboard/{asset}``…), never by a path prefix, so no spelling of a
path can be exempt and reach another route. And before any of that, ``refuse_ambiguous_paths``
answers 400 (``invalid_path``) to a path that the router and the upstream URL could read
differently. The router matches the percent-decoded path; the pass-through route forwards to
``backend URL + decoded path``, which the HTTP client normalizes (``/a/../b`` is ``/b``), and
backends or front-ends may normalize further (``//`` merged, ``;params`` dropped, a backslash
read as ``/``). So ``/healthz/../v1/chat/completions`` would be routed as an unknown path, forwarded
with the proxy's backend key, and served as chat completions; ``/v1/chat/./completions`` would
skip validation, the tenant's ``cache_salt`` and the record. A path is refused when:

- it holds a ``.`` or ``..`` segment, raw or percent-encoded (``%2e``);
- it holds an encoded slash or backslash (``%2f``, ``%5c``), which the router keeps inside one
  segment and the upstream URL does not;
- it holds an empty segment (``//``) anywhere but at the very end (``/dashboard/``);
- once decoded it holds anything but ``A-Z a-z 0-9 - . _ ~ ! $ & ' ( ) * + , = : @ /``: no
  ``%`` (double encoding), ``;`` (path parameters), ``?`` or ``#`` (they would start the query
  or fragment of the upstream URL), backslashes, whitespace, control or non-ASCII characters.

Every path left is one that the router, the HTTP client and the backend all read the same way
(``tests/unit/test_path_guard.py`` checks that the client never rewrites one).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import hdrs, web
from aiohttp.typedefs import Middleware
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.backends.apis import MESSAGES
from proxy.errors import BadRequest, ProxyError, Unauthorized, anthropic_error_response
from proxy.state import REQUEST_ID, TENANT
from proxy.store import DEFAULT_NAMESPACE

X_API_KEY = "X-Api-Key"  # how the Anthropic SDK sends its key; taken like a bearer token
_TENANT_OK = re.compile(r"^[A-Za-z0-9._\-]{1,64}$")
# A decoded path: RFC 3986 unreserved and sub-delims but ";", then ":" "@" and "/".
_PATH_OK = re.compile(r"/[A-Za-z0-9\-._~!$&'()*+,=:@/]*")
_ENCODED_SEPARATOR = re.compile(r"%(?:2f|5c)", re.IGNORECASE)
_BEARER = re.compile(r"^\s*Bearer\s+(\S+)\s*$", re.IGNORECASE)


class KeysFileError(ValueError):
    """The API keys file cannot be read or has a malformed line."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The configured client keys, by SHA-256 digest, with the tenant each one names."""

    by_digest: Mapping[bytes, str]

    @property
    def enabled(self) -> bool:
        return bool(self.by_digest)

    def tenant_for(self, authorization: str | None) -> str | None:
        """The tenant of the key in an ``Authorization`` header, or None when it is not valid."""
        if not authorization:
            return None
        m = _BEARER.match(authorization)
        if m is None:
            return None
        presented = _digest(m.group(1))
        found: str | None = None
        for digest, tenant in self.by_digest.items():
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found


def default_tenant_name(key: str) -> str:
    """The tenant of a key configured without a name: stable, and reveals nothing of the key."""
    return "key-" + _digest(key).hex()[:12]


def parse_keys_file(text: str, *, source: str = "keys file") -> dict[str, str]:
    """``{key: tenant}`` from lines ``KEY [TENANT]``; blank lines and ``#`` comments skipped."""
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) > 2:
            raise KeysFileError(f"{source}:{n}: expected 'KEY [TENANT]', got {len(parts)} fields")
        key = parts[0]
        tenant = parts[1] if len(parts) == 2 else default_tenant_name(key)
        if not _TENANT_OK.match(tenant):
            raise KeysFileError(
                f"{source}:{n}: tenant must be 1-64 characters of A-Z a-z 0-9 . _ -"
            )
        out[key] = tenant
    return out


def load_keys(keys: Iterable[str] = (), keys_file: str | None = None) -> ApiKeys:
    """Keys given on the command line (tenant from the key) and from a keys file."""
    mapping = {k: default_tenant_name(k) for k in keys if k}
    if keys_file:
        try:
            text = Path(keys_file).read_text()
        except OSError as exc:
            raise KeysFileError(f"cannot read {keys_file}: {exc}") from exc
        mapping.update(parse_keys_file(text, source=keys_file))
    return ApiKeys(by_digest={_digest(k): t for k, t in mapping.items()})


def tenant_of(
    keys: ApiKeys,
    *,
    authorization: str | None,
    tenant_header_value: str | None,
) -> str | None:
    """The request's tenant, or None when keys are required and the request has no valid one.

    Raises ``ValueError`` for a tenant header that is present but not a valid tenant name.
    """
    base: str | None
    if keys.enabled:
        base = keys.tenant_for(authorization)
        if base is None:
            return None
    else:
        base = None
    if tenant_header_value is not None:
        sub = tenant_header_value.strip()
        if not _TENANT_OK.match(sub):
            raise ValueError("tenant header must be 1-64 characters of A-Z a-z 0-9 . _ -")
        return f"{base}/{sub}" if base else sub
    return base or DEFAULT_NAMESPACE


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def path_problem(raw_path: str, path: str) -> str | None:
    """Why a request path is ambiguous, or None when it is not.

    ``raw_path`` is the path as sent (percent-encoded, without the query), ``path`` the same
    path decoded (what the router matches and the pass-through route forwards).
    """
    if _ENCODED_SEPARATOR.search(raw_path):
        return "an encoded slash or backslash (%2F, %5C)"
    if not _PATH_OK.fullmatch(path):
        return "a character outside A-Z a-z 0-9 - . _ ~ ! $ & ' ( ) * + , = : @ /"
    segments = path.split("/")
    last = len(segments) - 1
    for i, segment in enumerate(segments[1:], start=1):
        if segment in (".", ".."):
            return "a '.' or '..' segment"
        if not segment and i != last:
            return "an empty segment ('//')"
    return None


@web.middleware
async def refuse_ambiguous_paths(request: web.Request, handler: Handler) -> web.StreamResponse:
    """400 ``invalid_path`` for a path that the router and the upstream URL could read
    differently (see the module docstring). It runs before authentication and any handler:
    aiohttp has resolved the route already, but nothing has acted on it yet."""
    problem = path_problem(request.rel_url.raw_path, request.path)
    if problem is not None:
        raise BadRequest(f"invalid request path: it holds {problem}", code="invalid_path")
    return await handler(request)


def auth_middleware(
    keys: ApiKeys,
    *,
    tenant_header: str | None,
    open_routes: Iterable[str],
) -> Middleware:
    """The middleware that checks client keys and stamps each request's tenant.

    ``open_routes`` are route templates (``/v1/models``-style names, never path prefixes; the
    traffic application has none since the probes and admin routes moved to the admin listener):
    a request the router matched to one of them is let through without a client key. Anything
    else, the pass-through catch-all included, needs one; so does a method an open route does not
    serve (it falls through to the catch-all). When keys are enabled the client's Authorization
    header is removed before the request goes on, so the backend never sees a client's proxy key.
    """
    exempt = frozenset(open_routes)

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        if resource is not None and resource.canonical in exempt:
            return await handler(request)
        header_value = request.headers.get(tenant_header) if tenant_header else None
        authorization = request.headers.get(hdrs.AUTHORIZATION)
        api_key = request.headers.get(X_API_KEY)
        if authorization is None and api_key is not None:  # the Anthropic SDK's header
            authorization = f"Bearer {api_key}"
        anthropic = request.path == MESSAGES
        try:
            tenant = tenant_of(keys, authorization=authorization, tenant_header_value=header_value)
        except ValueError as exc:
            failure: ProxyError = BadRequest(str(exc), param=tenant_header)
            if anthropic:
                return anthropic_error_response(failure, request_id=request.get(REQUEST_ID))
            raise failure from exc
        if tenant is None:
            failure = Unauthorized(
                "missing or invalid API key: send 'Authorization: Bearer <key>'"
                + (" or 'x-api-key: <key>'" if anthropic else "")
            )
            if anthropic:
                return anthropic_error_response(failure, request_id=request.get(REQUEST_ID))
            raise failure
        if keys.enabled:
            headers = CIMultiDict(request.headers)
            headers.popall(hdrs.AUTHORIZATION, None)
            headers.popall(X_API_KEY, None)
            request = request.clone(headers=CIMultiDictProxy(headers))
        request[TENANT] = tenant
        return await handler(request)

    return authenticate
