"""OpenAI-compatible HTTP routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

Request bodies are decoded with orjson and checked with msgspec structs that ignore fields we
do not use (OpenAI clients send many), then go through the same `prepare_request` as WebSocket
requests. Streaming answers are server-sent events, one chunk per engine step that produced
text, ending with `data: [DONE]`; a stream the server ends (an engine error, or the drain at
shutdown) sends an error chunk (`data: {"error": ...}`) before `[DONE]`. A client that goes away
mid-request cancels it: a watcher task waits for `http.disconnect` and aborts the engine
request, so its KV blocks come back even while no text is being written. Every request holds an
admission ticket (`admission.py`) from before it is prepared until its stream ends.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated

import msgspec
import orjson
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..engine import EngineStoppedError, RequestStream
from ..outputs import RequestDelta
from ..validation import (
    PreparedRequest,
    RequestError,
    SpeculationSpec,
    StopSpec,
    validation_param,
)
from .admission import RETRY_AFTER_S, Ticket
from .auth import error_body
from .metrics import request_metrics

if TYPE_CHECKING:
    from .app import ServerState

# OpenAI's finish reasons; an abort only happens when the client has gone already.
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatMessage(msgspec.Struct):
    role: str  # checked against the chat template's roles by validation
    content: str | list[dict] | None = None  # text parts only; validation checks each


class _Common(msgspec.Struct, kw_only=True):
    model: str
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: StopSpec | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # specserve extensions (pass with extra_body= from the openai package)
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    ignore_eos: bool | None = None
    speculation: SpeculationSpec | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None


class CompletionRequest(_Common, kw_only=True):
    # str, [str] or token ids (msgspec unions allow one list type; _prepare sorts them out)
    prompt: str | list[str | int]


def _error(status: int, message: str, code: str, param: str | None = None) -> Response:
    headers = {"retry-after": str(RETRY_AFTER_S)} if status == 429 else None
    return Response(error_body(message, code, param=param), status,
                    media_type="application/json", headers=headers)


def _shown(name: str, limit: int = 64) -> str:
    """A client-sent string as error messages quote it: never more than `limit` characters."""
    return repr(name) if len(name) <= limit else repr(name[:limit]) + "..."


async def _decode(request: Request, cls: type[msgspec.Struct]):
    try:
        obj = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise RequestError("invalid_json", f"body is not valid JSON: {exc}") from exc
    try:
        return msgspec.convert(obj, cls)
    except msgspec.ValidationError as exc:
        raise RequestError("invalid_field", str(exc), validation_param(exc)) from exc


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = {"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created,
        "owned_by": "specserve", "root": state.model_root, "parent": None,
        "max_model_len": state.limits.max_model_len}]}
    return Response(orjson.dumps(body), media_type="application/json")


async def chat_completions(request: Request) -> Response:
    return await _complete(request, chat=True)


async def completions(request: Request) -> Response:
    return await _complete(request, chat=False)


async def _complete(request: Request, chat: bool) -> Response:
    state: ServerState = request.app.state.server
    ticket: Ticket | None = None
    streaming = False
    try:
        body = await _decode(request, ChatCompletionRequest if chat else CompletionRequest)
        if body.model not in (state.model_name, state.model_root):
            return _error(404, f"the model {_shown(body.model)} does not exist; this server "
                          f"serves {state.model_name!r}", "model_not_found", "model")
        if body.n != 1:
            raise RequestError("invalid_field", "only n=1 is supported", "n")
        ticket = state.admission.admit()
        prepared = await _prepare(state, body, chat)
        stream = state.engine.add_request(prepared.prompt_token_ids, prepared.params,
                                          _new_id("req"), prepared.speculation)
        ticket.attach(stream.abort)

        reply = _Reply(state, chat, len(prepared.prompt_token_ids))
        watcher = asyncio.create_task(_abort_on_disconnect(request, stream, reply, ticket))
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            response = StreamingResponse(_sse(reply, stream, watcher, ticket, include_usage),
                                         media_type="text/event-stream",
                                         headers={"cache-control": "no-cache",
                                                  "x-accel-buffering": "no"})
            streaming = True  # the ticket is _sse's now
            return response
        try:
            async for delta in stream:
                reply.add(delta)
        finally:
            watcher.cancel()
        if reply.error is not None:
            return _error(500, reply.error, "engine_error")
        if reply.finish_reason == "abort" and not reply.client_gone:
            return _error(503, "the server is shutting down", "server_unavailable")
        return Response(orjson.dumps(reply.whole()), media_type="application/json")
    except RequestError as exc:
        return _error(exc.http_status, exc.message, exc.code, exc.param)
    except EngineStoppedError as exc:
        return _error(503, str(exc), "server_unavailable")
    except ValueError as exc:
        return _error(400, str(exc), "invalid_request")
    finally:
        if ticket is not None and not streaming:
            ticket.release()



async def _prepare(state: ServerState, body: _Common, chat: bool) -> PreparedRequest:
    max_tokens = body.max_tokens
    names = {"max_output_tokens": "max_tokens"}
    if chat:
        if body.max_completion_tokens is not None:
            max_tokens, names["max_output_tokens"] = body.max_completion_tokens, \
                "max_completion_tokens"
        # "developer" is the newer OpenAI name of the system role.
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content or ""} for m in body.messages]
        prompt = None
    else:
        messages, prompt = None, body.prompt
        if isinstance(prompt, list) and any(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise RequestError("invalid_field", "give one prompt string, or token ids",
                                   "prompt")
            prompt = prompt[0]
    return await state.preparer.prepare(
        messages=messages, prompt=prompt,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
        stop=body.stop, max_output_tokens=max_tokens, ignore_eos=body.ignore_eos,
        speculation=body.speculation, param=lambda name: names.get(name, name))


async def _abort_on_disconnect(request: Request, stream: RequestStream, reply: _Reply,
                               ticket: Ticket) -> None:
    # Starlette no longer watches for disconnects while streaming (ASGI spec 2.4), and a
    # non-streaming request would otherwise run to its end for nobody. The ticket goes back
    # here too: a response whose client left before it started never runs _sse's cleanup.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            reply.client_gone = True
            stream.abort()
            ticket.release()
            return


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class _Reply:
    """Accumulates one request's output and renders OpenAI objects from it."""

    def __init__(self, state: ServerState, chat: bool, n_prompt: int) -> None:
        self.state = state
        self.chat = chat
        self.id = _new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.n_prompt = n_prompt
        self.n_out = 0
        self.parts: list[str] = []
        self.finish_reason: str | None = None
        self.metrics: dict | None = None
        self.error: str | None = None
        self.role_sent = False
        self.client_gone = False

    def add(self, delta: RequestDelta) -> None:
        self.n_out += len(delta.token_ids)
        self.parts.append(delta.text)
        if delta.finished:
            self.finish_reason = _FINISH.get(delta.finish_reason, delta.finish_reason)
            self.metrics = delta.metrics
            self.error = delta.error
            self.state.metrics.observe("openai", delta.finish_reason, delta.metrics)

    def usage(self) -> dict:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": self.n_out,
                "total_tokens": self.n_prompt + self.n_out}

    def _base(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created,
                "model": self.state.model_name}

    def whole(self) -> dict:
        text = "".join(self.parts)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}}
                  if self.chat else {"index": 0, "text": text})
        choice.update(finish_reason=self.finish_reason, logprobs=None)
        return {**self._base(self.object), "choices": [choice], "usage": self.usage(),
                "metrics": request_metrics(self.metrics)}

    def chunk(self, text: str | None, finish_reason: str | None, with_usage: bool) -> bytes:
        if self.chat:
            delta: dict = {}
            if text is not None:
                if not self.role_sent:  # the role rides on the first real token
                    delta["role"] = "assistant"
                    self.role_sent = True
                delta["content"] = text
            choice = {"index": 0, "delta": delta}
            object_ = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or ""}
            object_ = "text_completion"
        choice.update(finish_reason=finish_reason, logprobs=None)
        chunk = {**self._base(object_), "choices": [choice]}
        if with_usage:
            chunk["usage"] = None
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def usage_chunk(self) -> bytes:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {**self._base(object_), "choices": [], "usage": self.usage()}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def _sse(reply: _Reply, stream: RequestStream, watcher: asyncio.Task, ticket: Ticket,
               include_usage: bool) -> AsyncIterator[bytes]:
    try:
        async for delta in stream:
            reply.add(delta)
            if delta.text:
                yield reply.chunk(delta.text, None, include_usage)
        yield reply.chunk(None, reply.finish_reason, include_usage)
        if include_usage:
            yield reply.usage_chunk()
        if reply.error is not None:
            yield _error_chunk(reply.error, "engine_error")
        elif reply.finish_reason == "abort" and not reply.client_gone:
            yield _error_chunk("the server is shutting down", "server_shutdown")
        yield b"data: [DONE]\n\n"
    finally:
        watcher.cancel()
        stream.abort()  # a no-op once finished; frees the blocks if the writer failed
        ticket.release()


def _error_chunk(message: str, code: str) -> bytes:
    return b"data: " + error_body(message, code, "server_error") + b"\n\n"
