"""The prefill role: an engine that computes prompts, samples their first token and holds their
KV for a decode server to pull, and the internal HTTP route that drives it.

    POST /v1/disagg/prefill
    {"prompt_token_ids": [...], "sampling": {"temperature": 0.0, ...}, "speculation": null}
    -> {"request_id": ..., "first_token": 42, "kv_transfer_params": {...}}

The request runs with max_tokens 1 and `kv_hold` set: when it finishes, `PrefillHandoff` takes
its blocks, and the answer names them (`KVTransferParams`). The decode server then pulls them
from the TCP endpoint this engine starts and stops with itself. The route is internal: it sits
behind the server's usual guard (API key, hosts), and only a decode server calls it.
"""

from __future__ import annotations

import asyncio
import secrets

import msgspec
import orjson
from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route

from ..engine import AsyncEngine
from ..engine.async_engine import EngineStoppedError
from ..engine.core import EngineCore
from ..sampling import SamplingParams
from ..server.auth import error_body
from .handoff import PrefillHandoff
from .protocol import KVTransferParams
from .transport import TcpKVServer

PREFILL_PATH = "/v1/disagg/prefill"
# The sampling fields that decide the first token (the rest stay on the decode side).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed")


def prefill_params(sampling: dict) -> SamplingParams:
    """A prefill-only request's params: the decode request's sampling fields, one token."""
    return SamplingParams(**{k: v for k, v in sampling.items() if k in SAMPLING_FIELDS},
                          max_tokens=1, ignore_eos=True)


class PrefillRequestBody(msgspec.Struct, forbid_unknown_fields=True):
    prompt_token_ids: list[int]
    sampling: dict[str, float | int | None] = {}
    speculation: str | list | None = None


class PrefillError(RuntimeError):
    """The prefill did not produce a first token (aborted, engine failure)."""


class PrefillEngine(AsyncEngine):
    """An `AsyncEngine` that also prefills for decode servers (see the module docstring)."""

    def __init__(self, core: EngineCore, kv_host: str = "127.0.0.1", kv_port: int = 0,
                 advertise_host: str | None = None, ttl_s: float = 60.0,
                 kv_token: str | None = None) -> None:
        super().__init__(core)
        self.engine_id = f"prefill-{secrets.token_hex(6)}"
        self.handoff = PrefillHandoff(core, self.call_on_engine, ttl_s)
        self.kv_server = TcpKVServer(self.handoff, self.engine_id, kv_host, kv_port,
                                     advertise_host=advertise_host, token=kv_token)
        self._expiry: asyncio.Task | None = None

    async def start(self) -> None:
        await super().start()
        self.kv_server.start()
        self._expiry = asyncio.get_running_loop().create_task(self._expire_forever())

    async def shutdown(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        self.kv_server.stop()
        await super().shutdown()

    async def _expire_forever(self) -> None:
        """Free the blocks of transfers nobody came for, even while no new prompt arrives."""
        while True:
            await asyncio.sleep(self.handoff.ttl_s / 4)
            self.handoff.expire()

    async def prefill(self, prompt_token_ids: list[int], sampling: dict,
                      speculation=None) -> dict:
        """Prefill one prompt; the answer with its first token and `kv_transfer_params`.
        ValueError on bad input, PrefillError when no first token came."""
        req = self.core.make_request(prompt_token_ids, prefill_params(sampling),
                                     f"pf-{secrets.token_hex(8)}", speculation)
        req.kv_hold = True
        error = "the prefill ended without a first token"
        stream = self.submit(req)
        try:
            async for delta in stream:
                if delta.error:
                    error = delta.error
        except asyncio.CancelledError:  # the decode server went away: free the blocks now
            stream.abort()
            # After the abort, on the engine thread: by then a step that finished the request
            # has held its blocks, and the release finds them.
            self.call_on_engine(self._release(req.request_id))
            raise
        held = self.handoff.held(req.request_id)
        if held is None:
            raise PrefillError(error)
        params_out = KVTransferParams(remote_engine_id=self.engine_id,
                                      remote_block_ids=held.block_ids,
                                      remote_host=self.kv_server.host,
                                      remote_port=self.kv_server.port,
                                      remote_request_id=req.request_id)
        return {"request_id": req.request_id, "first_token": held.meta.first_token,
                "kv_transfer_params": msgspec.to_builtins(params_out)}


    def _release(self, request_id: str):
        def release(core: EngineCore) -> list:
            self.handoff.release(request_id)
            return []
        return release


def _error(message: str, status: int, code: str) -> Response:
    return Response(error_body(message, code), status, media_type="application/json")


async def prefill_route(request: HttpRequest) -> Response:
    engine = request.app.state.server.engine
    if not isinstance(engine, PrefillEngine):
        return _error("this server does not prefill for others (start it with --role "
                      "prefill)", 404, "not_found")
    try:
        body = msgspec.json.decode(await request.body(), type=PrefillRequestBody)
        answer = await _unless_disconnected(
            request, engine.prefill(body.prompt_token_ids, body.sampling, body.speculation))
    except ClientGone:
        return Response(status_code=499)  # nobody reads it; the prefill was cancelled
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
        return _error(f"bad prefill request: {exc}", 400, "invalid_request")
    except (EngineStoppedError, PrefillError) as exc:
        return _error(f"prefill failed: {exc}", 503, "prefill_failed")
    return Response(orjson.dumps(answer), media_type="application/json")


class ClientGone(Exception):
    """The decode server closed the prefill request before its answer."""


async def _unless_disconnected(request: HttpRequest, work):
    """Await `work`, cancelling it if the client disconnects first (ClientGone): a decode
    server whose own client aborted closes its request, and the prompt's blocks go back at
    once. (The body is read already, so the next ASGI message is the disconnect.)"""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        abandoned = not task.done()  # the client went away (or the server is stopping)
        if abandoned:
            task.cancel()
    if abandoned:
        raise ClientGone
    return task.result()


async def _disconnect(request: HttpRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


ROUTES = [Route(PREFILL_PATH, prefill_route, methods=["POST"])]
