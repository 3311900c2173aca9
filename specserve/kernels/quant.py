"""Weight-only quantized linear layers: one entry point, `quant_linear`, over three paths.

  "auto"       CUDA tensors: the Triton kernel (quant_triton.py). CPU: the C kernel (cpu_quant.c,
               on the ISA path `SPECSERVE_CPU_ISA` selects, see cpu_build.py) on bf16/fp32 rows, in
               calls of at most MAX_ROWS rows; the reference otherwise.
  "cpu" / "triton" / "reference"   that path alone.

The reference (quant_reference.py) dequantizes to fp32 and runs F.linear; the Triton kernel and
the C kernel with `SPECSERVE_QUANT_ACT=fp32` compute the same sums in other orders. By default
(q16; q8 on request, see quant_cpu.py) the C kernel quantizes the activations to integer blocks
first, for integer dot products: quant_reference.quant_linear_int_reference gives its exact
results.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import quant_cpu
from .quant_reference import QuantizedWeight, quant_linear_reference

QuantImpl = Literal["auto", "cpu", "triton", "reference"]

# Rows per C kernel call. The kernel computes each row alone (row-count invariant), so every
# row of a step, prompt chunk or decode token, gets the same bits whatever it is batched with:
# greedy speculation then equals plain decoding even in mixed batches. Longer prompt chunks
# read the weights once per MAX_ROWS rows; that keeps the activations in L2.
MAX_ROWS = 64


def quant_linear(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None = None,
                 *, impl: QuantImpl = "auto") -> torch.Tensor:
    """x [..., K] @ dequantize(qweight).T (+ bias) -> [..., N] in x's dtype."""
    if impl not in ("auto", "cpu", "triton", "reference"):
        raise ValueError(f"unknown impl {impl!r}; expected 'auto', 'cpu', 'triton' or 'reference'")
    n, k = qweight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight has {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # [rows, K]
    if impl == "triton" or (impl == "auto" and x.is_cuda):
        from .quant_triton import quant_matmul_triton

        out = quant_matmul_triton(x2, qweight, bias)
    elif impl in ("cpu", "auto") and (lib := _cpu_library(x2)) is not None:
        out = _cpu_in_calls(lib, x2, qweight, bias)
    elif impl == "cpu":
        out = quant_cpu.quant_matmul(x2, qweight, bias)  # raises, naming what does not fit
    else:
        out = quant_linear_reference(x2, qweight, bias)
    return out.reshape(*lead, n)


_CPU_DTYPES = (torch.bfloat16, torch.float32)


def _cpu_library(x2: torch.Tensor):
    """The C kernel library when it can take x2 (CPU, bf16 or fp32), else None."""
    if x2.device.type != "cpu" or x2.dtype not in _CPU_DTYPES:
        return None
    return quant_cpu.library()


def _cpu_in_calls(lib, x2: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    """The C kernel, its inputs checked once, in quant_linear (a decode step makes four calls
    per layer, each a few tens of microseconds)."""
    act, x2 = quant_cpu.activation_format(), x2.contiguous()
    if x2.shape[0] <= MAX_ROWS:
        return quant_cpu.run_quant_matmul(lib, x2, qweight, bias, x2.dtype, act)
    return torch.cat([quant_cpu.run_quant_matmul(lib, rows, qweight, bias, x2.dtype, act)
                      for rows in x2.split(MAX_ROWS)])
