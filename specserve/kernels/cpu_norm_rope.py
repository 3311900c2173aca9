"""RMSNorm and rotary embedding on CPU through the C kernels in `cpu_norm_rope.c`.

`rms_norm` and `rotary_` return None / False when the kernels do not apply (not bf16 or fp32 on
CPU, or no kernel library); the caller then runs its PyTorch code, which is also their
reference.
"""

from __future__ import annotations

import torch

from .cpu_build import library

DTYPES = (torch.bfloat16, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [T, H], weight [H], both bf16 or both fp32 -> weight * round(x / rms(x)) in x's dtype,
    or None."""
    lib = library()
    if (lib is None or x.device.type != "cpu" or x.dtype not in DTYPES or x.dim() != 2
            or weight.dtype != x.dtype or weight.shape != x.shape[1:]
            or not weight.is_contiguous()):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.rms_norm_rows(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                      eps, x.dtype == torch.float32)
    return out


def rotary_(rows: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
            sin: torch.Tensor, positions: torch.Tensor) -> bool:
    """Rotate, in place, the first `num_heads` heads of every row of `rows` [T, >= heads * D]
    (bf16 or fp32, contiguous) with tables cos, sin [P, D / 2] fp32 at positions [T]; False
    (nothing done) when the kernel does not apply."""
    lib = library()
    if (lib is None or rows.device.type != "cpu" or rows.dtype not in DTYPES
            or rows.dim() != 2 or not rows.is_contiguous()
            or rows.shape[1] < num_heads * head_dim or cos.dtype != torch.float32
            or cos.shape != sin.shape or cos.shape[1] * 2 != head_dim
            or not (cos.is_contiguous() and sin.is_contiguous())):
        return False
    positions = positions.to(torch.int64).contiguous()
    if lib.rotary_rows(rows.data_ptr(), rows.shape[0], rows.shape[1], num_heads, head_dim,
                       cos.data_ptr(), sin.data_ptr(), len(cos), positions.data_ptr(),
                       rows.dtype == torch.float32) != 0:
        raise IndexError(f"rotary positions must lie in [0, {len(cos)})")
    return True
