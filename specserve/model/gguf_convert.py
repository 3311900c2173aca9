"""GGUF block types the kernels do not run, converted at load into the nearest type they do.

The quantized kernels (specserve/kernels/quant*.py) run Q8_0, Q4_0 and Q4_1 (blocks of 32
weights) and Q4_K and Q6_K (super-blocks of 256) on the file's own blocks, bit-exact. A
`Q4_K_M` file's Q4_K and Q6_K tensors therefore load as they are; where a matrix's width is not
a multiple of 256 it holds Q5_0 / Q5_1 (llama.cpp's fallback), and other k-quant files hold
Q5_K, Q3_K or Q2_K. Each of those is turned, once at load, into a type the kernels take:

  Q5_0 -> Q8_0   exact: the same fp16 scale, the 5-bit value minus 16 as the int8.
  Q3_K -> Q6_K   exact: Q3_K's w = d (sc - 32) q, q in [-4, 3], a 6-bit sc per 16 weights, is
                 Q6_K's w = d sc6 (q6 - 32) with the same d, sc6 = sc - 32 and q6 = q + 32
                 (and the same fp32 products, so gguf's dequantization of both agrees bit for
                 bit); 3.44 -> 6.56 bits per weight, where Q8_0 would take 8.5.
  Q5_1, Q2_K, Q5_K -> Q8_0   re-quantized from the dequantized values by the gguf package's
                 Q8_0 quantizer: a rounding of at most a block's amax / 254 on top of the
                 file's own (no native type holds their sub-block mins exactly: Q4_K's
                 sub-blocks are 32 weights with 4-bit values, Q2_K's 16, Q5_K's values 5-bit).

A converted weight is larger than the file's (Q5_0 5.5 -> 8.5 bits per weight) and, but for
Q5_0 and Q3_K, not bit-exact. `tests/model/test_gguf_convert.py` measures the error against
`gguf.quants.dequantize`.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ..kernels.quant_reference import pack_q6_k

# File type -> the native type it is converted into.
CONVERSIONS = {Q.Q5_0: Q.Q8_0, Q.Q3_K: Q.Q6_K, Q.Q5_1: Q.Q8_0, Q.Q2_K: Q.Q8_0, Q.Q5_K: Q.Q8_0}


def convert(raw: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """raw uint8 [rows, bytes per row] of `qtype` blocks -> (the same weights' blocks in
    CONVERSIONS[qtype], uint8 [rows, bytes per row of that type]; that type)."""
    if qtype == Q.Q5_0:
        return _q5_0_to_q8_0(raw), Q.Q8_0
    if qtype == Q.Q3_K:
        return _q3_k_to_q6_k(raw), Q.Q6_K
    if qtype not in CONVERSIONS:
        raise ValueError(f"no conversion for GGUF type {qtype.name}")
    values = gguf_dequantize(raw, qtype)  # float32 [rows, cols]
    return np.ascontiguousarray(gguf_quantize(values, Q.Q8_0)), Q.Q8_0


def _q5_0_to_q8_0(raw: np.ndarray) -> np.ndarray:
    """Q5_0 (fp16 d, 32 high bits, 16 bytes of low nibbles; w = d (q - 16)) -> Q8_0."""
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, 22)  # [rows, nb, 22]
    qh = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [rows, nb, 1]
    qs = blocks[..., 6:]  # [rows, nb, 16]: value j low nibble, value j + 16 high nibble
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)  # [rows, nb, 32]
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [rows, nb, 32]
    q = (low | (high.astype(np.int16) << 4)) - 16  # [rows, nb, 32] in [-16, 15]
    out = np.empty((rows, blocks.shape[1], 34), dtype=np.uint8)
    out[..., :2] = blocks[..., :2]  # the same fp16 scale
    out[..., 2:] = q.astype(np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def _q3_k_to_q6_k(raw: np.ndarray) -> np.ndarray:
    """Q3_K (hmask[32], qs[64] low 2 bits, 12 bytes of 6-bit scales, fp16 d; ggml-common.h)
    -> Q6_K, weight for weight (see the module docstring)."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, 110)  # [S, 110]
    hmask, qs, scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], blocks[:, 108:]
    # scale i: nibble i // 8 of byte i % 8, bits 2 (i // 4) of byte 8 + i % 4
    low = (scales[:, None, :8] >> np.array([0, 4], np.uint8)[:, None]).reshape(-1, 16) & 15
    high = (scales[:, None, 8:] >> np.array([0, 2, 4, 6], np.uint8)[:, None]).reshape(-1, 16)
    sc = (low | (high & 3) << 4).astype(np.int8) - 32  # [S, 16] in [-32, 31]
    ql = (qs.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    qh = (hmask.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [S, 8, 32]
    # a high bit of 0 means -4 (gguf's dequantize: "the offset is zero when the bitmask is 1")
    q = ql.reshape(-1, 256).astype(np.int8) - ((qh.reshape(-1, 256) ^ 1) << 2).astype(np.int8)
    return pack_q6_k(q, sc, d.copy().view(np.float16)[:, 0]).reshape(rows, -1)
