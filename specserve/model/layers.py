"""Decoder building blocks: RMSNorm, rotary embedding, gated MLP.

The tensor-parallel linears and the vocabulary-parallel embedding live in `parallel.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import WHOLE, TPShard
from ..kernels import cpu_decoder, cpu_norm_rope
from .parallel import ColumnParallelLinear, RowParallelLinear, even_range


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_norm_rope.rms_norm(x, self.weight, self.eps)  # the same steps, in C
        if fused is not None:
            return fused
        # Normalise in float32 as the reference implementations do, then cast back.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position.

    inv_freq: [head_dim / 2] from the checkpoint's rope settings (see architectures.rope_inv_freq).
    """

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor,
                 attention_scaling: float = 1.0) -> None:
        super().__init__()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.float())  # [P, D/2]
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, D]; k [T, Hkv, D] -> rotated (q, k), same dtypes."""
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def rotate_qk_(self, positions: torch.Tensor, qkv: torch.Tensor, num_q_heads: int,
                   num_kv_heads: int) -> bool:
        """Rotate q and k in place inside the fused projection output qkv [T, (Hq + 2 Hkv) D]
        (q heads, then k heads, lead each row); False when only `forward` can do it."""
        return cpu_norm_rope.rotary_(qkv, num_q_heads + num_kv_heads, self.head_dim, self.cos,
                                     self.sin, positions)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Llama-style "rotate half": the first and second halves of head_dim form the pairs.
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one column-parallel matmul; act is
    silu (SwiGLU) or gelu with the tanh approximation (Gemma's GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 shard: TPShard = WHOLE, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {activation!r}")
        self.activation = activation
        channels = even_range(intermediate_size, shard, "intermediate size")
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [channels, channels], bias=False,
                                                 dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, dtype, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        gelu = self.activation == "gelu_tanh"
        activated = (cpu_decoder.gelu_tanh_mul if gelu else cpu_decoder.silu_mul)(gate_up)
        if activated is None:  # not in C
            gate, up = gate_up.chunk(2, dim=-1)
            activated = (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up
        return self.down_proj(activated)
