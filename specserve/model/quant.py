"""Weight-only quantization of a loaded decoder: `quantize_model(model, "int8" | "int4")`.

Every projection (q/k/v, o, gate/up, down) becomes a `QuantizedLinear` whose weight is stored in
GGUF blocks of 32 (int8 = Q8_0: an fp16 scale per block; int4 = Q4_1: an fp16 scale and min per
block), quantized by the gguf package's own quantizer, and multiplied by the kernels of
`specserve.kernels.quant` (activations stay in the model's dtype, sums in fp32). The embedding,
the LM head (tied or not) and the norms stay in the checkpoint's dtype: the embedding is a row
lookup, not a matmul, and the LM head's logits decide every greedy token.

The GGUF names (`q8_0`, `q4_0`, `q4_1`) are accepted too, for one exact format.
"""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import all_reduce_sum
from ..kernels.quant import quant_linear
from ..kernels.quant_reference import QuantizedWeight, quant_format, quantize

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
    """y = x dequantize(W)^T + b with W in GGUF blocks; `reduce` sums a row-parallel layer's
    partial products across tensor-parallel ranks."""

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None,
                 reduce: bool = False) -> None:
        super().__init__()
        self.register_buffer("blocks", qweight.blocks)  # [N, row_bytes] uint8
        self.register_buffer("bias", bias)
        self.qweight = qweight
        self.reduce = reduce

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)  # moves the blocks buffer: keep qweight pointing at it
        self.qweight = QuantizedWeight(self.qweight.fmt, self.blocks, self.qweight.shape)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = quant_linear(x, self.qweight, self.bias)
        return all_reduce_sum(out) if self.reduce else out

    def extra_repr(self) -> str:
        n, k = self.qweight.shape
        return f"in_features={k}, out_features={n}, format={self.qweight.fmt.name}"


def quantize_model(model: nn.Module, quantization: str | None) -> nn.Module:
    """Replace every tensor-parallel linear of model by its quantized form (in place)."""
    from .layers import ColumnParallelLinear, RowParallelLinear

    fmt = resolve_quantization(quantization)
    if fmt is None:
        return model
    targets = [(name, module) for name, module in model.named_modules()
               if isinstance(module, (ColumnParallelLinear, RowParallelLinear))]
    for name, module in targets:
        qweight = quantize(module.weight.data, quant_format(fmt))
        bias = getattr(module, "bias", None)
        quantized = QuantizedLinear(qweight, None if bias is None else bias.data,
                                    reduce=isinstance(module, RowParallelLinear))
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, quantized)
    return model
