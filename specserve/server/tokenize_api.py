"""`POST /tokenize`, `POST /detokenize` and `GET /tokenizer_info`, in vLLM's shapes.

`/tokenize` takes either `prompt` (text; `add_special_tokens` default true, as completions
encode it) or `messages` (the chat template applied as `/v1/chat/completions` applies it;
`add_generation_prompt` default true, `add_special_tokens` default false) and answers
`{"count", "max_model_len", "tokens", "token_strs"}`; `token_strs` (the tokenizer's token
spellings) only with `return_token_strs: true`, else null. `/detokenize` takes `tokens` and
answers `{"prompt": text}`. `model` is optional; when given it must be the served model.
`/tokenizer_info` describes the tokenizer (class, special tokens, chat template), enough for a
client such as lm-evaluation-harness to tokenize through the server instead of loading it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import orjson
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response

from ..validation import (
    RequestError,
    check_messages,
    check_prompt_text,
    validation_param,
)
from .auth import error_body
from .state import ServerState


class _Message(msgspec.Struct):
    role: str
    content: str | list[dict] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[_Message], Meta(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[Annotated[int, Meta(ge=0)]]


def _json(body: dict | bytes, status: int = 200) -> Response:
    return Response(body if isinstance(body, bytes) else orjson.dumps(body), status,
                    media_type="application/json")


async def _decode(request: Request, cls: type[msgspec.Struct]):
    state: ServerState = request.app.state.server
    try:
        body = msgspec.json.decode(await request.body(), type=cls)
    except msgspec.ValidationError as exc:
        raise RequestError("invalid_field", str(exc), validation_param(exc)) from exc
    except msgspec.DecodeError as exc:
        raise RequestError("invalid_json", f"body is not valid JSON: {exc}") from exc
    if body.model is not None and body.model not in (state.model_name, state.model_root):
        raise RequestError("model_not_found", f"the model {body.model!r} does not exist; this "
                           f"server serves {state.model_name!r}", "model", 404)
    return body


def _checked_chat(state: ServerState, body: TokenizeRequest) -> list[dict] | None:
    """The request's messages after the same role, content and size checks as a chat request
    (None for a prompt), before any tokenizer work."""
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("invalid_field", "give exactly one of prompt and messages", "prompt")
    byte_cap = state.limits.prompt_byte_cap
    if body.prompt is not None:
        check_prompt_text(body.prompt, byte_cap)
        return None
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.content}
                for m in body.messages]
    return check_messages(messages, state.preparer.facts.roles, byte_cap)


def _tokenize(tokenizer, body: TokenizeRequest, chat: list[dict] | None) -> list[int]:
    if chat is None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer.encode(body.prompt, add_special_tokens=special)
    continue_final = bool(body.continue_final_message)
    generation = (not continue_final if body.add_generation_prompt is None
                  else body.add_generation_prompt)
    if generation and continue_final:
        raise RequestError("invalid_field", "add_generation_prompt and continue_final_message "
                           "cannot both be true", "continue_final_message")
    try:
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=generation,
                                             continue_final_message=continue_final,
                                             tokenize=False)
    except Exception as exc:  # a template may reject role orders; say so, don't crash
        raise RequestError("invalid_field", f"chat template failed: {exc}", "messages") from exc
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


async def tokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    tokenizer = state.engine.tokenizer
    try:
        body = await _decode(request, TokenizeRequest)
        chat = _checked_chat(state, body)
        ids = await state.preparer.run(lambda: _tokenize(tokenizer, body, chat))
    except RequestError as exc:
        return _json(error_body(exc.message, exc.code, param=exc.param), exc.http_status)
    return _json({"count": len(ids), "max_model_len": state.limits.max_model_len,
                  "tokens": ids,
                  "token_strs": (tokenizer.convert_ids_to_tokens(ids)
                                 if body.return_token_strs else None)})


async def detokenize(request: Request) -> Response:
    state: ServerState = request.app.state.server
    tokenizer = state.engine.tokenizer
    try:
        body = await _decode(request, DetokenizeRequest)
        vocab = len(tokenizer)
        if any(t >= vocab for t in body.tokens):
            raise RequestError("invalid_field", f"token ids must be in [0, {vocab})", "tokens")
    except RequestError as exc:
        return _json(error_body(exc.message, exc.code, param=exc.param), exc.http_status)
    return _json({"prompt": await state.preparer.run(lambda: tokenizer.decode(body.tokens))})


async def tokenizer_info(request: Request) -> Response:
    state: ServerState = request.app.state.server
    tokenizer = state.engine.tokenizer
    return _json({"tokenizer_class": type(tokenizer).__name__,
                  "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token,
                  "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
                  "chat_template": tokenizer.chat_template,
                  "model_max_length": state.limits.max_model_len})
