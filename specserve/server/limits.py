"""Server limits and the one path every request takes from wire fields to an engine request.

Both front ends (the WebSocket session and the OpenAI routes) decode their own wire format, then
call `prepare_request`, which renders the chat template, tokenizes, applies `ServerLimits` and
builds `SamplingParams`. Limits are therefore checked in exactly one place, and the same
`ServerLimits` object is what `session.created` reports to clients.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import msgspec

from ..engine import AsyncEngine
from ..sampling import SamplingParams


class RequestError(Exception):
    """A request the server refuses; `code` and `param` go to the client as they are."""

    def __init__(self, code: str, message: str, param: str | None = None,
                 http_status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.http_status = http_status


def validation_param(exc: msgspec.ValidationError) -> str | None:
    """'Expected `int` - at `$.response.top_k`' -> 'response.top_k'; missing fields too."""
    text = str(exc)
    if " - at `$." in text:
        path = text.rsplit(" - at `$.", 1)[1].rstrip("`")
        if text.startswith("Object contains unknown field `"):
            path += "." + text.split("`", 2)[1]
        return path
    if text.startswith(("Object missing required field `", "Object contains unknown field `")):
        return text.split("`", 2)[1]
    return None


@dataclass(frozen=True)
class ServerLimits:
    """Bounds on one request and on one WebSocket; reported in `session.created`."""

    max_model_len: int  # prompt + output tokens
    max_prompt_tokens: int
    max_output_tokens: int
    default_max_output_tokens: int = 512  # when a request does not say; cut to fit the context
    max_message_bytes: int = 1 << 20  # one WebSocket frame
    max_requests_in_flight: int = 16  # per WebSocket
    max_choices: int = 64  # engine requests one OpenAI request may start (prompts x n)

    @classmethod
    def for_engine(cls, engine: AsyncEngine, **overrides) -> ServerLimits:
        """Limits that follow from the engine: its context and its KV pool, whichever is less."""
        engine_limits = engine.limits
        context = min(engine_limits.max_model_len, engine_limits.kv_pool_tokens)
        values = dict(max_model_len=context, max_prompt_tokens=context - 1,  # noqa: C408
                      max_output_tokens=context - 1)
        values.update(overrides)
        values.setdefault("default_max_output_tokens",
                          min(cls.default_max_output_tokens, values["max_output_tokens"]))
        return cls(**values)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PreparedRequest:
    """A validated request, ready for `AsyncEngine.add_request`."""

    prompt_token_ids: list[int]
    params: SamplingParams
    speculation: object  # the client's spelling (None: the engine's default mode)
    speculation_name: str  # the mode that will run, e.g. "tree:24"


def _content_text(content) -> str:
    """OpenAI message content: a string, or a list of parts of which text parts are used."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def prepare_request(engine: AsyncEngine, limits: ServerLimits, *,
                    messages: Sequence[dict] | None = None,
                    prompt: str | Sequence[int] | None = None,
                    temperature: float | None = None, top_p: float | None = None,
                    top_k: int | None = None, seed: int | None = None,
                    stop: str | Sequence[str] | None = None,
                    max_output_tokens: int | None = None, ignore_eos: bool | None = None,
                    speculation=None,
                    param: Callable[[str], str] = lambda name: name) -> PreparedRequest:
    """Validate one request; RequestError names the offending field through `param`.

    `param` maps the canonical field names used here (messages, prompt, max_output_tokens,
    speculation, ...) to the caller's wire names, so errors point at what the client sent.
    """
    tokenizer = engine.tokenizer
    if (messages is None) == (prompt is None):
        raise RequestError("invalid_field", "give exactly one of messages and prompt",
                           param("messages"))
    if messages is not None:
        if not messages:
            raise RequestError("invalid_field", "messages is empty", param("messages"))
        chat = [{"role": m["role"], "content": _content_text(m["content"])} for m in messages]
        try:
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                 tokenize=False)
        except Exception as exc:  # a template may reject role orders; say so, don't crash
            raise RequestError("invalid_field", f"chat template failed: {exc}",
                               param("messages")) from exc
        # The template already spells out BOS and role markers; don't add them twice.
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(prompt, str):
        prompt_ids = tokenizer.encode(prompt)  # the same call LLM.generate makes
    else:
        prompt_ids = list(prompt)
        vocab = engine.model_info.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
               for t in prompt_ids):
            raise RequestError("invalid_field", f"token ids must be integers in [0, {vocab})",
                               param("prompt"))
    if not prompt_ids:
        raise RequestError("invalid_field", "the prompt is empty", param("prompt"))

    n_prompt = len(prompt_ids)
    if n_prompt > limits.max_prompt_tokens:
        raise RequestError("prompt_too_long", f"the prompt has {n_prompt} tokens; the limit is "
                           f"{limits.max_prompt_tokens}", param("messages" if messages
                                                               is not None else "prompt"))
    if max_output_tokens is None:
        max_output_tokens = min(limits.default_max_output_tokens,
                                limits.max_model_len - n_prompt)
    elif not 1 <= max_output_tokens <= limits.max_output_tokens:
        raise RequestError("invalid_field", f"max_output_tokens must be in "
                           f"[1, {limits.max_output_tokens}], got {max_output_tokens}",
                           param("max_output_tokens"))
    elif n_prompt + max_output_tokens > limits.max_model_len:
        raise RequestError("prompt_too_long", f"prompt ({n_prompt} tokens) + max_output_tokens "
                           f"({max_output_tokens}) exceeds the context of "
                           f"{limits.max_model_len} tokens", param("max_output_tokens"))

    try:
        mode = (engine.parse_speculation(speculation) if speculation is not None
                else engine.model_info.default_speculation)
    except ValueError as exc:
        raise RequestError("invalid_field", str(exc), param("speculation")) from exc

    fields = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
              "stop": stop, "ignore_eos": ignore_eos}
    try:
        params = SamplingParams(max_tokens=max_output_tokens,
                                **{k: v for k, v in fields.items() if v is not None})
    except ValueError as exc:
        # SamplingParams messages start with the field name ("top_p must be ...").
        name = str(exc).split(" ", 1)[0]
        raise RequestError("invalid_field", str(exc),
                           param(name) if name in fields else None) from exc
    return PreparedRequest(prompt_ids, params, speculation, str(mode))
