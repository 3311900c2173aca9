"""Weight-only quantized formats (GGUF's Q8_0, Q4_0, Q4_1) and their PyTorch reference.

A quantized weight [N, K] is stored as GGUF stores it: per output row, ceil(K / 32) blocks of 32
weights, each block a few bytes of fp16 scale (and min) followed by the quantized values, so a
`.gguf` file's rows are used as they are and quantizing at load is the gguf package's own
quantizer (bit-exact with llama.cpp's). K is padded with zeros to whole blocks. The same blocks
may be stored with the rows grouped (`row_group`, the CPU kernel's faster order: cpu_quant.c's
header); `block_rows` reads either order.

The reference product dequantizes to fp32 (exactly: see the block formats in cpu_quant.c) and
runs an fp32 matmul; the Triton kernel and the C kernel with fp32 activations differ from it only
in the order of the fp32 sums. It is also the fallback wherever no kernel applies.

`quant_linear_int_reference` models the C kernel with integer activations (cpu_quant.c's header
defines the numerics: activations quantized to int8 or int16 blocks, integer dot products, then a
fixed sequence of fp32 operations per block), operation for operation, so it gives the kernel's
bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 32  # weights per block, every format
ROW_GROUP = 4  # cpu_quant.c's ROW_GROUP: rows per group in the grouped order
TILE_ROWS = 16  # cpu_quant.c's TILE_ROWS: rows per group in the tiled order
ROW_ORDERS = (1, ROW_GROUP, TILE_ROWS)


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
    """A [N, K] weight in one of `FORMATS`; blocks: [N, ceil(K / 32) * block_bytes] uint8.

    row_group 1: row n's blocks are blocks[n] (GGUF's order). ROW_GROUP: each group of
    ROW_GROUP consecutive rows (the last may hold fewer) is stored block by block, the group's
    rows' block 0, then their block 1, ...: the same bytes, in the order the CPU kernel reads
    them as one stream. TILE_ROWS (N a multiple of it; the integer-activation kernel only):
    groups of TILE_ROWS rows block by block, and each block of a group interleaved by 16-bit
    words, the rows' first words, then their second, ... (word t of row r at t * TILE_ROWS + r),
    so that one load holds the same two weights of every row of the group (cpu_quant.c)."""

    fmt: QuantFormat
    blocks: torch.Tensor
    shape: tuple[int, int]  # (N, K), the logical shape
    row_group: int = 1

    def __post_init__(self) -> None:
        n, k = self.shape
        want = (n, -(-k // BLOCK) * self.fmt.block_bytes)
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != want:
            raise ValueError(f"{self.fmt.name} blocks of a {n}x{k} weight must be uint8 {want}, "
                             f"got {self.blocks.dtype} {tuple(self.blocks.shape)}")
        if self.row_group not in ROW_ORDERS:
            raise ValueError(f"row_group must be one of {ROW_ORDERS}, got {self.row_group}")
        if self.row_group == TILE_ROWS:
            _check_tileable(n)

    def to(self, device: str | torch.device) -> QuantizedWeight:
        return QuantizedWeight(self.fmt, self.blocks.to(device), self.shape, self.row_group)

    def block_rows(self) -> torch.Tensor:
        """-> [N, nb, block_bytes] uint8, row n's blocks in k order (a view when row_group is 1)."""
        n = self.shape[0]
        if self.row_group == 1:
            return self.blocks.view(n, -1, self.fmt.block_bytes)
        g, bb = self.row_group, self.fmt.block_bytes
        nb = self.blocks.shape[1] // bb
        if g == TILE_ROWS:  # [groups, nb, words, rows] of int16 -> [groups, rows, nb, words]
            words = self.blocks.view(torch.int16).view(n // g, nb, bb // 2, g)
            return words.permute(0, 3, 1, 2).reshape(n, nb, bb // 2).view(torch.uint8) \
                .view(n, nb, bb)
        full, flat = n // g * g, self.blocks.view(-1)
        grouped = flat[:full * nb * bb].view(full // g, nb, g, bb)  # [groups, nb, g, bytes]
        tail = flat[full * nb * bb:].view(nb, n - full, bb)  # the last group's [nb, rows, bytes]
        return torch.cat([grouped.transpose(1, 2).reshape(full, nb, bb), tail.transpose(0, 1)])

    def with_row_group(self, row_group: int) -> QuantizedWeight:
        """The same weight stored in row_group's order (self when it already is)."""
        if row_group == self.row_group:
            return self
        rows = self.block_rows()  # [N, nb, bytes]
        if row_group == TILE_ROWS:
            _check_tileable(self.shape[0])
            n, nb, bb = rows.shape
            words = rows.contiguous().view(torch.int16).view(n // row_group, row_group, nb,
                                                             bb // 2)  # [groups, rows, nb, words]
            rows = words.permute(0, 2, 3, 1).contiguous().view(torch.uint8)
        elif row_group != 1:
            n = self.shape[0]
            full = n // row_group * row_group
            grouped = rows[:full].view(full // row_group, row_group, *rows.shape[1:])
            rows = torch.cat([grouped.transpose(1, 2).reshape(-1),
                              rows[full:].transpose(0, 1).reshape(-1)])
        return QuantizedWeight(self.fmt, rows.reshape(self.blocks.shape).contiguous(),
                               self.shape, row_group)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()


def _check_tileable(n: int) -> None:
    if n % TILE_ROWS:
        raise ValueError(f"row_group {TILE_ROWS} needs a multiple of {TILE_ROWS} rows, got {n}")


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
    blocks = qweight.block_rows()  # [N, nb, bytes]
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


def block_integers(qweight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (q int32 [N, nb, 32], d fp32 [N, nb], m fp32 [N, nb]) with w = q * d + m exactly:
    q signed for Q8_0, q - 8 for Q4_0 (m 0), the unsigned nibble for Q4_1."""
    fmt = qweight.fmt
    blocks = qweight.block_rows()  # [N, nb, bytes]
    d = blocks[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # [N, nb]
    m = torch.zeros_like(d)
    values = blocks[..., fmt.header_bytes:]
    if fmt.name == "Q8_0":
        q = values.contiguous().view(torch.int8).int()  # [N, nb, 32]
    else:
        q = torch.cat([values & 0x0F, values >> 4], dim=-1).int()  # [N, nb, 32]
        if fmt.name == "Q4_0":
            q = q - 8
        else:
            m = blocks[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
    return q, d, m


# Integer activation formats: name -> (levels a block's largest magnitude maps to, dtype).
ACTIVATION_INTS = {"q8": (127, torch.int8), "q16": (32767, torch.int16)}


def quantize_activations(x: torch.Tensor, act: str = "q8"
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> its integer blocks (`act`: "q8" or "q16") as the kernel makes them, K
    zero-padded to whole blocks: (q int8/int16 [M, nb, 32], d fp32 [M, nb], sum of q int32
    [M, nb]); x ~ q * d."""
    levels, dtype = ACTIVATION_INTS[act]
    rows, k = x.shape
    xb = F.pad(x.float(), (0, -k % BLOCK)).view(rows, -1, BLOCK)  # [M, nb, 32]
    d = xb.abs().amax(-1) / levels  # [M, nb], one fp32 division
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).to(dtype)  # half to even, as lrintf
    return q, d, q.sum(-1, dtype=torch.int32)


def quant_linear_int_reference(x: torch.Tensor, qweight: QuantizedWeight,
                               bias: torch.Tensor | None = None, act: str = "q8"
                               ) -> torch.Tensor:
    """The integer-activation kernel's numerics (`act`: "q8" or "q16"): x [..., K] -> [..., N]
    in x's dtype."""
    n, k = qweight.shape
    lead = x.shape[:-1]
    xq, dx, sx = quantize_activations(x.reshape(-1, k).cpu(), act)  # [M, nb, 32], [M, nb] x2
    wq, dw, mw = block_integers(qweight.to("cpu"))  # [N, nb, 32], [N, nb], [N, nb]
    # Integer dot products per block pair, exact in float64 (|isum| < 2^28).
    isum = torch.einsum("mbk,nbk->mnb", xq.double(), wq.double()).float()  # [M, N, nb]
    v = (dw[None] * dx[:, None]) * isum  # [M, N, nb]
    if qweight.fmt.name == "Q4_1":
        v = v + mw[None] * (dx * sx.float())[:, None]
    acc = torch.zeros(v.shape[:2])  # [M, N], summed over blocks in k order
    for b in range(v.shape[-1]):
        acc = acc + v[..., b]
    if bias is not None:
        acc = acc + bias.float().cpu()
    return acc.reshape(*lead, n).to(device=x.device, dtype=x.dtype)
