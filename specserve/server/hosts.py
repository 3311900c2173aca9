"""The Host allow-list: a defence against DNS rebinding.

A page on `evil.example` can make its own name resolve to 127.0.0.1 and then talk to a local
server as if same-origin: its requests carry `Host: evil.example`. A server bound to loopback
therefore answers only to loopback names (`localhost`, `127.0.0.1`, `::1`) unless told more with
`--allowed-hosts`; a server bound to a routable address answers to that address, loopback names
and `--allowed-hosts` (a wildcard bind with no `--allowed-hosts` answers any name and says so at
start-up). A foreign Host gets HTTP 421 and no WebSocket upgrade (403 at the handshake).
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from .auth import error_body

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
_WILDCARD_BINDS = ("0.0.0.0", "::", "")


def host_name(value: str) -> str:
    """'Example.COM:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def default_allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The names a server bound to bind_host answers to; None means any."""
    extra = {host_name(h) for h in extra if h.strip()}
    if "*" in extra:
        return None
    bind = host_name(bind_host)
    if bind in _WILDCARD_BINDS:
        return frozenset(extra | set(LOOPBACK_NAMES)) if extra else None
    return frozenset(set(LOOPBACK_NAMES) | extra | {bind})


class HostGuard:
    def __init__(self, allowed: Iterable[str] | None) -> None:
        self.allowed = None if allowed is None else frozenset(host_name(h) for h in allowed)

    def ok(self, headers: Headers) -> bool:
        if self.allowed is None:
            return True
        host = headers.get("host")
        return host is not None and host_name(host) in self.allowed


class HostMiddleware:
    """Refuse requests and WebSocket handshakes whose Host is not on the allow-list."""

    def __init__(self, app: ASGIApp, guard: HostGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self.guard.ok(Headers(scope=scope)):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})  # handshake gets 403
                return
            body = error_body("the Host header names a host this server does not serve",
                              "host_not_allowed", param="host")
            await send({"type": "http.response.start", "status": 421,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)
