"""Build and load the C kernels for x86 CPUs with AVX-512 BF16 (`cpu_*.c` in this folder).

They are compiled once per machine with the system C compiler into a cache folder and loaded
with ctypes: no build step at install time, and the `.so` links the same OpenMP runtime torch
has already loaded (same soname), so the two share one thread pool. `library()` is None where
they cannot run (another CPU, no compiler, a failed build, SPECSERVE_CPU_KERNELS=0); callers then
take their PyTorch path, which is also the reference the tests compare against.
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

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name)
           for name in ("cpu_gemv.c", "cpu_attention.c", "cpu_norm_rope.c")]
HEADER = Path(__file__).with_name("cpu_bf16.h")  # included by the sources
# No FMA contraction: the elementwise kernels round like the PyTorch ops they replace.
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-ffp-contract=off",
         "-fopenmp", "-shared", "-fPIC"]

_p, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "gemv_bf16": ([_p] * 5 + [_i64] * 3 + [_i32], None),
    "paged_attention_bf16": ([_p] * 3 + [_p, _i64] + [_p] * 3 + [_i64] * 6 + [_f32, _p, _i32],
                             ctypes.c_int),
    "rms_norm_bf16": ([_p] * 3 + [_i64] * 2 + [_f32], None),
    "rotary_bf16": ([_p] + [_i64] * 4 + [_p] * 2 + [_i64, _p], ctypes.c_int),
}


@cache
def library() -> ctypes.CDLL | None:
    if os.environ.get("SPECSERVE_CPU_KERNELS", "1") == "0" or not _cpu_has_avx512_bf16():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (set CC): the CPU kernels fall back to PyTorch")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, KeyError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        log.warning("building the CPU kernels failed (%s %s): using PyTorch", exc,
                    detail.decode(errors="replace")[-500:])
        return None
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def _build(compiler: str) -> Path:
    """Compile once per sources, flags and compiler; concurrent builders each rename atomically."""
    digest = hashlib.sha256(" ".join([compiler, *FLAGS]).encode())
    for source in [*SOURCES, HEADER]:
        digest.update(source.read_bytes())
    # An unset or empty XDG_CACHE_HOME means ~/.cache (Path.home() raises without a home).
    cache_root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    target = cache_root / "specserve" / "cpu_kernels" / f"kernels-{digest.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-lm", "-o", str(built)],
                       check=True, capture_output=True)
        os.replace(built, target)
    return target


def _cpu_has_avx512_bf16() -> bool:
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "avx512_bf16" in line.split()
               for line in cpuinfo.splitlines())
