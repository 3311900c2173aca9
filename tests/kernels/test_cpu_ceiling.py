"""The arithmetic-ceiling probes (cpu_ceiling.c) that bench/quant.py divides kernel speeds by:
each ISA path does the operations it reports, and computes what its chains define."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from specserve.kernels import cpu_build

VF = {"amx": 16, "avx512": 16, "avx2": 8, "portable": 4}  # cpu_simd.h's fp32 lanes
MADD16_LANES = {"amx": 16, "avx512": 16, "avx2": 8, "portable": 4}  # the int16 probe's int32 lanes
ACCS = 8


@pytest.fixture(params=cpu_build.supported_isas())
def lib(request):
    library = cpu_build.library_for(request.param)
    if library is None:
        pytest.skip(f"the {request.param} build is not available (no C compiler?)")
    return request.param, library


def madd16_chains(iters: int, dpwssd: bool, lanes: int) -> int:
    """The probe's int16 chains in numpy: x -> madd(x, 3) - 2 (AVX-512: x + madd(x, 3)),
    int32 lanes read as int16 pairs, wrapping as the instructions do; their folded sum."""
    acc = np.repeat(np.arange(ACCS, dtype=np.int32)[:, None], lanes, axis=1)  # [ACCS, lanes]
    with np.errstate(over="ignore"):
        for _ in range(iters):
            pairs = acc.view(np.int16).astype(np.int32).reshape(ACCS, lanes, 2)
            madd = (pairs * 3).sum(-1).astype(np.int32)
            acc = acc + madd if dpwssd else madd - np.int32(2)
    return int(acc.astype(np.int64).sum().astype(np.int32))


@pytest.mark.parametrize("threads", [1, 2])
def test_probes_report_the_operations_they_do(lib, threads):
    isa, library = lib
    iters = 1000
    fma_sink, madd_sink = ctypes.c_float(0), ctypes.c_int32(0)
    fmas = library.ceiling_fma(iters, ctypes.byref(fma_sink), threads)
    madds = library.ceiling_madd16(iters, ctypes.byref(madd_sink), threads)
    assert fmas == iters * ACCS * VF[isa] * threads
    assert madds == iters * ACCS * 2 * MADD16_LANES[isa] * threads
    assert np.isfinite(fma_sink.value) and fma_sink.value != 0
    want = madd16_chains(iters, dpwssd=isa in ("avx512", "amx"), lanes=MADD16_LANES[isa])
    assert madd_sink.value == np.int32(np.int64(want) * threads)  # every thread ran the chains


DOT_K = {"amx": 32, "avx512": 32, "avx2": 16, "portable": 8}  # cpu_simd.h's dot step
DOT_ACCS = 12


@pytest.mark.parametrize("threads", [1, 2])
def test_dot_probe_reports_the_bf16_products_it_does(lib, threads):
    """Each of its chains adds 1.0 * 2^-10 per bf16 product: exact in fp32 up to 2^14 per lane,
    so the folded sum is known."""
    isa, library = lib
    iters = 1000
    sink = ctypes.c_float(0)
    dots = library.ceiling_dot(iters, ctypes.byref(sink), threads)
    assert dots == iters * DOT_ACCS * DOT_K[isa] * threads
    assert sink.value == dots * 2.0 ** -10
