"""GGUF block types the kernels do not run, converted at load into the nearest type they do.

The quantized kernels (specserve/kernels/quant*.py) run Q8_0, Q4_0 and Q4_1 (blocks of 32
weights) and Q4_K and Q6_K (super-blocks of 256) on the file's own blocks, bit-exact. A
`Q4_K_M` file's Q4_K and Q6_K tensors therefore load as they are; where a matrix's width is not
a multiple of 256 it holds Q5_0 / Q5_1 (llama.cpp's fallback), and other k-quant files hold
Q5_K, Q3_K or Q2_K. Each of those is turned, once at load, into a type the kernels take:

  Q5_0 -> Q8_0   exact: the same fp16 scale, the 5-bit value minus 16 as the int8.
  Q5_1, Q2_K, Q3_K, Q5_K -> Q8_0   re-quantized from the dequantized values by the gguf
                 package's Q8_0 quantizer: a rounding of at most a block's amax / 254 on top of
                 the file's own.

A converted weight is larger than the file's (Q5_0 5.5 -> 8.5 bits per weight) and, but for
Q5_0, not bit-exact. `tests/model/test_gguf_convert.py` measures the error against
`gguf.quants.dequantize`.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

# File type -> the native type it is converted into.
CONVERSIONS = {Q.Q5_0: Q.Q8_0, Q.Q5_1: Q.Q8_0, Q.Q2_K: Q.Q8_0, Q.Q3_K: Q.Q8_0, Q.Q5_K: Q.Q8_0}


def convert(raw: np.ndarray, qtype: Q) -> tuple[np.ndarray, Q]:
    """raw uint8 [rows, bytes per row] of `qtype` blocks -> (the same weights' blocks in
    CONVERSIONS[qtype], uint8 [rows, bytes per row of that type]; that type)."""
    if qtype == Q.Q5_0:
        return _q5_0_to_q8_0(raw), Q.Q8_0
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
