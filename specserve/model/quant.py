"""Weight-only quantization of a loaded decoder: `quantize_model(model, "int8" | "int4")`.

Every projection (q/k/v, o, gate/up, down) becomes a `QuantizedLinear` whose weight is stored in
GGUF blocks of 32 (int8 = Q8_0: an fp16 scale per block; int4 = Q4_1: an fp16 scale and min per
block), quantized by the gguf package's own quantizer, and multiplied by the kernels of
`specserve.kernels.quant` (the activations stay in the model's dtype, sums in fp32; the CPU
kernel rounds them to int16 blocks per call, finer than bf16, for integer dot products: see
specserve/kernels/quant_cpu.py). The embedding, the LM head (tied or not) and the norms stay in
the checkpoint's dtype: the embedding is a row lookup, not a matmul, and the LM head's logits
decide every greedy token.

The GGUF names (`q8_0`, `q4_0`, `q4_1`) are accepted too, for one exact format.

`use_file_blocks` does the same for a GGUF checkpoint's own Q8_0 / Q4_0 / Q4_1 tensors: their
blocks are the kernels' format, so they run as stored, with no re-quantization (on the CPU their
rows are regrouped once at load, the same bytes in the order the kernel streams them:
QuantizedLinear). A quantized LM
head in the file computes the logits on its blocks too: the file holds no other values for it
(the dense head is their exact dequantization), and they are a quarter of fp32's bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from ..distributed import WHOLE, TPShard, all_reduce_sum
from ..kernels.quant import quant_linear
from ..kernels.quant_cpu import cpu_row_order
from ..kernels.quant_reference import (
    BLOCK,
    FORMATS,
    QuantizedWeight,
    quant_format,
    quantize,
)
from .parallel import ColumnParallelLinear, RowParallelLinear

# The quantization names of LLM(quantization=...) and --quantization -> GGUF block format.
QUANTIZATIONS = {"int8": "Q8_0", "int4": "Q4_1", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


def resolve_quantization(name: str | None) -> str | None:
    """A quantization name -> its GGUF block format ("Q8_0", ...), None for no quantization."""
    if name is None or name == "none":
        return None
    fmt = QUANTIZATIONS.get(str(name).lower()) if isinstance(name, str) else None
    if fmt is None:
        raise ValueError(f"unknown quantization {name!r}; expected one of "
                         f"{', '.join(['none', *QUANTIZATIONS])}")
    return fmt


class QuantizedLinear(nn.Module):
    """y = x dequantize(W)^T + b with W in GGUF blocks; `shard` is a row-parallel layer's
    tensor-parallel shard, whose partial products are summed across ranks (WHOLE: no sum).

    On the CPU the blocks are kept in the C kernel's row order (QuantizedWeight.row_group): the
    tiled order when the activations are integer blocks (the default) and the row count allows,
    else rows grouped (each thread then reads its weights as one stream); elsewhere in GGUF's
    row order (the Triton kernel's). Moving the module converts them."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None,
                 shard: TPShard = WHOLE) -> None:
        super().__init__()
        qweight = qweight.with_row_group(_row_group(qweight))
        self.register_buffer("blocks", qweight.blocks)  # [N, row_bytes] uint8
        self.register_buffer("bias", bias)
        self.qweight = qweight
        self.shard = shard

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)  # moves the blocks buffer: keep qweight pointing at it
        moved = QuantizedWeight(self.qweight.fmt, self.blocks, self.qweight.shape,
                                self.qweight.row_group)
        self.qweight = moved.with_row_group(_row_group(moved))
        self.blocks = self.qweight.blocks
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = quant_linear(x, self.qweight, self.bias)
        return all_reduce_sum(out, self.shard)

    def extra_repr(self) -> str:
        n, k = self.qweight.shape
        return f"in_features={k}, out_features={n}, format={self.qweight.fmt.name}"


def _row_group(qweight: QuantizedWeight) -> int:
    """The row order the kernel on qweight's device reads: the C kernel's choice on the CPU,
    GGUF's own (the Triton kernel's) elsewhere."""
    return cpu_row_order(qweight.shape[0]) if qweight.blocks.device.type == "cpu" else 1


def quantize_model(model: nn.Module, quantization: str | None) -> nn.Module:
    """Replace every tensor-parallel linear of model by its quantized form (in place); each rank
    quantizes its own slice (`loader` checks that a row-parallel slice holds whole blocks)."""

    fmt = resolve_quantization(quantization)
    if fmt is None:
        return model
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, (ColumnParallelLinear, RowParallelLinear))]
    for name, module in targets:
        qweight = quantize(module.weight.data, quant_format(fmt))
        bias = getattr(module, "bias", None)
        quantized = QuantizedLinear(qweight, None if bias is None else bias.data,
                                    _reduce_shard(module))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quantized)
    return model


# Our fused linear -> the checkpoint weights stacked in it, in order (see loader._FUSED).
_FUSED_PARTS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def _reduce_shard(module: nn.Module) -> TPShard:
    return module.shard if isinstance(module, RowParallelLinear) else WHOLE


def use_file_blocks(model: nn.Module, tensors: Mapping) -> list[str]:
    """Run every linear whose checkpoint weights all have one of `FORMATS` on the file's blocks.

    tensors: Hugging Face name -> a GGUF tensor with `ggml_type`, `shape` (out, in) and `raw`
    (uint8 [out, bytes per row], the file's blocks). A linear whose parts differ in type, or
    have another type, keeps the dequantized weight it was loaded with. Under tensor
    parallelism each linear takes this rank's part of the blocks: its rows of each fused part
    (column-parallel) or its whole blocks of input columns (row-parallel, split on block
    boundaries: see loader). The LM head (the embedding when tied) computes its logits on the
    file's blocks too, its rows of this rank's vocabulary. Returns the names of the modules
    replaced or given file blocks.
    """
    replaced = _use_file_head(model, tensors)
    for layer in range(len(model.layers)):
        for ours, parts in _FUSED_PARTS.items():
            found = [tensors.get(f"model.layers.{layer}.{part}.weight") for part in parts]
            types = {t.ggml_type.name for t in found if t is not None}
            if None in found or len(types) != 1 or next(iter(types)) not in FORMATS:
                continue
            fmt = FORMATS[next(iter(types))]
            name = f"layers.{layer}.{ours}"
            module = model.get_submodule(name)
            if isinstance(module, RowParallelLinear):  # [out, this rank's blocks of columns]
                cols = module.cols
                first, end = cols.start // BLOCK, -(-(cols.start + cols.size) // BLOCK)
                raw = [t.raw[:, first * fmt.block_bytes:end * fmt.block_bytes] for t in found]
                shape = (found[0].shape[0], cols.size)
            else:  # [this rank's rows of each part, in]
                raw = [t.raw[r.start:r.start + r.size] for t, r in zip(found, module.ranges)]
                shape = (sum(r.size for r in module.ranges), found[0].shape[1])
            blocks = torch.from_numpy(np.ascontiguousarray(np.concatenate(raw)))
            bias = getattr(module, "bias", None)
            quantized = QuantizedLinear(QuantizedWeight(fmt, blocks, shape),
                                        None if bias is None else bias.data,
                                        _reduce_shard(module))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, quantized)
            replaced.append(name)
    return replaced


def _use_file_head(model: nn.Module, tensors: Mapping) -> list[str]:
    """Quantized LM head rows of the file -> the head's `file_head`; [] when not quantized."""
    tied = model.lm_head is None
    head = model.embed_tokens if tied else model.lm_head
    found = tensors.get("model.embed_tokens.weight" if tied else "lm_head.weight")
    if found is None or found.ggml_type.name not in FORMATS:
        return []
    fmt = FORMATS[found.ggml_type.name]
    rows = found.raw[head.vocab_start:head.vocab_start + head.shard_size]
    blocks = torch.zeros(head.shard_size, found.raw.shape[1], dtype=torch.uint8)  # [rows, bytes]
    blocks.numpy()[:len(rows)] = rows  # one copy from the file; padding rows stay zero
    head.file_head = QuantizedLinear(QuantizedWeight(fmt, blocks, (head.shard_size,
                                                                   found.shape[1])), None)
    return ["embed_tokens" if tied else "lm_head"]
