"""OpenAI-compatible HTTP routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

Request bodies are decoded with orjson and checked with msgspec structs that ignore fields we
do not use (OpenAI clients send many) and take `null` for every optional one; fields asking for
something this server does not do (penalties, logit_bias) are refused with a 400 naming them.
Structured output (`response_format`, vLLM's `structured_outputs` / `guided_*`) and tools
(`tools`, `tool_choice`) become a `StructuredOutput` on the request's SamplingParams, compiled off
the event loop before the request starts (specserve/structured); tool calls in the reply come
back as OpenAI `tool_calls`, streamed as whole calls. Each prompt then goes through the same
`prepare_request` as WebSocket requests.
One HTTP request may start several engine requests: prompts x `n` (or `best_of`) choices,
streamed side by side. Streaming answers are server-sent events, one chunk per engine step and
choice that produced text (or log-probabilities), ending with `data: [DONE]`. A client that goes
away mid-request cancels it: a watcher task waits for `http.disconnect` and aborts every engine
request of it, so KV blocks come back even while no text is being written. A stream the server
ends (an engine error, or the drain at shutdown) sends an error chunk (`data: {"error": ...}`)
before `[DONE]`. Every request holds an admission ticket (`admission.py`), weighted by its engine
requests, from before it is prepared until its stream ends.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Annotated

import msgspec
import orjson
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..engine import EngineStoppedError, RequestStream
from ..outputs import RequestDelta, TokenLogprob
from ..sampling import MAX_LOGPROBS, SamplingParams
from ..structured import api as structured_api
from ..structured.compiler import GrammarError
from ..structured.spec import StructuredOutput
from ..structured.tools import (
    ToolCallStream,
    ToolError,
    ToolPlan,
    parse_tool_calls,
    plan_tools,
    render_messages,
)
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
from .openai_logprobs import (
    CompletionLogprobs,
    TokenStrings,
    chat_logprobs,
    merge_completion_logprobs,
)
from .state import ServerState

# OpenAI's finish reasons; an abort only happens when the client has gone already.
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


class ChatMessage(msgspec.Struct):
    role: str  # checked against the chat template's roles by validation
    content: str | list[dict] | None = None  # text parts only; validation checks each
    tool_calls: list[dict] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool result's call
    name: str | None = None


class _Common(msgspec.Struct, kw_only=True):
    # Every optional field takes null, as OpenAI's API does (clients send explicit nulls).
    model: str
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=0)] | None = None  # 0 only for completions with echo
    stop: StopSpec | None = None
    seed: int | None = None
    n: Annotated[int, Meta(ge=1)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # specserve extensions (pass with extra_body= from the openai package)
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    ignore_eos: bool | None = None
    speculation: SpeculationSpec | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprob tokens as "token_id:ID"
    # Structured output: OpenAI's field, and vLLM's (at most one of them)
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None


class CompletionRequest(_Common, kw_only=True):
    # A string, token ids, or a list of either (msgspec unions allow one list type per level;
    # _prompts sorts them out).
    prompt: str | list[str | int | list[int]]
    echo: bool | None = None
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None
    suffix: str | None = None


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


def _model_card(state: ServerState) -> dict:
    return {"id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "specserve", "root": state.model_root, "parent": None,
            "max_model_len": state.limits.max_model_len}


async def list_models(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body = {"object": "list", "data": [_model_card(state)]}
    return Response(orjson.dumps(body), media_type="application/json")


async def retrieve_model(request: Request) -> Response:
    """`GET /v1/models/{id}` (the SDK's `models.retrieve`); ids may contain slashes."""
    state: ServerState = request.app.state.server
    model = request.path_params["model"]
    if model not in (state.model_name, state.model_root):
        return _error(404, f"the model {_shown(model)} does not exist; this server serves "
                      f"{state.model_name!r}", "model_not_found", "model")
    return Response(orjson.dumps(_model_card(state)), media_type="application/json")


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
        _check_supported(body, chat)
        completion = _Completion(state, body, chat)
        ticket = state.admission.admit(completion.num_requests)
        await completion.prepare(body)
        completion.start_leaders()
        ticket.attach(completion.abort)
        watcher = asyncio.create_task(_abort_on_disconnect(request, completion, ticket))
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            response = StreamingResponse(_sse(completion, watcher, ticket, include_usage),
                                         media_type="text/event-stream",
                                         headers={"cache-control": "no-cache",
                                                  "x-accel-buffering": "no"})
            streaming = True  # the ticket is _sse's now
            return response
        try:
            async for choice, delta in completion.events():
                choice.add(delta)
        finally:
            watcher.cancel()
            completion.abort()
        if completion.error is not None:
            return _error(500, completion.error, "engine_error")
        if completion.cut_short:
            return _error(503, "the server is shutting down", "server_unavailable")
        return Response(orjson.dumps(completion.whole()), media_type="application/json")
    except RequestError as exc:
        return _error(exc.http_status, exc.message, exc.code, exc.param)
    except EngineStoppedError as exc:
        return _error(503, str(exc), "server_unavailable")
    except ValueError as exc:
        return _error(400, str(exc), "invalid_request")
    finally:
        if ticket is not None and not streaming:
            ticket.release()


def _unsupported(message: str, param: str) -> RequestError:
    return RequestError("unsupported_field", message, param)


def _check_supported(body: _Common, chat: bool) -> None:
    """Refuse, naming the field, what a client asks for that this server does not do, rather
    than answer as if it had been done."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise _unsupported(f"{name} is not supported; leave it 0 or unset", name)
    if body.logit_bias:
        raise _unsupported("logit_bias is not supported; leave it empty or unset", "logit_bias")
    if chat:
        if body.top_logprobs and not body.logprobs:
            raise RequestError("invalid_field", "top_logprobs needs logprobs: true",
                               "top_logprobs")
        return
    if body.suffix:
        raise _unsupported("suffix (insertion) is not supported", "suffix")
    n, best_of = body.n or 1, body.best_of
    if best_of is not None and best_of < n:
        raise RequestError("invalid_field", f"best_of ({best_of}) must be >= n ({n})",
                           "best_of")
    if best_of is not None and best_of > n and body.stream:
        raise RequestError("invalid_field", "best_of > n cannot be streamed", "best_of")
    if body.max_tokens == 0 and not body.echo:
        raise RequestError("invalid_field", "max_tokens must be >= 1 (0 only with echo)",
                           "max_tokens")


def _prompts(body: CompletionRequest) -> list[str | list[int]]:
    """A completions `prompt` as a list of prompts: one string, token ids, or a list of either."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("invalid_field", "prompt is an empty list", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    if all(isinstance(p, (str, list)) for p in prompt):
        return list(prompt)
    raise RequestError("invalid_field", "prompt must be a string, a list of token ids, or a "
                       "list of strings or of token-id lists", "prompt")


async def _prepare(state: ServerState, body: _Common, chat: bool,
                   prompt: str | list[int] | None = None,
                   plan: ToolPlan | None = None) -> PreparedRequest:
    max_tokens = body.max_tokens
    names = {"max_output_tokens": "max_tokens"}
    if chat:
        if body.max_completion_tokens is not None:
            max_tokens, names["max_output_tokens"] = body.max_completion_tokens, \
                "max_completion_tokens"
        # "developer" is the newer OpenAI name of the system role.
        messages = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content or "", "tool_calls": m.tool_calls}
                     for m in body.messages]
        if plan is not None or any(m["tool_calls"] or m["role"] == "tool" for m in messages):
            # Calls and tool results as the model's format spells them (text), and the tool
            # list where the template does not render it itself.
            messages = render_messages(messages, plan, state.preparer.facts.roles)
        else:
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        prompt = None
    else:
        messages = None
        if max_tokens == 0:  # echo only: the engine computes the prompt and one dropped token
            max_tokens = 1
    return await state.preparer.prepare(
        messages=messages, prompt=prompt,
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
        stop=body.stop, max_output_tokens=max_tokens, ignore_eos=body.ignore_eos,
        speculation=body.speculation, param=lambda name: names.get(name, name),
        tools=plan.openai_tools() if plan is not None and plan.native else None)


def _structured(body: _Common, chat: bool, plan: ToolPlan | None
                ) -> tuple[str, StructuredOutput] | None:
    """The request's output constraint and the field that asked for it."""
    fields = [("response_format", structured_api.from_response_format(body.response_format)),
              ("structured_outputs", structured_api.from_vllm(
                  body.structured_outputs, json=body.guided_json, regex=body.guided_regex,
                  grammar=body.guided_grammar, choice=body.guided_choice))]
    if plan is not None:
        fields.append(("tool_choice", plan.constraint()))
    spec = structured_api.one_of(*fields)
    return None if spec is None else (next(n for n, s in fields if s is spec), spec)


def _tool_plan(state: ServerState, body: _Common, chat: bool) -> ToolPlan | None:
    if not chat:
        return None
    try:
        return plan_tools(body.tools, body.tool_choice,
                          getattr(state.engine.tokenizer, "chat_template", None))
    except ToolError as exc:
        raise RequestError("invalid_field", str(exc), exc.param) from None


async def _abort_on_disconnect(request: Request, completion: _Completion,
                               ticket: Ticket) -> None:
    # Starlette no longer watches for disconnects while streaming (ASGI spec 2.4), and a
    # non-streaming request would otherwise run to its end for nobody. The ticket goes back
    # here too: a response whose client left before it started never runs _sse's cleanup.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            completion.client_gone = True
            completion.abort()
            ticket.release()
            return


def _new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class _Group:
    """The choices of one prompt: `n` (or `best_of`) samples that share its KV blocks."""

    def __init__(self, prepared: PreparedRequest, text: str, plan: ToolPlan | None) -> None:
        self.prepared = prepared
        self.plan = plan
        self.text = text  # what echo repeats: the prompt as sent, or its token ids decoded
        self.choices: list[_Choice] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # from the leader


class _Choice:
    """One engine request behind one choice: what it has produced so far."""

    def __init__(self, group: _Group, index: int, params: SamplingParams,
                 strings: TokenStrings) -> None:
        self.group = group
        self.index = index
        self.params = params
        self.stream: RequestStream | None = None
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.metrics: dict | None = None
        self.error: str | None = None
        self.role_sent = False
        self.echo_sent = False
        # With tools: splits the streamed reply into content and whole tool calls.
        self.tool_stream = ToolCallStream(group.plan) if group.plan is not None else None
        self.completion_logprobs = CompletionLogprobs(strings)  # keeps text_offset running

    def add(self, delta: RequestDelta) -> None:
        self.token_ids += delta.token_ids
        self.parts.append(delta.text)
        if delta.logprobs:
            self.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.group.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason = _FINISH.get(delta.finish_reason, delta.finish_reason)
            self.metrics = delta.metrics
            self.error = delta.error

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


class _Completion:
    """One OpenAI request: its choices (prompts x samples), their engine streams, and the
    OpenAI objects rendered from them.

    Choice `i * n + j` is sample j of prompt i. Sample j runs with seed `seed + j` when the
    request has a seed, so each has its own reproducible random stream. Samples of one prompt
    share its KV through the prefix cache: sample 0 (the leader) is started first and the others
    once the leader's prompt is computed, so they find its full blocks cached and compute only
    the prompt's last partial block.
    """

    def __init__(self, state: ServerState, body: _Common, chat: bool) -> None:
        self.state = state
        self.chat = chat
        self.id = _new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.strings = TokenStrings(state.engine.tokenizer,
                                    bool(body.return_tokens_as_token_ids))
        self.n = body.n or 1
        best_of = None if chat else body.best_of
        self.samples = max(self.n, best_of or 1)  # engine requests per prompt
        if chat:
            self.logprobs = (body.top_logprobs or 0) if body.logprobs else None
            self.echo = False
        else:
            self.logprobs = body.logprobs
            self.echo = bool(body.echo)
        self.drop_output = not chat and body.max_tokens == 0  # echo of the prompt only
        self.prompts = [None] if chat else _prompts(body)
        self.tool_plan = _tool_plan(state, body, chat)
        self.structured = _structured(body, chat, self.tool_plan)
        limit = state.limits.max_choices
        if self.num_requests > limit:
            raise RequestError("invalid_field", f"prompts x {'best_of' if best_of else 'n'} is "
                               f"{self.num_requests}; the limit is {limit}",
                               "best_of" if best_of else "n")
        self.groups: list[_Group] = []
        self.choices: list[_Choice] = []
        self.queue: asyncio.Queue[tuple[_Choice, RequestDelta]] = asyncio.Queue()
        self.pumps: list[asyncio.Task] = []
        self.closed = False
        self.client_gone = False

    @property
    def num_requests(self) -> int:
        """Engine requests this completion starts: prompts x samples."""
        return len(self.prompts) * self.samples

    async def prepare(self, body: _Common) -> None:
        """Validate and tokenize each prompt (off the event loop) and plan its samples."""
        # best_of ranks samples by their cumulative log-probability, so it needs them.
        engine_logprobs = self.logprobs if self.samples == self.n else (self.logprobs or 0)
        tokenizer = self.state.engine.tokenizer
        spec = None
        if self.structured is not None:
            field, spec = self.structured
            try:  # on the compiler's threads, capped in time; cached for the engine
                await self.state.engine.core.grammars.compile_async(spec)
            except GrammarError as exc:
                raise RequestError("invalid_field", str(exc), field) from None
        for prompt in self.prompts:
            prepared = await _prepare(self.state, body, self.chat, prompt, self.tool_plan)
            group = _Group(prepared, prompt if isinstance(prompt, str) or prompt is None
                           else tokenizer.decode(prompt), self.tool_plan)
            base = replace(prepared.params, structured=spec)
            for j in range(self.samples):
                params = replace(
                    base, seed=None if base.seed is None else base.seed + j,
                    logprobs=engine_logprobs,
                    prompt_logprobs=self.logprobs if self.echo and j == 0 else None)
                choice = _Choice(group, len(self.choices), params, self.strings)
                group.choices.append(choice)
                self.choices.append(choice)
            self.groups.append(group)

    # ---- engine requests -------------------------------------------------------------------
    def start_leaders(self) -> None:
        """Start each prompt's first sample; any error aborts what was started and propagates."""
        try:
            for group in self.groups:
                self._start(group.choices[0])
        except Exception:
            self.abort()
            raise

    def _start(self, choice: _Choice) -> None:
        prepared = choice.group.prepared
        choice.stream = self.state.engine.add_request(
            prepared.prompt_token_ids, choice.params, _new_id("req"), prepared.speculation)
        self.pumps.append(asyncio.create_task(self._pump(choice)))

    def _start_followers(self, group: _Group) -> None:
        for choice in group.choices[1:]:
            if self.closed:  # the client is gone: end them unstarted
                self.queue.put_nowait((choice, RequestDelta("", [], "", finish_reason="abort")))
                continue
            try:
                self._start(choice)
            except (EngineStoppedError, ValueError) as exc:
                self.queue.put_nowait((choice, RequestDelta("", [], "", finish_reason="error",
                                                            error=str(exc))))

    async def _pump(self, choice: _Choice) -> None:
        first = choice is choice.group.choices[0]
        async for delta in choice.stream:
            if first:
                first = False
                self._start_followers(choice.group)
            self.queue.put_nowait((choice, delta))

    async def events(self) -> AsyncIterator[tuple[_Choice, RequestDelta]]:
        """Every choice's deltas as they come, until each has finished."""
        remaining = len(self.choices)
        while remaining:
            choice, delta = await self.queue.get()
            if delta.finished:
                remaining -= 1
                if delta.metrics is not None:
                    self.state.metrics.observe("openai", delta.finish_reason, delta.metrics)
            yield choice, delta

    def abort(self) -> None:
        """Abort every engine request still running (a no-op for finished ones)."""
        self.closed = True
        for choice in self.choices:
            if choice.stream is not None:
                choice.stream.abort()

    # ---- rendering -------------------------------------------------------------------------
    @property
    def error(self) -> str | None:
        return next((c.error for c in self.choices if c.error is not None), None)

    @property
    def cut_short(self) -> bool:
        """The server aborted a choice (the drain at shutdown), not the client."""
        return not self.client_gone and any(c.finish_reason == "abort" for c in self.choices)

    def usage(self) -> dict:
        n_prompt = sum(len(g.prepared.prompt_token_ids) for g in self.groups)
        n_out = 0 if self.drop_output else sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                "total_tokens": n_prompt + n_out}

    def _base(self, object_: str) -> dict:
        return {"id": self.id, "object": object_, "created": self.created,
                "model": self.state.model_name}

    def _echo(self, choice: _Choice) -> tuple[str, dict | None]:
        """The prompt's text and, with logprobs, its rendered prompt log-probabilities."""
        group = choice.group
        ids = group.prepared.prompt_token_ids
        if self.logprobs is None:
            return group.text, None
        logprobs = group.prompt_logprobs or [None] * len(ids)
        return group.text, choice.completion_logprobs.render(logprobs, ids)

    def _output_logprobs(self, choice: _Choice, token_ids: list[int],
                         logprobs: list[TokenLogprob] | None) -> dict | None:
        if self.logprobs is None or self.drop_output:
            return None
        if self.chat:
            return chat_logprobs(self.strings, logprobs or [])
        return choice.completion_logprobs.render(logprobs or [], token_ids)

    def _ranked(self) -> list[_Choice]:
        """The choices returned: all of them, or with best_of the n likeliest per prompt."""
        if self.samples == self.n:
            return self.choices
        return [c for g in self.groups
                for c in sorted(g.choices, key=lambda c: -c.cumulative_logprob)[:self.n]]

    def whole(self) -> dict:
        choices = []
        for index, choice in enumerate(self._ranked()):
            text = "" if self.drop_output else "".join(choice.parts)
            finish_reason = choice.finish_reason
            if self.chat:
                message = {"role": "assistant", "content": text}
                if self.tool_plan is not None:
                    content, calls = parse_tool_calls(text, self.tool_plan)
                    message["content"] = content
                    if calls:
                        message["tool_calls"] = calls
                        finish_reason = _tool_finish(finish_reason)
                rendered = {"index": index, "message": message}
                logprobs = self._output_logprobs(choice, choice.token_ids, choice.logprobs)
            else:
                parts = []
                if self.echo:
                    prompt_text, prompt_lp = self._echo(choice)
                    text = prompt_text + text
                    parts.append(prompt_lp)
                parts.append(self._output_logprobs(choice, choice.token_ids, choice.logprobs))
                rendered = {"index": index, "text": text}
                logprobs = merge_completion_logprobs([p for p in parts if p is not None])
            rendered.update(finish_reason=finish_reason, logprobs=logprobs)
            if len(self.choices) > 1:
                rendered["metrics"] = request_metrics(choice.metrics)
            choices.append(rendered)
        return {**self._base(self.object), "choices": choices, "usage": self.usage(),
                "metrics": request_metrics(self.choices[0].metrics)}

    def chunk(self, choice: _Choice, delta: RequestDelta | None,
              with_usage: bool) -> bytes | None:
        """One SSE event for a choice's delta, or for its end (delta None); None: nothing new."""
        text, token_ids, logprobs = "", [], None
        if delta is not None and not self.drop_output:
            text, token_ids, logprobs = delta.text, delta.token_ids, delta.logprobs
        finish_reason = choice.finish_reason if delta is None else None
        if self.chat:
            rendered_lp = self._output_logprobs(choice, token_ids, logprobs) if token_ids \
                else None
            calls: list[dict] = []
            if choice.tool_stream is not None:
                text, calls = (choice.tool_stream.feed(text) if delta is not None
                               else choice.tool_stream.finish())
                if delta is None and choice.tool_stream.num_calls:
                    finish_reason = _tool_finish(finish_reason)
            if delta is not None and not text and not calls and rendered_lp is None:
                return None
            message: dict = {}
            if delta is not None or text or calls:
                if not choice.role_sent:  # the role rides on the first real token
                    message["role"] = "assistant"
                    choice.role_sent = True
                message["content"] = text if text or not calls else None
            if calls:
                first = choice.tool_stream.num_calls - len(calls)
                message["tool_calls"] = [{"index": first + k, **call}
                                         for k, call in enumerate(calls)]
            rendered = {"index": choice.index, "delta": message}
            object_ = "chat.completion.chunk"
        else:
            parts = []
            if self.echo and not choice.echo_sent and delta is not None:
                choice.echo_sent = True
                prompt_text, prompt_lp = self._echo(choice)
                text = prompt_text + text
                parts.append(prompt_lp)
            if token_ids:
                parts.append(self._output_logprobs(choice, token_ids, logprobs))
            rendered_lp = merge_completion_logprobs([p for p in parts if p is not None])
            if delta is not None and not text and rendered_lp is None:
                return None
            rendered = {"index": choice.index, "text": text}
            object_ = "text_completion"
        rendered.update(finish_reason=finish_reason, logprobs=rendered_lp)
        chunk = {**self._base(object_), "choices": [rendered]}
        if with_usage:
            chunk["usage"] = None
        return b"data: " + orjson.dumps(chunk) + b"\n\n"

    def usage_chunk(self) -> bytes:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        chunk = {**self._base(object_), "choices": [], "usage": self.usage()}
        return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def _sse(completion: _Completion, watcher: asyncio.Task, ticket: Ticket,
               include_usage: bool) -> AsyncIterator[bytes]:
    try:
        async for choice, delta in completion.events():
            choice.add(delta)
            if (event := completion.chunk(choice, delta, include_usage)) is not None:
                yield event
            if delta.finished:
                yield completion.chunk(choice, None, include_usage)
        if include_usage:
            yield completion.usage_chunk()
        if completion.error is not None:
            yield _error_chunk(completion.error, "engine_error")
        elif completion.cut_short:
            yield _error_chunk("the server is shutting down", "server_shutdown")
        yield b"data: [DONE]\n\n"
    finally:
        watcher.cancel()
        completion.abort()  # a no-op once finished; frees the blocks if the writer failed
        ticket.release()


def _tool_finish(reason: str | None) -> str | None:
    """OpenAI's finish reason of a reply that ended in tool calls."""
    return "tool_calls" if reason == "stop" else reason


def _error_chunk(message: str, code: str) -> bytes:
    return b"data: " + error_body(message, code, "server_error") + b"\n\n"
