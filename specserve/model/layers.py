"""Decoder building blocks: RMSNorm, rotary embedding, tensor-parallel linears, gated MLP.

Every linear owns a `weight_loader` that copies its slice of a checkpoint tensor, so the loader
never needs to know how a layer is split: at tp=1 the slice is the whole tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import all_reduce_sum, tp_rank, tp_world_size
from ..kernels import cpu_norm_rope, linear


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


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across tensor-parallel ranks.

    `output_sizes` lists the logical sub-matrices stacked in this one weight (q, k, v or gate, up);
    each is split separately so every rank holds its own slice of each.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        world = tp_world_size()
        for size in output_sizes:
            if size % world:
                raise ValueError(f"output size {size} is not divisible by tp={world}")
        self.shard_sizes = [size // world for size in output_sizes]
        out = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False)
                     if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """Copy this rank's rows of logical sub-matrix `shard` from the full checkpoint tensor."""
        size = self.shard_sizes[shard]
        offset = sum(self.shard_sizes[:shard])
        _expect_shape(loaded, (size * tp_world_size(), *param.shape[1:]))
        rows = loaded.narrow(0, tp_rank() * size, size)
        _checked_copy(param.data.narrow(0, offset, size), rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks and the partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        world = tp_world_size()
        if input_size % world:
            raise ValueError(f"input size {input_size} is not divisible by tp={world}")
        self.shard_size = input_size // world
        self.weight = nn.Parameter(torch.empty(output_size, self.shard_size, dtype=dtype),
                                   requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        _expect_shape(loaded, (param.shape[0], self.shard_size * tp_world_size()))
        cols = loaded.narrow(1, tp_rank() * self.shard_size, self.shard_size)
        _checked_copy(param.data, cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(linear(x, self.weight))


class VocabEmbedding(nn.Module):
    """Token embedding; at tp>1 each rank holds a contiguous range of the vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        world = tp_world_size()
        self.shard_size = -(-vocab_size // world)
        self.vocab_start = tp_rank() * self.shard_size
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size, dtype=dtype),
                                   requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        _expect_shape(loaded, (self.vocab_size, param.shape[1]))
        rows = loaded[self.vocab_start:self.vocab_start + self.shard_size]
        _checked_copy(param.data[: rows.shape[0]], rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_world_size() == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        return all_reduce_sum(out.masked_fill(outside.unsqueeze(-1), 0))


def _expect_shape(loaded: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Check the full (unsliced) checkpoint tensor before taking this rank's slice of it."""
    if tuple(loaded.shape) != tuple(shape):
        raise ValueError(f"shape mismatch: expected {tuple(shape)}, got {tuple(loaded.shape)}")


def _checked_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: expected {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one column-parallel matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=False, dtype=dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
