"""Kernel benchmark: paged decode bandwidth and tree-verify cost, against dense SDPA.

    python -m bench gpu-kernels

Two tables, each row timed for `specserve.kernels.paged_attention` (Triton, paged KV) and for
`torch.nn.functional.scaled_dot_product_attention` on the same numbers gathered into dense
`[B, H, L, D]` tensors beforehand (the gather is not timed, so SDPA gets contiguous KV for free):

1. decode: one query per request over its context; achieved bandwidth = K and V bytes read
   divided by the time (the KV read dominates every other byte moved), for a range of batch
   sizes and context lengths.
2. tree verify: a dynamic-shaped tree of 32 and 64 nodes per request versus a single-token
   decode at the same context; the ratio says what verifying a whole tree costs over decoding
   one token.

Outputs are checked against SDPA before timing. Needs CUDA: without it, says so and exits 0.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels import paged_attention, store_kv

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16  # Llama-3-8B-like
DTYPE = torch.bfloat16
MAX_CACHED_TOKENS = 1 << 21  # batch * context cap: ~8 GiB of bf16 KV at this shape


@dataclass
class Case:
    """One paged batch and the same data laid out densely for SDPA."""

    paged_args: tuple  # paged_attention's positional arguments
    q_dense: torch.Tensor  # [B, Hq, n, D]
    k_dense: torch.Tensor  # [B, Hkv, context + n, D]
    v_dense: torch.Tensor  # [B, Hkv, context + n, D]
    dense_mask: torch.Tensor | None  # [B, 1, n, context + n] bool; None for decode

    def run_paged(self) -> torch.Tensor:  # [B * n, Hq, D]
        return paged_attention(*self.paged_args)

    def run_sdpa(self) -> torch.Tensor:  # [B, Hq, n, D]
        return F.scaled_dot_product_attention(
            self.q_dense, self.k_dense, self.v_dense, attn_mask=self.dense_mask,
            enable_gqa=True,
        )


def random_tree_mask(n: int, gen: torch.Generator) -> torch.Tensor:  # [n, n] bool
    """Each node hangs off one of the four nodes before it: a bushy, EAGLE-2-like shape."""
    mask = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        mask[i] |= mask[int(torch.randint(max(0, i - 4), i, (1,), generator=gen))]
    return mask


def make_case(batch: int, context: int, tree: torch.Tensor | None, device: str) -> Case:
    """`batch` requests with `context` cached tokens and `tree` (None: one decode query)."""
    gen = torch.Generator().manual_seed(0)
    n = 1 if tree is None else tree.shape[0]
    length = context + n
    blocks_per_req = -(-length // BLOCK_SIZE)
    num_blocks = batch * blocks_per_req
    kv_cache = torch.empty(
        2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device
    )  # [2, num_blocks, block_size, Hkv, D]
    block_tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_req)
    block_tables = block_tables.to(device=device, dtype=torch.int32)  # [B, blocks_per_req]
    k = torch.randn(batch, length, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn(batch, length, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    pos = torch.arange(length, device=device)  # [length]
    slots = block_tables[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    store_kv(k.flatten(0, 1), v.flatten(0, 1), kv_cache[0], kv_cache[1], slots.flatten())

    q = torch.randn(batch * n, NUM_Q_HEADS, HEAD_DIM, dtype=DTYPE, device=device)  # [T, Hq, D]
    query_start_loc = torch.arange(batch + 1, device=device, dtype=torch.int32) * n
    context_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
    local_mask = None if tree is None else tree.to(device).repeat(batch, 1)  # [T, n]
    paged_args = (
        q, kv_cache[0], kv_cache[1], block_tables, query_start_loc, context_lens, local_mask,
        HEAD_DIM**-0.5, n,
    )
    dense_mask = None
    if tree is not None:
        dense_mask = torch.ones(n, length, dtype=torch.bool, device=device)  # [n, length]
        dense_mask[:, context:] = tree
        dense_mask = dense_mask.expand(batch, 1, n, length)
    return Case(
        paged_args=paged_args,
        q_dense=q.view(batch, n, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2),
        k_dense=k.transpose(1, 2).contiguous(),
        v_dense=v.transpose(1, 2).contiguous(),
        dense_mask=dense_mask,
    )


def time_ms(fn: Callable[[], torch.Tensor], repeats: int = 50) -> float:
    """Median of CUDA-event timings, after a warm-up that also compiles the kernels."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def check(case: Case) -> None:
    paged = case.run_paged()  # [B * n, Hq, D]
    dense = case.run_sdpa().transpose(1, 2).flatten(0, 1)  # [B * n, Hq, D]
    torch.testing.assert_close(paged, dense, atol=3e-2, rtol=2e-2)


def bench_decode(device: str) -> None:
    print("decode: one query per request, bf16, Hq=32 Hkv=8 D=128, block 16")
    print(f"{'batch':>6} {'context':>8} {'paged ms':>9} {'paged GB/s':>11} "
          f"{'sdpa ms':>9} {'sdpa GB/s':>10} {'sdpa/paged':>11}")
    for batch in (1, 8, 32, 128):
        for context in (1024, 4096, 16384, 65536):
            if batch * context > MAX_CACHED_TOKENS:
                continue
            case = make_case(batch, context, None, device)
            check(case)
            kv_bytes = 2 * batch * (context + 1) * NUM_KV_HEADS * HEAD_DIM * DTYPE.itemsize
            paged, sdpa = time_ms(case.run_paged), time_ms(case.run_sdpa)
            print(f"{batch:>6} {context:>8} {paged:>9.3f} {kv_bytes / paged / 1e6:>11.0f} "
                  f"{sdpa:>9.3f} {kv_bytes / sdpa / 1e6:>10.0f} {sdpa / paged:>11.2f}")
            del case
            torch.cuda.empty_cache()


def bench_tree(device: str) -> None:
    print("\ntree verify vs single-token decode, bf16, Hq=32 Hkv=8 D=128, block 16")
    print(f"{'batch':>6} {'context':>8} {'nodes':>6} {'tree ms':>9} {'decode ms':>10} "
          f"{'tree/decode':>12} {'sdpa ms':>9} {'sdpa/tree':>10}")
    gen = torch.Generator().manual_seed(1)
    for batch in (1, 8, 32):
        for context in (1024, 4096, 16384):
            if batch * context > MAX_CACHED_TOKENS:
                continue
            decode = time_ms(make_case(batch, context, None, device).run_paged)
            for nodes in (32, 64):
                case = make_case(batch, context, random_tree_mask(nodes, gen), device)
                check(case)
                tree, sdpa = time_ms(case.run_paged), time_ms(case.run_sdpa)
                print(f"{batch:>6} {context:>8} {nodes:>6} {tree:>9.3f} {decode:>10.3f} "
                      f"{tree / decode:>12.2f} {sdpa:>9.3f} {sdpa / tree:>10.2f}")
                del case
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None, prog: str = "python -m bench gpu-kernels") -> int:
    # No options: the cases are fixed; parsing still answers --help.
    argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{prog} needs a CUDA GPU (none found); nothing to measure.")
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    bench_decode("cuda")
    bench_tree("cuda")
    return 0
