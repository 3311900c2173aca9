"""Paged-KV attention and KV-cache kernels: one entry point per operation.

Each function takes `impl`: "reference" runs the PyTorch code in `reference.py` (what production
runs on CPU); "auto" picks the best implementation for the tensors' device. The Triton kernels
land in the next commits; until then "auto" uses the reference everywhere.
"""

from __future__ import annotations

from typing import Literal

import torch

from .reference import (
    copy_kv_slots_reference,
    paged_attention_reference,
    store_kv_reference,
)

Impl = Literal["auto", "reference"]

__all__ = ["Impl", "copy_kv_slots", "paged_attention", "store_kv"]


def _check_impl(impl: Impl) -> None:
    if impl not in ("auto", "reference"):
        raise ValueError(f"unknown impl {impl!r}")


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = padding (skipped)
    *,
    impl: Impl = "auto",
) -> None:
    """Write this step's K/V into their slots (`slot = block_id * block_size + offset`)."""
    _check_impl(impl)
    store_kv_reference(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32, tokens cached before this step
    local_mask: torch.Tensor | None,  # [T, max_query_len] bool, None = causal
    scale: float,
    max_query_len: int,
    *,
    impl: Impl = "auto",
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of this step's queries over paged KV; see `paged_attention_reference`."""
    _check_impl(impl)
    return paged_attention_reference(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, local_mask, scale,
        max_query_len,
    )


def copy_kv_slots(
    kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
    *,
    impl: Impl = "auto",
) -> None:
    """KV compaction, all layers at once: slot dst_slots[i] gets what src_slots[i] held."""
    _check_impl(impl)
    copy_kv_slots_reference(kv_cache, src_slots, dst_slots)
