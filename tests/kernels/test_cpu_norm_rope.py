"""The CPU RMSNorm and rotary kernels (specserve/kernels/cpu_norm_rope.c) against the PyTorch
layers, on every ISA path this CPU runs (the `cpu_isa` fixture)."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels import cpu_norm_rope
from specserve.model.layers import RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.usefixtures("cpu_isa")


def _torch_only(monkeypatch):
    monkeypatch.setattr(cpu_norm_rope, "library", lambda: None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_matches_the_pytorch_steps(monkeypatch, dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(1000, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    x = (torch.randn(7, 1000, generator=gen) * 3).to(dtype)
    fused = norm(x)
    _torch_only(monkeypatch)
    want = norm(x)
    assert fused.dtype == want.dtype == dtype
    # Only the fp32 sum of squares is added in another order, which moves the scale 1/rms by a
    # few fp32 steps (about 1e-6 over 1000 terms, measured 8.8e-7): in bf16 at most one
    # rounding step, and rarely that.
    if dtype == torch.bfloat16:
        torch.testing.assert_close(fused, want, rtol=2 ** -7, atol=0)
        assert (fused == want).float().mean() > 0.99
    else:
        torch.testing.assert_close(fused, want, rtol=2e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_in_place_equals_the_pytorch_rotation(monkeypatch, dtype):
    heads_q, heads_kv, dim = 4, 2, 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    rotary = RotaryEmbedding(dim, 512, inv_freq, attention_scaling=1.0)
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (heads_q + 2 * heads_kv) * dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 77, 300, 511])
    q = qkv[:, : heads_q * dim].reshape(5, heads_q, dim)
    k = qkv[:, heads_q * dim : (heads_q + heads_kv) * dim].reshape(5, heads_kv, dim)
    want_q, want_k = rotary(positions, q, k)
    v_before = qkv[:, (heads_q + heads_kv) * dim :].clone()
    assert rotary.rotate_qk_(positions, qkv, heads_q, heads_kv)
    # The same fp32 operations and roundings: bit for bit.
    assert torch.equal(qkv[:, : heads_q * dim].reshape(5, heads_q, dim), want_q)
    assert torch.equal(qkv[:, heads_q * dim : (heads_q + heads_kv) * dim].reshape(5, heads_kv, dim),
                       want_k)
    assert torch.equal(qkv[:, (heads_q + heads_kv) * dim :], v_before)  # v untouched
    _torch_only(monkeypatch)
    assert not rotary.rotate_qk_(positions, qkv, heads_q, heads_kv)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_dtypes_take_the_pytorch_path(dtype):
    assert cpu_norm_rope.rms_norm(torch.randn(2, 8, dtype=dtype), torch.ones(8, dtype=dtype),
                                  1e-6) is None
    assert not cpu_norm_rope.rotary_(torch.randn(2, 8, dtype=dtype), 1, 8, torch.ones(4, 4),
                                     torch.ones(4, 4), torch.tensor([0, 1]))


def test_mixed_dtypes_take_the_pytorch_path():
    assert cpu_norm_rope.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16),
                                  1e-6) is None


def test_rotary_position_outside_the_table_is_an_error_and_changes_nothing():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    rotary = RotaryEmbedding(32, 16, inv_freq)
    qkv = torch.randn(2, 3 * 32).to(torch.bfloat16)
    before = qkv.clone()
    with pytest.raises(IndexError, match="positions"):
        rotary.rotate_qk_(torch.tensor([3, 16]), qkv, 1, 1)
    assert torch.equal(qkv, before)
