"""The PyTorch references (the CPU production path) against hand-built brute force."""

from __future__ import annotations

import pytest
import torch
from paged_cases import (
    DECODE,
    brute_force_attention,
    causal,
    make_batch,
    mixed_requests,
)

from specserve.kernels import copy_kv_slots, paged_attention, store_kv


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 1), (8, 1), (8, 2)])
def test_mixed_batch_matches_brute_force(head_dim: int, num_q_heads: int, num_kv_heads: int):
    batch = make_batch(
        mixed_requests(), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim
    )
    out = paged_attention(*batch.args(), impl="reference")
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    torch.testing.assert_close(out.double(), brute_force_attention(batch), atol=1e-5, rtol=1e-5)


def test_bf16_output_dtype_and_accuracy():
    batch = make_batch(
        mixed_requests(1), num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16
    )
    out = paged_attention(*batch.args(), impl="reference")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), brute_force_attention(batch), atol=2e-2, rtol=2e-2)


def test_none_mask_means_causal():
    requests = [(40, causal(9)), (0, causal(33)), (5, DECODE)]
    explicit = make_batch(requests, num_q_heads=4, num_kv_heads=1, head_dim=64)
    implicit = make_batch(
        requests, num_q_heads=4, num_kv_heads=1, head_dim=64, causal_as_none=True
    )
    assert implicit.local_mask is None
    out = paged_attention(*implicit.args(), impl="reference")
    torch.testing.assert_close(out, paged_attention(*explicit.args(), impl="reference"))
    torch.testing.assert_close(out.double(), brute_force_attention(implicit), atol=1e-5, rtol=1e-5)


def test_decode_batch_long_contexts():
    requests = [(ctx, DECODE) for ctx in (1, 15, 16, 17, 200, 333)]
    batch = make_batch(requests, num_q_heads=8, num_kv_heads=1, head_dim=128)
    out = paged_attention(*batch.args(), impl="reference")
    torch.testing.assert_close(out.double(), brute_force_attention(batch), atol=1e-5, rtol=1e-5)


def test_store_kv_writes_slots_and_skips_padding():
    num_blocks, block_size, heads, dim = 6, 4, 2, 8
    k_cache = torch.zeros(num_blocks, block_size, heads, dim)
    v_cache = torch.zeros(num_blocks, block_size, heads, dim)
    slots = torch.tensor([5, -1, 0, 23, -1, 9], dtype=torch.int64)
    key, value = torch.randn(6, heads, dim), torch.randn(6, heads, dim)
    store_kv(key, value, k_cache, v_cache, slots, impl="reference")
    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t]
            expected_v[slot // block_size, slot % block_size] = value[t]
    torch.testing.assert_close(k_cache, expected_k, atol=0, rtol=0)
    torch.testing.assert_close(v_cache, expected_v, atol=0, rtol=0)


def test_copy_kv_slots_reads_all_sources_first():
    kv_cache = torch.randn(3, 2, 4, 4, 2, 8)  # [L, 2, num_blocks, block_size, Hkv, D]
    # Overlapping: a path moving down by one slot, then a chain of swaps across blocks.
    src = torch.tensor([6, 7, 8, 1, 13], dtype=torch.int64)
    dst = torch.tensor([5, 6, 7, 13, 1], dtype=torch.int64)
    before = kv_cache.clone().flatten(2, 3)  # [L, 2, slots, Hkv, D]
    copy_kv_slots(kv_cache, src, dst, impl="reference")
    expected = before.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        expected[:, :, d] = before[:, :, s]
    torch.testing.assert_close(kv_cache.flatten(2, 3), expected, atol=0, rtol=0)


def test_unknown_impl_is_rejected():
    batch = make_batch([(3, DECODE)], num_q_heads=2, num_kv_heads=2, head_dim=64)
    with pytest.raises(ValueError):
        paged_attention(*batch.args(), impl="cuda")
