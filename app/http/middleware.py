"""The outermost layer of every request: X-Request-ID, Bearer auth, access log, latency metric.

A pure ASGI middleware (no body buffering), so uploads still stream to the route.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid

from starlette.datastructures import Headers
from starlette.routing import Match

from ..errors import TooManyRequests
from ..runtime.metrics import Metrics
from .logs import request_id_var

log = logging.getLogger("rev88." + __name__)

PROBE_PATHS = frozenset({"/health", "/v2/health/live", "/v2/health/ready"})  # the health probes
# Open without the key: the probes, and the web page (app/web), whose HTML and scripts carry no
# data; its script sends the key the user typed in as Bearer to every API route it calls.
OPEN_PATHS = PROBE_PATHS | {"/"}
OPEN_PREFIXES = ("/ui/", "/static/")
QUIET_PATHS = PROBE_PATHS | {"/metrics"}  # probes and scrapes: logged at debug level
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


def request_id_from(headers: Headers) -> str:
    """The client's X-Request-ID when it is sane (1-128 of [A-Za-z0-9._:-]), else a new one."""
    given = headers.get("x-request-id")
    if given and _REQUEST_ID.match(given):
        return given
    return uuid.uuid4().hex


# An evaluation's report page (its HTML carries no data), and its JSON URL asked for HTML (which
# only redirects there): open, like the web page.
_REPORT = re.compile(r"^/evaluations/[A-Za-z0-9_-]{1,128}(/report)?$")


def prefers_html(accept: str | None) -> bool:
    """Whether an Accept header ranks text/html above JSON (a browser's navigation does; a
    client asking for application/json, ``*/*`` or nothing gets JSON)."""
    ranks: dict[str, float] = {}
    for part in (accept or "").split(","):
        kind, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for param in params:
            if param.startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    q = 0.0
        ranks[kind.lower()] = max(q, ranks.get(kind.lower(), 0.0))
    html = ranks.get("text/html", 0.0)
    return html > 0 and html > ranks.get("application/json", 0.0)


def is_open(path: str, method: str = "GET", accept: str | None = None) -> bool:
    """Whether ``path`` is served without the API key. Prefixed paths with dot segments
    or empty segments (``/ui/../tasks``) are not open, whatever a router would make of them."""
    if path in OPEN_PATHS:
        return True
    m = _REPORT.match(path)
    if m and method in ("GET", "HEAD") and (m[1] or prefers_html(accept)):
        return True
    if not path.startswith(OPEN_PREFIXES):
        return False
    segments = path.split("/")[1:]
    dots = any(s in (".", "..") for s in segments)
    return not dots and "" not in segments[:-1] and "\\" not in path


def routed(scope) -> bool:
    """Whether a route of the app serves ``scope``'s path (any method): a path none serves holds
    nothing the key protects, so a browser asking for it is shown the not-found page, not a 401."""
    app = scope.get("app")
    for route in getattr(app, "routes", ()):
        try:
            match, _ = route.matches(scope)
        except Exception:  # noqa: BLE001 - a route that cannot say: taken as serving it
            return True
        if match != Match.NONE:
            return True
    return app is None


def authorized(headers: Headers, api_key: str) -> bool:
    token = bearer(headers)
    return token is not None and hmac.compare_digest(token.encode(), api_key.encode())


def bearer(headers: Headers) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def required_scope(method: str) -> str:
    return "read" if method in ("GET", "HEAD", "OPTIONS") else "write"


class RequestMiddleware:
    """Request ids, the access log and metrics, and who a request is. With an API key set, a
    request to anything but the open paths needs a Bearer key: ``resolve(token)`` (the service's
    key ring, app/tasks/tenants.py) says which tenant it is, or why not (a 401); a tenant whose
    scopes lack the request's (``read`` for GET and HEAD, ``write`` otherwise) gets a 403. The
    tenant is left in ``scope["state"]["tenant"]`` for the routes. ``resolve_fast(token)``
    answers without I/O when it can (the admin key, a cached key), else None; then ``resolve``
    runs in a thread. Without them (``resolve`` None) only the API key itself is accepted."""

    def __init__(self, app, api_key: str | None, metrics: Metrics, resolve=None, resolve_fast=None,
                 limit=None) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics
        self.resolve, self.resolve_fast, self.limit = resolve, resolve_fast, limit

    async def _tenant(self, headers: Headers, method: str):
        """(tenant, None, extra headers) or (None, (status, message, headers), {}) for a protected
        path. A write by a key with a rate limit is counted (``limit``: its RateLimit headers, or
        a 429); refusals before it (401, 403) count against nobody."""
        token = bearer(headers)
        if token is None:
            return None, (401, "missing Authorization: Bearer <key> header", {}), {}
        if self.resolve is None:
            return (None, None, {}) if hmac.compare_digest(token.encode(), self.api_key.encode()) else (
                None, (401, "invalid API key", {}), {})
        found = self.resolve_fast(token) if self.resolve_fast is not None else None
        if found is None:
            try:
                found = await asyncio.to_thread(self.resolve, token)
            except Exception as exc:  # noqa: BLE001 - the key store unavailable: a 503, said so
                return None, (503, f"cannot check the API key now: {exc}", {}), {}
        if isinstance(found, str):
            return None, (401, found, {}), {}
        scope = required_scope(method)
        if not found.can(scope):
            return None, (403, f"key {found.name!r} lacks the {scope} scope this request needs "
                               f"(it has: {', '.join(sorted(found.scopes))})", {}), {}
        key = getattr(found, "key", None)
        if scope == "write" and self.limit is not None and getattr(key, "rate_per_minute", None):
            try:
                return found, None, await asyncio.to_thread(self.limit, found)
            except TooManyRequests as exc:
                return None, (429, exc.message, exc.headers()), {}
            except Exception as exc:  # noqa: BLE001 - the key store unavailable: a 503, said so
                return None, (503, f"cannot count the request against its rate limit now: {exc}", {}), {}
        return found, None, {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        headers = Headers(scope=scope)
        rid = request_id_from(headers)
        scope.setdefault("state", {})
        scope["state"]["request_id"] = rid
        scope["state"]["t0"] = t0
        token = request_id_var.set(rid)
        status = {"code": 500}
        path = scope.get("path", "")

        extra: dict[str, str] = {}

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode()),
                                      *((k.lower().encode(), v.encode()) for k, v in extra.items())]
            await send(message)

        try:
            method = scope.get("method", "GET")
            refusal = None
            if self.api_key is not None and not is_open(path, method, headers.get("accept")):
                tenant, refusal, counted = await self._tenant(headers, method)
                scope["state"]["tenant"] = tenant
                extra.update(counted)
                if (refusal is not None and refusal[0] == 401 and method in ("GET", "HEAD")
                        and prefers_html(headers.get("accept")) and not routed(scope)):
                    refusal = None  # (a browser's mistyped address: the page that leads on)
            if refusal is not None:
                await self._refuse(send_with_id, *refusal)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - t0
            self.metrics.request(path, seconds)
            log.log(
                logging.DEBUG if path in QUIET_PATHS else logging.INFO,
                "request",
                extra={"method": scope.get("method"), "path": path, "status": status["code"],
                       "duration_ms": round(seconds * 1000, 3),
                       "client": (scope.get("client") or [None])[0]},
            )
            request_id_var.reset(token)

    @staticmethod
    async def _refuse(send, status: int, message: str, more: dict[str, str]) -> None:
        word = {401: "unauthorized", 403: "forbidden", 429: "too many requests", 503: "unavailable"}[status]
        body = json.dumps({"error": f"{word}: {message}"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   *((k.lower().encode(), v.encode()) for k, v in more.items())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="rev88"'))
        if status == 503:
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
