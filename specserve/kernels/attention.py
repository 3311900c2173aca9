"""Paged attention in Triton: one tiled online-softmax kernel, three launch shapes.

Computes exactly `paged_attention_reference`: query row t (request b, local index i) attends to
the request's cached positions [0, context_len) and to this step's new positions
context_len + j that `local_mask[t, j]` allows (j <= i when causal), reading K/V through the
block table. Scores, softmax and accumulation are fp32; the output has q's dtype.

One program owns a tile of query rows of one request and one KV head, and streams that
request's KV in tiles of BLOCK_N positions (FlashAttention-2: the query tile stays in registers,
K/V tiles stream past it, the softmax is rescaled online). Two things make the same loop serve
decode, tree verification and prefill:

* GQA packing. A tile's BLOCK_M rows are (query, head) pairs of the query heads that share one
  KV head: row r is query `r // GROUP`, head `kv_head * GROUP + r % GROUP`. Each K/V tile is
  loaded once for all the heads of its group, and decode (one query, GROUP heads) still fills
  the rows a `tl.dot` needs.
* Split-K (Flash-Decoding). With few query tiles (decode, a tree or two) there are too few
  programs to fill the GPU, so the KV range is also split `num_splits` ways; each split writes
  a partial output and its log-sum-exp, and `_merge_splits_kernel` combines them.

The mask is a compile-time variant (`TREE_MASK`): causal rows compare positions, tree rows load
`local_mask` bits, and either only on KV tiles that reach the new tokens; committed-context
tiles just check bounds. The launch shapes (`_launch_config`):

  decode   max_query_len == 1: one tile of GROUP rows per request and KV head, split-K sized to
           fill the GPU (Flash-Decoding).
  tree     a local_mask is given: query rows are a request's nodes, mask bits from local_mask,
           split-K as needed (the tree is small, the committed context long).
  prefill  local_mask is None: causal varlen prompt chunks that start after cached tokens; a
           tile stops at its last query's position (FlashAttention-2 causal tiling).

References: Dao, "FlashAttention-2" (2023); Dao et al., "Flash-Decoding for long-context
inference" (2023); Kwon et al., "PagedAttention" (vLLM, 2023); Miao et al., "SpecInfer" (tree
attention masks, 2024); the Triton fused-attention tutorial. Offsets into the caches, q and the
output are computed in int64, so caches past 2**31 elements work.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_utils import check_launchable, interpreting, kernel

LOG2E = 1.4426950408889634
# Below this many KV positions per split, the merge costs more than the extra parallelism buys.
MIN_SPLIT_LEN = 256
MAX_SPLITS = 64


@kernel
def _attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    out_ptr,  # [T, Hq, D]
    part_out_ptr,  # [T, Hq, num_splits, D] fp32 (only with SPLIT)
    part_lse_ptr,  # [T, Hq, num_splits] fp32, log2 domain (only with SPLIT)
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    context_lens_ptr,  # [B] int32
    mask_ptr,  # [T, max_query_len] uint8 (only with TREE_MASK)
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    num_q_tiles,
    num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    stride_mt, stride_mj,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV page size
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # (query, head) rows per tile
    BLOCK_N: tl.constexpr,  # KV positions per inner step
    TREE_MASK: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for the merge kernel
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # Triton's interpreter multiplies bf16 bit patterns in tl.dot
):
    QUERIES_PER_TILE: tl.constexpr = BLOCK_M // GROUP
    req = tl.program_id(0) // num_q_tiles
    q_tile = tl.program_id(0) % num_q_tiles
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    num_queries = tl.load(query_start_loc_ptr + req + 1) - q_start
    first_query = q_tile * QUERIES_PER_TILE
    # The grid is sized from max_query_len; shorter requests leave tiles with nothing to do.
    if first_query >= num_queries:
        return
    context_len = tl.load(context_lens_ptr + req)

    rows = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    query = first_query + rows // GROUP  # [BLOCK_M] local query index
    head = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    row_valid = (rows < QUERIES_PER_TILE * GROUP) & (query < num_queries)  # [BLOCK_M]
    token = (q_start + query).to(tl.int64)  # [BLOCK_M] global query row
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    d_valid = d < HEAD_DIM  # [BLOCK_D]

    q_off = token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    # [BLOCK_M, BLOCK_D]
    if UPCAST_DOT:
        q = q.to(tl.float32)

    if TREE_MASK:
        kv_end = context_len + num_queries
    else:
        # Causal: the tile's last query sees up to its own position; later KV is masked for all.
        last_query = tl.minimum(first_query + QUERIES_PER_TILE, num_queries) - 1
        kv_end = context_len + last_query + 1
    split_len = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, kv_end)

    # A finite floor instead of -inf keeps exp2(m_i - m_new) defined for rows that see nothing
    # in a tile (tree nodes in a split that holds only other branches).
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # [BLOCK_M] running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # [BLOCK_M] running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # [BLOCK_M, BLOCK_D]
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt

    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical positions
        in_range = pos < kv_hi  # [BLOCK_N]
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        page_off = pos % BLOCK_SIZE  # [BLOCK_N]
        k_off = block * stride_kb + page_off * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        v_off = block * stride_vb + page_off * stride_vs + kv_head * stride_vh  # [BLOCK_N]
        kv_valid = in_range[:, None] & d_valid[None, :]  # [BLOCK_N, BLOCK_D]
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_valid, other=0.0)
        # [BLOCK_N, BLOCK_D]
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        # [BLOCK_M, BLOCK_N]

        visible = row_valid[:, None] & in_range[None, :]  # [BLOCK_M, BLOCK_N]
        if start + BLOCK_N > context_len:  # the tile reaches this step's new tokens
            new_idx = pos - context_len  # [BLOCK_N] index j among the new tokens, < 0 = cached
            if TREE_MASK:
                is_new = (new_idx >= 0) & in_range  # [BLOCK_N]
                bits = tl.load(
                    mask_ptr + token[:, None] * stride_mt + new_idx[None, :] * stride_mj,
                    mask=row_valid[:, None] & is_new[None, :],
                    other=0,
                )  # [BLOCK_M, BLOCK_N]
                visible = visible & ((new_idx < 0)[None, :] | (bits != 0))
            else:
                visible = visible & (new_idx[None, :] <= query[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
        alpha = tl.exp2(m_i - m_new)  # [BLOCK_M]
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_valid, other=0.0)
        # [BLOCK_N, BLOCK_D]
        p_in = p.to(v_cache_ptr.dtype.element_ty)  # the probabilities enter the dot in KV dtype
        if UPCAST_DOT:
            v, p_in = v.to(tl.float32), p_in.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_in, v, input_precision=DOT_PRECISION)
        m_i = m_new

    seen = l_i > 0  # [BLOCK_M] False for a split with nothing visible
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # [BLOCK_M, BLOCK_D]
    store_mask = row_valid[:, None] & d_valid[None, :]
    if SPLIT:
        row_part = (token * tl.num_programs(1) * GROUP + head) * num_splits + split  # [BLOCK_M]
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row_part, lse, mask=row_valid)
        tl.store(part_out_ptr + row_part[:, None] * HEAD_DIM + d[None, :], out, mask=store_mask)
    else:
        o_off = token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@kernel
def _merge_splits_kernel(
    part_out_ptr,  # [T, Hq, num_splits, D] fp32
    part_lse_ptr,  # [T, Hq, num_splits] fp32, log2 domain
    out_ptr,  # [T, Hq, D]
    num_heads,
    num_splits,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    row = (token * num_heads + head) * num_splits + s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=s < num_splits, other=float("-inf"))  # [BLOCK_S]
    # Every real query row sees at least itself, so some split has a finite lse.
    weight = tl.exp2(lse - tl.max(lse, 0))  # [BLOCK_S]
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=(s < num_splits)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)  # [BLOCK_D]
    o_off = token * stride_ot + head * stride_oh + d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one launch shape."""

    kind: str  # "decode" | "tree" | "prefill"
    block_m: int
    block_n: int
    num_warps: int


def _launch_config(
    max_query_len: int, has_mask: bool, group: int, dtype: torch.dtype
) -> LaunchConfig:
    # tl.dot needs at least 16 rows; a tile must hold at least one query's whole head group.
    min_m = max(16, triton.next_power_of_2(group))
    # fp32 tiles take twice the registers, and exact fp32 dots run on FMA units, not tensor
    # cores: halve the tiles so they do not spill.
    fp32 = dtype == torch.float32
    block_n = 32 if fp32 else 64
    if max_query_len == 1:
        return LaunchConfig("decode", block_m=min_m, block_n=block_n, num_warps=8 if fp32 else 4)
    if has_mask:
        return LaunchConfig(
            "tree", block_m=max(min_m, 32 if fp32 else 64), block_n=block_n, num_warps=8
        )
    return LaunchConfig(
        "prefill", block_m=max(min_m, 64 if fp32 else 128), block_n=block_n, num_warps=8
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _auto_num_splits(programs: int, max_kv_len: int, device: torch.device) -> int:
    """Enough splits for about two waves of programs, never splits shorter than MIN_SPLIT_LEN.

    `max_kv_len` comes from the block table's width, a host-side bound: reading the real
    lengths would cost a device sync.
    """
    if device.type != "cuda":
        return 1
    want = triton.cdiv(2 * _num_sms(device.index or 0), programs)
    return max(1, min(want, triton.cdiv(max_kv_len, MIN_SPLIT_LEN), MAX_SPLITS))


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32
    local_mask: torch.Tensor | None,  # [T, max_query_len] bool, None = causal
    scale: float,
    max_query_len: int,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Triton version of `paged_attention_reference`; `num_splits` overrides the split-K count.

    A single-query request always sees its own new position: with max_query_len == 1 the decode
    shape ignores `local_mask` (a node sees itself by definition).
    """
    check_launchable(q, k_cache)
    for t in (q, k_cache, v_cache):
        if t.stride(-1) != 1:
            raise ValueError("paged_attention needs the head dimension to be contiguous")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not share {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    num_reqs = context_lens.shape[0]
    out = torch.empty_like(q)  # [T, Hq, D]
    if num_tokens == 0 or num_reqs == 0:
        return out

    tree = local_mask is not None and max_query_len > 1
    cfg = _launch_config(max_query_len, tree, group, q.dtype)
    num_q_tiles = triton.cdiv(max_query_len, cfg.block_m // group)
    if num_splits is None:
        num_splits = _auto_num_splits(
            num_reqs * num_q_tiles * num_kv_heads, block_tables.shape[1] * block_size, q.device
        )
    if tree:
        mask_u8 = local_mask.view(torch.uint8)  # [T, max_query_len]: Triton loads bytes
        stride_mt, stride_mj = mask_u8.stride()
    else:
        mask_u8, stride_mt, stride_mj = block_tables, 0, 0  # unused pointer argument
    if num_splits > 1:
        part_out = torch.empty(
            num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )  # [T, Hq, S, D]
        part_lse = torch.empty(
            num_tokens, num_q_heads, num_splits, dtype=torch.float32, device=q.device
        )  # [T, Hq, S]
    else:
        part_out = part_lse = out  # unused pointer arguments

    _attention_kernel[(num_reqs * num_q_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse,
        block_tables, query_start_loc, context_lens, mask_u8,
        scale * LOG2E, num_q_tiles, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        stride_mt, stride_mj,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        GROUP=group,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        TREE_MASK=tree,
        SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Upcasting bf16 to fp32 is exact, so the interpreter still checks the GPU arithmetic.
        UPCAST_DOT=interpreting() and q.dtype != torch.float32,
        num_warps=cfg.num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_out, part_lse, out, num_q_heads, num_splits,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out
