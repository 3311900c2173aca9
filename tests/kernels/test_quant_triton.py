"""The Triton quantized matmul (specserve/kernels/quant_triton.py) against the dequantize-then-
matmul reference: under Triton's interpreter without a GPU, compiled on CUDA (see conftest.py)."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.quant_reference import (
    FORMATS,
    QK_K,
    QuantizedWeight,
    quant_linear_reference,
    quantize,
)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m,n,k", [(1, 7, 100), (5, 70, 96), (16, 64, 256), (17, 3, 32)])
def test_triton_matches_reference(device: str, fmt: str, m: int, n: int, k: int):
    from specserve.kernels.quant_triton import quant_matmul_triton

    if FORMATS[fmt].is_k_quant:  # whole super-blocks: 256 or 512 columns
        k = -(-k // QK_K) * QK_K
    gen = torch.Generator().manual_seed(m * n + k)
    qw = quantize(torch.randn(n, k, generator=gen), fmt)
    x = torch.randn(m, k, generator=gen)
    want = quant_linear_reference(x, qw)  # [m, n]
    got = quant_matmul_triton(x.to(device), qw.to(device)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_triton_bias_and_bf16(device: str):
    from specserve.kernels.quant_triton import quant_matmul_triton

    gen = torch.Generator().manual_seed(1)
    qw = quantize(torch.randn(33, 64, generator=gen), "Q4_1")
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(33, generator=gen).to(torch.bfloat16)
    got = quant_matmul_triton(x.to(device), qw.to(device), bias.to(device)).cpu()
    assert got.dtype == torch.bfloat16
    want32 = quant_linear_reference(x.float(), qw, bias.float())
    torch.testing.assert_close(got.float(), want32.to(torch.bfloat16).float(), rtol=2 ** -7,
                               atol=1e-6)


@pytest.mark.parametrize("fmt", [f for f in FORMATS if FORMATS[f].is_k_quant])
def test_triton_k_quants_on_random_blocks(device: str, fmt: str):
    """Random k-quant bytes: every packed 6-bit Q4_K scale and min, negative Q6_K scales."""
    from specserve.kernels.quant_triton import quant_matmul_triton

    gen = torch.Generator().manual_seed(3)
    f = FORMATS[fmt]
    blocks = torch.randint(0, 256, (9, 2, f.block_bytes), dtype=torch.uint8, generator=gen)
    fields = (torch.randn(9, 2, 2, generator=gen) * 0.01).half().view(torch.uint8)  # [9, 2, 4]
    if fmt == "Q4_K":
        blocks[..., :4] = fields
    else:
        blocks[..., 208:210] = fields[..., :2]
    qw = QuantizedWeight(f, blocks.view(9, -1), (9, 2 * QK_K))
    x = torch.randn(3, 2 * QK_K, generator=gen)
    got = quant_matmul_triton(x.to(device), qw.to(device)).cpu()
    torch.testing.assert_close(got, quant_linear_reference(x, qw), rtol=1e-5, atol=1e-4)
