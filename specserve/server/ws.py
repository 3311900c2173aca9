"""One WebSocket session of the `specserve.v1` protocol (docs/PROTOCOL.md).

A session reads client events, validates each with a msgspec struct, and runs any number of
requests side by side: every accepted `response.create` gets an engine stream and a small pump
task that turns the stream's deltas into `response.output_text.delta` events and ends with
`response.done`. Requests are keyed by the client's `request_id` (prefixed with the session id
inside the engine, so two sockets may use the same ids). A bad event is answered with an `error`
event and the session goes on; closing the socket aborts everything still in flight, which
returns its KV blocks to the pool before the engine's next step.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import replace
from typing import Annotated, Literal

import msgspec
import orjson
from msgspec import UNSET, Meta, UnsetType
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from ..engine import EngineStoppedError, RequestStream
from ..outputs import RequestDelta
from ..sampling import MAX_LOGPROBS
from ..structured import api as structured_api
from ..structured.compiler import GrammarError
from ..validation import (
    RequestError,
    SpeculationSpec,
    StopSpec,
    check_speculation,
    validation_param,
)
from .admission import Ticket
from .metrics import request_metrics
from .openai_logprobs import TokenStrings
from .state import ServerState

log = logging.getLogger("specserve.server")

# What a send on a socket the client has closed raises (the first send, then every later one).
_GONE = (WebSocketDisconnect, WebSocketDisconnected)

# ---- client events (validated by msgspec; unknown fields are errors, so typos surface) ------

RequestId = Annotated[str, Meta(min_length=1, max_length=128)]


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The per-request knobs; also what `session.update` may set as defaults."""

    temperature: Annotated[float, Meta(ge=0)] | UnsetType = UNSET
    top_p: Annotated[float, Meta(gt=0, le=1)] | UnsetType = UNSET
    top_k: Annotated[int, Meta(ge=-1)] | UnsetType = UNSET
    seed: int | None | UnsetType = UNSET
    stop: StopSpec | None | UnsetType = UNSET
    max_output_tokens: Annotated[int, Meta(ge=1)] | UnsetType = UNSET
    ignore_eos: bool | UnsetType = UNSET
    speculation: SpeculationSpec | None | UnsetType = UNSET
    speculation_events: bool | UnsetType = UNSET
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None | UnsetType = UNSET


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ResponseParams(SamplingFields, forbid_unknown_fields=True):
    messages: Annotated[list[Message], Meta(min_length=1)] | UnsetType = UNSET
    prompt: str | list[int] | UnsetType = UNSET
    # What the output must match: one of {"json": schema, "json_object": true, "regex": ...,
    # "grammar": ..., "choice": [...]} (vLLM's structured_outputs keys); per request only.
    structured: dict | UnsetType = UNSET


class _Event(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    event_id: str | None = None


class ResponseCreate(_Event, kw_only=True):
    request_id: RequestId
    response: ResponseParams


class ResponseCancel(_Event, kw_only=True):
    request_id: RequestId


class SessionFields(msgspec.Struct, forbid_unknown_fields=True):
    defaults: SamplingFields = msgspec.field(default_factory=SamplingFields)


class SessionUpdate(_Event, kw_only=True):
    session: SessionFields


class Ping(_Event, kw_only=True):
    pass


CLIENT_EVENTS: dict[str, type[_Event]] = {
    "response.create": ResponseCreate,
    "response.cancel": ResponseCancel,
    "session.update": SessionUpdate,
    "ping": Ping,
}

_SAMPLING_NAMES = ("temperature", "top_p", "top_k", "seed", "stop", "max_output_tokens",
                   "ignore_eos", "speculation")


def _merged(params: SamplingFields, defaults: SamplingFields, name: str):
    value = getattr(params, name)
    if value is UNSET:
        value = getattr(defaults, name)
    return None if value is UNSET else value


# ---- the session --------------------------------------------------------------------------

class _InFlight:
    """One request of this session between `response.created` and `response.done`."""

    __slots__ = ("stream", "task", "cancelled", "ticket")

    def __init__(self, stream: RequestStream, ticket: Ticket) -> None:
        self.stream = stream
        self.task: asyncio.Task | None = None
        self.cancelled = False  # by the client (`response.cancel`), not by a shutdown
        self.ticket = ticket  # back to admission control when the pump ends


class Session:
    def __init__(self, websocket: WebSocket, state: ServerState) -> None:
        self.ws = websocket
        self.state = state
        self.engine = state.engine
        self.limits = state.limits
        self.id = "sess_" + secrets.token_hex(6)
        self.defaults = SamplingFields()
        self.inflight: dict[str, _InFlight] = {}
        self.token_strings = TokenStrings(self.engine.tokenizer)

    async def send(self, event: dict) -> None:
        await self.ws.send({"type": "websocket.send", "text": orjson.dumps(event).decode()})

    async def error(self, code: str, message: str, param: str | None = None,
                    event_id: str | None = None, request_id: str | None = None) -> None:
        await self.send({"type": "error", "code": code, "message": message, "param": param,
                         "event_id": event_id, "request_id": request_id})

    def _session_object(self) -> dict:
        return {"id": self.id, "model": self.state.model_name,
                "speculation": str(self.engine.model_info.default_speculation),
                "defaults": msgspec.to_builtins(self.defaults),
                "limits": self.limits.as_dict()}

    async def run(self) -> None:
        """Serve the socket until the client closes it; then cancel what is left."""
        self.state.metrics.sessions.inc()
        try:
            await self.send({"type": "session.created", "session": self._session_object()})
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    self._log_gone(message.get("code"))
                    return
                await self.on_frame(message)
        except _GONE as exc:
            self._log_gone(getattr(exc, "code", None))
        finally:
            self.close_all()
            self.state.metrics.sessions.dec()

    def _log_gone(self, code: int | None) -> None:
        log.info("session %s: client went away (close code %s, %d request(s) in flight "
                 "aborted)", self.id, code, len(self.inflight))

    def close_all(self) -> None:
        """Abort every request in flight (the engine frees their blocks) and stop the pumps."""
        for flight in self.inflight.values():
            flight.cancelled = True
            flight.stream.abort()
            if flight.task is not None:
                flight.task.cancel()
            flight.ticket.release()  # a task cancelled before it ran has no finally to do it
        self.inflight.clear()

    async def on_frame(self, message: dict) -> None:
        text = message.get("text")
        if text is None:
            await self.error("binary_not_supported", "send JSON in text frames")
            return
        # A str of n chars encodes to at most 4n bytes; only measure when that could matter.
        limit = self.limits.max_message_bytes
        if len(text) * 4 > limit and len(text.encode()) > limit:
            await self.error("message_too_large", f"frames are limited to {limit} bytes")
            return
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            await self.error("invalid_json", f"frame is not valid JSON: {exc}")
            return
        if not isinstance(obj, dict):
            await self.error("invalid_json", "a frame must hold one JSON object")
            return
        event_id = obj.get("event_id") if isinstance(obj.get("event_id"), str) else None
        request_id = obj.get("request_id") if isinstance(obj.get("request_id"), str) else None
        kind = obj.get("type")
        cls = CLIENT_EVENTS.get(kind) if isinstance(kind, str) else None
        if cls is None:
            await self.error("unknown_event", f"unknown event type {kind!r}; expected one of "
                             f"{', '.join(CLIENT_EVENTS)}", "type", event_id, request_id)
            return
        try:
            event = msgspec.convert(obj, cls)
        except msgspec.ValidationError as exc:
            await self.error("invalid_field", str(exc), validation_param(exc), event_id,
                             request_id)
            return
        if isinstance(event, ResponseCreate):
            await self.on_create(event)
        elif isinstance(event, ResponseCancel):
            await self.on_cancel(event)
        elif isinstance(event, SessionUpdate):
            await self.on_session_update(event)
        else:
            await self.send({"type": "pong", "event_id": event.event_id})

    async def on_create(self, event: ResponseCreate) -> None:
        rid, event_id, params = event.request_id, event.event_id, event.response
        if rid in self.inflight:
            await self.error("duplicate_request_id", f"request {rid!r} is already in flight "
                             f"on this socket", "request_id", event_id, rid)
            return
        if len(self.inflight) >= self.limits.max_requests_in_flight:
            await self.error("too_many_requests", f"at most {self.limits.max_requests_in_flight}"
                             f" requests may be in flight on one socket", None, event_id, rid)
            return
        defaults = self.defaults
        fields = {name: _merged(params, defaults, name) for name in _SAMPLING_NAMES}
        ticket = None
        try:
            ticket = self.state.admission.admit()
            prepared = await self.state.preparer.prepare(
                messages=([{"role": m.role, "content": m.content} for m in params.messages]
                          if params.messages is not UNSET else None),
                prompt=params.prompt if params.prompt is not UNSET else None,
                param=lambda name: f"response.{name}", **fields)
            logprobs = _merged(params, defaults, "logprobs")
            structured = await self._structured(params)
            stream = self.engine.add_request(prepared.prompt_token_ids,
                                             replace(prepared.params, logprobs=logprobs,
                                                     structured=structured),
                                             f"{self.id}/{rid}", prepared.speculation)
        except RequestError as exc:
            await self._refuse(ticket, exc.code, exc.message, exc.param, event_id, rid)
            return
        except EngineStoppedError as exc:
            await self._refuse(ticket, "server_unavailable", str(exc), None, event_id, rid)
            return
        except ValueError as exc:  # what only the engine knows to check
            await self._refuse(ticket, "invalid_request", str(exc), None, event_id, rid)
            return
        flight = _InFlight(stream, ticket)
        ticket.attach(stream.abort)
        self.inflight[rid] = flight
        n_prompt = len(prepared.prompt_token_ids)
        await self.send({"type": "response.created", "request_id": rid,
                         "response": {"status": "in_progress", "model": self.state.model_name,
                                      "input_tokens": n_prompt,
                                      "max_output_tokens": prepared.params.max_tokens,
                                      "speculation": prepared.speculation_name}})
        spec_events = bool(_merged(params, defaults, "speculation_events"))
        flight.task = asyncio.create_task(self._pump(rid, flight, n_prompt, spec_events))

    async def _structured(self, params: ResponseParams):
        """The request's StructuredOutput, compiled (off the loop, capped); None if none."""
        if params.structured is UNSET:
            return None
        param = "response.structured"
        spec = structured_api.from_vllm(params.structured, param=param)
        try:
            await self.engine.core.grammars.compile_async(spec)
        except GrammarError as exc:
            raise RequestError("invalid_field", str(exc), param) from None
        return spec

    async def _refuse(self, ticket: Ticket | None, code: str, message: str,
                      param: str | None, event_id: str | None, rid: str) -> None:
        if ticket is not None:
            ticket.release()
        await self.error(code, message, param, event_id, rid)

    async def on_cancel(self, event: ResponseCancel) -> None:
        flight = self.inflight.get(event.request_id)
        if flight is None:
            await self.error("unknown_request_id", f"no request {event.request_id!r} is in "
                             f"flight on this socket", "request_id", event.event_id,
                             event.request_id)
            return
        flight.cancelled = True
        flight.stream.abort()  # the pump sends response.done once the engine confirms

    async def on_session_update(self, event: SessionUpdate) -> None:
        defaults = event.session.defaults
        try:  # catch a bad default now, rather than on every later request
            if defaults.speculation not in (UNSET, None):
                check_speculation(defaults.speculation, self.state.preparer.facts.has_draft,
                                  "session.defaults.speculation")
        except RequestError as exc:
            await self.error(exc.code, exc.message, exc.param, event.event_id)
            return
        max_out = defaults.max_output_tokens
        if max_out is not UNSET and max_out > self.limits.max_output_tokens:
            await self.error("invalid_field", f"max_output_tokens must be at most "
                             f"{self.limits.max_output_tokens}",
                             "session.defaults.max_output_tokens", event.event_id)
            return
        self.defaults = defaults
        await self.send({"type": "session.updated", "event_id": event.event_id,
                         "session": self._session_object()})

    async def _pump(self, rid: str, flight: _InFlight, n_prompt: int,
                    spec_events: bool) -> None:
        """Engine deltas -> events, one delta event per engine step, then response.done."""
        seq = n_out = 0
        send = self.send
        try:
            async for delta in flight.stream:
                n_tokens = len(delta.token_ids)
                if n_tokens or delta.text:
                    if spec_events and n_tokens:
                        await send({"type": "response.speculation.step", "request_id": rid,
                                    "seq": seq, "token_ids": delta.token_ids,
                                    "n_draft_accepted": delta.num_draft_accepted})
                    event = {"type": "response.output_text.delta", "request_id": rid,
                             "seq": seq, "delta": delta.text, "n_tokens": n_tokens,
                             "n_draft_accepted": delta.num_draft_accepted}
                    if delta.logprobs is not None:
                        event["logprobs"] = self._logprobs(delta)
                    await send(event)
                    seq += 1
                    n_out += n_tokens
                if delta.finished:
                    # Free the id before telling the client, so it may reuse it at once.
                    if self.inflight.get(rid) is flight:
                        del self.inflight[rid]
                    await send(self._done(rid, flight, delta, n_prompt, n_out))
        except _GONE:  # the receive loop sees the close too, logs it and aborts the rest
            pass
        except Exception:  # a bug here must not leave the request running unseen
            log.exception("pump for %s/%s failed", self.id, rid)
            flight.stream.abort()
            if self.inflight.get(rid) is flight:
                del self.inflight[rid]
        finally:
            flight.ticket.release()

    def _logprobs(self, delta: RequestDelta) -> list[dict]:
        strings = self.token_strings
        return [{"token_id": lp.token_id, "token": strings(lp.token_id), "logprob": lp.logprob,
                 "top": [{"token_id": t, "token": strings(t), "logprob": v} for t, v in lp.top]}
                for lp in delta.logprobs]

    def _done(self, rid: str, flight: _InFlight, delta: RequestDelta, n_prompt: int,
              n_out: int) -> dict:
        reason = delta.finish_reason
        if reason == "stop":
            status, why = "completed", "stop"
        elif reason == "length":
            status, why = "incomplete", "max_output_tokens"
        elif reason == "abort":
            status, why = "cancelled", ("client_cancelled" if flight.cancelled
                                        else "server_shutdown")
        else:
            status, why = "failed", "error"
        self.state.metrics.observe("ws", status, delta.metrics)
        event = {"type": "response.done", "request_id": rid, "status": status, "reason": why,
                 "usage": {"input_tokens": n_prompt, "output_tokens": n_out,
                           "total_tokens": n_prompt + n_out},
                 "metrics": request_metrics(delta.metrics)}
        if status == "failed":
            event["error"] = {"code": "engine_error", "message": delta.error or "engine error"}
        return event
