"""The engine thread and its asyncio face: one output stream per request, abort, shutdown.

`EngineCore` is single-threaded. `AsyncEngine` runs its step loop on a dedicated thread so the
event loop never waits on a forward pass. Requests and aborts cross into the thread through a
command queue that is drained between steps; each step's deltas cross back in one
`call_soon_threadsafe` call and are routed to per-request asyncio queues. A step that raises
ends every affected stream with an error delta instead of leaving it hanging.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable

from ..outputs import RequestDelta
from ..sampling import SamplingParams
from ..speculation.modes import SpecMode, parse_speculation
from .core import EngineCore
from .interface import EngineLimits, EngineStats, KVPoolStats, ModelInfo
from .request import Request

log = logging.getLogger("specserve.engine")


class EngineStoppedError(RuntimeError):
    """The engine is not running (not started yet, or shut down)."""


class DeltaStream:
    """Async iterator over one request's deltas; ends after the delta that finishes it.

    The face the routes stream from. Whoever produces the deltas puts them on `queue` (the
    engine thread through `AsyncEngine._deliver`, or a cluster gateway's pump); a subclass says
    how to cancel the request behind it (`abort`).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.finished = False

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestDelta]:
        while not self.finished:
            delta = await self.queue.get()
            self.finished = delta.finished
            yield delta

    def abort(self) -> None:
        """Cancel the request; its stream still ends with a finished delta. Safe to repeat."""
        raise NotImplementedError


class RequestStream(DeltaStream):
    """One request of this process's engine."""

    def __init__(self, engine: AsyncEngine, request: Request) -> None:
        super().__init__(request.request_id, request.prompt_token_ids)
        self.engine = engine

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort everything in flight, stop the thread and wait for it."""
        if self._thread is None:
            return
        self._stopping = True
        self._wakeup.set()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._thread = None

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopping

    # ---- read-only views (safe from the event loop) ---------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self.core.model_info

    @property
    def limits(self) -> EngineLimits:
        return self.core.limits

    @property
    def stats(self) -> EngineStats:
        """The engine's live counters (the engine thread updates them; read, never write)."""
        return self.core.stats

    def kv_pool(self) -> KVPoolStats:
        return self.core.kv_pool()

    def parse_speculation(self, value) -> SpecMode:
        """A request's `speculation` spelling as a mode for this engine; ValueError names a bad
        one (or one that needs a draft model when none is loaded)."""
        return parse_speculation(value, self.model_info.has_draft)

    # ---- requests (called on the event loop) ----------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, speculation=None) -> RequestStream:
        """Validate (ValueError on bad input) and queue a request; returns its stream."""
        if not self.running:
            raise EngineStoppedError("the engine is not running")
        return self.submit(self.core.make_request(prompt, params, request_id, speculation))

    def submit(self, req: Request) -> RequestStream:
        """Queue a request made by `core.make_request` (and perhaps marked up, e.g. to hold
        its KV for a transfer); returns its stream."""
        stream = self.open_stream(req)
        self._send(("add", req))
        return stream

    def open_stream(self, req: Request) -> RequestStream:
        """The stream a request's deltas will go to, before the engine has the request."""
        if not self.running:
            raise EngineStoppedError("the engine is not running")
        if req.request_id in self._streams:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        stream = RequestStream(self, req)
        self._streams[req.request_id] = stream
        return stream

    def call_on_engine(self, fn: Callable[[EngineCore], list[RequestDelta]]) -> None:
        """Run fn(core) on the engine thread between steps (the core is single-threaded); the
        deltas it returns go to their streams. Safe from any thread."""
        self._send(("call", fn))

    def abort(self, request_id: str) -> None:
        """Cancel a request; its blocks are freed before the next step. Safe to repeat."""
        if request_id in self._streams:
            self._send(("abort", request_id))

    def num_in_flight(self) -> int:
        return len(self._streams)

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.finished:
                del self._streams[delta.request_id]
            stream.queue.put_nowait(delta)

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while not self._stopping:
            deltas = self._drain_commands()
            if core.has_work:
                try:
                    deltas += core.step()
                except Exception as exc:  # one bad step must not hang every stream
                    log.exception("engine step failed")
                    deltas += core.fail_all(f"engine step failed: {exc}")
            elif not deltas:
                self._wakeup.wait(0.05)
                self._wakeup.clear()
            if deltas:
                self._loop.call_soon_threadsafe(self._deliver, deltas)
        self._drain_commands()
        deltas = [d for rid in list(core.requests) if (d := core.abort(rid)) is not None]
        if deltas:
            self._loop.call_soon_threadsafe(self._deliver, deltas)

    def _drain_commands(self) -> list[RequestDelta]:
        deltas = []
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return deltas
            if kind == "add":
                try:
                    self.core.add(arg)
                except ValueError as exc:
                    deltas.append(RequestDelta(arg.request_id, [], "", finish_reason="error",
                                               error=str(exc)))
            elif kind == "call":
                try:
                    deltas += arg(self.core)
                except Exception:  # a hook's bug must not stop the engine thread
                    log.exception("engine call failed")
            elif (delta := self.core.abort(arg)) is not None:
                deltas.append(delta)
