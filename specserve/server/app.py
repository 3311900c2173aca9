"""The starlette app: routes, the engine's lifespan, and the uvicorn settings it runs under.

`create_app(engine)` wires an `AsyncEngine` (already loaded, not started) to the routes; the
app's lifespan starts the engine thread and stops it, aborting whatever is still running.
`uvicorn_config` holds the server settings in one place, for `specserve serve` and the tests:
uvloop, the `websockets` library's sans-I/O implementation, no per-message deflate (token
frames are a few dozen bytes; compressing them costs CPU and saves nothing), and the h11
protocol with a request-read deadline and a connection cap (`connections.py`).

Around the routes, outermost first: the Host allow-list (`hosts.py`), the HTTP body cap
(`body_limit.py`), then the Origin and API key checks (`auth.py`). Every error a route or
starlette itself answers with (404, 405, a bug's 500) has the OpenAI JSON error shape.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket

from ..engine import AsyncEngine
from . import openai_api, tokenize_api
from .admission import Admission
from .auth import (
    SUBPROTOCOL,
    WS_CLOSE_BAD_SUBPROTOCOL,
    WS_CLOSE_UNAUTHORIZED,
    Guard,
    GuardMiddleware,
    error_body,
)
from .body_limit import BodyLimitMiddleware
from .connections import guarded_h11_protocol
from .hosts import LOOPBACK_NAMES, HostGuard, HostMiddleware
from .limits import Preparer, ServerLimits, batch_slots, model_facts
from .metrics import CONTENT_TYPE, ServerMetrics
from .state import ServerState
from .ws import Session

STATIC_DIR = Path(__file__).resolve().parent / "static"


def default_model_name(engine: AsyncEngine) -> str:
    target = Path(engine.model_info.target)
    if target.name == "target" and target.parent.name == "demo":
        return "specserve-demo"
    return target.name


def create_app(engine: AsyncEngine, *, api_key: str | None = None,
               allowed_origins: Iterable[str] | None = None, model_name: str | None = None,
               limits: ServerLimits | None = None,
               static_dir: str | Path | None = None,
               allowed_hosts: Iterable[str] | None = LOOPBACK_NAMES,
               extra_routes: Iterable[Route] = ()) -> Starlette:
    """The app for one engine. The engine starts and stops with the app's lifespan.

    `allowed_hosts`: the names the Host header may carry (`hosts.default_allowed_hosts` says
    which follow from a bind address); None accepts any. `extra_routes`: a role's own (the
    prefill route of `specserve.disagg`).
    """
    name = model_name or default_model_name(engine)
    guard = Guard(api_key, allowed_origins)
    limits = limits or ServerLimits.for_engine(engine)
    state = ServerState(engine=engine, model_name=name,
                        model_root=str(engine.model_info.target),
                        limits=limits, guard=guard,
                        metrics=ServerMetrics(engine, name), created=int(time.time()),
                        preparer=Preparer(model_facts(engine), limits),
                        admission=Admission(batch_slots(engine) + limits.max_queued_requests))
    static = Path(static_dir) if static_dir is not None else STATIC_DIR

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()
            state.preparer.close()

    async def index(request: Request) -> Response:
        return FileResponse(static / "index.html")

    routes = [
        Route("/health", health),
        Route("/metrics", metrics),
        Route("/v1/models", openai_api.list_models),
        Route("/v1/models/{model:path}", openai_api.retrieve_model),
        Route("/v1/chat/completions", openai_api.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai_api.completions, methods=["POST"]),
        Route("/tokenize", tokenize_api.tokenize, methods=["POST"]),
        Route("/detokenize", tokenize_api.detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenize_api.tokenizer_info),
        WebSocketRoute("/v1/ws", websocket_endpoint),
        *extra_routes,
        Route("/", index),
        Mount("/static", StaticFiles(directory=static, check_dir=False), name="static"),
    ]
    middleware = [Middleware(HostMiddleware, guard=HostGuard(allowed_hosts)),
                  Middleware(BodyLimitMiddleware, max_bytes=limits.max_request_bytes),
                  Middleware(GuardMiddleware, guard=guard)]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error, Exception: internal_error})
    app.state.server = state
    return app


async def http_error(request: Request, exc: HTTPException) -> Response:
    """Routing errors (unknown route 404, wrong method 405, ...) as OpenAI-shaped JSON."""
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        code, message = "not_found", f"not found: {where}"
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("Allow", "")
        code, message = "method_not_allowed", f"method not allowed: {where} (allowed: {allowed})"
    else:
        code, message = "http_error", str(exc.detail)
    return Response(error_body(message, code), exc.status_code, headers=exc.headers,
                    media_type="application/json")


async def internal_error(request: Request, exc: Exception) -> Response:
    # A bug: starlette logs the traceback; the client gets the error shape, not a text page.
    return Response(error_body("internal server error", "internal_error", "server_error"), 500,
                    media_type="application/json")


async def health(request: Request) -> Response:
    state: ServerState = request.app.state.server
    running = state.engine.running and not state.admission.draining
    status = "draining" if state.admission.draining else "ok" if running else "unavailable"
    body = {"status": status, "model": state.model_name,
            "auth_required": state.guard.auth_required,
            "requests_in_flight": state.engine.num_in_flight()}
    if running and hasattr(state.engine, "replica_health"):  # behind a cluster gateway
        body.update(state.engine.replica_health())  # per replica; its status overrides
        running = body["status"] != "unavailable"
    return Response(orjson.dumps(body), 200 if running else 503, media_type="application/json")


async def metrics(request: Request) -> Response:
    state: ServerState = request.app.state.server
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


async def websocket_endpoint(websocket: WebSocket) -> None:
    state: ServerState = websocket.app.state.server
    guard = state.guard
    if not guard.origin_ok(websocket.headers, websocket.url.scheme):
        await websocket.close(code=1008)  # before accept: the handshake is refused with 403
        return
    offered = websocket.scope.get("subprotocols", [])
    if SUBPROTOCOL not in offered:
        # Accept, then close with a code: a browser can see a close code, not an HTTP status.
        await websocket.accept()
        await websocket.close(WS_CLOSE_BAD_SUBPROTOCOL, f"offer subprotocol {SUBPROTOCOL}")
        return
    await websocket.accept(subprotocol=SUBPROTOCOL)
    if not guard.ws_key_ok(websocket.headers, offered):
        await websocket.close(WS_CLOSE_UNAUTHORIZED, "invalid or missing API key")
        return
    await Session(websocket, state).run()


def uvicorn_config(app: Starlette, host: str = "127.0.0.1", port: int = 8000,
                   log_level: str = "info", **overrides):
    """The uvicorn settings specserve runs under (the CLI and the tests share them)."""
    import uvicorn

    state: ServerState = app.state.server
    try:
        import uvloop  # noqa: F401
        loop = "uvloop"
    except ImportError:  # Windows
        loop = "asyncio"
    options = dict(host=host, port=port, loop=loop, ws="websockets-sansio",  # noqa: C408
                   ws_per_message_deflate=False, lifespan="on", log_level=log_level,
                   # The session answers frames over the limit with an error event; only
                   # frames far beyond it are cut off by the protocol layer (close 1009).
                   ws_max_size=4 * state.limits.max_message_bytes,
                   http=guarded_h11_protocol(state.limits.request_read_timeout_s,
                                             state.limits.max_connections),
                   timeout_graceful_shutdown=5)
    options.update(overrides)
    return uvicorn.Config(app, **options)
