"""Triton kernels that write the paged KV cache: this step's K/V into slots, and KV compaction.

`store_kv_triton`: token t's K and V (`[Hkv, D]` each) go to slot `slot_mapping[t]`, i.e. block
`slot // block_size`, offset `slot % block_size`; negative slots are padding and skipped. One
program per token moves the whole `[Hkv, D]` tile, so each program does two contiguous-ish
reads and two writes (what vLLM's `reshape_and_cache` does, in Triton).

`copy_kv_slots_triton`: after verification the accepted path's KV moves to the request's
contiguous positions, for every layer at once. Sources and destinations can overlap (a path
shifted down by a few slots, or swaps), and programs run in no fixed order, so a single pass
could read a slot another program already overwrote. The copy therefore runs in two launches of
one kernel: gather every source into a small scratch buffer `[L * 2, M, Hkv, D]`, then scatter
the scratch into the destinations.

References: the PyTorch versions in `reference.py` define the semantics; the tests compare them.
All slot and block offsets are computed in int64 (caches past 2**31 elements are normal).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_utils import check_launchable, kernel


@kernel
def _store_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    valid = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=valid)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=valid)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch
    tl.store(k_dst + d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=valid)
    tl.store(v_dst + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=valid)


@kernel
def _copy_slots_kernel(
    cache_ptr,  # [L, 2, num_blocks, block_size, Hkv, D]
    scratch_ptr,  # [L * 2, M, Hkv, D] contiguous
    slots_ptr,  # [M] int64: sources when gathering, destinations when scattering
    num_slots,
    stride_l, stride_kv, stride_b, stride_s, stride_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TO_CACHE: tl.constexpr,  # False: cache -> scratch (gather); True: scratch -> cache (scatter)
):
    i = tl.program_id(0).to(tl.int64)
    layer_kv = tl.program_id(1).to(tl.int64)  # layer * 2 + (0 for K, 1 for V)
    slot = tl.load(slots_ptr + i).to(tl.int64)
    h = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    valid = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    cache_off = (
        (layer_kv // 2) * stride_l
        + (layer_kv % 2) * stride_kv
        + (slot // BLOCK_SIZE) * stride_b
        + (slot % BLOCK_SIZE) * stride_s
        + h[:, None] * stride_h
        + d[None, :]
    )  # [BLOCK_H, BLOCK_D]
    scratch_off = (layer_kv * num_slots + i) * (NUM_HEADS * HEAD_DIM) + h[:, None] * HEAD_DIM
    scratch_off = scratch_off + d[None, :]  # [BLOCK_H, BLOCK_D]
    if TO_CACHE:
        tl.store(cache_ptr + cache_off, tl.load(scratch_ptr + scratch_off, mask=valid), mask=valid)
    else:
        tl.store(scratch_ptr + scratch_off, tl.load(cache_ptr + cache_off, mask=valid), mask=valid)


def _last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("the KV kernels need the head dimension to be contiguous")


def store_kv_triton(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = padding
) -> None:
    """Triton version of `store_kv_reference`."""
    check_launchable(key, k_cache)
    _last_dim_contiguous(key, value, k_cache, v_cache)
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def copy_kv_slots_triton(
    kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
) -> None:
    """Triton version of `copy_kv_slots_reference`: gather all sources, then scatter."""
    check_launchable(kv_cache)
    _last_dim_contiguous(kv_cache)
    num_layers, _, _, block_size, num_heads, head_dim = kv_cache.shape
    num_slots = src_slots.shape[0]
    if num_slots == 0:
        return
    scratch = torch.empty(
        num_layers * 2, num_slots, num_heads, head_dim, dtype=kv_cache.dtype,
        device=kv_cache.device,
    )  # [L * 2, M, Hkv, D]
    for slots, to_cache in ((src_slots, False), (dst_slots, True)):
        _copy_slots_kernel[(num_slots, num_layers * 2)](
            kv_cache, scratch, slots, num_slots,
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
            kv_cache.stride(4),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
            TO_CACHE=to_cache,
        )
