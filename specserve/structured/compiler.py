"""Compile a `StructuredOutput` for this engine's tokenizer with xgrammar, capped and cached.

xgrammar was picked over llguidance by measurement (a 6-field JSON schema, SmolLM2's 49,152-token
vocabulary, first-generation Zen): about 12 us per next-token mask against about 180 us, which
matters here because a speculating request needs a mask at every tree node, every step.
Compiling costs more (100-200 ms against a few ms), so it runs once per distinct output spec,
off the event loop and off the engine thread, and the result is cached.

Caps: `spec.py` bounds the text; here a compile that runs past `timeout_s` is refused (its
thread finishes in the background: xgrammar releases the GIL while compiling, so nothing else
waits on it), and concurrent compiles of the same spec share one job.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import xgrammar as xgr

from .spec import StructuredOutput

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed check.
_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# Every JSON the engine constrains is written with these separators and no other whitespace:
# the output stays compact, a small model cannot wander into endless blank lines, and the
# literal parts (keys, punctuation) are forced tokens that the draft proposes for free.
JSON_SEPARATORS = (", ", ": ")


class GrammarError(ValueError):
    """A schema, regex or grammar that does not compile (the message says why)."""


def _clean(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _ERROR_PREFIX.sub("", text)


def _literal(text: str) -> xgr.Grammar:
    # json.dumps escapes quotes, backslashes and control characters the way EBNF strings read.
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")


def build_grammar(spec: StructuredOutput) -> xgr.Grammar:
    """The xgrammar `Grammar` of a spec (GrammarError if it does not parse)."""
    try:
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.value if spec.kind == "json_schema" else '{"type": "object"}'
            grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False,
                                                   separators=JSON_SEPARATORS)
        elif spec.kind == "regex":
            grammar = xgr.Grammar.from_regex(spec.value)
        elif spec.kind == "grammar":
            grammar = xgr.Grammar.from_ebnf(spec.value)
        else:  # choice
            options = json.loads(spec.value)
            grammar = xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
        if spec.prefix or spec.suffix:
            grammar = xgr.Grammar.concat(*([_literal(spec.prefix)] if spec.prefix else []),
                                         grammar,
                                         *([_literal(spec.suffix)] if spec.suffix else []))
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses
        raise GrammarError(f"invalid {spec.kind}: {_clean(exc)}") from None
    return grammar


class GrammarCompiler:
    """One per engine: the tokenizer's xgrammar view, a compile pool and an LRU cache."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 timeout_s: float = 10.0, cache_size: int = 64, workers: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._jobs: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="specserve-grammar")

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        # Built on first use: reading the vocabulary takes about a second.
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.stop_token_ids)
                # One thread per compile: the pool bounds how many run at once.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile_now(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        grammar = build_grammar(spec)
        try:
            return self._xgr_compiler().compile_grammar(grammar)
        except Exception as exc:
            raise GrammarError(f"invalid {spec.kind}: {_clean(exc)}") from None

    def submit(self, spec: StructuredOutput) -> Future:
        """The compile job of a spec: cached, shared with a compile already running."""
        with self._lock:
            job = self._jobs.get(spec)
            if job is not None:
                self._jobs.move_to_end(spec)
                return job
            job = self._pool.submit(self._compile_now, spec)
            self._jobs[spec] = job
            while len(self._jobs) > self.cache_size:
                self._jobs.popitem(last=False)
            return job

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """Blocking compile (GrammarError on a bad spec or one that takes too long)."""
        self._xgr_compiler()  # the one-time vocabulary read is not the spec's time
        try:
            return self.submit(spec).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise self._too_slow(spec) from None

    async def compile_async(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """`compile` for the event loop: it only awaits the pool's jobs."""
        # The one-time vocabulary read (about a second) is not charged to the spec's time.
        await asyncio.wrap_future(self._pool.submit(self._xgr_compiler))
        try:
            # shield: a timed-out waiter must not cancel the job other requests may share.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.submit(spec))),
                                          self.timeout_s)
        except asyncio.TimeoutError:
            raise self._too_slow(spec) from None

    def _too_slow(self, spec: StructuredOutput) -> GrammarError:
        return GrammarError(f"the {spec.kind} did not compile within {self.timeout_s:g} s; "
                            f"simplify it")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
