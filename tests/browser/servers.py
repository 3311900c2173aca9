"""The servers the browser tests drive: the real app on uvicorn, over a real or scripted engine.

`LiveServer` runs `create_app(engine)` on 127.0.0.1 in a background thread, on a port the OS
picks (or a given one, so a test can bring a server back where the page expects it).

Two engine-side test hooks, both subclasses of the layer below the server rather than mocks:
- `PacedCore`: the real `EngineCore` with a short sleep per step, so a reply takes long enough
  for a test to watch it stream and to press Stop halfway.
- `ScriptedCore`: the real `EngineCore` for everything the server asks of it (tokenizer, chat
  template, limits) whose steps replay a fixed reply, so a test can make "the model" say
  `<script>` or markdown. The `AsyncEngine` thread, the session and the page stay real.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.core import EngineCore
from specserve.outputs import RequestDelta
from specserve.server import ServerLimits, create_app, uvicorn_config


class PacedCore(EngineCore):
    """The real engine core, at most one step per `step_s` seconds."""

    def __init__(self, config, step_s: float) -> None:
        super().__init__(config)
        self.step_s = step_s

    def step(self) -> list[RequestDelta]:
        time.sleep(self.step_s)
        return super().step()


@dataclass(frozen=True)
class ScriptedDelta:
    text: str
    n_tokens: int
    n_draft_accepted: int = 0


class ScriptedCore(EngineCore):
    """A real core whose every request replies with `script`, one delta per step."""

    def __init__(self, config, script: list[ScriptedDelta], step_s: float = 0.02) -> None:
        super().__init__(config)
        self.script = script
        self.step_s = step_s
        self.position: dict[str, int] = {}  # request id -> index of its next delta
        self.arrival: dict[str, float] = {}
        self.first_token: dict[str, float] = {}

    def add(self, req) -> None:
        self.requests[req.request_id] = req
        self.position[req.request_id] = 0
        self.arrival[req.request_id] = time.monotonic()

    @property
    def has_work(self) -> bool:
        return bool(self.position)

    def abort(self, request_id: str) -> RequestDelta | None:
        if self.requests.pop(request_id, None) is None:
            return None
        done = self.position.pop(request_id)
        return RequestDelta(request_id, [], "", finish_reason="abort",
                            metrics=self._metrics(request_id, done), time=time.monotonic())

    def step(self) -> list[RequestDelta]:
        time.sleep(self.step_s)
        deltas = []
        for rid, i in list(self.position.items()):
            part = self.script[i]
            self.first_token.setdefault(rid, time.monotonic())
            last = i + 1 == len(self.script)
            self.position[rid] = i + 1
            delta = RequestDelta(rid, [0] * part.n_tokens, part.text,
                                 num_draft_accepted=part.n_draft_accepted, time=time.monotonic())
            if last:
                del self.position[rid]
                del self.requests[rid]
                delta.finish_reason = "stop"
                delta.metrics = self._metrics(rid, i + 1)
            deltas.append(delta)
        return deltas

    def _metrics(self, rid: str, n_done: int) -> dict:
        """The engine's per-request metrics dict, for the first `n_done` scripted deltas."""
        done = self.script[:n_done]
        n_out = sum(d.n_tokens for d in done)
        accepted = sum(d.n_draft_accepted for d in done)
        now = time.monotonic()
        arrival = self.arrival.pop(rid, now)
        first = self.first_token.pop(rid, now)
        decode_steps = max(len(done) - 1, 0)
        return {
            "acceptance_length": (n_out - 1) / decode_steps if decode_steps else 1.0,
            "num_drafts": decode_steps, "num_draft_tokens": 3 * decode_steps,
            "num_accepted_tokens": accepted, "accepted_per_pos": [],
            "num_target_steps": len(done), "num_prompt_tokens": 0,
            "num_output_tokens": n_out, "queue_s": 0.0,
            "ttft_s": first - arrival, "e2e_s": now - arrival,
        }


class RecordingEngine(AsyncEngine):
    """The real AsyncEngine, remembering every abort, so a test sees a cancel reach it."""

    def __init__(self, core: EngineCore) -> None:
        super().__init__(core)
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        super().abort(request_id)


class LiveServer:
    """uvicorn serving `create_app(engine, **app_options)` on its own thread."""

    def __init__(self, engine: AsyncEngine, port: int = 0, **app_options) -> None:
        self.engine = engine
        self.core = engine.core
        self.app_options = app_options
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/"
        self.server = None
        self.thread = None

    def start(self) -> LiveServer:
        import uvicorn

        limits = ServerLimits.for_engine(self.engine)
        app = create_app(self.engine, model_name="tiny", limits=limits, **self.app_options)
        # A short graceful shutdown: a test that stops the server with the page still
        # connected should not wait out uvicorn's default.
        self.server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", self.port,
                                                    log_level="warning",
                                                    timeout_graceful_shutdown=1))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-browser-{self.port}", daemon=True)
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
        """Wait until the engine holds no request, then require every KV block back."""
        deadline = time.monotonic() + timeout
        while self.engine.num_in_flight() or self.core.has_work:
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s")
            time.sleep(0.01)
        self.core.block_manager.check_no_leak()
