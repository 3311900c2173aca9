"""The quantized matmul C kernels (cpu_quant.c), on the ISA path cpu_build.py selects.

`SPECSERVE_CPU_ISA` (see cpu_build.py) picks amx or avx512 (the same VNNI kernel here), avx2,
portable C or torch (no C kernel: the PyTorch reference); tests pass `isa=` to run every path
this CPU supports.

`SPECSERVE_QUANT_ACT` picks how the kernel takes the activations (tests and benchmarks pass
`act=`):
  q16   (default) quantized once per call to 16-bit blocks (int16 and an fp32 scale per 32
        values, error at most amax / 65534 of the block: finer than bf16 rounds the block's
        largest values), then integer dot products per block (AVX2: two madds per 32 weights,
        the weights widened to int16 straight from memory). At one row, weights from memory:
        1.3-2.1x the fp32 path's speed on Q8_0 and 1.7-4.3x on 4-bit blocks (bench/RESULTS.md).
        On SmolLM2-135M-Instruct (the default model) 17 of 17 greedy chat replies of 48 tokens
        were identical to fp32's. Model: quant_reference.quant_linear_int_reference.
  q8    the same with 8-bit blocks (as llama.cpp's q8_0 products): 32 products cost two AVX2
        instructions, but the activation rounding is 258x coarser: on the default model it
        turned the greedy answer to "What is the capital of France?" from "The capital of
        France is Paris." into "L'Étoile, la Marseillaise, ..." (6 of 17 replies identical),
        so q16 stays the default on every CPU. On AVX-512, Q4_0 / Q4_1 in the tiled order
        multiply the Q8 bytes as they are (VPDPBUSD, 64 products an instruction against
        VPDPWSSD's 32 for int16): 24 widened layers of Q4_1 from memory at 5 / 8 / 16 / 32
        rows in 0.90 / 0.87 / 0.80 / 0.78x q16's time (2-vCPU Sapphire Rapids class Xeon,
        where the products are compute-bound from a few rows); the same at one row. On the
        demo target (int4 weights) its NLL is q16's (3.9952 against 3.9951). On AVX2 the
        tiled order multiplies the bytes too (VPMADDUBSW, four weights of a row per int16 lane
        pair, summed in int16): Q4_0 / Q4_1 / Q4_K, 24 widened layers from memory at 3 / 5 /
        16 / 32 rows in 0.73-0.76 / 0.67-0.76 / 0.75-0.87 / 0.63-0.79x q16's time (2-core Zen
        3; 0.90-0.98x at one row), Q6_K from 5 rows 0.57-0.87x.
  fp32  each weight converted to fp32 and multiplied by the fp32 activation: no activation
        rounding (differs from the dequantize-then-matmul reference in summation order only).
"""

from __future__ import annotations

import os

import torch

from . import cpu_build
from .quant_reference import ACTIVATION_INTS, ROW_GROUP, TILE_ROWS, QuantizedWeight

ACTIVATIONS = ("q16", "q8", "fp32")
# The integer formats' widths, as quant_matmul_int takes them.
_ACT_BITS = {act: torch.iinfo(dtype).bits for act, (_, dtype) in ACTIVATION_INTS.items()}


def activation_format() -> str:
    """SPECSERVE_QUANT_ACT (checked), default q16."""
    act = os.environ.get("SPECSERVE_QUANT_ACT", "").strip().lower() or "q16"
    if act not in ACTIVATIONS:
        raise ValueError(f"SPECSERVE_QUANT_ACT={act!r}: expected one of {', '.join(ACTIVATIONS)}")
    return act


def activation_bits(act: str) -> int:
    """The width quant_matmul_int takes for act (one of ACTIVATIONS); 0 for fp32."""
    return 0 if act == "fp32" else _ACT_BITS[act]


def cpu_row_order(rows: int, act: str | None = None) -> int:
    """The row order (QuantizedWeight.row_group) the CPU kernel reads fastest for a weight of
    `rows` rows with activations `act` (default: activation_format()): tiled when the
    activations are integer blocks and the rows fill whole tiles, else grouped. Tiled beside
    grouped, first-generation Zen, one thread, the default model's shapes: Q4_1 1.28x at one
    activation row, 1.17x at 5, 1.16x at 32; Q8_0 1.11x, 1.26x, 1.27x (cpu_quant.c)."""
    if rows % TILE_ROWS == 0 and (act or activation_format()) != "fp32":
        return TILE_ROWS
    return ROW_GROUP


def library(isa: str | None = None):
    """The kernel library of isa (default: the selected ISA), or None (torch path)."""
    return cpu_build.library_for(isa or cpu_build.selected_isa())


def quant_matmul(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None = None,
                 *, isa: str | None = None, out_dtype: torch.dtype | None = None,
                 act: str | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp32 on CPU -> x @ dequantize(qweight).T (+ bias) [M, N] in out_dtype
    (x's dtype by default; bias in out_dtype) on the isa path (default: the selected one), the
    activations taken as `act` (one of ACTIVATIONS; default: activation_format())."""
    act = act or activation_format()
    if act not in ACTIVATIONS:
        raise ValueError(f"act={act!r}: expected one of {', '.join(ACTIVATIONS)}")
    lib = library(isa)
    if lib is None:
        raise RuntimeError(f"no quantized CPU kernel on the {isa or cpu_build.selected_isa()} "
                           "path (SPECSERVE_CPU_ISA=torch, or no C compiler)")
    n, k = qweight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match a {n}x{k} weight")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    return run_quant_matmul(lib, x.contiguous(), qweight, bias, out_dtype or x.dtype, act)


def run_quant_matmul(lib, x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None,
                     out_dtype: torch.dtype, act: str) -> torch.Tensor:
    """`quant_matmul` after its checks (the model's decode path calls it per projection, where
    a few microseconds of checks are a fifth of a small layer's product): x [M, K] contiguous
    bf16/fp32 on CPU, act one of ACTIVATIONS -> [M, N] in out_dtype."""
    blocks = qweight.blocks.contiguous()
    bias = None if bias is None else bias.to(out_dtype).contiguous()
    out = torch.empty(x.shape[0], qweight.shape[0], dtype=out_dtype)
    if x.shape[0] == 0:
        return out
    args = (x.data_ptr(), x.dtype == torch.bfloat16, blocks.data_ptr(), qweight.fmt.code,
            qweight.row_group, None if bias is None else bias.data_ptr(), out.data_ptr(),
            out_dtype == torch.bfloat16, x.shape[0], qweight.shape[0], qweight.shape[1])
    if act == "fp32":
        status = lib.quant_matmul(*args, torch.get_num_threads())
    else:
        status = lib.quant_matmul_int(*args, _ACT_BITS[act], torch.get_num_threads())
    if status == -3 and qweight.row_group == TILE_ROWS:  # the C kernel's refusal, explained
        raise ValueError(f"quant_matmul: row_group {TILE_ROWS} (the tiled order) is read by the "
                         "integer-activation kernel only; fp32 activations need row_group 1 or "
                         f"{ROW_GROUP} (set SPECSERVE_QUANT_ACT=fp32 before a model loads)")
    if status == -3:
        raise ValueError(f"quant_matmul: row_group {qweight.row_group} is not a kernel row order")
    if status == -4:
        raise ValueError(f"quant_matmul: {qweight.fmt.name} needs K a multiple of 256, got "
                         f"{qweight.shape[1]}")
    if status:
        raise MemoryError("quant_matmul: cannot allocate the activation buffer")
    return out
