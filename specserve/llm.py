"""Offline API: `LLM(...).generate(prompts, params)` and `LLM(...).chat(conversations, params)`
run all their requests through one engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .config import EngineConfig
from .engine.core import EngineCore
from .model.tp_worker import launch as launch_tensor_parallel
from .named_models import demo_pair, resolve_models
from .outputs import RequestOutput
from .pipeline.batch_queue import PipelinedEngine
from .sampling import SamplingParams

__all__ = ["LLM", "build_engine_config", "demo_pair", "make_engine"]


def build_engine_config(target=None, draft=None, speculation=None, dtype="auto", tp: int = 1,
                        quantization=None, draft_quantization=None, pp: int = 1,
                        **options) -> EngineConfig:
    """Engine config from the LLM/CLI keyword options; `target=None` is the default model,
    "demo" the demo pair (see named_models)."""
    target, draft = resolve_models(target, draft)
    return EngineConfig.from_options(target, draft, speculation, dtype, tp, quantization,
                                     draft_quantization, pp=pp, **options)


def make_engine(config: EngineConfig) -> EngineCore:
    """The engine for a config: with pipeline stages, one that keeps micro-batches in flight."""
    return PipelinedEngine(config) if config.pp > 1 else EngineCore(config)


class LLM:
    def __init__(self, target: str | Path | None = None, draft: str | Path | None = None,
                 speculation=None, dtype: str = "auto", tp: int = 1,
                 quantization: str | None = None, draft_quantization: str | None = None,
                 pp: int = 1, **engine_options) -> None:
        """`tp`: tensor-parallel ranks per pipeline stage; `pp`: pipeline stages (the target's
        layers split into `pp` contiguous ranges); tp x pp processes in all, spawned here or
        started by torchrun (see README, "Tensor and pipeline parallelism")."""
        config = build_engine_config(target, draft, speculation, dtype, tp, quantization,
                                     draft_quantization, pp, **engine_options)
        # tp x pp > 1: the workers start (and rank 0 joins them) before the engine loads its
        # shard.
        self.tensor_parallel = launch_tensor_parallel(config)
        try:
            self.engine = make_engine(config)
        except BaseException:
            self.shutdown()
            raise
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """End the tensor/pipeline-parallel workers (a no-op at tp = pp = 1; also done at
        interpreter exit)."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.shutdown()

    def chat(self, conversations: Sequence[Sequence[dict]] | Sequence[dict],
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             speculation=None) -> list[RequestOutput]:
        """One output per conversation (a list of {"role", "content"} messages; a single
        conversation is accepted too), each rendered with the model's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use generate() with plain prompts")
        prompts = [self.tokenizer.encode(
            self.tokenizer.apply_chat_template(list(conv), tokenize=False,
                                               add_generation_prompt=True),
            add_special_tokens=False) for conv in conversations]
        return self.generate(prompts, params, speculation=speculation)

    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 speculation=None) -> list[RequestOutput]:
        """One output per prompt, in order. Prompts are strings or token-id lists."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        engine = self.engine
        requests = [engine.add_request(p if isinstance(p, str) else list(p), sp,
                                       speculation=speculation)
                    for p, sp in zip(prompts, params)]
        try:
            while any(not r.is_finished for r in requests):
                engine.step()
        finally:
            for r in requests:  # an exception mid-run must not leave blocks held
                engine.abort(r.request_id)
        return [RequestOutput(r.request_id, r.prompt_token_ids, list(r.output_token_ids),
                              r.output_text, r.finish_reason, r.metrics(), r.logprobs,
                              r.prompt_logprobs) for r in requests]
