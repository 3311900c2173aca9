"""The quantized matmul C kernel (cpu_quant.c): one build per instruction set, loaded by ctypes.

`SPECSERVE_CPU_ISA` picks the build: `avx512` (AVX-512F/BW/VL), `avx2` (AVX2 + FMA + F16C),
`portable` (plain C, any CPU), or `torch` (no C kernel: the PyTorch reference). Unset, the best
one the CPU has. Each build is compiled once per machine into the cache folder of the other C
kernels (see cpu_build.py); a build that fails leaves the reference path, with a warning.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from .quant_reference import QuantizedWeight

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_quant.c")
HEADER = Path(__file__).with_name("cpu_bf16.h")
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "portable": [],
}
ISAS = (*ISA_FLAGS, "torch")
# Explicit FMAs only: the compiler must not contract the portable build's sums differently.
FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
_CPU_FLAGS = {"avx512": {"avx512f", "avx512bw", "avx512vl"}, "avx2": {"avx2", "fma", "f16c"}}

_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
ARGTYPES = [_p, _i32, _p, _i32, _p, _p, _i32, _i64, _i64, _i64, _i32]


def selected_isa() -> str:
    """The build `SPECSERVE_CPU_ISA` names, or the best this CPU runs."""
    isa = os.environ.get("SPECSERVE_CPU_ISA", "").strip().lower()
    if isa:
        if isa not in ISAS:
            raise ValueError(f"SPECSERVE_CPU_ISA={isa!r} is not one of {', '.join(ISAS)}")
        return isa
    return best_isa()


def best_isa() -> str:
    flags = _cpu_flags()
    return next((isa for isa, need in _CPU_FLAGS.items() if need <= flags), "portable")


def supported_isas() -> list[str]:
    """The C builds this CPU can run."""
    flags = _cpu_flags()
    return [isa for isa in ISA_FLAGS if _CPU_FLAGS.get(isa, set()) <= flags]


@cache
def library(isa: str) -> ctypes.CDLL | None:
    """The loaded build for isa, or None (`torch`, no compiler, or a failed build)."""
    if isa == "torch" or os.environ.get("SPECSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (set CC): quantized matmuls fall back to PyTorch")
        return None
    try:
        lib = ctypes.CDLL(str(build(compiler, isa)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("building the %s quantized kernel failed (%s %s): using PyTorch", isa, exc,
                    detail.decode(errors="replace")[-500:])
        return None
    lib.quant_matmul.argtypes, lib.quant_matmul.restype = ARGTYPES, ctypes.c_int
    return lib


def build(compiler: str, isa: str) -> Path:
    """Compile (once per source, flags and compiler) the isa build; return the .so path."""
    flags = [*FLAGS, *ISA_FLAGS[isa]]
    digest = hashlib.sha256(" ".join([compiler, *flags]).encode())
    for source in (SOURCE, HEADER):
        digest.update(source.read_bytes())
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = (cache_root / "specserve" / "cpu_kernels"
              / f"quant-{isa}-{digest.hexdigest()[:16]}.so")
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(SOURCE), "-o", str(built)], check=True,
                       capture_output=True)
        os.replace(built, target)
    return target


def quant_matmul(x: torch.Tensor, qweight: QuantizedWeight, bias: torch.Tensor | None = None,
                 *, isa: str | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp32 on CPU -> x @ dequantize(qweight).T (+ bias) [M, N] in out_dtype
    (x's dtype by default; bias in out_dtype) with the isa build (default: `selected_isa()`)."""
    lib = library(isa or selected_isa())
    if lib is None:
        raise RuntimeError(f"the {isa or selected_isa()} quantized CPU kernel is not available")
    n, k = qweight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not match a {n}x{k} weight")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    out_dtype = out_dtype or x.dtype
    x = x.contiguous()
    blocks = qweight.blocks.contiguous()
    bias = None if bias is None else bias.to(out_dtype).contiguous()
    out = torch.empty(x.shape[0], n, dtype=out_dtype)
    if x.shape[0] == 0:
        return out
    status = lib.quant_matmul(x.data_ptr(), x.dtype == torch.bfloat16, blocks.data_ptr(),
                              qweight.fmt.code, None if bias is None else bias.data_ptr(),
                              out.data_ptr(), out_dtype == torch.bfloat16, x.shape[0], n, k,
                              torch.get_num_threads())
    if status:
        raise MemoryError("quant_matmul: cannot allocate the activation buffer")
    return out


def _cpu_flags() -> set[str]:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split()) for line in cpuinfo.splitlines()
                 if line.startswith("flags")), set())
