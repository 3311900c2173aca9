"""Paged-KV attention and KV-cache kernels: one entry point per operation.

Every function takes `impl`:
  "auto"       Triton on CUDA tensors; on CPU the C kernels (cpu_build.py) where they apply
               (paged_attention and store_kv on bf16 or fp32, see cpu_attention.py), the PyTorch
               reference otherwise.
  "triton"     the Triton kernels; CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter,
               read at each launch, so tests can switch it per test).
  "reference"  the PyTorch code in `reference.py`, on any device.
  "cpu"        the C kernels (paged_attention and store_kv; bf16 or fp32 CPU tensors).

The Triton modules are imported on first use, so CPU-only code never needs Triton.

`linear` is the model's matmul: on CPU with bf16 weights and few rows it runs the C kernel of
`cpu_linear.py` (its reference: `F.linear`), everywhere else `F.linear` itself. The CPU path
(amx, avx512, avx2, portable C or torch) is chosen by `SPECSERVE_CPU_ISA`; see cpu_build.py.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import cpu_attention
from .cpu_linear import linear
from .reference import (
    copy_kv_slots_reference,
    paged_attention_reference,
    store_kv_reference,
)

Impl = Literal["auto", "triton", "reference", "cpu"]

__all__ = ["Impl", "copy_kv_slots", "linear", "paged_attention", "store_kv"]


def _use_triton(impl: Impl, tensor: torch.Tensor) -> bool:
    if impl == "auto":
        return tensor.is_cuda
    if impl in ("triton", "reference", "cpu"):
        return impl == "triton"
    raise ValueError(f"unknown impl {impl!r}; expected 'auto', 'triton', 'reference' or 'cpu'")


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
    if _use_triton(impl, key):
        from .kv_store import store_kv_triton

        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    elif impl == "cpu":
        cpu_attention.store_kv_cpu(key, value, k_cache, v_cache, slot_mapping)
    elif impl == "auto" and cpu_attention.store_kv_unsupported(key, value, k_cache,
                                                               v_cache) is None:
        cpu_attention.store_kv_cpu(key, value, k_cache, v_cache, slot_mapping, checked=True)
    else:
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
    """Attention of this step's queries over paged KV; see `paged_attention_reference`.

    The Triton path picks its launch shape from `max_query_len` and `local_mask`: decode
    (max_query_len == 1), prefill (local_mask is None, causal), tree verify (otherwise).
    """
    args = (
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, local_mask, scale,
        max_query_len,
    )
    if _use_triton(impl, q):
        from .attention import paged_attention_triton

        return paged_attention_triton(*args)
    if impl == "cpu":
        return cpu_attention.paged_attention_cpu(*args)
    if impl == "auto" and cpu_attention.supports(q, k_cache, v_cache):
        return cpu_attention.paged_attention_cpu(*args, checked=True)
    return paged_attention_reference(*args)


def copy_kv_slots(
    kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
    *,
    impl: Impl = "auto",
) -> None:
    """KV compaction, all layers at once: slot dst_slots[i] gets what src_slots[i] held.

    Every source is read before any destination is written, so the sets may overlap.
    """
    if _use_triton(impl, kv_cache):
        from .kv_store import copy_kv_slots_triton

        copy_kv_slots_triton(kv_cache, src_slots, dst_slots)
    else:
        copy_kv_slots_reference(kv_cache, src_slots, dst_slots)
