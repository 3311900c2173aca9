"""The quantized matmul C kernel (cpu_quant.c), on the ISA path cpu_build.py selects.

`SPECSERVE_CPU_ISA` (see cpu_build.py) picks avx512, avx2, portable C or torch (no C kernel: the
PyTorch reference); tests pass `isa=` to run every path this CPU supports.
"""

from __future__ import annotations

import torch

from . import cpu_build
from .quant_reference import QuantizedWeight


def library(isa: str | None = None):
    """The kernel library of isa (default: the selected ISA), or None (torch path)."""
    return cpu_build.library_for(isa or cpu_build.selected_isa())


def quant_matmul(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None = None,
                 *, isa: str | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp32 on CPU -> x @ dequantize(qweight).T (+ bias) [M, N] in out_dtype
    (x's dtype by default; bias in out_dtype) on the isa path (default: the selected one)."""
    lib = library(isa)
    if lib is None:
        raise RuntimeError(f"no quantized CPU kernel on the {isa or cpu_build.selected_isa()} "
                           "path (SPECSERVE_CPU_ISA=torch, or no C compiler)")
    n, k = qweight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match a {n}x{k} weight")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    out_dtype = out_dtype or x.dtype
    x = x.contiguous()
    blocks = qweight.blocks.contiguous()
    bias = None if bias is None else bias.to(out_dtype).contiguous()
    out = torch.empty(x.shape[0], n, dtype=out_dtype)
    if x.shape[0] == 0:
        return out
    status = lib.quant_matmul(x.data_ptr(), x.dtype == torch.bfloat16, blocks.data_ptr(),
                              qweight.fmt.code, None if bias is None else bias.data_ptr(),
                              out.data_ptr(), out_dtype == torch.bfloat16, x.shape[0], n, k,
                              torch.get_num_threads())
    if status:
        raise MemoryError("quant_matmul: cannot allocate the activation buffer")
    return out
