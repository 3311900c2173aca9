"""Weight-only quantized formats (GGUF's Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) and their PyTorch
reference.

A quantized weight [N, K] is stored as GGUF stores it: per output row, ceil(K / B) blocks of B
weights (`QuantFormat.block_weights`), so a `.gguf` file's rows are used as they are.
  Q8_0, Q4_0, Q4_1   B = 32: a few bytes of fp16 scale (and min), then the quantized values.
                     Quantizing at load is the gguf package's own quantizer (bit-exact with
                     llama.cpp's); K is padded with zeros to whole blocks.
  Q4_K, Q6_K         B = 256, "super-blocks" of sub-blocks with their own integer scales
                     (layouts below, as ggml-common.h defines them). K must be a multiple of 256
                     (GGUF files guarantee it). `quantize` has a simple quantizer of its own for
                     tests and benchmarks (the gguf package has none; llama.cpp's searches
                     harder for the scales): these formats come from files.
The same blocks may be stored with the rows grouped (`row_group`, the CPU kernel's faster order:
cpu_quant.c's header); `block_rows` reads either order.

Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8] (packed:
`_q4_k_scales`), 128 bytes of nibbles: bytes 32c .. 32c + 31 hold sub-block 2c's 32 weights in
their low nibbles and sub-block 2c + 1's in their high nibbles. Weight i of sub-block j:
  w = (d sc[j]) q - (dmin m[j])      (d sc[j] and dmin m[j] exact in fp32, one rounding in the -)
Q6_K, 210 bytes: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), int8 scales sc[16] (one per
16 weights), fp16 d. Weight i = 128 h + 32 s + l (h < 2, s < 4, l < 32): low bits from nibble
s // 2 of ql[64 h + 32 (s % 2) + l], high bits from bits 2s, 2s + 1 of qh[32 h + l]:
  w = (d sc[i // 16]) (q - 32)      (exact in fp32)

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

BLOCK = 32  # weights per block of Q8_0 / Q4_0 / Q4_1, per activation block and per k-quant
#              sub-block (Q6_K's scales cover halves of one)
QK_K = 256  # weights per k-quant super-block
ROW_GROUP = 4  # cpu_quant.c's ROW_GROUP: rows per group in the grouped order
TILE_ROWS = 16  # cpu_quant.c's TILE_ROWS: rows per group in the tiled order
ROW_ORDERS = (1, ROW_GROUP, TILE_ROWS)


@dataclass(frozen=True)
class QuantFormat:
    name: str  # GGUF's name of the type
    code: int  # the format number the kernels take
    block_bytes: int
    header_bytes: int  # fp16 scale (+ fp16 min) before the values; 0 for the k-quants
    block_weights: int = BLOCK

    @property
    def is_k_quant(self) -> bool:
        return self.block_weights == QK_K


FORMATS = {f.name: f for f in (QuantFormat("Q8_0", 0, 34, 2), QuantFormat("Q4_0", 1, 18, 2),
                               QuantFormat("Q4_1", 2, 20, 4), QuantFormat("Q4_K", 3, 144, 0, QK_K),
                               QuantFormat("Q6_K", 4, 210, 0, QK_K))}


@dataclass(frozen=True)
class QuantizedWeight:
    """A [N, K] weight in one of `FORMATS`; blocks: [N, ceil(K / B) * block_bytes] uint8 (B the
    format's block_weights; a k-quant's K a multiple of 256).

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
        if self.fmt.is_k_quant and k % QK_K:
            raise ValueError(f"{self.fmt.name} needs K a multiple of {QK_K} (whole super-blocks), "
                             f"got {n}x{k}")
        want = (n, -(-k // self.fmt.block_weights) * self.fmt.block_bytes)
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
    """weight [N, K] (any float dtype) -> its blocks: by the gguf package's quantizer for the
    32-weight formats, by `_quantize_k` (simple, not llama.cpp's) for the k-quants."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    fmt = quant_format(fmt) if isinstance(fmt, str) else fmt
    n, k = weight.shape
    if fmt.is_k_quant:
        if k % QK_K:
            raise ValueError(f"{fmt.name} needs K a multiple of {QK_K}, got {n}x{k}")
        blocks = _quantize_k(weight.detach().float().cpu().numpy(), fmt.name)
    else:
        padded = F.pad(weight.detach().float().cpu(), (0, -k % BLOCK))  # [N, Kp]
        blocks = gguf_quantize(padded.numpy(), GGMLQuantizationType[fmt.name])
    return QuantizedWeight(fmt, torch.from_numpy(np.ascontiguousarray(blocks)), (n, k))


def _quantize_k(w: np.ndarray, name: str) -> np.ndarray:
    """w float32 [N, K] (K % 256 == 0) -> Q4_K or Q6_K blocks uint8 [N, K / 256 * bytes]: each
    sub-block's range (Q4_K) or largest magnitude (Q6_K) sets its scale, the scales are
    quantized against the super-block's largest, then each weight rounds to its nearest level."""
    n = w.shape[0]
    if name == "Q4_K":
        x = w.reshape(-1, 8, 32)  # [S, sub-block, weight]
        low = np.minimum(x.min(-1), 0)  # [S, 8]
        scale = (x.max(-1) - low) / 15  # [S, 8]
        d = (scale.max(-1) / 63).astype(np.float16)  # [S]
        dmin = (-low.min(-1) / 63).astype(np.float16)  # [S]
        sc = _safe_round(scale, d.astype(np.float32)[:, None], 63)  # [S, 8]
        m = _safe_round(-low, dmin.astype(np.float32)[:, None], 63)  # [S, 8]
        big, small = d.astype(np.float32)[:, None] * sc, dmin.astype(np.float32)[:, None] * m
        q = _safe_round(x + small[..., None], big[..., None], 15).astype(np.uint8)  # [S, 8, 32]
        out = np.empty((x.shape[0], 144), dtype=np.uint8)
        out[:, 0:2] = d[:, None].view(np.uint8)
        out[:, 2:4] = dmin[:, None].view(np.uint8)
        out[:, 4:16] = _q4_k_scales(sc.astype(np.uint8), m.astype(np.uint8))
        out[:, 16:] = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
        return out.reshape(n, -1)
    x = w.reshape(-1, 16, 16)  # [S, sub-block, weight]
    scale = np.abs(x).max(-1) / 31  # [S, 16]
    d = (scale.max(-1) / 127).astype(np.float16)  # [S]
    sc = _safe_round(scale, d.astype(np.float32)[:, None], 127)  # [S, 16]
    step = d.astype(np.float32)[:, None] * sc  # [S, 16]
    q = np.clip(np.rint(np.divide(x, step[..., None], out=np.zeros_like(x),
                                  where=step[..., None] != 0)), -32, 31)
    return pack_q6_k(q.astype(np.int8).reshape(-1, 256), sc.astype(np.int8), d).reshape(n, -1)


def pack_q6_k(q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q6_K super-blocks [S, 210] uint8 from q - 32 int8 [S, 256] (in [-32, 31]), the int8
    scales sc [S, 16] and d float16 [S] (w = d sc[i / 16] q[i])."""
    q = (q.astype(np.int16) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [S, h, s, l]
    out = np.empty((q.shape[0], 210), dtype=np.uint8)
    out[:, :128] = (q[:, :, 0:2] & 15 | (q[:, :, 2:4] & 15) << 4).reshape(-1, 128)
    high = q >> 4  # [S, h, s, l]
    out[:, 128:192] = (high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4
                       | high[:, :, 3] << 6).reshape(-1, 64)
    out[:, 192:208] = sc.view(np.uint8)
    out[:, 208:210] = d.astype(np.float16)[:, None].view(np.uint8)
    return out


def _safe_round(x: np.ndarray, step: np.ndarray, top: int) -> np.ndarray:
    """round(x / step) clipped to [0, top]; 0 where step is 0."""
    ratio = np.divide(x, step, out=np.zeros(np.broadcast_shapes(x.shape, step.shape), np.float32),
                      where=step != 0)
    return np.clip(np.rint(ratio), 0, top)


def _q4_k_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit sc, m uint8 [S, 8] -> Q4_K's 12 packed bytes [S, 12]: bytes 0..3 sc[0..3] and
    4..7 m[0..3] in their low 6 bits, sc[4..7] and m[4..7] split into low nibbles (bytes 8..11,
    sc low, m high) and top two bits (the top bits of bytes 0..3 and 4..7)."""
    out = np.empty((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | (sc[:, 4:] >> 4) << 6
    out[:, 4:8] = m[:, :4] | (m[:, 4:] >> 4) << 6
    out[:, 8:12] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    return out


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 bytes [..., 2] uint8 -> fp32 [..., 1]."""
    return b.contiguous().view(torch.float16).float()


def _q4_k_scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks [..., 144] uint8 -> (sc, m) int32 [..., 8], the 6-bit scales and mins."""
    b = blocks[..., 4:16].int()  # [..., 12]
    sc = torch.cat([b[..., 0:4] & 63, (b[..., 8:12] & 15) | (b[..., 0:4] >> 6) << 4], dim=-1)
    m = torch.cat([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | (b[..., 4:8] >> 6) << 4], dim=-1)
    return sc, m


def _k_integers(fmt: QuantFormat, blocks: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Super-blocks [N, S, bytes] -> (q int32 [N, S * 8, 32], d fp32 [N, S * 8, 2], m fp32
    [N, S * 8]) per 32-weight sub-block: w = q * d[half] + m exactly (see block_integers)."""
    n, s = blocks.shape[:2]
    if fmt.name == "Q4_K":
        sc, mins = _q4_k_scales_mins(blocks)  # [N, S, 8] each
        big = _fp16(blocks[..., 0:2]) * sc.float()  # [N, S, 8]: d sc, exact
        small = _fp16(blocks[..., 2:4]) * mins.float()  # [N, S, 8]: dmin m, exact
        qs = blocks[..., 16:].reshape(n, s, 4, 1, 32).int()  # [N, S, chunk, 1, byte]
        q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, s * 8, 32)  # [N, S * 8, 32]
        d = big.reshape(n, s * 8, 1).expand(n, s * 8, 2)
        return q, d, -small.reshape(n, s * 8)
    ql = blocks[..., :128].reshape(n, s, 2, 2, 32).int()  # [N, S, h, s % 2, l]
    qh = blocks[..., 128:192].reshape(n, s, 2, 1, 32).int()  # [N, S, h, 1, l]
    low = torch.cat([ql & 15, ql >> 4], dim=3)  # [N, S, h, s, l]
    high = (qh >> torch.arange(0, 8, 2).view(4, 1)) & 3  # [N, S, h, s, l]
    q = (low | high << 4).reshape(n, s * 8, 32) - 32  # [N, S * 8, 32] in [-32, 31]
    scales = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, S, 16]
    d = (_fp16(blocks[..., 208:210]) * scales).reshape(n, s * 8, 2)  # d sc, exact
    return q, d, torch.zeros(n, s * 8)


def block_integers(qweight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> per 32-weight block (a k-quant's sub-block), k padded to whole blocks: (q int32
    [N, nb, 32], d fp32 [N, nb, 2] (the scale of each half of the block), m fp32 [N, nb]) with
    w = q * d + m exactly: q signed for Q8_0, q - 8 for Q4_0 (m 0), the unsigned nibble for
    Q4_1 and Q4_K (Q4_K: d = d sc, m = -(dmin m)), q - 32 for Q6_K (d = d sc per half, m 0)."""
    fmt = qweight.fmt
    blocks = qweight.block_rows()  # [N, nb, bytes]
    if fmt.is_k_quant:
        return _k_integers(fmt, blocks)
    d = _fp16(blocks[..., 0:2])[..., 0]  # [N, nb]
    m = torch.zeros_like(d)
    values = blocks[..., fmt.header_bytes:]
    if fmt.name == "Q8_0":
        q = values.contiguous().view(torch.int8).int()  # [N, nb, 32]
    else:
        q = torch.cat([values & 0x0F, values >> 4], dim=-1).int()  # [N, nb, 32]
        if fmt.name == "Q4_0":
            q = q - 8
        else:
            m = _fp16(blocks[..., 2:4])[..., 0]
    return q, d[..., None].expand(*d.shape, 2), m


def dequantize(qweight: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> [N, K] in dtype (computed in fp32, where every format's weights are exact: each is
    q * d exactly, plus m rounded once, as gguf.quants.dequantize computes them)."""
    n, k = qweight.shape
    q, d, m = block_integers(qweight)  # [N, nb, 32], [N, nb, 2], [N, nb]
    w = q.float().view(*q.shape[:2], 2, 16) * d[..., None]  # [N, nb, 2, 16]
    w = w.view(q.shape) + m[..., None]  # [N, nb, 32]
    return w.reshape(n, -1)[:, :k].to(dtype)


def quant_linear_reference(x: torch.Tensor, qweight: QuantizedWeight,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(qweight).T (+ bias) in fp32 -> [..., N] in x's dtype."""
    w = dequantize(qweight.to(x.device))  # [N, K]
    out = F.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)


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
    wq, dw, mw = block_integers(qweight.to("cpu"))  # [N, nb, 32], [N, nb, 2], [N, nb]
    rows, nb = dx.shape
    # Integer dot products per half block pair, exact in float64.
    halves = torch.einsum("mbhk,nbhk->mnbh", xq.double().view(rows, nb, 2, 16),
                          wq.double().view(n, nb, 2, 16))  # [M, N, nb, 2]
    if qweight.fmt.name == "Q6_K":
        # One scale per half: each half's isum is exact in fp32 (|isum| <= 16 * 32 * 32767 <
        # 2^24), then v = (da * isum_a + db * isum_b) * dx.
        isum = halves.float()  # [M, N, nb, 2]
        v = (dw[None, ..., 0] * isum[..., 0] + dw[None, ..., 1] * isum[..., 1]) * dx[:, None]
    else:
        isum = halves.sum(-1).float()  # [M, N, nb]: exact in int32 (|isum| < 2^28)
        v = (dw[None, ..., 0] * dx[:, None]) * isum  # [M, N, nb]
        if qweight.fmt.name in ("Q4_1", "Q4_K"):
            v = v + mw[None] * (dx * sx.float())[:, None]
    acc = torch.zeros(v.shape[:2])  # [M, N], summed over blocks in k order
    for b in range(v.shape[-1]):
        acc = acc + v[..., b]
    if bias is not None:
        acc = acc + bias.float().cpu()
    return acc.reshape(*lead, n).to(device=x.device, dtype=x.dtype)
