"""GGUF block types the kernels do not run, converted at load into the nearest type they do.

The quantized kernels (specserve/kernels/quant*.py) run Q8_0, Q4_0 and Q4_1: blocks of 32
weights. A `Q4_K_M` file also holds Q4_K and Q6_K (super-blocks of 256 weights) and, where a
matrix's width is not a multiple of 256, Q5_0 / Q5_1 (llama.cpp's fallback). Each is turned,
once at load, into blocks of 32 the kernels take:

  Q5_0 -> Q8_0   exact: the same fp16 scale, the 5-bit value minus 16 as the int8.
  Q4_K -> Q4_1   each 32-weight sub-block is already scale * q + min with a 4-bit q: the same
                 nibbles, the scale d * sc and the min -dmin * m rounded to fp16 (a relative
                 error of at most 2^-11 on each; llama.cpp computes them in fp32).
  Q5_1, Q2_K, Q3_K, Q5_K, Q6_K -> Q8_0   re-quantized from the dequantized values by the gguf
                 package's Q8_0 quantizer: a rounding of at most a block's amax / 254 on top of
                 the file's own (Q6_K's step is about 4x coarser than the Q8_0 it becomes).

These are conversions, not native kernels: a converted weight is larger than the file's (Q4_K
4.5 -> 5 bits per weight, Q6_K 6.56 -> 8.5) and, but for Q5_0, not bit-exact.
`tests/model/test_gguf_convert.py` measures the error against `gguf.quants.dequantize`.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

# File type -> the native type it is converted into.
CONVERSIONS = {Q.Q5_0: Q.Q8_0, Q.Q4_K: Q.Q4_1, Q.Q5_1: Q.Q8_0, Q.Q2_K: Q.Q8_0, Q.Q3_K: Q.Q8_0,
               Q.Q5_K: Q.Q8_0, Q.Q6_K: Q.Q8_0}


def convert(raw: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """raw uint8 [rows, bytes per row] of `qtype` blocks -> (the same weights' blocks in
    CONVERSIONS[qtype], uint8 [rows, bytes per row of that type]; that type)."""
    if qtype == Q.Q5_0:
        return _q5_0_to_q8_0(raw), Q.Q8_0
    if qtype == Q.Q4_K:
        out = _q4_k_to_q4_1(raw)
        if np.isfinite(_fp16_fields(out, Q.Q4_1)).all():
            return out, Q.Q4_1
        # A scale past fp16's range (not seen in real files): re-quantize to Q8_0 instead.
    if qtype not in CONVERSIONS:
        raise ValueError(f"no conversion for GGUF type {qtype.name}")
    values = gguf_dequantize(raw, qtype)  # float32 [rows, cols]
    return np.ascontiguousarray(gguf_quantize(values, Q.Q8_0)), Q.Q8_0


def _fp16_fields(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """The fp16 header fields of every block (d, and m for Q4_1) as float32 [rows, nb, fields]."""
    _, size = GGML_QUANT_SIZES[qtype]
    fields = 2 if qtype == Q.Q4_1 else 1
    blocks = raw.reshape(raw.shape[0], -1, size)
    return np.ascontiguousarray(blocks[..., :2 * fields]).view(np.float16).astype(np.float32)


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


def _q4_k_to_q4_1(raw: np.ndarray) -> np.ndarray:
    """Q4_K super-blocks (fp16 d, dmin; 8 packed 6-bit scales and mins; 128 bytes holding 8
    sub-blocks of 32 nibbles, sub-blocks 2c and 2c + 1 in the low and high nibbles of bytes
    32c .. 32c + 31; w = d sc q - dmin m) -> one Q4_1 block (fp16 d, m; value i low nibble of
    byte i, value i + 16 high nibble) per sub-block."""
    rows = raw.shape[0]
    blocks = raw.reshape(-1, 144)  # [super-blocks, 144]
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [n, 1]
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] each, 6-bit
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(n, 8, 32)  # [n, sub-block, value]
    out = np.empty((n, 8, 20), dtype=np.uint8)
    out[..., 0:2] = (d * sc).astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:4] = (-(dmin * mins)).astype(np.float16)[..., None].view(np.uint8)
    out[..., 4:] = q[..., :16] | (q[..., 16:] << 4)
    return out.reshape(rows, -1)
