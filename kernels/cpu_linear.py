"""bf16 linear layers for few-row (decode and tree-verify) steps on CPU.

At batch 1 a decode step is a chain of matrix-vector products whose cost is reading the
weights, and torch's bf16 `F.linear` reads them at a fraction of the memory bandwidth. On x86
CPUs with AVX-512 BF16, `linear` runs the small C kernel in `cpu_gemv.c` instead: compiled once
per machine with the system C compiler into a cache folder and loaded with ctypes (no build
step at install time; the `.so` links the same OpenMP runtime torch has already loaded, so the
two share one thread pool). Anything else (no compiler, another CPU, fp32 weights, many rows,
CUDA tensors) takes `F.linear`, which is also the reference the tests compare against.

Set SPECSERVE_CPU_KERNELS=0 to always use `F.linear`.
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
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_gemv.c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-fopenmp", "-shared", "-fPIC"]
# Above this many rows (prompt chunks) oneDNN's blocked GEMM in F.linear is faster (measured
# on a 2-core AVX-512 BF16 machine: level at 32 rows, 15% faster at 48).
MAX_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear(x, weight, bias); x [..., K], weight [N, K] -> [..., N] in x's dtype."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (0 < rows <= MAX_ROWS and x.dtype == weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and weight.is_contiguous()) or _library() is None:
        return F.linear(x, weight, bias)
    out = gemv_bf16(x.reshape(rows, x.shape[-1]), weight)  # [rows, N] fp32
    if bias is not None:
        out += bias
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def gemv_bf16(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] bf16 -> x @ weight.T [M, N] in fp32 (the C kernel)."""
    lib = _library()
    if lib is None:
        raise RuntimeError("the AVX-512 BF16 CPU kernel is not available on this machine")
    x = x.contiguous()
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has {k} features but weight has {weight.shape[1]}")
    out = torch.empty(m, n, dtype=torch.float32)
    lib.gemv_bf16(x.data_ptr(), weight.data_ptr(), out.data_ptr(), m, n, k,
                  torch.get_num_threads())
    return out


def available() -> bool:
    return _library() is not None


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("SPECSERVE_CPU_KERNELS", "1") == "0" or not _cpu_has_avx512_bf16():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler: bf16 linears use F.linear")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("building the CPU bf16 kernel failed (%s): using F.linear", exc)
        return None
    lib.gemv_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.gemv_bf16.restype = None
    return lib


def _build(compiler: str) -> Path:
    """Compile once per source, flags and compiler; concurrent builders each rename atomically."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS]).encode()).hexdigest()[:16]
    cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    target = cache_root / "specserve" / "cpu_kernels" / f"gemv_bf16-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], check=True,
                       capture_output=True)
        os.replace(built, target)
    return target


def _cpu_has_avx512_bf16() -> bool:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "avx512_bf16" in line.split()
               for line in cpuinfo.splitlines())
