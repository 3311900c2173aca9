"""API key and Origin checks for HTTP routes and WebSocket handshakes.

The key travels as `Authorization: Bearer KEY`, or, for browsers that cannot set headers on a
WebSocket, as an offered subprotocol `bearer.KEY` next to `specserve.v1`. Keys are compared with
`hmac.compare_digest` so the time taken does not reveal how much of a guess was right.

The Origin check stops other web pages from driving the server through a visitor's browser
(cross-site WebSocket hijacking, or a form POST to the completions routes). Requests without an
Origin header come from non-browser clients and are not affected.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

import orjson
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

SUBPROTOCOL = "specserve.v1"
BEARER_SUBPROTOCOL_PREFIX = "bearer."
WS_CLOSE_BAD_SUBPROTOCOL = 4400
WS_CLOSE_UNAUTHORIZED = 4401

# Routes anyone may read: the health probe, and the chat page with its assets (they hold no
# data; the page asks the user for the key and passes it on the WebSocket).
_PUBLIC_PATHS = ("/health", "/", "/favicon.ico")
_PUBLIC_PREFIXES = ("/static/",)


class Guard:
    def __init__(self, api_key: str | None = None,
                 allowed_origins: Iterable[str] | None = None) -> None:
        self.api_key = api_key.encode() if api_key else None
        self.allowed_origins = {o.rstrip("/").lower() for o in (allowed_origins or ())}

    @property
    def auth_required(self) -> bool:
        return self.api_key is not None

    def key_ok(self, provided: str | None) -> bool:
        if self.api_key is None:
            return True
        return provided is not None and hmac.compare_digest(provided.encode(), self.api_key)

    def http_key_ok(self, headers: Headers) -> bool:
        return self.key_ok(_bearer(headers))

    def ws_key_ok(self, headers: Headers, subprotocols: Sequence[str]) -> bool:
        if self.api_key is None:
            return True
        offered = [p[len(BEARER_SUBPROTOCOL_PREFIX):] for p in subprotocols
                   if p.startswith(BEARER_SUBPROTOCOL_PREFIX)]
        # Check every candidate (no early exit) to keep the timing independent of the order.
        return sum(self.key_ok(k) for k in [_bearer(headers), *offered] if k is not None) > 0

    def origin_ok(self, headers: Headers, scheme: str = "http") -> bool:
        """`scheme`: the request's own (http/https, or ws/wss for a WebSocket handshake)."""
        origin = headers.get("origin")
        if origin is None:
            return True
        origin = origin.rstrip("/").lower()
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        # Same origin: the page was served by this scheme, host and port.
        host = headers.get("host", "").lower()
        page_scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
        parts = urlsplit(origin)
        return bool(host) and parts.netloc == host and parts.scheme == page_scheme


def _bearer(headers: Headers) -> str | None:
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _is_public(path: str) -> bool:
    return path in _PUBLIC_PATHS or path.startswith(_PUBLIC_PREFIXES)


def error_body(message: str, code: str, type_: str = "invalid_request_error",
               param: str | None = None) -> bytes:
    """An OpenAI-shaped error body."""
    return orjson.dumps({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}})


class GuardMiddleware:
    """Origin and API key checks for HTTP requests (WebSockets are checked in their endpoint,
    which can answer with a close code a browser is able to see)."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if not self.guard.origin_ok(headers, scope.get("scheme", "http")):
            await _respond(send, 403, error_body("cross-origin request refused",
                                                 "origin_not_allowed"))
        elif not _is_public(scope["path"]) and not self.guard.http_key_ok(headers):
            await _respond(send, 401, error_body("invalid or missing API key",
                                                 "invalid_api_key"),
                           [(b"www-authenticate", b"Bearer")])
        else:
            await self.app(scope, receive, send)


async def _respond(send: Send, status: int, body: bytes,
                   extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *(extra_headers or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
