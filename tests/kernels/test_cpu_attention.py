"""The AVX-512 BF16 CPU attention kernel (kernels/cpu_attention.c) against its reference."""

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

pytestmark = pytest.mark.skipif(
    not cpu_attention.supports(torch.zeros(1, 1, 32, dtype=torch.bfloat16),
                               torch.zeros(1, 1, 1, 32, dtype=torch.bfloat16)),
    reason="no AVX-512 BF16 CPU or no C compiler")

def requests(seed: int) -> list:
    return [*mixed_requests(seed), (300, DECODE)]  # and a decode over many pages


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(2, 2), (4, 1), (8, 1), (8, 2)])
@pytest.mark.parametrize("causal_as_none", [False, True], ids=["mask", "none"])
def test_matches_reference_and_brute_force(head_dim, num_q_heads, num_kv_heads, causal_as_none):
    reqs = requests(head_dim + num_q_heads)
    if causal_as_none:  # None means causal: only causal requests
        reqs = [(ctx, causal(m.shape[0])) for ctx, m in reqs]
    batch = make_batch(reqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                       head_dim=head_dim, dtype=torch.bfloat16, causal_as_none=causal_as_none)
    out = paged_attention(*batch.args(), impl="cpu")
    ref = paged_attention(*batch.args(), impl="reference")
    assert out.dtype == torch.bfloat16 and out.shape == batch.q.shape
    assert not out.isnan().any()  # unwritten (NaN) slots and masked positions are never read
    # Both round an fp32 result to bf16; the fp32 sums differ only in order.
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.double(), brute_force_attention(batch), atol=2e-2, rtol=2e-2)


def test_auto_takes_the_kernel_for_bf16_and_the_reference_for_fp32(monkeypatch):
    calls = []
    real = cpu_attention.paged_attention_cpu
    monkeypatch.setattr(cpu_attention, "paged_attention_cpu",
                        lambda *a: calls.append(1) or real(*a))
    bf16 = make_batch(requests(0), num_q_heads=4, num_kv_heads=2, head_dim=64,
                      dtype=torch.bfloat16)
    paged_attention(*bf16.args())
    assert calls == [1]
    fp32 = make_batch(requests(0), num_q_heads=4, num_kv_heads=2, head_dim=64)
    paged_attention(*fp32.args())
    assert calls == [1]
