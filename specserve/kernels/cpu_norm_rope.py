"""RMSNorm and rotary embedding on CPU through the C kernels in `cpu_norm_rope.c`.

`rms_norm` and `rotary_` return None when the kernels do not apply (not bf16 on CPU, or no
kernel library); the caller then runs its PyTorch code, which is also their reference.
"""

from __future__ import annotations

import torch

from .cpu_build import library


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """x [T, H] bf16, weight [H] bf16 -> bf16(weight * bf16(x / rms(x))), or None."""
    lib = library()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.bfloat16 or x.dim() != 2
            or weight.dtype != torch.bfloat16 or weight.shape != x.shape[1:]
            or not weight.is_contiguous()):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.rms_norm_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1],
                      eps)
    return out


def rotary_(rows: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
            sin: torch.Tensor, positions: torch.Tensor) -> bool:
    """Rotate, in place, the first `num_heads` heads of every row of `rows` [T, >= heads * D]
    (bf16, contiguous) with tables cos, sin [P, D / 2] fp32 at positions [T]; False (nothing
    done) when the kernel does not apply."""
    lib = library()
    if (lib is None or rows.device.type != "cpu" or rows.dtype != torch.bfloat16
            or rows.dim() != 2 or not rows.is_contiguous()
            or rows.shape[1] < num_heads * head_dim or cos.dtype != torch.float32
            or cos.shape != sin.shape or cos.shape[1] * 2 != head_dim
            or not (cos.is_contiguous() and sin.is_contiguous())):
        return False
    positions = positions.to(torch.int64).contiguous()
    if lib.rotary_bf16(rows.data_ptr(), rows.shape[0], rows.shape[1], num_heads, head_dim,
                       cos.data_ptr(), sin.data_ptr(), len(cos), positions.data_ptr()) != 0:
        raise IndexError(f"rotary positions must lie in [0, {len(cos)})")
    return True
