"""Request validation: the one set of checks every entry point applies.

The WebSocket session, the OpenAI routes and the offline `LLM` path all decode their own wire
format, then come here: byte caps first (cheap, before any templating or tokenizing), then the
chat template and the tokenizer, then token counts against the context, then sampling fields.
The caps on client-sent structures (stop strings, speculation trees) are defined once, as
msgspec types that the wire structs use and as checks that `prepare_request` repeats for callers
that did not go through msgspec.

Errors are `RequestError` (a `ValueError`): a stable `code`, a message that names what is wrong,
and the offending field (`param`), which the server passes to the client unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec
from msgspec import Meta

from .sampling import SamplingParams
from .speculation.modes import SpecMode, parse_speculation

# ---- caps on what a client may send ------------------------------------------------------
MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 256
# A list-form speculation tree: the same node cap as the largest named mode ("tree:64"), and
# no path deeper than the longest chain ("chain:16"). One target forward verifies every node.
MAX_TREE_NODES = 64
MAX_TREE_DEPTH = 16
MAX_SPECULATION_CHARS = 64
# Roles a chat message may have; a template may support fewer (see `template_roles`).
STANDARD_ROLES = ("system", "user", "assistant", "tool")

StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopSpec = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]
TreePath = Annotated[list[Annotated[int, Meta(ge=0)]], Meta(min_length=1,
                                                            max_length=MAX_TREE_DEPTH)]
SpeculationSpec = (Annotated[str, Meta(max_length=MAX_SPECULATION_CHARS)]
                   | Annotated[list[TreePath], Meta(min_length=1, max_length=MAX_TREE_NODES)])


class RequestError(ValueError):
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
class RequestLimits:
    """Bounds on one request."""

    max_model_len: int  # prompt + output tokens
    max_prompt_tokens: int
    max_output_tokens: int
    default_max_output_tokens: int = 512  # when a request does not say; cut to fit the context
    # Text (prompt or message contents) is refused above this many UTF-8 bytes before it is
    # templated or tokenized; 0 means derive it from max_prompt_tokens (see `prompt_byte_cap`).
    max_prompt_bytes: int = 0

    @classmethod
    def for_context(cls, context: int, **overrides) -> RequestLimits:
        """Limits for a context of `context` tokens (the model's, or its KV pool's if less)."""
        values = dict(max_model_len=context, max_prompt_tokens=context - 1,  # noqa: C408
                      max_output_tokens=context - 1)
        values.update(overrides)
        values.setdefault("default_max_output_tokens",
                          min(cls.default_max_output_tokens, values["max_output_tokens"]))
        return cls(**values)

    @property
    def prompt_byte_cap(self) -> int:
        # Real tokenizers average 3-5 bytes a token; 32 leaves room for long whitespace runs
        # and byte-level fallbacks while keeping the work a refused request costs bounded.
        return self.max_prompt_bytes or max(64 * 1024, 32 * self.max_prompt_tokens)


@dataclass(frozen=True)
class ModelFacts:
    """What validation needs to know about the loaded models."""

    tokenizer: object  # a Hugging Face tokenizer
    vocab_size: int
    has_draft: bool
    default_mode: SpecMode
    roles: frozenset[str] = frozenset(STANDARD_ROLES)


@dataclass
class PreparedRequest:
    """A validated request, ready for `AsyncEngine.add_request`."""

    prompt_token_ids: list[int]
    params: SamplingParams
    speculation: object  # the client's spelling (None: the engine's default mode)
    speculation_name: str  # the mode that will run, e.g. "tree:24"


# ---- the checks, one function each -------------------------------------------------------
_ROLE_ACCESS = re.compile(r"""(?:\[\s*['"]role['"]\s*\]|\.role\b)""")
_COMPARISON = re.compile(r"\s*(?:==|!=|is\b|in\b|not\b)")


def template_roles(template: str | None) -> frozenset[str]:
    """The standard roles a chat template can render.

    A template that writes the role name into the text (`'<|im_start|>' + m['role']`) renders
    any of them; one that only compares it (`m['role'] == 'user'`) knows the roles it names.
    User and assistant turns are always allowed.
    """
    if not template:
        return frozenset(STANDARD_ROLES)
    generic = any(not _COMPARISON.match(template, m.end())
                  for m in _ROLE_ACCESS.finditer(template))
    if generic:
        return frozenset(STANDARD_ROLES)
    named = {r for r in STANDARD_ROLES if f"'{r}'" in template or f'"{r}"' in template}
    return frozenset({"user", "assistant"} | named)


def _too_many_bytes(text: str, cap: int) -> int | None:
    """The UTF-8 size of text when it is over cap, else None (measured only when it could be)."""
    if len(text) * 4 <= cap:
        return None
    size = len(text.encode("utf-8", "surrogatepass"))
    return size if size > cap else None


def message_text(content, param: str) -> str:
    """OpenAI message content: a string, None, or a list of `{"type": "text", "text": ...}`."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise RequestError("invalid_field", "content must be a string or a list of text parts",
                           param)
    parts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise RequestError("invalid_field", "only parts of type 'text' are supported",
                               f"{where}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError("invalid_field", f"text must be a string, got "
                               f"{type(text).__name__}", f"{where}.text")
        parts.append(text)
    return "".join(parts)


def check_messages(messages: Sequence[dict], roles: frozenset[str], byte_cap: int,
                   param: str = "messages") -> list[dict]:
    """Plain `{"role", "content": str}` messages, after role, type and size checks."""
    if not messages:
        raise RequestError("invalid_field", "messages is empty", param)
    out, total = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError("invalid_field", "a message must be an object", f"{param}[{i}]")
        role = m.get("role")
        if role not in roles:
            raise RequestError("invalid_field", f"role must be one of {', '.join(sorted(roles))}"
                               f" for this model's chat template", f"{param}[{i}].role")
        text = message_text(m.get("content"), f"{param}[{i}].content")
        total += len(text)
        out.append({"role": role, "content": text})
    if total * 4 > byte_cap:
        size = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in out)
        if size > byte_cap:
            raise RequestError("prompt_too_long", f"the messages hold {size} bytes of text; "
                               f"the limit is {byte_cap}", param)
    return out


def check_prompt_text(prompt: str, byte_cap: int, param: str = "prompt") -> str:
    size = _too_many_bytes(prompt, byte_cap)
    if size is not None:
        raise RequestError("prompt_too_long", f"the prompt holds {size} bytes; the limit is "
                           f"{byte_cap}", param)
    return prompt


def check_prompt_ids(ids: Sequence[int], vocab_size: int, param: str = "prompt") -> list[int]:
    ids = list(ids)
    if not ids:
        raise RequestError("invalid_field", "the prompt is empty", param)
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
           for t in ids):
        raise RequestError("invalid_field", f"token ids must be ints in [0, {vocab_size})",
                           param)
    return ids


def check_lengths(n_prompt: int, max_output_tokens: int | None, limits: RequestLimits,
                  param: Callable[[str], str] = lambda name: name,
                  prompt_param: str = "prompt") -> int:
    """The output budget for a prompt of n_prompt tokens (the default when None is asked)."""
    if n_prompt > limits.max_prompt_tokens:
        raise RequestError("prompt_too_long", f"the prompt has {n_prompt} tokens; the limit is "
                           f"{limits.max_prompt_tokens}", param(prompt_param))
    if max_output_tokens is None:
        return min(limits.default_max_output_tokens, limits.max_model_len - n_prompt)
    if isinstance(max_output_tokens, bool) or not isinstance(max_output_tokens, int) or \
            not 1 <= max_output_tokens <= limits.max_output_tokens:
        raise RequestError("invalid_field", f"max_output_tokens must be in "
                           f"[1, {limits.max_output_tokens}], got {max_output_tokens!r}",
                           param("max_output_tokens"))
    if n_prompt + max_output_tokens > limits.max_model_len:
        raise RequestError("prompt_too_long", f"prompt ({n_prompt} tokens) + max_output_tokens "
                           f"({max_output_tokens}) exceeds the model's context of "
                           f"{limits.max_model_len} tokens", param("max_output_tokens"))
    return max_output_tokens


def check_stop(stop, param: str = "stop") -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOP_STRINGS:
        raise RequestError("invalid_field", f"stop must be a string or a list of at most "
                           f"{MAX_STOP_STRINGS} strings", param)
    for s in stops:
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            raise RequestError("invalid_field", f"each stop string must have 1 to "
                               f"{MAX_STOP_CHARS} characters", param)
    return tuple(stops)


def check_speculation(value, has_draft: bool, param: str = "speculation") -> SpecMode:
    """A client's speculation spelling -> its mode, with list-form trees capped first."""
    if isinstance(value, (list, tuple)):
        if not 1 <= len(value) <= MAX_TREE_NODES:
            raise RequestError("invalid_field", f"a speculation tree must have 1 to "
                               f"{MAX_TREE_NODES} nodes, got {len(value)}", param)
        if any(not isinstance(p, (list, tuple)) or len(p) > MAX_TREE_DEPTH for p in value):
            raise RequestError("invalid_field", f"a speculation tree is a list of paths of at "
                               f"most {MAX_TREE_DEPTH} child indices", param)
    elif isinstance(value, str) and len(value) > MAX_SPECULATION_CHARS:
        raise RequestError("invalid_field", "unknown speculation mode", param)
    try:
        return parse_speculation(value, has_draft)
    except ValueError as exc:
        raise RequestError("invalid_field", str(exc), param) from exc


# ---- the whole path ----------------------------------------------------------------------
def check_request_text(facts: ModelFacts, limits: RequestLimits, *,
                       messages: Sequence[dict] | None = None, prompt=None,
                       param: Callable[[str], str] = lambda name: name) -> None:
    """Roles, content types and byte caps alone: cheap enough for the event loop, so a request
    refused here never waits for the tokenizer's thread."""
    cap = limits.prompt_byte_cap
    if messages is not None:
        check_messages(messages, facts.roles, cap, param("messages"))
    elif isinstance(prompt, str):
        check_prompt_text(prompt, cap, param("prompt"))


def prepare_request(facts: ModelFacts, limits: RequestLimits, *,
                    messages: Sequence[dict] | None = None,
                    prompt: str | Sequence[int] | None = None,
                    temperature: float | None = None, top_p: float | None = None,
                    top_k: int | None = None, seed: int | None = None,
                    stop: str | Sequence[str] | None = None,
                    max_output_tokens: int | None = None, ignore_eos: bool | None = None,
                    speculation=None,
                    param: Callable[[str], str] = lambda name: name,
                    tools: list[dict] | None = None) -> PreparedRequest:
    """Validate, template and tokenize one request; RequestError names the offending field.

    `param` maps the canonical field names used here (messages, prompt, max_output_tokens,
    speculation, ...) to the caller's wire names, so errors point at what the client sent.
    This does the tokenizing: the server runs it on a worker thread, never on its event loop.
    `tools` (OpenAI function tools) go to a chat template that renders them itself.
    """
    tokenizer = facts.tokenizer
    cap = limits.prompt_byte_cap
    if (messages is None) == (prompt is None):
        raise RequestError("invalid_field", "give exactly one of messages and prompt",
                           param("messages"))
    # Everything cheap first: a request refused here costs no templating or tokenizing.
    stop_strings = check_stop(stop, param("stop"))
    mode = (check_speculation(speculation, facts.has_draft, param("speculation"))
            if speculation is not None else facts.default_mode)
    if messages is not None:
        chat = check_messages(messages, facts.roles, cap, param("messages"))
        try:
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                 tokenize=False,
                                                 **({"tools": tools} if tools else {}))
        except Exception as exc:  # a template may reject role orders; say so, don't crash
            raise RequestError("invalid_field", f"chat template failed: {exc}",
                               param("messages")) from exc
        # The template already spells out BOS and role markers; don't add them twice.
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(prompt, str):
        text = check_prompt_text(prompt, cap, param("prompt"))
        prompt_ids = tokenizer.encode(text)  # the same call LLM.generate makes
    else:
        prompt_ids = check_prompt_ids(prompt, facts.vocab_size, param("prompt"))
    if not prompt_ids:
        raise RequestError("invalid_field", "the prompt is empty", param("prompt"))
    max_output_tokens = check_lengths(len(prompt_ids), max_output_tokens, limits, param,
                                      "messages" if messages is not None else "prompt")

    fields = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
              "ignore_eos": ignore_eos}
    try:
        params = SamplingParams(max_tokens=max_output_tokens, stop=stop_strings,
                                **{k: v for k, v in fields.items() if v is not None})
    except (ValueError, TypeError) as exc:
        # SamplingParams messages start with the field name ("top_p must be ...").
        name = str(exc).split(" ", 1)[0]
        raise RequestError("invalid_field", str(exc),
                           param(name) if name in fields else None) from exc
    return PreparedRequest(prompt_ids, params, speculation, str(mode))
