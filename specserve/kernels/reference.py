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
offset % size` tensor indexing (any strides work), and attention is a dense masked softmax per
request in fp32, with the query heads of each KV head folded into one matmul. The loops run
over requests (and over 256-row slices of long prompt chunks), never over tokens.
"""

from __future__ import annotations

import torch


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
    if not bool(keep.all()):  # padding present (usually none: then no masked copies)
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    slots = slot_mapping.long()  # [T']
    blocks, offsets = slots // block_size, slots % block_size  # [T'], [T']
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


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
    Scores and softmax are computed in fp32; the output has q's dtype. Rows past
    query_start_loc[-1] are left unspecified.
    """
    del max_query_len  # the slices below read each request's own query count
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
        k = gather_request_kv(k_cache, block_tables[b], length).float()  # [length, Hkv, D]
        v = gather_request_kv(v_cache, block_tables[b], length).float()  # [length, Hkv, D]
        if local_mask is None:
            new_mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # [n, n]
        else:
            new_mask = local_mask[start:end, :n]  # [n, n]
        # Long prompt chunks go in slices of query rows so the scores stay small.
        for lo in range(0, n, QUERY_CHUNK):
            hi = min(lo + QUERY_CHUNK, n)
            out[start + lo : start + hi] = _grouped_attention(
                q[start + lo : start + hi].float(), k, v, new_mask[lo:hi], ctx, scale
            ).to(q.dtype)
    return out


# Query rows per dense product: scores take Hq * QUERY_CHUNK * context floats.
QUERY_CHUNK = 256


def _grouped_attention(
    q: torch.Tensor,  # [n, Hq, D] fp32
    k: torch.Tensor,  # [L, Hkv, D] fp32
    v: torch.Tensor,  # [L, Hkv, D] fp32
    new_mask: torch.Tensor,  # [n, L - context_len] bool: which new positions each row sees
    context_len: int,
    scale: float,
) -> torch.Tensor:  # [n, Hq, D] fp32
    """Dense masked softmax attention, query heads grouped under their KV head.

    Query head h uses KV head h // group. Folding the group into the rows of one matmul per KV
    head never copies K or V per query head. (On CPU this is also far cheaper than
    `scaled_dot_product_attention` with a boolean mask and GQA: ~0.2 ms against ~5 ms for one
    decode query over 1k positions.)
    """
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    rows = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    rows = rows.reshape(num_kv_heads, group * n, head_dim)  # [Hkv, G * n, D]
    scores = torch.bmm(rows, k.permute(1, 2, 0)) * scale  # [Hkv, G * n, L]
    scores = scores.view(num_kv_heads, group, n, -1)  # [Hkv, G, n, L]
    scores[..., context_len:].masked_fill_(~new_mask, float("-inf"))
    probs = scores.softmax(-1).view(num_kv_heads, group * n, -1)  # [Hkv, G * n, L]
    out = torch.bmm(probs, v.transpose(0, 1))  # [Hkv, G * n, D]
    return out.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(
        n, num_q_heads, head_dim
    )
