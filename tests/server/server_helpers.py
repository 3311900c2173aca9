"""Helpers for the server tests: uvicorn on a background thread, a bare WebSocket client."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from pathlib import Path

import orjson

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.core import EngineCore
from specserve.llm import build_engine_config
from specserve.server import ServerLimits, create_app, uvicorn_config

SPEC = "chain:3"
NUM_BLOCKS = 64  # x 16 = 1024 KV slots; the tiny models' context is 512
MAX_IN_FLIGHT = 3  # small, so the too_many_requests case is cheap to reach


class ServerThread:
    """uvicorn serving `app` on a pre-bound socket, run on its own thread and event loop."""

    def __init__(self, app, engine: AsyncEngine) -> None:
        import uvicorn

        self.app = app
        self.engine = engine
        self.core = engine.core
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.http = f"http://127.0.0.1:{self.port}"
        self.ws = f"ws://127.0.0.1:{self.port}/v1/ws"
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn-test", daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        self.sock.close()

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no request is in the engine, then require every block back."""
        deadline = time.monotonic() + timeout
        while self.engine.num_in_flight() or self.core.has_work:
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: "
                                     f"{self.engine.num_in_flight()} requests in flight")
            time.sleep(0.01)
        self.core.block_manager.check_no_leak()


def start_server(target: Path, draft: Path | None, speculation, **app_options) -> ServerThread:
    core = EngineCore(build_engine_config(target, draft, speculation, num_blocks=NUM_BLOCKS))
    engine = AsyncEngine(core)
    limits = ServerLimits.for_engine(engine, max_requests_in_flight=MAX_IN_FLIGHT,
                                     max_message_bytes=64 * 1024)
    app = create_app(engine, model_name="tiny", limits=limits, **app_options)
    return ServerThread(app, engine).start()


def run(coro, timeout: float = 30.0):
    """Run a coroutine to completion on a fresh event loop, bounded in time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


class WSConn:
    """A bare `websockets` client speaking specserve.v1 (what the tests check the server with)."""

    def __init__(self, url: str, subprotocols=("specserve.v1",), headers=None,
                 origin: str | None = None) -> None:
        self.url, self.subprotocols, self.headers, self.origin = url, subprotocols, headers, origin
        self.ws = None
        self.session: dict = {}

    async def __aenter__(self) -> WSConn:
        from websockets.asyncio.client import connect

        self.ws = await connect(self.url, subprotocols=list(self.subprotocols),
                                additional_headers=self.headers, origin=self.origin,
                                compression=None, proxy=None, open_timeout=10)
        first = await self.recv()
        assert first["type"] == "session.created", first
        self.session = first["session"]
        return self

    async def __aexit__(self, *exc) -> None:
        await self.ws.close()

    async def send(self, event) -> None:
        await self.ws.send(event if isinstance(event, (str, bytes)) else
                           orjson.dumps(event).decode())

    async def recv(self, timeout: float = 10.0) -> dict:
        return orjson.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def create(self, request_id: str, **response) -> None:
        await self.send({"type": "response.create", "request_id": request_id,
                         "response": response})

    async def until_done(self, *request_ids: str, timeout: float = 20.0) -> dict[str, list]:
        """Events per request id until each has response.done (or an error); others dropped."""
        events: dict[str, list] = {rid: [] for rid in request_ids}
        open_ids = set(request_ids)
        deadline = asyncio.get_running_loop().time() + timeout
        while open_ids:
            event = await self.recv(deadline - asyncio.get_running_loop().time())
            rid = event.get("request_id")
            if rid in events:
                events[rid].append(event)
                if event["type"] in ("response.done", "error"):
                    open_ids.discard(rid)
        return events

    async def roundtrip_ok(self) -> None:
        """The socket still answers (after an error, say)."""
        await self.send({"type": "ping", "event_id": "alive"})
        while True:
            event = await self.recv()
            if event["type"] == "pong":
                assert event["event_id"] == "alive"
                return


def text_of(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def done_of(events: list[dict]) -> dict:
    assert events[-1]["type"] == "response.done", events[-1]
    return events[-1]
