"""Quantized formats and the C kernel (kernels/cpu_quant.c) against the dequantize-then-matmul
reference, on every ISA path this CPU runs (avx512 where present, avx2, portable); the AVX-512
path's compile check on machines without it is test_cpu_build.py's (it builds every path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from specserve.kernels import cpu_build, quant, quant_cpu
from specserve.kernels.quant_reference import (
    FORMATS,
    QuantizedWeight,
    dequantize,
    quant_format,
    quant_linear_reference,
    quantize,
)

ISAS = cpu_build.supported_isas()
SHAPES = [(1, 32), (7, 100), (33, 1000), (64, 256), (5, 4864), (130, 4096)]  # (N, K)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=ISAS)
def isa(request) -> str:
    if cpu_build.library_for(request.param) is None:
        pytest.skip(f"the {request.param} build is not available (no C compiler?)")
    return request.param


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantize_dequantize_match_gguf(fmt: str):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = _randn(9, 96, seed=0)
    qw = quantize(w, fmt)
    want = gguf_dequantize(qw.blocks.numpy(), GGMLQuantizationType[fmt])  # [9, 96]
    assert np.array_equal(dequantize(qw).numpy(), want)
    # Within half a step of the grid: d = amax/127 (Q8_0), |max|/8 (Q4_0), range/15 (Q4_1).
    steps = {"Q8_0": 1 / 127, "Q4_0": 2 / 8, "Q4_1": 2 / 15}[fmt]
    amax = w.view(9, 3, 32).abs().amax(-1, keepdim=True)
    assert ((dequantize(qw) - w).view(9, 3, 32).abs() <= amax * steps * 0.5 + 1e-3).all()


def test_k_pads_to_whole_blocks():
    w = _randn(3, 40, seed=1)
    qw = quantize(w, "Q8_0")
    assert qw.blocks.shape == (3, 2 * 34) and qw.shape == (3, 40)
    assert dequantize(qw).shape == (3, 40)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 12, 16])
def test_kernel_matches_reference(isa: str, fmt: str, m: int, n: int, k: int):
    qw = quantize(_randn(n, k, seed=n + k), fmt)
    x = _randn(m, k, seed=m).to(torch.bfloat16)
    want = quant_linear_reference(x.float(), qw)  # [m, n] fp32
    got = quant_cpu.quant_matmul(x, qw, isa=isa, out_dtype=torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # Exact dequantized weights; only the fp32 summation order differs.
    scale = float(dequantize(qw).abs().max()) * k ** 0.5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * scale)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rows_are_bit_identical_alone_or_together(isa: str, fmt: str):
    """A row's output must not depend on how many rows share the call (greedy speculation
    equals plain decoding only then)."""
    qw = quantize(_randn(67, 1000, seed=3), fmt)
    x = _randn(16, 1000, seed=4).to(torch.bfloat16)
    together = quant_cpu.quant_matmul(x, qw, isa=isa, out_dtype=torch.float32)  # [16, 67]
    for rows in (1, 2, 3, 7):
        for start in range(0, 16 - rows + 1, 5):
            part = quant_cpu.quant_matmul(x[start:start + rows], qw, isa=isa,
                                          out_dtype=torch.float32)
            assert torch.equal(part, together[start:start + rows]), (rows, start)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bias_and_output_dtype(isa: str, dtype: torch.dtype):
    qw = quantize(_randn(50, 64, seed=5), "Q4_1")
    x, bias = _randn(3, 64, seed=6).to(dtype), _randn(50, seed=7).to(dtype)
    got = quant_cpu.quant_matmul(x, qw, bias, isa=isa)
    assert got.dtype == dtype
    want32 = quant_linear_reference(x.float(), qw, bias.float())
    if dtype == torch.float32:
        torch.testing.assert_close(got, want32, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of the fp32 sum (+ bias), maybe one step apart
        torch.testing.assert_close(got.float(), want32.to(dtype).float(), rtol=2 ** -7, atol=1e-6)


def test_quant_linear_paths_agree():
    qw = quantize(_randn(40, 96, seed=8), "Q8_0")
    x = _randn(2, 3, 96, seed=9)  # [2, 3, K]: leading dimensions are kept
    want = quant.quant_linear(x, qw, impl="reference")
    assert want.shape == (2, 3, 40)
    if quant_cpu.library() is not None:
        torch.testing.assert_close(quant.quant_linear(x, qw, impl="cpu"), want)
    torch.testing.assert_close(quant.quant_linear(x, qw), want)
    many = _randn(2 * quant.MAX_ROWS + 1, 96, seed=10)  # a prompt chunk: split into calls
    torch.testing.assert_close(quant.quant_linear(many, qw), quant_linear_reference(many, qw))


def test_torch_path_means_the_reference():
    assert quant_cpu.library("torch") is None
    with pytest.raises(RuntimeError, match="torch"):
        quant_cpu.quant_matmul(torch.zeros(1, 32), quantize(torch.ones(2, 32), "Q8_0"),
                               isa="torch")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="'Q5_K'"):
        quant_format("Q5_K")
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight(FORMATS["Q8_0"], torch.zeros(2, 33, dtype=torch.uint8), (2, 32))
    with pytest.raises(ValueError, match="features"):
        quant.quant_linear(torch.zeros(1, 31), quantize(torch.ones(2, 32), "Q8_0"))
    with pytest.raises(ValueError, match="impl"):
        quant.quant_linear(torch.zeros(1, 32), quantize(torch.ones(2, 32), "Q8_0"), impl="gpu")
    with pytest.raises(ValueError, match="x must be"):
        quant_cpu.quant_matmul(torch.zeros(1, 32, dtype=torch.float16),
                               quantize(torch.ones(2, 32), "Q8_0"), isa=ISAS[-1])

