"""The CPU matrix-vector kernel (specserve/kernels/cpu_gemv.c) and the blocked GEMM
(specserve/kernels/cpu_gemm.c) against their reference, F.linear in fp32, and against each other
(bit for bit), and the outer-product GEMM for many rows (specserve/kernels/cpu_outer.c) against
its own order's reference bit for bit, on every ISA path this CPU runs (the `cpu_isa`
fixture)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specserve.kernels import cpu_build, cpu_linear


def _bf16(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("m", [1, 3, 5, 7, 8, 9, 17, 32])
@pytest.mark.parametrize("n,k", [(1, 32), (5, 1000), (77, 1024), (4096, 256), (130, 4864),
                                 (9, 2048), (3, 7)])
def test_gemv_matches_fp32_reference(cpu_isa: str, m: int, n: int, k: int):
    x, w = _bf16(m, k, seed=m), _bf16(n, k, seed=n + k)
    want = F.linear(x.float(), w.float())  # [m, n]: bf16 products are exact in fp32
    got = cpu_linear.gemv_bf16(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    # Only the fp32 summation order differs.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * k ** 0.5)


@pytest.mark.parametrize("m", [1, 2, 5, 16, 33, 100])
@pytest.mark.parametrize("n,k", [(1, 32), (5, 1000), (77, 1024), (13, 3000), (130, 4864),
                                 (9, 2048), (3, 7), (50, 17)])
def test_gemm_matches_fp32_reference_and_the_gemv_bit_for_bit(cpu_isa: str, m: int, n: int,
                                                               k: int):
    """Odd shapes: ragged weight tiles (n not a multiple of the tile), K tails, K longer than
    one packed K-block (3000, 4864), row counts not a multiple of the register tile."""
    x, w = _bf16(m, k, seed=m + 1), _bf16(n, k, seed=n + k + 1)
    got = cpu_linear.gemm_bf16(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, F.linear(x.float(), w.float()), rtol=1e-5,
                               atol=1e-5 * k ** 0.5)
    assert torch.equal(got, cpu_linear.gemv_bf16(x, w))


@pytest.mark.parametrize("n,k", [(77, 1024), (130, 4864), (9, 2048), (33, 1000), (5, 7)])
def test_a_row_is_bit_identical_alone_or_among_other_rows(cpu_isa: str, n: int, k: int):
    """Fixed reduction order per output element: a row's results do not depend on how many
    rows share the call (2..32, every blocking shape), nor on the thread count, nor on the
    activations being split into blocks of rows (a long prompt chunk)."""
    x, w = _bf16(cpu_linear.INVARIANT_ROWS, k, seed=k), _bf16(n, k, seed=n)
    alone = torch.cat([cpu_linear.gemv_bf16(x[j : j + 1], w) for j in range(len(x))])  # [32, n]
    for m in range(2, cpu_linear.INVARIANT_ROWS + 1):
        together = cpu_linear.gemv_bf16(x[:m], w)  # [m, n]
        assert torch.equal(together, alone[:m]), f"{m} rows change a row's result"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_linear.gemv_bf16(x[:5], w), alone[:5])
    finally:
        torch.set_num_threads(threads)
    long_chunk = torch.cat([x] * 40)  # [1280, k]: several blocks of rows
    assert torch.equal(cpu_linear.gemv_bf16(long_chunk, w)[-32:], alone)
    # The blocked GEMM (prompt chunks) sums in the same order, on any thread count.
    assert torch.equal(cpu_linear.gemm_bf16(long_chunk, w)[-32:], alone)
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_linear.gemm_bf16(long_chunk[:100], w),
                           alone[torch.arange(100) % len(x)])
    finally:
        torch.set_num_threads(threads)
    # The layer path (bias, bf16 rounding in the kernel) keeps it too, on either side of the
    # row count where it switches from the matrix-vector kernel to the GEMM.
    b = _bf16(n, seed=7)
    one = torch.cat([cpu_linear.linear(x[j : j + 1], w, b) for j in range(len(x))])
    for m in (cpu_linear.GEMM_MIN_ROWS - 1, cpu_linear.GEMM_MIN_ROWS, len(x)):
        assert torch.equal(cpu_linear.linear(x[:m], w, b), one[:m])


@pytest.mark.parametrize("m", [1, 6, 7, 33, 100])
@pytest.mark.parametrize("n,k", [(1, 32), (5, 300), (77, 257), (33, 16), (3, 7), (130, 130)])
def test_outer_gemm_is_one_chain_per_output_in_k_order(cpu_isa: str, m: int, n: int, k: int):
    """Odd shapes: ragged row and weight tiles, k past one weight panel (257, 300). The
    reference adds the products (exact in fp32: bf16 x bf16) to an fp32 sum in k order, which
    is what one multiply-add chain per output gives, so the kernel must match it bit for bit."""
    x, w = _bf16(m, k, seed=m + 2), _bf16(n, k, seed=n + k + 2)
    xf, wf = x.float(), w.float()
    want = torch.zeros(m, n)
    for j in range(k):
        want = want + xf[:, j : j + 1] * wf[:, j]  # [m, n]
    got = cpu_linear.outer_gemm_bf16(x, w)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.equal(got, want)


def test_outer_gemm_rows_are_bit_identical_among_themselves(cpu_isa: str):
    """Past INVARIANT_ROWS, where linear takes the outer-product kernel on avx2: a row's results
    do not depend on the row count (past one pass of CHUNK_ROWS too) nor the thread count."""
    x, w = _bf16(500, 4864, seed=11), _bf16(70, 4864, seed=12)
    full = cpu_linear.outer_gemm_bf16(x, w)  # [500, 70]
    for m in (cpu_linear.INVARIANT_ROWS + 1, 100, 385):
        assert torch.equal(cpu_linear.outer_gemm_bf16(x[:m], w), full[:m])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_linear.outer_gemm_bf16(x[-40:], w), full[-40:])
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(full, F.linear(x.float(), w.float()), rtol=1e-5,
                               atol=1e-5 * 4864 ** 0.5)


class RecordingLibrary:
    """Stands in for the kernel library: records gemv and gemm calls, forwards them (or
    fails)."""

    def __init__(self, real, allowed: bool = True) -> None:
        self.real, self.allowed = real, allowed
        self.kernels: list[str] = []

    @property
    def calls(self) -> int:
        return len(self.kernels)

    def gemv_bf16(self, *args):
        return self._call("gemv_bf16", *args)

    def gemm_bf16(self, *args):
        return self._call("gemm_bf16", *args)

    def outer_gemm_bf16(self, *args):
        return self._call("outer_gemm_bf16", *args)

    def _call(self, kernel: str, *args):
        assert self.allowed, "the kernel was used"
        self.kernels.append(kernel)
        return getattr(self.real, kernel)(*args)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("lead,n", [((2, 3), 48), ((3, 5), 50), ((17,), 50)],
                         ids=["6x48", "15x50-ragged", "17x50-gemm"])
def test_linear_takes_the_kernel_for_few_bf16_rows(cpu_isa, monkeypatch, with_bias, lead, n):
    x, w = _bf16(*lead, 64, seed=1), _bf16(n, 64, seed=2)
    b = _bf16(n, seed=3) if with_bias else None
    recorder = RecordingLibrary(cpu_linear._library())
    monkeypatch.setattr(cpu_linear, "_library", lambda: recorder)
    out = cpu_linear.linear(x, w, b)
    want_kernel = "gemm_bf16" if x[..., 0].numel() >= cpu_linear.GEMM_MIN_ROWS else "gemv_bf16"
    assert recorder.kernels == [want_kernel]
    assert out.dtype == torch.bfloat16 and out.shape == (*lead, n)
    # The reference rounds once, from fp32 (products + bias), like the kernel.
    want32 = F.linear(x.float(), w.float()) + (b.float() if with_bias else 0)
    # fp32 sums in another order: at most one bf16 rounding step apart.
    torch.testing.assert_close(out.float(), want32.to(torch.bfloat16).float(), rtol=2 ** -7,
                               atol=1e-6)
    assert (out == want32.to(torch.bfloat16)).float().mean() > 0.95


def test_prompt_chunks_take_the_kernel_where_torch_has_no_native_bf16_gemm(cpu_isa, monkeypatch):
    x, w = _bf16(520, 96, seed=8), _bf16(40, 96, seed=9)
    recorder = RecordingLibrary(cpu_linear._library())
    monkeypatch.setattr(cpu_linear, "_library", lambda: recorder)
    out = cpu_linear.linear(x, w)
    limit = cpu_linear.MAX_ROWS.get(cpu_isa)
    kernel = "outer_gemm_bf16" if len(x) >= cpu_linear.outer_min_rows() else "gemm_bf16"
    assert recorder.kernels == ([] if limit is not None and len(x) > limit else [kernel])
    assert kernel == ("outer_gemm_bf16" if cpu_isa == "avx2" else "gemm_bf16")
    want = F.linear(x.float(), w.float()).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=1e-6)


def test_linear_falls_back_to_f_linear(monkeypatch):
    """fp32, long prompt chunks on avx512 and a disabled kernel all give exactly F.linear."""
    monkeypatch.setattr(cpu_linear, "_library", lambda: RecordingLibrary(None, allowed=False))
    monkeypatch.setattr(cpu_build, "selected_isa", lambda: "avx512")
    w = _bf16(16, 32, seed=4)
    many = _bf16(cpu_linear.MAX_ROWS["avx512"] + 1, 32, seed=5)
    assert torch.equal(cpu_linear.linear(many, w), F.linear(many, w))
    xf, wf = torch.randn(2, 32), torch.randn(16, 32)
    assert torch.equal(cpu_linear.linear(xf, wf), F.linear(xf, wf))
    monkeypatch.setattr(cpu_linear, "_library", lambda: None)
    few = _bf16(2, 32, seed=6)
    assert torch.equal(cpu_linear.linear(few, w), F.linear(few, w))


def test_gemv_rejects_mismatched_shapes(cpu_isa):
    with pytest.raises(ValueError, match="features"):
        cpu_linear.gemv_bf16(_bf16(1, 32, seed=0), _bf16(4, 64, seed=0))


def test_bf16_model_decode_with_the_kernel_matches_f_linear(cpu_isa, tmp_path, monkeypatch):
    from specserve.model.loader import load_model
    from specserve.model.runner import ModelRunner, Segment
    from tests.tiny_models import save_model

    path = save_model(tmp_path / "m", "qwen2", seed=5)  # q/k/v biases go through the kernel
    ids = list(range(3, 23))

    def decode_logits() -> torch.Tensor:  # [4, V]: one-token steps after a 20-token prompt
        runner = ModelRunner(load_model(path, dtype="bfloat16"), num_blocks=4, block_size=16)
        runner.forward([Segment(ids, range(20), 0, [0, 1], [])])
        return torch.cat([runner.forward([Segment([t], [20 + i], 20 + i, [0, 1], [0])])[0]
                          for i, t in enumerate([7, 8, 9, 10])])

    with_kernel = decode_logits()
    monkeypatch.setattr(cpu_linear, "_library", lambda: None)
    without = decode_logits()
    # bf16 activations: the two paths round differently, never far apart.
    torch.testing.assert_close(with_kernel, without, rtol=0, atol=0.05 * without.abs().max())
    assert with_kernel.argmax(-1).tolist() == without.argmax(-1).tolist()
