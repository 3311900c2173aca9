"""Attention over the paged KV cache for one flat, variable-length batch.

The runner fills one `AttentionMetadata` per forward; every layer stores its new K/V through the
slot mapping and attends through the block tables. The kernels package chooses the Triton kernel
on CUDA and the PyTorch reference on CPU, so the model code never branches on the device.

A sliding window (Gemma 3's local layers: a query at position p sees keys at positions
> p - window) runs in the C kernel on CPU (cpu_attention.c masks it, as the C layer stack does)
and elsewhere in `masked_attention` (PyTorch, any device; the C kernel's reference) once some
query of the forward is past it; before that the window hides nothing and the kernels run.
The window is masking only: blocks that slid out of every window stay allocated until the
request ends.

Layout of one request's KV positions during a step (block size 16 shown, `|` = block boundary):

    | computed (context_len) ...    |  new: prompt chunk, or root + tree nodes  | unused |
      attended by every query          attended per `local_mask`
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.kernels import cpu_attention, paged_attention, store_kv
from specserve.kernels.reference import gather_request_kv


@dataclass
class AttentionMetadata:
    """Per-forward inputs shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: physical KV slot each new token writes
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32: request b owns query rows [qs[b], qs[b+1])
    context_lens: torch.Tensor  # [B] int32: tokens cached before this step's queries
    local_mask: torch.Tensor | None  # [T, max_query_len] bool; None = causal within the request
    max_query_len: int
    # The largest rotary position of the forward's queries; DecoderLM fills it for a model with
    # sliding layers (None: not computed).
    max_position: int | None = None


class PagedAttention(nn.Module):
    """Store this step's K/V, then attend to cache + new tokens (causal or tree-masked)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float | None = None, window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window = window

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, Hq, D]; k, v [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; positions
        [T] (needed by a sliding window) -> [T, Hq, D]."""
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        window = self.window
        if window is not None:
            if positions is None:
                raise ValueError("a sliding-window layer needs the queries' positions")
            top = meta.max_position
            top = (int(positions.max()) if len(positions) else 0) if top is None else top
            window = window if top >= window else None  # no key is out of any query's window
        args = (q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                meta.local_mask, self.scale, meta.max_query_len)
        if window is None:
            return paged_attention(*args)
        if cpu_attention.supports(q, k_cache, v_cache):
            return cpu_attention.paged_attention_cpu(*args, checked=True, window=window,
                                                     positions=positions)
        return masked_attention(q, k_cache, v_cache, meta, positions, self.scale, window)


# Query rows per dense product in masked_attention: its scores take Hq x rows x keys floats.
QUERY_CHUNK = 256


def masked_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, positions: torch.Tensor, scale: float,
                     window: int) -> torch.Tensor:
    """Paged attention over a sliding window, in fp32.

    q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; positions [T] rotary positions (the
    request's cached tokens sit at positions 0 .. context_len - 1, its new tokens at their own,
    a tree node at root + depth) -> [T, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)  # [T, Hq, D]
    group = q.shape[1] // k_cache.shape[2]
    starts = meta.query_start_loc.tolist()  # one host copy of the small metadata
    for b, ctx in enumerate(meta.context_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        n = end - start
        if n == 0:
            continue
        k = gather_request_kv(k_cache, meta.block_tables[b], ctx + n).float()  # [L, Hkv, D]
        v = gather_request_kv(v_cache, meta.block_tables[b], ctx + n).float()  # [L, Hkv, D]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [L, Hq, D]
        new = (torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
               if meta.local_mask is None else meta.local_mask[start:end, :n])  # [n, n]
        allowed = torch.cat([new.new_ones(n, ctx), new], dim=1)  # [n, L]
        q_pos = positions[start:end]  # [n]
        key_pos = torch.cat([torch.arange(ctx, device=q.device), q_pos])  # [L]
        allowed &= (q_pos[:, None] - key_pos[None, :]) < window
        for lo in range(0, n, QUERY_CHUNK):
            hi = min(lo + QUERY_CHUNK, n)
            scores = torch.einsum("qhd,khd->hqk", q[start + lo:start + hi].float(), k) * scale
            scores = scores.masked_fill(~allowed[lo:hi], float("-inf"))  # [Hq, rows, L]
            probs = torch.softmax(scores, dim=-1)
            out[start + lo:start + hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
