"""Attention over the paged KV cache for one flat, variable-length batch.

The runner fills one `AttentionMetadata` per forward; every layer stores its new K/V through the
slot mapping and attends through the block tables. The kernels package chooses the Triton kernel
on CUDA and the PyTorch reference on CPU, so the model code never branches on the device.

Layout of one request's KV positions during a step (block size 16 shown, `|` = block boundary):

    | computed (context_len) ...    |  new: prompt chunk, or root + tree nodes  | unused |
      attended by every query          attended per `local_mask`
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.kernels import paged_attention, store_kv


@dataclass
class AttentionMetadata:
    """Per-forward inputs shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: physical KV slot each new token writes
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32: request b owns query rows [qs[b], qs[b+1])
    context_lens: torch.Tensor  # [B] int32: tokens cached before this step's queries
    local_mask: torch.Tensor | None  # [T, max_query_len] bool; None = causal within the request
    max_query_len: int


class PagedAttention(nn.Module):
    """Store this step's K/V, then attend to cache + new tokens (causal or tree-masked)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        """q [T, Hq, D]; k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D] -> [T, Hq, D]."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                               meta.context_lens, meta.local_mask, self.scale,
                               meta.max_query_len)
