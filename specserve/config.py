"""Engine configuration: frozen dataclasses resolved once, derived values as properties.

The model pair, the KV cache and the scheduler are configured here and nowhere else; the
server's own limits (`server.limits.ServerLimits`) follow from the engine's at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV pool budget (target + draft); the block count follows from the models' shapes.
    kv_cache_memory_bytes: int = 512 * 2**20
    num_blocks: int | None = None  # overrides the budget (tests force tiny pools with it)
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class EngineConfig:
    target: Path
    draft: Path | None = None
    speculation: object = None  # a spelling, see speculation.modes; parsed by the engine
    dtype: str = "auto"
    device: str = "cpu"
    quantization: str | None = None  # weight-only: None, "int8", "int4" (see model/quant.py)
    draft_quantization: str | None = None  # the draft's ("none": unquantized)
    tp: int = 1  # tensor-parallel ranks the target is split over
    draft_tp: int = 1  # 1: the draft runs whole on rank 0; tp: split like the target
    pp: int = 1  # pipeline stages the target's layers are split over (each of tp ranks)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_options(cls, target, draft=None, speculation=None, dtype: str = "auto",
                     tp: int = 1, quantization: str | None = None,
                     draft_quantization: str | None = None, draft_tp: int = 1,
                     pp: int = 1, **options) -> EngineConfig:
        """The config for `LLM(...)` / CLI keyword options; unknown ones are an error.

        draft_quantization None means the target's quantization (and int8 for a target that
        runs on a GGUF's quantized blocks: model.quant.draft_quantization)."""
        from .model.quant import resolve_quantization

        if draft_quantization is None:
            draft_quantization = quantization
        resolve_quantization(quantization)  # an unknown name fails here, before any loading
        resolve_quantization(draft_quantization)
        for name, ranks in (("tp", tp), ("draft_tp", draft_tp), ("pp", pp)):
            if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
                raise ValueError(f"{name} must be a positive int; got {ranks!r}")
        if draft_tp not in (1, tp):
            raise ValueError(f"draft_tp must be 1 (the draft whole on rank 0) or tp={tp}; "
                             f"got {draft_tp}")
        cache_keys = {f.name for f in fields(CacheConfig)}
        sched_keys = {f.name for f in fields(SchedulerConfig)}
        unknown = set(options) - cache_keys - sched_keys - {"device"}
        if unknown:
            raise TypeError(f"unknown engine options: {', '.join(sorted(unknown))}")
        return cls(
            target=Path(target), draft=Path(draft) if draft is not None else None,
            speculation=speculation, dtype=dtype, device=options.get("device", "cpu"),
            quantization=quantization, draft_quantization=draft_quantization,
            tp=tp, draft_tp=draft_tp, pp=pp,
            cache=CacheConfig(**{k: v for k, v in options.items() if k in cache_keys}),
            scheduler=SchedulerConfig(**{k: v for k, v in options.items() if k in sched_keys}))
