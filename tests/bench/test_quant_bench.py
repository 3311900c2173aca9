"""bench.quant's kernel table: each share is taken of the ceiling that bounds the kernel run."""

from __future__ import annotations

from bench import quant

MACS = 24 * sum(n * k for n, k in quant.LAYER_SHAPES)  # multiply-adds of one row's pass


def _share_cells(table: str, kind: str) -> list[str]:
    """The "of ceiling" share of each row count in `kind`'s line."""
    line = next(row for row in table.splitlines() if row.startswith(f"| {kind} |"))
    return [cell.split(",")[-1].strip() for cell in line.strip("|").split("|")[1:]]


def test_bf16_shares_follow_the_kernel_each_row_count_runs():
    # A pass at 1 and 16 rows, each at exactly 1e9 multiply-adds a second per row...
    result = {"bf16": {1: MACS / 1e6, 16: MACS / 1e6}}  # ms
    # ...is 16e9 at 16 rows: half the fp32 FMA ceiling, a quarter of the (faster) dot step's.
    ceilings = {"fma": 32e9, "dot": 64e9, "madd16": 1e12}
    nbytes = {"bf16": 2 * MACS}
    # AVX2: from GEMM_MIN_ROWS rows the blocked GEMM multiplies fp32-packed weights (FMAs).
    assert _share_cells(quant.format_kernels(result, nbytes, ceilings, isa="avx2"),
                        "bf16") == ["2%", "50%"]
    # AVX-512: the GEMM's steps are the dot instruction at every row count.
    assert _share_cells(quant.format_kernels(result, nbytes, ceilings, isa="avx512"),
                        "bf16") == ["2%", "25%"]


def test_integer_kernels_are_shared_against_the_int16_ceiling():
    result = {"Q4_1 q16": {1: MACS / 1e6}, "Q4_1 fp32": {1: MACS / 1e6}}
    ceilings = {"fma": 4e9, "dot": 8e9, "madd16": 2e9}
    nbytes = {"Q4_1 q16": MACS, "Q4_1 fp32": MACS}
    table = quant.format_kernels(result, nbytes, ceilings, isa="avx2")
    assert _share_cells(table, "Q4_1 q16") == ["50%"]
    assert _share_cells(table, "Q4_1 fp32") == ["25%"]
