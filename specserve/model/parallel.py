"""Tensor-parallel layers (Megatron style) and the rules that split a checkpoint across ranks.

- Column-parallel linears (q/k/v, gate/up) hold a slice of the output rows of each logical
  sub-matrix they fuse; their outputs stay split, so attention and the MLP's activation run on
  this rank's heads and channels only.
- Row-parallel linears (o, down) hold the matching slice of input columns; their partial
  products are summed with one all-reduce each.
- The vocabulary-parallel embedding holds a contiguous range of token rows (an all-reduce joins
  the ranks' lookups); as an LM head (tied or not) each rank computes its range of logits and
  rank 0 gathers them.

Grouped-query attention splits query heads evenly; key/value heads split evenly too when there
are at least as many as ranks, and are otherwise replicated: rank r holds KV head
r // (world / num_kv_heads), the one its query heads read.

Every layer's `weight_loader` takes the checkpoint tensor either loaded or as a lazy safetensors
slice (`safe_open(...).get_slice(name)`) and reads only this rank's part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed import WHOLE, TPShard, all_reduce_sum, gather_last_dim
from ..kernels import linear
from ..kernels.quant_reference import BLOCK

# Quantized weights store 32 consecutive input features per scale block; a row-parallel split
# must not cut a block.
QUANT_BLOCK = BLOCK


# ---- sharding rules -----------------------------------------------------------------------
@dataclass(frozen=True)
class RowRange:
    """Rows [start, start + size) of a logical sub-matrix with `full` rows."""

    full: int
    start: int
    size: int


def even_range(full: int, shard: TPShard, what: str) -> RowRange:
    if full % shard.world_size:
        raise ValueError(f"{what} ({full}) does not split evenly over tp={shard.world_size}")
    size = full // shard.world_size
    return RowRange(full, shard.rank * size, size)


def kv_head_range(num_kv_heads: int, shard: TPShard) -> tuple[int, int]:
    """(first KV head, number of KV heads) this rank holds; replicated below one per rank."""
    world = shard.world_size
    if num_kv_heads >= world:
        if num_kv_heads % world:
            raise ValueError(f"{num_kv_heads} key/value heads do not split evenly over "
                             f"tp={world}")
        per_rank = num_kv_heads // world
        return shard.rank * per_rank, per_rank
    if world % num_kv_heads:
        raise ValueError(f"{num_kv_heads} key/value heads cannot be replicated evenly over "
                         f"tp={world} (tp must be a multiple of the KV head count)")
    return shard.rank // (world // num_kv_heads), 1


def check_split(num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                shard: TPShard, quant_block: int | None = None) -> None:
    """Raise a clear error when a model cannot be split over `shard.world_size` ranks.

    `quant_block`: the scale-block length of quantized weights; the row-parallel inputs (o_proj:
    a rank's heads, down_proj: a rank's MLP channels) must split on block boundaries.
    """
    world = shard.world_size
    if world == 1:
        return
    if num_heads % world:
        raise ValueError(f"{num_heads} attention heads do not split evenly over tp={world}")
    kv_head_range(num_kv_heads, shard)
    even_range(intermediate_size, shard, "intermediate size")
    if quant_block:
        for what, cols in (("o_proj input (heads x head_dim)", num_heads * head_dim // world),
                           ("down_proj input (intermediate size)", intermediate_size // world)):
            if cols % quant_block:
                raise ValueError(f"quantized weights cannot be split over tp={world}: each "
                                 f"rank's {what} slice has {cols} features, not a multiple "
                                 f"of the {quant_block}-weight scale block")


# ---- reading a rank's part of a checkpoint tensor -----------------------------------------
def checkpoint_shape(loaded) -> tuple[int, ...]:
    """Shape of a loaded tensor or of a lazy safetensors slice."""
    return tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else tuple(loaded.get_shape())


def read_range(loaded, dim: int, start: int, size: int) -> torch.Tensor:
    """`loaded`[..., start:start + size, ...] along `dim`; a lazy slice reads only that part."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    return loaded[(slice(None),) * dim + (slice(start, start + size),)]


def _expect_shape(loaded, shape: tuple[int, ...]) -> None:
    """Check the full (unsliced) checkpoint tensor before taking this rank's slice of it."""
    if checkpoint_shape(loaded) != tuple(shape):
        raise ValueError(f"shape mismatch: expected {tuple(shape)}, got "
                         f"{checkpoint_shape(loaded)}")


def _checked_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: expected {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


# ---- layers -------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split across ranks; the output stays split.

    `ranges` lists, for each logical sub-matrix stacked in this one weight (q, k, v or gate, up),
    the rows this rank holds; the weight is their concatenation.
    """

    def __init__(self, input_size: int, ranges: list[RowRange], bias: bool,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.ranges = ranges
        out = sum(r.size for r in ranges)
        self.weight = nn.Parameter(torch.empty(out, input_size, dtype=dtype), requires_grad=False)
        self.bias = (nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False)
                     if bias else None)

    def weight_loader(self, param: nn.Parameter, loaded, shard: int = 0) -> None:
        """Copy this rank's rows of logical sub-matrix `shard` from the checkpoint tensor."""
        rows = self.ranges[shard]
        offset = sum(r.size for r in self.ranges[:shard])
        _expect_shape(loaded, (rows.full, *param.shape[1:]))
        _checked_copy(param.data.narrow(0, offset, rows.size),
                      read_range(loaded, 0, rows.start, rows.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = x W^T with W's input columns split across ranks and the partial sums all-reduced."""

    def __init__(self, input_size: int, output_size: int, dtype: torch.dtype,
                 shard: TPShard = WHOLE) -> None:
        super().__init__()
        self.shard = shard
        self.cols = even_range(input_size, shard, "row-parallel input size")
        self.weight = nn.Parameter(torch.empty(output_size, self.cols.size, dtype=dtype),
                                   requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded, shard: int = 0) -> None:
        _expect_shape(loaded, (param.shape[0], self.cols.full))
        _checked_copy(param.data, read_range(loaded, 1, self.cols.start, self.cols.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(linear(x, self.weight), self.shard)


class VocabParallelEmbedding(nn.Module):
    """Token embedding and LM head over a contiguous range of the vocabulary per rank.

    The vocabulary is padded to a multiple of the world size; padding rows stay zero, and their
    logits are cut off after the gather. `file_head`, when set (a GGUF checkpoint's own quantized
    rows of this rank's vocabulary, see model/quant.py), computes the logits instead of `weight`:
    the same values (`weight` is their exact dequantization), a quarter of the bytes to read.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 shard: TPShard = WHOLE) -> None:
        super().__init__()
        self.shard = shard
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // shard.world_size)
        self.vocab_start = shard.rank * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.file_head: nn.Module | None = None  # hidden [N, H] -> [N, shard_size]

    def weight_loader(self, param: nn.Parameter, loaded, shard: int = 0) -> None:
        _expect_shape(loaded, (self.vocab_size, param.shape[1]))
        size = max(0, min(self.shard_size, self.vocab_size - self.vocab_start))
        if size:
            _checked_copy(param.data[:size], read_range(loaded, 0, self.vocab_start, size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> embeddings [T, H]."""
        if not self.shard.is_split:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.clamp(0, self.shard_size - 1), self.weight)
        return all_reduce_sum(out.masked_fill(outside.unsqueeze(-1), 0), self.shard)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H] -> float32 logits [N, vocab] on rank 0 (None on the other ranks)."""
        local = (linear(hidden, self.weight) if self.file_head is None
                 else self.file_head(hidden))  # [N, shard_size]
        full = gather_last_dim(local, self.shard)  # [N, padded vocab]
        return full[..., : self.vocab_size].float() if full is not None else None
