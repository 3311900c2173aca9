"""PyTorch references for the paged-KV kernels; also the production path on CPU.

KV cache layout (one tensor per model):

    kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    k_cache = kv_cache[layer, 0]      # [num_blocks, block_size, Hkv, D]
    v_cache = kv_cache[layer, 1]      # [num_blocks, block_size, Hkv, D]

A slot is `block_id * block_size + offset`. Logical position `p` of request `b` lives in slot
`block_tables[b, p // block_size] * block_size + p % block_size`.

One `paged_attention` call covers a whole step: queries of all requests back to back, each
request's view of its KV drawn as

    | cached: [0, context_len) | new: this step's queries, already stored by store_kv |
      every query sees all       query i sees new j iff local_mask[row i, j]

Prompt chunks (causal), token trees (tree mask) and single decode tokens are the same thing with
different `local_mask` rows, so one function serves them all.

The functions here favour being obviously correct: every index goes through `block // size,
offset % size` tensor indexing (any strides work), and attention is one dense
`scaled_dot_product_attention` per request in fp32. The per-request loop is the only Python loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_reference(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, < 0 = padding
) -> None:
    """Write each token's K/V into its slot; tokens with a negative slot are skipped."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep].long()  # [T']
    blocks, offsets = slots // block_size, slots % block_size  # [T'], [T']
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def copy_kv_slots_reference(
    kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
    src_slots: torch.Tensor,  # [M] int64
    dst_slots: torch.Tensor,  # [M] int64
) -> None:
    """For every layer, K and V: slot dst_slots[i] gets what slot src_slots[i] held.

    Advanced indexing makes a copy of every source before the first destination is written, so
    overlapping source and destination sets (a path moving down by a few slots) are safe.
    """
    block_size = kv_cache.shape[3]
    src, dst = src_slots.long(), dst_slots.long()  # [M], [M]
    moved = kv_cache[:, :, src // block_size, src % block_size]  # [L, 2, M, Hkv, D] (a copy)
    kv_cache[:, :, dst // block_size, dst % block_size] = moved


def gather_request_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] int32
    length: int,
) -> torch.Tensor:  # [length, Hkv, D]
    """One request's first `length` logical positions, in order, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = block_table[:num_blocks].long()  # [num_blocks]
    return cache[blocks].flatten(0, 1)[:length]


def paged_attention_reference(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    context_lens: torch.Tensor,  # [B] int32, tokens cached before this step
    local_mask: torch.Tensor | None,  # [T, max_query_len] bool, None = causal
    scale: float,
    max_query_len: int,
) -> torch.Tensor:  # [T, Hq, D]
    """Attention of every query over its request's cached KV plus the allowed new positions.

    Query row t (request b, local index i) sees logical positions [0, context_lens[b]) and
    context_lens[b] + j for each j with local_mask[t, j] (j <= i when local_mask is None).
    Scores and softmax are computed in fp32; the output has q's dtype.
    """
    del max_query_len  # the slices below read each request's own query count
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)  # [T, Hq, D]
    # One host copy of the (small) metadata instead of a sync per request.
    starts = query_start_loc.tolist()
    contexts = context_lens.tolist()
    for b, ctx in enumerate(contexts):
        start, end = starts[b], starts[b + 1]
        n = end - start
        if n == 0:
            continue
        length = ctx + n
        k = gather_request_kv(k_cache, block_tables[b], length)  # [length, Hkv, D]
        v = gather_request_kv(v_cache, block_tables[b], length)  # [length, Hkv, D]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device)  # [n, length]
        if local_mask is None:
            mask[:, ctx:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        else:
            mask[:, ctx:] = local_mask[start:end, :n]
        attn = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).float(),  # [Hq, n, D]
            k.transpose(0, 1).float(),  # [Hkv, length, D]
            v.transpose(0, 1).float(),  # [Hkv, length, D]
            attn_mask=mask,
            scale=scale,
            enable_gqa=num_q_heads != num_kv_heads,
        )  # [Hq, n, D]
        out[start:end] = attn.transpose(0, 1).to(q.dtype)
    return out
