"""Engine configuration: frozen dataclasses resolved once, derived values as properties."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .engine.scheduler import SchedulerConfig


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
    speculation: object = None  # a spelling, see spec.modes; parsed by the engine
    dtype: str = "auto"
    device: str = "cpu"
    tp: int = 1  # tensor-parallel ranks the target is split over
    draft_tp: int = 1  # 1: the draft runs whole on rank 0; tp: split like the target
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
