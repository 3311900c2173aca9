"""The CPU attention kernel (specserve/kernels/cpu_attention.c) against its reference, on every
ISA path this CPU runs (the `cpu_isa` fixture)."""

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

from specserve.kernels import cpu_attention, paged_attention

pytestmark = pytest.mark.usefixtures("cpu_isa")


def requests(seed: int) -> list:
    return [*mixed_requests(seed), (300, DECODE)]  # and a decode over many pages


# bf16: both round an fp32 result to bf16; fp32: the sums differ only in order.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 1), (8, 1), (8, 2)])
@pytest.mark.parametrize("causal_as_none", [False, True], ids=["mask", "none"])
def test_matches_reference_and_brute_force(head_dim, num_q_heads, num_kv_heads, causal_as_none,
                                           dtype):
    reqs = requests(head_dim + num_q_heads)
    if causal_as_none:  # None means causal: only causal requests
        reqs = [(ctx, causal(m.shape[0])) for ctx, m in reqs]
    batch = make_batch(reqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, dtype=dtype, causal_as_none=causal_as_none)
    out = paged_attention(*batch.args(), impl="cpu")
    ref = paged_attention(*batch.args(), impl="reference")
    assert out.dtype == dtype and out.shape == batch.q.shape
    assert not out.isnan().any()  # unwritten (NaN) slots and masked positions never count
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.double(), brute_force_attention(batch), atol=tol, rtol=tol)


def test_a_big_batch_on_several_threads_matches_the_reference():
    batch = make_batch([(300, causal(64)), (700, DECODE), (20, causal(5))], num_q_heads=8,
                       num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    out = paged_attention(*batch.args(), impl="cpu")
    ref = paged_attention(*batch.args(), impl="reference")
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_auto_takes_the_kernel_for_bf16_and_fp32_and_the_reference_for_fp16(monkeypatch):
    calls = []
    real = cpu_attention.paged_attention_cpu
    monkeypatch.setattr(cpu_attention, "paged_attention_cpu",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    for dtype in (torch.bfloat16, torch.float32):
        batch = make_batch(requests(0), num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype)
        paged_attention(*batch.args())
    assert calls == [1, 1]
    fp16 = make_batch(requests(0), num_q_heads=4, num_kv_heads=2, head_dim=64,
                      dtype=torch.float16)
    paged_attention(*fp16.args())
    assert calls == [1, 1]


def test_inputs_the_kernel_cannot_take_are_a_clear_error():
    fp16 = make_batch(requests(0), num_q_heads=4, num_kv_heads=2, head_dim=64,
                      dtype=torch.float16)
    with pytest.raises(ValueError, match="bf16 or fp32"):
        paged_attention(*fp16.args(), impl="cpu")
    odd = make_batch([(5, DECODE)], num_q_heads=2, num_kv_heads=1, head_dim=40,
                     dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 16"):
        paged_attention(*odd.args(), impl="cpu")
    # "auto" falls back to the reference for them.
    out = paged_attention(*odd.args())
    torch.testing.assert_close(out.double(), brute_force_attention(odd), atol=2e-2, rtol=2e-2)


def test_head_dim_48_runs_in_the_kernel():
    batch = make_batch(requests(3), num_q_heads=4, num_kv_heads=2, head_dim=48,
                       dtype=torch.bfloat16)
    out = paged_attention(*batch.args(), impl="cpu")
    torch.testing.assert_close(out.double(), brute_force_attention(batch), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 2, 64), (8, 1, 128)])
def test_a_chain_row_equals_the_same_token_decoded_alone(num_q_heads, num_kv_heads, head_dim,
                                                         dtype):
    """Row-count invariance: row i of a verified chain (context c, 7 new tokens), batched with
    other requests (a prompt chunk makes the batch big enough to run on several threads), is
    bit-identical to decoding that token alone over context c + i (one thread)."""
    chain = make_batch([(40, causal(7)), (300, DECODE), (600, causal(16))], num_q_heads=num_q_heads,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    together = paged_attention(*chain.args(), impl="cpu")  # [11, Hq, D]
    for i in range(7):
        alone = paged_attention(
            chain.q[i : i + 1], chain.k_cache, chain.v_cache, chain.block_tables[:1],
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([40 + i], dtype=torch.int32),
            None, chain.scale, 1, impl="cpu")
        assert torch.equal(alone[0], together[i]), f"chain row {i}"


def _positions(reqs: list) -> torch.Tensor:  # [T] int64
    """Each new row's rotary position: its request's context plus its depth (a tree node's
    ancestors before it, a causal row's earlier rows)."""
    return torch.cat([ctx + mask.sum(-1).long() - 1 for ctx, mask in reqs])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [1, 4, 9, 40, 1000])
def test_a_sliding_window_matches_the_masked_reference(window, dtype):
    """Sliding-window layers (Gemma 3): keys at positions <= p - window hidden from a query at
    p, trees windowed by depth, against masked_attention (the model's own PyTorch path); a
    window wider than every context is the plain kernel's result, bit for bit."""
    from specserve.model.attention import AttentionMetadata, masked_attention

    reqs = requests(5)
    batch = make_batch(reqs, num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype)
    positions = _positions(reqs)
    out = cpu_attention.paged_attention_cpu(*batch.args(), window=window, positions=positions)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), batch.block_tables,
                             batch.query_start_loc, batch.context_lens, batch.local_mask,
                             batch.max_query_len)
    ref = masked_attention(batch.q, batch.k_cache, batch.v_cache, meta, positions, batch.scale,
                           window)
    assert not out.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    if window == 1000:
        assert torch.equal(out, paged_attention(*batch.args(), impl="cpu"))
    with pytest.raises(ValueError, match="sliding window"):
        cpu_attention.paged_attention_cpu(*batch.args(), window=window)


def test_a_windowed_row_equals_the_same_token_decoded_alone():
    """Row-count invariance under a window: the rows of a prompt chunk past the window, each
    bit-identical to that token decoded alone over the same cache."""
    chunk = make_batch([(40, causal(7)), (300, DECODE)], num_q_heads=4, num_kv_heads=2,
                       head_dim=64, dtype=torch.bfloat16)
    positions = torch.tensor([*range(40, 47), 300])
    together = cpu_attention.paged_attention_cpu(*chunk.args(), window=16, positions=positions)
    for i in range(7):
        alone = cpu_attention.paged_attention_cpu(
            chunk.q[i : i + 1], chunk.k_cache, chunk.v_cache, chunk.block_tables[:1],
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([40 + i], dtype=torch.int32),
            None, chunk.scale, 1, window=16, positions=positions[i : i + 1])
        assert torch.equal(alone[0], together[i]), f"chunk row {i}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_kv_matches_the_reference_on_views_of_the_fused_projection(dtype):
    from specserve.kernels import store_kv

    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, 4 * 16 + 2 * 2 * 16, generator=g).to(dtype)  # [T, q + k + v]
    k = qkv[:, 64:96].view(6, 2, 16)  # [T, Hkv, D], rows 96 values apart
    v = qkv[:, 96:].view(6, 2, 16)
    slots = torch.tensor([5, -1, 17, 0, 40, 33])  # -1: padding, skipped
    caches = {impl: (torch.full((3, 16, 2, 16), float("nan"), dtype=dtype),
                     torch.full((3, 16, 2, 16), float("nan"), dtype=dtype))
              for impl in ("cpu", "reference", "auto")}
    for impl, (kc, vc) in caches.items():
        store_kv(k, v, kc, vc, slots, impl=impl)
    for impl in ("cpu", "auto"):
        for got, want in zip(caches[impl], caches["reference"], strict=True):
            assert torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(IndexError, match="past the cache"):
        cpu_attention.store_kv_cpu(k, v, *caches["cpu"], torch.tensor([0, 1, 2, 3, 4, 48]))
    with pytest.raises(ValueError, match="all bf16 or all fp32"):
        cpu_attention.store_kv_cpu(k.double(), v.double(), *caches["cpu"], slots)
