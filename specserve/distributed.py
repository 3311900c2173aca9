"""Tensor-parallel process group state.

At `tp == 1` every collective is the identity and no process group exists, so the single-process
path pays nothing. Layers ask this module for their rank and world size instead of holding a group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results of a row-parallel layer across ranks (in place); identity at tp=1."""
    if tp_world_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate vocab-parallel logits along the last dim; identity at tp=1."""
    world = tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
