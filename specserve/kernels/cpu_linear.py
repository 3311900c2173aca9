"""bf16 linear layers on CPU: decode and tree-verify steps, and prompt chunks off AVX-512.

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the
weights, and torch's bf16 `F.linear` reads them at a fraction of the memory bandwidth. On CPU
`linear` runs the C kernels (built by `cpu_build.py` for the selected ISA) instead: `cpu_gemv.c`
for a few rows (decode, verify), the blocked GEMM `cpu_gemm.c` from GEMM_MIN_ROWS rows, and on
avx2 the outer-product GEMM `cpu_outer.c` past INVARIANT_ROWS (prompt chunks, large batches);
on the amx path the first two run the AMX tile kernel `cpu_amx.c`. Anything else
(no kernel library, fp32 weights, many rows on amx or avx512, CUDA tensors) takes `F.linear`,
which is also the reference the tests compare against.

Row-count invariance: on the C path a row's outputs are bit-identical alone or among up to
INVARIANT_ROWS rows (on portable among any number): gemv and the blocked GEMM sum every output
in the one order of cpu_dot_order.h (on amx: the tile kernel's one order), so a decode row gives
the same bits whether its forward is a lone decode step, a verify chain or a batch of chats
past the GEMM threshold. Past INVARIANT_ROWS amx and avx512 hand the product to F.linear and
avx2 to the outer-product GEMM, whose rows are invariant among themselves (one chain per
output, in k order, whatever the row count). `F.linear` promises no such thing:
oneDNN picks its blocking and reduction order from the shape, so on the torch path a row's last
bits may depend on how many rows share the call.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from . import cpu_build

# Rows above which F.linear takes over, per ISA path. With AVX-512 BF16 (and AMX), oneDNN's
# blocked bf16 GEMM is faster for prompt chunks (2-core AVX-512 BF16 machine: level at 32 rows,
# 15% faster at 48). Without it, torch's bf16 matmul is the slow part of prefill (2-core Zen 3,
# one layer's four products: 3 GFLOP/s at 48 and 128 rows, where the kernel ran 9-12 under the
# same load; at 512 rows the blocked GEMM runs about as fast as torch's fp32 GEMM on weights
# already converted to fp32), so the kernels take every row count and stay row-count invariant.
MAX_ROWS = {"amx": 32, "avx512": 32}
INVARIANT_ROWS = 32  # at least this many rows are row-count invariant on every C path
# Rows from which the blocked GEMM beats the matrix-vector kernel (2-core Zen 3, AVX2, the
# widened model's four products, one thread: 0.85x at 8 rows, 1.1x at 16, 1.2x at 32, 1.25x at
# 512). Both give the same bits, so this is a speed choice only.
GEMM_MIN_ROWS = 16
# Rows from which the outer-product GEMM takes bf16 products, per ISA path: past the invariant
# rows, where its summation order may differ from the other kernels'. 2-core Zen 3 (family 25
# model 1), avx2, the widened model's four products, 2 threads, best of 7, its time over the
# blocked GEMM's: 1.03x at 33 rows, 0.88x at 48, 0.86x at 64, 0.82-0.83x at 96-512 (75-83
# G multiply-adds/s, 78-86% of the FMA ceiling). amx and avx512 hand these rows to F.linear;
# portable, not measured, keeps the blocked GEMM.
OUTER_MIN_ROWS = {"avx2": INVARIANT_ROWS + 1}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear(x, weight, bias); x [..., K], weight [N, K] -> [..., N] in x's dtype."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    lib = _library()
    if lib is None or rows > MAX_ROWS.get(cpu_build.selected_isa(), rows):
        return F.linear(x, weight, bias)
    if not (0 < rows and x.dtype == weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and weight.is_contiguous()
            and (bias is None or bias.dtype == torch.bfloat16)):
        return F.linear(x, weight, bias)
    x2 = x.reshape(rows, x.shape[-1]).contiguous()  # [rows, K]
    _check_features(x2, weight)
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.bfloat16)  # [..., N]
    bias = None if bias is None else bias.contiguous()  # kept alive through the call
    # One pass: products, bias and the rounding to bf16 all in the kernel.
    kernel = ("outer_gemm_bf16" if rows >= outer_min_rows()
              else "gemm_bf16" if rows >= GEMM_MIN_ROWS else "gemv_bf16")
    _checked(kernel, getattr(lib, kernel)(
        x2.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), None,
        out.data_ptr(), rows, weight.shape[0], x.shape[-1], torch.get_num_threads()))
    return out


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] bf16 -> x @ weight.T [M, N] in fp32 (the C kernel for a
    few rows)."""
    return _fp32_product("gemv_bf16", x, weight)


def gemm_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] bf16 -> x @ weight.T [M, N] in fp32 (the blocked C kernel
    for prompt chunks; bit-identical to gemv_bf16)."""
    return _fp32_product("gemm_bf16", x, weight)


def outer_gemm_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] bf16 -> x @ weight.T [M, N] in fp32 (the outer-product C
    kernel for many rows: one multiply-add chain per output)."""
    return _fp32_product("outer_gemm_bf16", x, weight)


def outer_min_rows() -> int:
    """Rows from which `linear` takes the outer-product kernel on the selected path (sys.maxsize:
    never)."""
    return OUTER_MIN_ROWS.get(cpu_build.selected_isa(), sys.maxsize)


def _fp32_product(kernel: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    lib = _library()
    if lib is None:
        raise RuntimeError("no CPU kernel library (SPECSERVE_CPU_ISA=torch or no C compiler)")
    x, weight = x.contiguous(), weight.contiguous()
    _check_features(x, weight)
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    _checked(kernel, getattr(lib, kernel)(x.data_ptr(), weight.data_ptr(), None, out.data_ptr(),
                                          None, m, n, k, torch.get_num_threads()))
    return out


def _checked(kernel: str, status: int) -> None:
    if status != 0:
        raise MemoryError(f"{kernel}: could not allocate its buffers")


def _check_features(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} features but weight has {weight.shape[1]}")


def available() -> bool:
    return _library() is not None


def _library():  # one indirection, so tests can switch the kernel off
    return cpu_build.library()
