"""Server limits, and the worker thread that prepares requests off the event loop.

Both front ends (the WebSocket session and the OpenAI routes) decode their own wire format, then
await `Preparer.prepare`: the cheap checks of `specserve.validation` (roles, content types, byte
caps) run on the loop, so an oversized request is refused without queueing; templating and
tokenizing run on one worker thread, so a long prompt never stalls other streams or `/health`.
The same `ServerLimits` object is what `session.created` reports to clients.
"""

from __future__ import annotations

import asyncio
import functools
import resource
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TypeVar

from ..engine import AsyncEngine
from ..validation import (
    ModelFacts,
    PreparedRequest,
    RequestLimits,
    check_request_text,
    prepare_request,
    template_roles,
)

T = TypeVar("T")


def _default_max_connections() -> int:
    # Half the process's file descriptors: the rest stay free for the models, logs and the
    # connections that get in while the oldest idle ones are being closed.
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(32, min(4096, soft // 2)) if soft != resource.RLIM_INFINITY else 4096


@dataclass(frozen=True)
class ServerLimits(RequestLimits):
    """Bounds on one request, one connection and the server; reported in `session.created`."""

    max_message_bytes: int = 1 << 20  # one WebSocket frame
    max_requests_in_flight: int = 16  # per WebSocket
    max_request_bytes: int = 4 << 20  # one HTTP body; 413 past it, before reading further
    # Requests admitted beyond what the engine runs at once (its batch slots); past it, new
    # requests get HTTP 429 / WebSocket `overloaded`.
    max_queued_requests: int = 64
    max_connections: int = 0  # 0: half the file-descriptor limit (see below)
    request_read_timeout_s: float = 10.0  # a request's head and body must arrive within it

    def __post_init__(self) -> None:
        if self.max_connections <= 0:
            object.__setattr__(self, "max_connections", _default_max_connections())
    max_choices: int = 64  # engine requests one OpenAI request may start (prompts x n)

    @classmethod
    def for_engine(cls, engine: AsyncEngine, **overrides) -> ServerLimits:
        """Limits that follow from the engine: its context and its KV pool, whichever is less."""
        engine_limits = engine.limits
        return cls.for_context(min(engine_limits.max_model_len, engine_limits.kv_pool_tokens),
                               **overrides)

    def as_dict(self) -> dict:
        return asdict(self)


def model_facts(engine: AsyncEngine) -> ModelFacts:
    tokenizer = engine.tokenizer
    info = engine.model_info
    return ModelFacts(tokenizer=tokenizer, vocab_size=info.vocab_size,
                      has_draft=info.has_draft, default_mode=info.default_speculation,
                      roles=template_roles(getattr(tokenizer, "chat_template", None)))


def batch_slots(engine: AsyncEngine) -> int:
    """How many requests the engine runs side by side."""
    return engine.limits.max_num_seqs


class Preparer:
    """`prepare_request` for the event loop: cheap checks inline, tokenizing on one thread.

    One worker, not a pool: a Hugging Face tokenizer must not be entered from two threads at
    once, and the byte cap bounds how long any one request holds the worker.
    """

    def __init__(self, facts: ModelFacts, limits: ServerLimits) -> None:
        self.facts = facts
        self.limits = limits
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="specserve-tokenize")

    async def prepare(self, *, messages: Sequence[dict] | None = None, prompt=None,
                      param: Callable[[str], str] = lambda name: name,
                      **fields) -> PreparedRequest:
        check_request_text(self.facts, self.limits, messages=messages, prompt=prompt,
                           param=param)
        return await self.run(functools.partial(
            prepare_request, self.facts, self.limits, messages=messages, prompt=prompt,
            param=param, **fields))

    async def run(self, job: Callable[[], T]) -> T:
        """Any tokenizer work (its size checked by the caller) on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, job)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
