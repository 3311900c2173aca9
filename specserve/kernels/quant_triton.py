"""Weight-only quantized matmul on CUDA (Triton): y = x @ dequantize(w).T (+ bias).

w stays in GGUF's block layout (quant_reference.py): each program loads a [BLOCK_N, 32] tile of
one block column (for Q4_K / Q6_K, one 32-weight sub-block of a 256-weight super-block),
decodes its scales from the block's bytes (fp16 scale and min; a k-quant's fp16 super-block
scale times its sub-block's integer scale), dequantizes in registers (every weight exact, as the
reference's) and multiplies it into a [BLOCK_M, BLOCK_N] fp32 accumulator with `tl.dot` in full
fp32 precision.
Decode steps have few rows, so every row shares one read of the weights. Reference:
`quant_linear_reference`; tested under TRITON_INTERPRET=1 and compiled for sm_90 ahead of time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant_reference import QuantizedWeight
from .triton_utils import check_launchable, kernel


@triton.jit
def _fp16_at(ptr):
    """The little-endian fp16 at byte pointer(s) ptr, as fp32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@kernel
def _quant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr,
    M, N, K, stride_xm, stride_ym, row_bytes,
    FMT: tl.constexpr,  # 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 Q4_K, 4 Q6_K
    BLOCK_BYTES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    j = tl.arange(0, 32)  # position inside a block
    m_ok = offs_m < M
    n_ok = offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[:, None] * row_bytes  # [BLOCK_N, 1] byte pointers
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for blk in range(0, tl.cdiv(K, 32)):
        nb_ok = n_ok[:, None]
        if FMT >= 3:
            w = _k_quant_block(rows + (blk // 8) * BLOCK_BYTES, blk % 8, j, nb_ok, FMT)
        else:
            w = _block(rows + blk * BLOCK_BYTES, j, nb_ok, FMT)
        k = blk * 32 + j  # [32]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                    mask=m_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _block(block, j, nb_ok, FMT: tl.constexpr):
    """Block pointers [BLOCK_N, 1] of Q8_0 / Q4_0 / Q4_1 -> their weights [BLOCK_N, 32] fp32."""
    d = tl.where(nb_ok, _fp16_at(block), 0.0)  # [BLOCK_N, 1]
    if FMT == 0:
        q = tl.load(block + 2 + j[None, :], mask=nb_ok, other=0)  # [BLOCK_N, 32] uint8
        w = q.to(tl.int8, bitcast=True).to(tl.float32) * d
    else:
        # Weights 0..15: low nibbles of the 16 value bytes; 16..31: their high nibbles.
        header = 2 if FMT == 1 else 4
        byte = tl.load(block + header + (j % 16)[None, :], mask=nb_ok, other=0)
        q = tl.where(j[None, :] < 16, byte & 15, byte >> 4).to(tl.float32)
        if FMT == 1:
            w = (q - 8.0) * d
        else:
            w = q * d + tl.where(nb_ok, _fp16_at(block + 2), 0.0)
    return w


@triton.jit
def _k_quant_block(sb, sub, j, nb_ok, FMT: tl.constexpr):
    """Super-block pointers [BLOCK_N, 1] of Q4_K / Q6_K and a sub-block index (< 8) -> the
    sub-block's 32 weights [BLOCK_N, 32] fp32 (layouts: quant_reference.py)."""
    if FMT == 3:
        # Q4_K: 6-bit scale and min of sub-block `sub` from the 12 packed bytes at sb + 4:
        # sub < 4 the low 6 bits of bytes sub and sub + 4; sub >= 4 the nibbles of byte
        # sub + 4 and the top two bits of bytes sub - 4 and sub. The choice is made on scalars
        # (offsets, shifts, masks), so each is one expression over the rows.
        first = sub < 4
        low_mask = tl.where(first, 63, 15)
        top_mask = tl.where(first, 0, 0x30)
        s_low = tl.load(sb + 4 + tl.where(first, sub, sub + 4), mask=nb_ok, other=0).to(tl.int32)
        s_top = tl.load(sb + 4 + tl.where(first, sub, sub - 4), mask=nb_ok, other=0).to(tl.int32)
        m_low = tl.load(sb + 8 + sub, mask=nb_ok, other=0).to(tl.int32)  # byte sub + 4
        m_top = tl.load(sb + 4 + sub, mask=nb_ok, other=0).to(tl.int32)  # byte sub
        sc = (s_low & low_mask) | (((s_top >> 6) << 4) & top_mask)  # [BLOCK_N, 1]
        mn = ((m_low >> tl.where(first, 0, 4)) & low_mask) | (((m_top >> 6) << 4) & top_mask)
        scale = tl.where(nb_ok, _fp16_at(sb), 0.0) * sc.to(tl.float32)  # [BLOCK_N, 1], exact
        offset = tl.where(nb_ok, _fp16_at(sb + 2), 0.0) * mn.to(tl.float32)  # exact
        byte = tl.load(sb + 16 + 32 * (sub // 2) + j[None, :], mask=nb_ok, other=0)
        q = ((byte >> (4 * (sub % 2))) & 15).to(tl.float32)  # [BLOCK_N, 32]
        w = scale * q - offset
    else:
        # Q6_K: weight 32 sub + j = 128 h + 32 s + j; one int8 scale per 16 weights.
        h = sub // 4
        s = sub % 4
        low = tl.load(sb + 64 * h + 32 * (s % 2) + j[None, :], mask=nb_ok, other=0)
        high = tl.load(sb + 128 + 32 * h + j[None, :], mask=nb_ok, other=0)
        q = (((low >> (4 * (s // 2))) & 15) | (((high >> (2 * s)) & 3) << 4)).to(tl.int32) - 32
        sc = tl.load(sb + 192 + 2 * sub + j[None, :] // 16, mask=nb_ok, other=0)
        d = tl.where(nb_ok, _fp16_at(sb + 208), 0.0)  # [BLOCK_N, 1]
        scale = d * sc.to(tl.int8, bitcast=True).to(tl.float32)  # [BLOCK_N, 32], exact
        w = scale * q.to(tl.float32)  # exact
    return w


def quant_matmul_triton(x: torch.Tensor, qweight: QuantizedWeight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) -> x @ dequantize(qweight).T (+ bias) [M, N] in x's dtype."""
    n, k = qweight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match a {n}x{k} weight")
    blocks = qweight.with_row_group(1).blocks  # the kernel reads GGUF's row order
    check_launchable(x, blocks)
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16  # tl.dot's smallest tile; decode's few rows fit one
    block_n = 32
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _quant_matmul_kernel[grid](
        x, blocks, bias if bias is not None else y, y,
        m, n, k, x.stride(0), y.stride(0), blocks.shape[1],
        FMT=qweight.fmt.code, BLOCK_BYTES=qweight.fmt.block_bytes, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return y

