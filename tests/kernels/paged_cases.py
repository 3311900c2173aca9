"""Test inputs for the paged-KV kernels: token trees, batches of mixed requests, a brute force.

A batch is a list of requests, each `(context_len, local_mask [n, n] bool)`: `context_len`
tokens are already cached, `n` new queries attend to them and to each other through the mask.
Blocks are handed out in a shuffled order so every request's pages are scattered, and every slot
nobody wrote holds NaN: a kernel that reads past a request's length, or multiplies a masked
probability by an unwritten value, produces NaN instead of passing by luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.kernels.reference import store_kv_reference
from specserve.speculation.tree import build_tree_buffers, paths_to_parents

Request = tuple[int, torch.Tensor]  # (context_len, local_mask [n, n] bool)

STATIC_TREE = [[0], [1], [0, 0], [0, 1], [1, 0]]


def tree_mask_from_paths(paths: list[list[int]]) -> torch.Tensor:  # [1 + len(paths), same] bool
    """Tree buffers of a static (Medusa-style) shape: root plus one node per child-index path."""
    return build_tree_buffers(paths_to_parents(paths)).tree_mask


def chain_mask(n: int) -> torch.Tensor:  # [n, n] bool
    """Tree buffers of a chain of n nodes (root included): plain causal attention."""
    return build_tree_buffers([-1] + list(range(n - 1))).tree_mask


def random_tree_mask(n: int, generator: torch.Generator) -> torch.Tensor:  # [n, n] bool
    """Tree buffers of a dynamic-tree shape: each node hangs off one of the 4 nodes before it."""
    parents = [-1]
    for i in range(1, n):
        parents.append(int(torch.randint(max(0, i - 4), i, (1,), generator=generator)))
    return build_tree_buffers(parents).tree_mask


def causal(n: int) -> torch.Tensor:  # [n, n] bool
    return torch.ones(n, n, dtype=torch.bool).tril()


DECODE = torch.ones(1, 1, dtype=torch.bool)


def mixed_requests(seed: int = 0) -> list[Request]:
    """A prompt chunk after cached tokens, trees, a decode, an idle request, a fresh prompt."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (37, causal(20)),
        (50, tree_mask_from_paths(STATIC_TREE)),
        (70, DECODE),
        (12, torch.ones(0, 0, dtype=torch.bool)),  # nothing scheduled this step
        (0, causal(17)),
        (33, random_tree_mask(12, gen)),
        (16, chain_mask(5)),
    ]


@dataclass
class PagedBatch:
    """Everything `paged_attention` takes, plus the whole cache it was built from."""

    q: torch.Tensor  # [T, Hq, D]
    kv_cache: torch.Tensor  # [1, 2, num_blocks, block_size, Hkv, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    local_mask: torch.Tensor | None  # [T, max_query_len] bool
    scale: float
    max_query_len: int

    def to(self, device: str) -> PagedBatch:
        """The same batch on `device`; the cache views stay views of the moved cache."""
        kv_cache = self.kv_cache.to(device)
        mask = None if self.local_mask is None else self.local_mask.to(device)
        return PagedBatch(
            q=self.q.to(device),
            kv_cache=kv_cache,
            k_cache=kv_cache[0, 0],
            v_cache=kv_cache[0, 1],
            block_tables=self.block_tables.to(device),
            query_start_loc=self.query_start_loc.to(device),
            context_lens=self.context_lens.to(device),
            local_mask=mask,
            scale=self.scale,
            max_query_len=self.max_query_len,
        )

    def args(self) -> tuple:
        return (
            self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
            self.context_lens, self.local_mask, self.scale, self.max_query_len,
        )


def make_batch(
    requests: list[Request],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    block_size: int = 16,
    seed: int = 0,
    causal_as_none: bool = False,
    kv_cache: torch.Tensor | None = None,
    block_pool: list[int] | None = None,
) -> PagedBatch:
    """Build a batch whose cache holds every request's cached and new K/V, scattered over pages.

    `causal_as_none` passes `local_mask=None` (every request must then be causal). A given
    `kv_cache` ([1, 2, num_blocks, block_size, Hkv, D], any device) is used instead of a fresh
    one, with the requests' blocks drawn from `block_pool`; only those blocks are touched.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = [ctx + mask.shape[0] for ctx, mask in requests]
    blocks_per_req = [-(-length // block_size) for length in lengths]
    if kv_cache is None:
        kv_cache = torch.empty(
            1, 2, sum(blocks_per_req) + 3, block_size, num_kv_heads, head_dim, dtype=dtype
        )
        block_pool = list(range(kv_cache.shape[2]))
    assert block_pool is not None and len(block_pool) >= sum(blocks_per_req)
    pool = torch.tensor(block_pool)[torch.randperm(len(block_pool), generator=gen)]
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    # Per half: a given cache may be a view whose K and V halves share memory elsewhere.
    for cache in (k_cache, v_cache):
        cache[pool.to(kv_cache.device)] = float("nan")
    max_blocks = max(blocks_per_req) + 1  # one unused column: kernels must not read it
    block_tables = torch.full((len(requests), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(blocks_per_req):
        block_tables[b, :nb] = pool[used : used + nb].to(torch.int32)
        used += nb

    for b, length in enumerate(lengths):
        pos = torch.arange(length)  # [length]
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        store_kv_reference(
            k.to(kv_cache.device), v.to(kv_cache.device), k_cache, v_cache,
            slots.to(kv_cache.device),
        )

    counts = [mask.shape[0] for _, mask in requests]
    max_query_len = max(counts)
    total = sum(counts)
    q = torch.randn(total, num_q_heads, head_dim, generator=gen).to(dtype)  # [T, Hq, D]
    query_start_loc = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    local_mask = torch.zeros(total, max_query_len, dtype=torch.bool)  # [T, max_query_len]
    for b, (_, mask) in enumerate(requests):
        start = int(query_start_loc[b])
        local_mask[start : start + mask.shape[0], : mask.shape[0]] = mask
    if causal_as_none:
        assert all(torch.equal(mask, causal(mask.shape[0])) for _, mask in requests)
        local_mask = None
    return PagedBatch(
        q=q,
        kv_cache=kv_cache,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        context_lens=torch.tensor([ctx for ctx, _ in requests], dtype=torch.int32),
        local_mask=local_mask,
        scale=head_dim**-0.5,
        max_query_len=max_query_len,
    )


def brute_force_attention(batch: PagedBatch) -> torch.Tensor:  # [T, Hq, D] float64
    """Dense attention one query row at a time, in float64, slots computed by hand."""
    q = batch.q.double()  # [T, Hq, D]
    num_q_heads, num_kv_heads = q.shape[1], batch.k_cache.shape[2]
    block_size = batch.k_cache.shape[1]
    k_flat = batch.k_cache.reshape(-1, num_kv_heads, q.shape[2]).double()  # [slots, Hkv, D]
    v_flat = batch.v_cache.reshape(-1, num_kv_heads, q.shape[2]).double()  # [slots, Hkv, D]
    kv_head = torch.arange(num_q_heads) // (num_q_heads // num_kv_heads)  # [Hq]
    out = torch.zeros_like(q)
    starts = batch.query_start_loc.tolist()
    for b, ctx in enumerate(batch.context_lens.tolist()):
        table = batch.block_tables[b].tolist()
        for t in range(starts[b], starts[b + 1]):
            i = t - starts[b]
            visible = list(range(ctx))
            for j in range(starts[b + 1] - starts[b]):
                allowed = j <= i if batch.local_mask is None else bool(batch.local_mask[t, j])
                if allowed:
                    visible.append(ctx + j)
            slots = [table[p // block_size] * block_size + p % block_size for p in visible]
            k = k_flat[slots][:, kv_head]  # [S, Hq, D]
            v = v_flat[slots][:, kv_head]  # [S, Hq, D]
            scores = torch.einsum("hd,shd->hs", q[t], k) * batch.scale  # [Hq, S]
            out[t] = torch.einsum("hs,shd->hd", scores.softmax(-1), v)
    return out
