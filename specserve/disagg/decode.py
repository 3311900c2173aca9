"""The decode role: an `AsyncEngine` whose new requests are prefilled on a prefill server.

For each request the routes add, `DecodeEngine` opens the stream at once, then (on the event
loop) asks a prefill server for the prompt's first token and `kv_transfer_params`, pulls the
KV on a worker thread (`KVTransport`), and hands request and payload to the engine thread
(`handoff.import_prefilled`), which streams the first token and schedules the rest. The routes
see the same face as a colocated engine; `response.done` metrics carry `kv_transfer_ms`.

Requests that need the prompt's own logits here run colocated: prompt log-probabilities,
output log-probabilities (the first token's) and structured output (the grammar masks the first
token too). A prefill server that is down, answers an error or times out ends the request with
an error naming it; with several `--prefill-url`s they are tried in turn, starting round-robin.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import httpx
import msgspec

from ..engine import AsyncEngine
from ..engine.async_engine import RequestStream
from ..engine.core import EngineCore
from ..engine.request import Request
from ..outputs import RequestDelta
from ..sampling import SamplingParams
from .handoff import import_prefilled
from .prefill import PREFILL_PATH, SAMPLING_FIELDS
from .protocol import KVTransferParams
from .transport import KVPayload, KVTransport, TcpKVClient, TransferError

log = logging.getLogger("specserve.disagg")


class PrefillClient:
    """POSTs prompts to the prefill servers; PrefillUnavailable when none answers."""

    def __init__(self, urls: list[str], api_key: str | None = None,
                 timeout_s: float = 120.0) -> None:
        if not urls:
            raise ValueError("a decode server needs at least one --prefill-url")
        self.urls = [u.rstrip("/") for u in urls]
        self._next = itertools.cycle(range(len(self.urls)))
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(headers=headers,
                                         timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def prefill(self, prompt_token_ids: list[int], params: SamplingParams,
                      speculation) -> tuple[int, KVTransferParams]:
        body = {"prompt_token_ids": prompt_token_ids,
                "sampling": {k: getattr(params, k) for k in SAMPLING_FIELDS},
                "speculation": speculation}
        first = next(self._next)
        failures = []
        for i in range(len(self.urls)):
            url = self.urls[(first + i) % len(self.urls)]
            try:
                response = await self._client.post(url + PREFILL_PATH, json=body)
            except httpx.HTTPError as exc:  # down, refused, timed out: try the next one
                failures.append(f"{url}: {type(exc).__name__} {exc}".strip())
                continue
            if response.status_code != 200:
                raise PrefillUnavailable(f"prefill server {url} answered "
                                         f"{response.status_code}: {_message(response)}")
            answer = response.json()
            return (int(answer["first_token"]),
                    msgspec.convert(answer["kv_transfer_params"], KVTransferParams))
        raise PrefillUnavailable("no prefill server answered: " + "; ".join(failures))

    async def aclose(self) -> None:
        await self._client.aclose()


class PrefillUnavailable(RuntimeError):
    pass


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:200]


def runs_colocated(params: SamplingParams) -> bool:
    """Whether a request needs this engine to compute its prompt (see the module docstring)."""
    return (params.logprobs is not None or params.prompt_logprobs is not None
            or params.structured is not None)


class DecodeEngine(AsyncEngine):
    def __init__(self, core: EngineCore, prefill: PrefillClient,
                 transport: KVTransport | None = None) -> None:
        super().__init__(core)
        self.prefill_client = prefill
        self.transport = transport if transport is not None else TcpKVClient()
        self._pending: dict[str, asyncio.Task] = {}  # request id -> its remote prefill

    async def shutdown(self) -> None:
        for task in list(self._pending.values()):
            task.cancel()
        await asyncio.gather(*self._pending.values(), return_exceptions=True)
        await super().shutdown()
        await self.prefill_client.aclose()

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, speculation=None) -> RequestStream:
        if runs_colocated(params):
            return super().add_request(prompt, params, request_id, speculation)
        req = self.core.make_request(prompt, params, request_id, speculation)  # validates
        stream = self.open_stream(req)
        self._pending[req.request_id] = asyncio.get_running_loop().create_task(
            self._prefill_remote(req, speculation))
        return stream

    def abort(self, request_id: str) -> None:
        task = self._pending.get(request_id)
        if task is not None:
            task.cancel()  # the task ends the stream with an abort delta
        else:
            super().abort(request_id)

    async def _prefill_remote(self, req: Request, speculation) -> None:
        rid = req.request_id
        loop = asyncio.get_running_loop()
        params = None
        try:
            first_token, params = await self.prefill_client.prefill(
                req.prompt_token_ids, req.params, speculation)
            start = time.perf_counter()
            payload = await loop.run_in_executor(None, self.transport.pull, params)
            req.kv_transfer_ms = (time.perf_counter() - start) * 1e3
            if payload.meta.first_token != first_token:
                raise TransferError(f"the transfer's first token {payload.meta.first_token} "
                                    f"is not the prefill answer's {first_token}")
        except asyncio.CancelledError:
            # Aborted while prefilling (closing the HTTP request tells the prefill server) or
            # while pulling: the prefill server frees the blocks now, not when their time to
            # live runs out (a pull still running in its thread then finds nothing to read).
            if params is not None:
                loop.run_in_executor(None, self.transport.release, params)
            req.finish("abort")
            self._deliver([RequestDelta(rid, [], "", finish_reason="abort",
                                        metrics=req.metrics(), time=time.monotonic())])
            raise
        except Exception as exc:  # whatever it was, the client gets an error, never a hang
            log.warning("remote prefill of %s failed: %s", rid, exc)
            self._deliver([RequestDelta(rid, [], "", finish_reason="error",
                                        error=f"prefill failed: {exc}", metrics=req.metrics(),
                                        time=time.monotonic())])
            return
        finally:
            self._pending.pop(rid, None)
        self.call_on_engine(_importer(req, payload))


def _importer(req: Request, payload: KVPayload):
    def run(core: EngineCore) -> list[RequestDelta]:
        try:
            return import_prefilled(core, req, payload)
        except Exception as exc:  # a bad payload ends this request, not the engine
            log.exception("import of %s failed", req.request_id)
            return [RequestDelta(req.request_id, [], "", finish_reason="error",
                                 error=f"KV import failed: {exc}", metrics=req.metrics(),
                                 time=time.monotonic())]
    return run
