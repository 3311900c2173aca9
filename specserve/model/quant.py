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

`use_file_blocks` does the same for a GGUF checkpoint's own Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K
tensors: their blocks are the kernels' format, so they run as stored, with no re-quantization
(on the CPU their rows are regrouped once at load, the same bytes in the order the kernel
streams them: QuantizedLinear). A fused projection whose parts the file stores in different
types (a Q4_K_M file's q/k in Q4_K or Q5_0 beside a v in Q6_K or Q8_0) runs one product per
part on its own blocks, the outputs concatenated (`QuantizedParts`). A quantized LM
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


class QuantizedParts(nn.Module):
    """A column-parallel fused projection whose parts have different block formats: one
    QuantizedLinear per part, y = the parts' outputs concatenated ([..., sum of their N]).
    Each part's product is its kernel's alone, so the bits are those of the part run by
    itself (and a row's output still does not depend on the rows beside it)."""

    def __init__(self, parts: list[QuantizedLinear]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return "formats=" + "+".join(p.qweight.fmt.name for p in self.parts)


def _row_group(qweight: QuantizedWeight) -> int:
    """The row order the kernel on qweight's device reads: the C kernel's choice on the CPU,
    GGUF's own (the Triton kernel's) elsewhere."""
    return cpu_row_order(qweight.shape[0]) if qweight.blocks.device.type == "cpu" else 1


def draft_quantization(target: nn.Module, requested: str | None) -> str | None:
    """The quantization a draft loads with: `requested` (EngineConfig's, the target's unless
    asked otherwise; "none" keeps it unquantized), or "int8" when nothing was asked and the
    target runs on a GGUF's own quantized blocks. A draft forward reads its weights from memory
    each step, as the target's does, right after the target's forward has pushed them out of
    the cache; its Q8_0 blocks are half its bf16 bytes. The target verifies every drafted
    token, so this changes what the draft proposes, never the output."""
    if requested is not None:
        return requested
    runs_on_blocks = any(isinstance(m, (QuantizedLinear, QuantizedParts))
                         for m in target.modules())
    return "int8" if runs_on_blocks else None


def quantize_model(model: nn.Module, quantization: str | None, head: bool = False
                   ) -> nn.Module:
    """Replace every tensor-parallel linear of model by its quantized form (in place); each rank
    quantizes its own slice (`loader` checks that a row-parallel slice holds whole blocks).

    `head`: the LM head's logits are computed on blocks of the same format too (its rows of
    this rank's vocabulary, as a GGUF's quantized head is), for a draft: a target keeps its
    head in the checkpoint's dtype, since its logits decide every greedy token, but a draft's
    only propose tokens, and its head is the largest tensor a draft step reads."""

    fmt = resolve_quantization(quantization)
    if fmt is None:
        return model
    if head:
        lm_head = model.embed_tokens if model.lm_head is None else model.lm_head
        lm_head.file_head = QuantizedLinear(quantize(lm_head.weight.data, quant_format(fmt)),
                                            None)
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
    (uint8 [out, bytes per row], the file's blocks). A fused linear whose parts differ in type
    runs one product per part (QuantizedParts); a linear with a part of another type keeps the
    dequantized weight it was loaded with. Under tensor parallelism each linear takes this
    rank's part of the blocks: its rows of each fused part (column-parallel) or its whole
    blocks of input columns (row-parallel, split on block boundaries: see loader; a k-quant
    whose 256-weight super-blocks the split would cut keeps the dequantized weight). The LM
    head (the embedding when tied) computes its logits on the file's blocks too, its rows of
    this rank's vocabulary. Returns the names of the modules replaced or given file blocks.
    """
    replaced = _use_file_head(model, tensors)
    for layer in range(len(model.layers)):
        for ours, parts in _FUSED_PARTS.items():
            found = [tensors.get(f"model.layers.{layer}.{part}.weight") for part in parts]
            if None in found or any(t.ggml_type.name not in FORMATS for t in found):
                continue
            name = f"layers.{layer}.{ours}"
            module = model.get_submodule(name)
            quantized = _file_linear(module, found)
            if quantized is None:
                continue
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, quantized)
            replaced.append(name)
    return replaced


def _file_linear(module: nn.Module, found: list) -> nn.Module | None:
    """The quantized form of one linear from its checkpoint parts' file blocks (this rank's
    share), or None where the blocks cannot be split as tensor parallelism splits it."""
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.data
    if isinstance(module, RowParallelLinear):  # one part: [out, this rank's blocks of columns]
        (tensor,) = found
        fmt, cols = FORMATS[tensor.ggml_type.name], module.cols
        width = fmt.block_weights
        if fmt.is_k_quant and (cols.start % width or cols.size % width):
            return None
        first, end = cols.start // width, -(-(cols.start + cols.size) // width)
        raw = tensor.raw[:, first * fmt.block_bytes:end * fmt.block_bytes]
        blocks = torch.from_numpy(np.array(raw))  # a copy, off the file's read-only map
        return QuantizedLinear(QuantizedWeight(fmt, blocks, (tensor.shape[0], cols.size)), bias,
                               _reduce_shard(module))
    # Column-parallel: [this rank's rows of each part, in]; parts of one format are one weight.
    rows = [t.raw[r.start:r.start + r.size] for t, r in zip(found, module.ranges)]
    sizes = [r.size for r in module.ranges]
    formats = [FORMATS[t.ggml_type.name] for t in found]
    runs = []  # (format, [first part, end part)): consecutive parts of one format
    for i, fmt in enumerate(formats):
        if runs and runs[-1][0] == fmt:
            runs[-1][2] = i + 1
        else:
            runs.append([fmt, i, i + 1])
    linears, row = [], 0
    for fmt, start, end in runs:
        n = sum(sizes[start:end])
        blocks = torch.from_numpy(np.ascontiguousarray(np.concatenate(rows[start:end])))
        part_bias = None if bias is None else bias[row:row + n]
        linears.append(QuantizedLinear(QuantizedWeight(fmt, blocks, (n, found[0].shape[1])),
                                       part_bias, _reduce_shard(module)))
        row += n
    return linears[0] if len(linears) == 1 else QuantizedParts(linears)


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
