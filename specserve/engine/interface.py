"""What the server sees of the engine: the model it serves, its limits, its counters.

The server talks to `AsyncEngine` (add a request and stream it, abort, these read-only views)
and never to the engine's parts (core, scheduler, block manager, models); this module and
`specserve.engine`'s exports are that whole surface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..speculation.modes import SpecMode


@dataclass(frozen=True)
class ModelInfo:
    target: Path  # the target checkpoint (folder or file)
    draft: Path | None  # the draft checkpoint, None without one
    vocab_size: int
    default_speculation: SpecMode  # what a request without `speculation` runs

    @property
    def has_draft(self) -> bool:
        return self.draft is not None


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int  # prompt + output tokens one request may reach
    kv_pool_tokens: int  # KV slots in the whole pool (blocks x block size)
    max_num_seqs: int  # requests run side by side


@dataclass(frozen=True)
class KVPoolStats:
    num_blocks: int
    num_free_blocks: int
    prefix_hit_rate: float  # full prompt blocks found in the prefix cache, of those looked up


@dataclass
class EngineStats:
    """Engine-wide counters since start (the /metrics endpoint exports them)."""

    num_steps: int = 0
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    num_generation_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)
    num_finished: int = 0
    # Time by step phase.
    schedule_time_s: float = 0.0
    draft_time_s: float = 0.0  # proposers: draft catch-up and tree growing, n-gram lookup
    target_forward_time_s: float = 0.0
    verify_time_s: float = 0.0  # accepted path and bonus/recovered token per request
    commit_time_s: float = 0.0  # KV moves, token commits, finishing, prefix caching

    @property
    def acceptance_length(self) -> float:
        drafts = self.num_drafts
        return 1.0 + self.num_accepted_tokens / drafts if drafts else 1.0
