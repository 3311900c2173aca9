"""Weight-only quantized linear layers: one entry point, `quant_linear`, over three paths.

  "auto"       CUDA tensors: the Triton kernel (quant_triton.py). CPU: the C kernel (cpu_quant.c,
               the build `SPECSERVE_CPU_ISA` selects, see quant_cpu.py) for up to MAX_ROWS
               bf16/fp32 rows (decode, chains, draft trees), the reference otherwise.
  "cpu" / "triton" / "reference"   that path alone.

The reference (quant_reference.py) dequantizes to fp32 and runs F.linear: every path computes
the same sums, in different orders.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import quant_cpu
from .quant_reference import QuantizedWeight, quant_linear_reference

QuantImpl = Literal["auto", "cpu", "triton", "reference"]

# Past this many rows (prompt chunks) an fp32 GEMM over the dequantized weight does better
# than re-reading the blocks for every chunk of rows.
MAX_ROWS = 32


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
    elif impl == "cpu" or (impl == "auto" and _cpu_kernel_applies(x2)):
        out = quant_cpu.quant_matmul(x2, qweight, bias)
    else:
        out = quant_linear_reference(x2, qweight, bias)
    return out.reshape(*lead, n)


def _cpu_kernel_applies(x2: torch.Tensor) -> bool:
    return (x2.device.type == "cpu" and 0 < x2.shape[0] <= MAX_ROWS
            and x2.dtype in (torch.bfloat16, torch.float32)
            and quant_cpu.library(quant_cpu.selected_isa()) is not None)
