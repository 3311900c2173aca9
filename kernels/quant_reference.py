"""Weight-only quantized formats (GGUF's Q8_0, Q4_0, Q4_1) and their PyTorch reference.

A quantized weight [N, K] is stored as GGUF stores it: per output row, ceil(K / 32) blocks of 32
weights, each block a few bytes of fp16 scale (and min) followed by the quantized values, so a
`.gguf` file's rows are used as they are and quantizing at load is the gguf package's own
quantizer (bit-exact with llama.cpp's). K is padded with zeros to whole blocks.

The reference product dequantizes to fp32 (exactly: see the block formats in cpu_quant.c) and
runs an fp32 matmul; the C and Triton kernels differ from it only in the order of the fp32 sums.
It is also the fallback wherever no kernel applies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 32  # weights per block, every format


@dataclass(frozen=True)
class QuantFormat:
    name: str  # GGUF's name of the type
    code: int  # the format number the kernels take
    block_bytes: int
    header_bytes: int  # fp16 scale (+ fp16 min) before the values


FORMATS = {f.name: f for f in (QuantFormat("Q8_0", 0, 34, 2), QuantFormat("Q4_0", 1, 18, 2),
                               QuantFormat("Q4_1", 2, 20, 4))}


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight in one of `FORMATS`; blocks: [N, ceil(K / 32) * block_bytes] uint8."""

    fmt: QuantFormat
    blocks: torch.Tensor
    shape: tuple[int, int]  # (N, K), the logical shape

    def __post_init__(self) -> None:
        n, k = self.shape
        want = (n, -(-k // BLOCK) * self.fmt.block_bytes)
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != want:
            raise ValueError(f"{self.fmt.name} blocks of a {n}x{k} weight must be uint8 {want}, "
                             f"got {self.blocks.dtype} {tuple(self.blocks.shape)}")

    def to(self, device: str | torch.device) -> QuantizedWeight:
        return QuantizedWeight(self.fmt, self.blocks.to(device), self.shape)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


def quant_format(name: str) -> QuantFormat:
    fmt = FORMATS.get(name.upper())
    if fmt is None:
        raise ValueError(f"unsupported quantized format {name!r}; supported: {', '.join(FORMATS)}")
    return fmt


def quantize(weight: torch.Tensor, fmt: str | QuantFormat) -> QuantizedWeight:
    """weight [N, K] (any float dtype) -> its blocks, by the gguf package's quantizer."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    fmt = quant_format(fmt) if isinstance(fmt, str) else fmt
    n, k = weight.shape
    padded = F.pad(weight.detach().float().cpu(), (0, -k % BLOCK))  # [N, Kp]
    blocks = gguf_quantize(padded.numpy(), GGMLQuantizationType[fmt.name])
    return QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(blocks)), (n, k))


def dequantize(qweight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> [N, K] in dtype (computed in fp32, where every format's weights are exact)."""
    fmt, (n, k) = qweight.fmt, qweight.shape
    blocks = qweight.blocks.view(n, -1, fmt.block_bytes)  # [N, nb, bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    values = blocks[..., fmt.header_bytes:]
    if fmt.name == "Q8_0":
        w = values.contiguous().view(torch.int8).float() * d  # [N, nb, 32]
    else:
        q = torch.cat([values & 0x0F, values >> 4], dim=-1).float()  # [N, nb, 32]
        if fmt.name == "Q4_0":
            w = (q - 8) * d
        else:
            m = blocks[..., 2:4].contiguous().view(torch.float16).float()  # [N, nb, 1]
            w = q * d + m
    return w.reshape(n, -1)[:, :k].to(dtype)


def quant_linear_reference(x: torch.Tensor, qweight: QuantizedWeight,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(qweight).T (+ bias) in fp32 -> [..., N] in x's dtype."""
    w = dequantize(qweight.to(x.device))  # [N, K]
    out = F.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)
