"""Offline API: `LLM(...).generate(prompts, params)` runs all prompts through one engine."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .config import EngineConfig
from .engine.core import EngineCore
from .outputs import RequestOutput
from .sampling import SamplingParams

DEMO_DIR = Path(__file__).resolve().parent.parent / "draft_models" / "demo"


def demo_pair() -> tuple[Path, Path]:
    """The bundled demo target and draft (trained by draft_models/recipe.py)."""
    from importlib.util import find_spec

    spec = find_spec("specserve.draft_models")
    base = Path(next(iter(spec.submodule_search_locations))) / "demo" if spec else DEMO_DIR
    target, draft = base / "target", base / "draft"
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"bundled demo model not found at {target}")
    return target, draft


def build_engine_config(target=None, draft=None, speculation=None, dtype="auto", tp: int = 1,
                        quantization=None, draft_quantization=None, **options) -> EngineConfig:
    """Engine config from the LLM/CLI keyword options; `target=None` is the demo pair."""
    if target is None:
        target, demo_draft = demo_pair()
        draft = draft if draft is not None else demo_draft
    return EngineConfig.from_options(target, draft, speculation, dtype, tp, quantization,
                                     draft_quantization, **options)


class LLM:
    def __init__(self, target: str | Path | None = None, draft: str | Path | None = None,
                 speculation=None, dtype: str = "auto", tp: int = 1,
                 quantization: str | None = None, draft_quantization: str | None = None,
                 **engine_options) -> None:
        self.engine = EngineCore(build_engine_config(target, draft, speculation, dtype, tp,
                                                     quantization, draft_quantization,
                                                     **engine_options))
        self.tokenizer = self.engine.tokenizer

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
